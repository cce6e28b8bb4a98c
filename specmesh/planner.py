"""Speculation planned from measured costs: pure functions over what a process has measured.

Inputs, each measured on the machine at hand:
- the costs (`specmesh.costs`): the drafter's calls, the target's verification by rows, the link's
  share of a step, and each kind of plan's measured step periods (`Costs`);
- `Acceptance`: per depth and sibling rank, how often a drafted node was accepted given that its
  parent was and its elder siblings were not (Beta counts over the session's own history, started
  from a prior: the drafter's recent sessions).

`plan` picks, for one step, the tree shape (budget, depth) within the caps and, when pipelining,
which outcomes of the step to predraft and with how many bonus candidates (`branches`), or no
predrafting, or no speculation at all (E = 1: a run of `plain_run` one-row steps that the verifier
takes without asking, whose tokens the drafter feeds in one call later, so the link is paid once
a run), maximising expected tokens per second:
- tokens per step E(shape) = 1 + sum over nodes of P(node accepted) on the shape's topology
  (`grow_tree`'s, with the drafter's scores ranking siblings), that sum scaled by how many tokens
  the trees verified so far had accepted against what it gave them (`Acceptance.tokens_calibration`);
- sequential: a step takes V + D (V = verification plus the link, D = drafting the tree);
- pipelined with predrafts S: the predrafts take P(S) and run while the step is verified; on a hit
  (probability h(S): the outcome is in S and the bonus is one of the predraft's candidates, whose
  odds are the candidates' rank rates times the session's observed/predicted bonus hits) the next
  tree is ready at max(V, P); on a miss the drafter drafts afresh after that: max(V, P) + D.
- no speculation: V(1 row) per token (`Costs.one_row_s`: as plain runs take it), plus feeding
  that token to the drafter before its next tree, or (pipelined) feeding it beside the verifier's
  steps.
Each plan's step is then scaled by `Costs.period_ratio` of its kind (PERIOD_KINDS: plain runs,
speculative steps, steps with drafter work overlapped): how far that kind's measured step periods
ran from their predictions. What the cost terms cannot see shows there: two processes whose threads
contend for the same cores (pipelining turns off by measurement), the first step after a change of
shape paying for the caches (a tree among plain runs costs more than the verifier's table of steady
runs says), the link's own variance. Plain runs and trees are each judged by what they measured.
An overlapped plan must beat the best sequential one by OVERLAP_MARGIN: "pipelining never slower
than not" is worth more than a predicted near-tie. This module knows nothing of sessions, transport or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from specmesh.costs import OVERLAPPED, PERIOD_KINDS, PLAIN, SPECULATIVE, Costs
from specmesh.drafters.base import Children, grow_tree
from specmesh.tree import ROOT, children_of_parents, depths

MAX_OUTCOMES = 8  # predrafts per step considered at most
MAX_BRANCHES = 2  # bonus candidates with a tree under them, per predraft
MAX_RANKS = 8  # sibling ranks tracked (deeper ranks share the last)
MAX_LEVELS = 17  # depths tracked (a predraft is one level deeper than a tree)
PRIOR_ACCEPT = (0.5, 0.15)  # prior acceptance of rank 0 and of later ranks, before any evidence
PRIOR_WEIGHT = 2.0  # observations the prior is worth
CALIBRATION_PRIOR_TOKENS = 4.0  # accepted tokens (and as many expected) `tokens_calibration` starts from
CALIBRATION_KEEP = 32.0  # expected tokens of that evidence a new session takes from its drafter's recent ones
CALIBRATION_RANGE = (0.5, 1.5)
# an overlapped plan is taken only when predicted this much faster than the best sequential one:
# its prediction stacks more estimates (hit odds, the overlapped verification, its kind's period
# ratio), and a miss costs a whole draft after the step, so a predicted near-tie loses on average
OVERLAP_MARGIN = 0.05


@dataclass
class Acceptance:
    """Beta counts of acceptance per (depth, sibling rank): accepted[d][r] of tried[d][r]."""

    accepted: list[list[float]] = field(default_factory=lambda: _grid(0.0))
    tried: list[list[float]] = field(default_factory=lambda: _grid(0.0))
    # predrafts whose outcome came: how often the bonus was one of their candidates, against the
    # sum of what `bonus_hit` predicted for them (a feature drafter guesses the bonus from predicted
    # features, worse than its rank rates say; a model drafter may guess better)
    bonus_hits: float = 0.0
    bonus_expected: float = 0.0
    # trees verified: the tokens they had accepted, against the sum of what `expected_tokens` gave
    # each when it was sent (the rates behind a plan are estimates, and a plan is chosen where they
    # look best: a session that drafts trees after a run of acceptance expects more than it gets)
    tokens_seen: float = 0.0
    tokens_expected: float = 0.0

    def rate(self, depth: int, rank: int) -> float:
        """Beta mean at (depth, rank), its prior the same rank pooled over every depth (itself
        started from PRIOR_ACCEPT): a depth no tree has reached yet, such as the bonus one level
        below a tree that a predraft bets on, takes what the session showed at the depths it did
        reach, not the fixed prior."""
        d, r = min(depth, MAX_LEVELS) - 1, min(rank, MAX_RANKS - 1)
        return self._at(d, r, self.pooled(r))

    def pooled(self, rank: int) -> float:
        """Acceptance at sibling rank `rank` over all depths together."""
        r = min(rank, MAX_RANKS - 1)
        prior = PRIOR_ACCEPT[0] if r == 0 else PRIOR_ACCEPT[1]
        return ((sum(row[r] for row in self.accepted) + PRIOR_WEIGHT * prior)
                / (sum(row[r] for row in self.tried) + PRIOR_WEIGHT))

    def _at(self, d: int, r: int, prior: float) -> float:
        return (self.accepted[d][r] + PRIOR_WEIGHT * prior) / (self.tried[d][r] + PRIOR_WEIGHT)

    def observe(self, parents: list[int], accepted_nodes: list[int]) -> None:
        """One verified tree: along the accepted path, each parent's children up to the accepted
        one were tried (the elder ones rejected); below the path's end all were tried, none taken."""
        kids = children_of_parents(parents)
        node, on_path = ROOT, list(accepted_nodes)
        for depth in range(1, MAX_LEVELS + 1):
            children = kids.get(node, [])
            if not children:
                return
            taken = on_path.pop(0) if on_path else None
            for rank, c in enumerate(children):
                d, r = depth - 1, min(rank, MAX_RANKS - 1)
                self.tried[d][r] += 1
                if c == taken:
                    self.accepted[d][r] += 1
                    break
            if taken is None:
                return
            node = taken

    def observe_at(self, depth: int, rank: int, accepted: bool) -> None:
        """One trial at (depth, rank) that no verified tree made, known otherwise (a greedy
        drafter's own choice against the committed token there: `DraftAhead`'s evidence)."""
        d, r = min(depth, MAX_LEVELS) - 1, min(rank, MAX_RANKS - 1)
        self.tried[d][r] += 1
        self.accepted[d][r] += float(accepted)

    def observe_bonus(self, expected: float, hit: bool) -> None:
        """A predraft's outcome came: `bonus_hit` gave it `expected`; `hit`: the bonus had a tree in it."""
        self.bonus_expected += expected
        self.bonus_hits += float(hit)

    @property
    def bonus_calibration(self) -> float:
        """Observed over predicted bonus hits (PRIOR_WEIGHT observations of 1 before any)."""
        return (self.bonus_hits + PRIOR_WEIGHT) / (self.bonus_expected + PRIOR_WEIGHT)

    def observe_tokens(self, expected: float, seen: int) -> None:
        """A verified tree had `seen` tokens accepted where its rates expected `expected`."""
        self.tokens_expected += expected
        self.tokens_seen += float(seen)

    @property
    def tokens_calibration(self) -> float:
        """Accepted over expected tokens of the trees verified (CALIBRATION_PRIOR_TOKENS of each
        before any), within CALIBRATION_RANGE: `plan` scales each tree's expected accepted tokens
        by it, as `Costs.period_ratio` scales its predicted step."""
        low, high = CALIBRATION_RANGE
        ratio = (self.tokens_seen + CALIBRATION_PRIOR_TOKENS) / (self.tokens_expected + CALIBRATION_PRIOR_TOKENS)
        return min(high, max(low, ratio))

    def decay(self, total: float) -> None:
        """Halve the history once it holds more than `total` depth-1 trials (recent sessions count)."""
        if sum(self.tried[0]) > total:
            for grid in (self.accepted, self.tried):
                for row in grid:
                    row[:] = [0.5 * x for x in row]
            self.bonus_hits *= 0.5
            self.bonus_expected *= 0.5
            self.tokens_seen *= 0.5
            self.tokens_expected *= 0.5

    def scaled(self, total: float) -> "Acceptance":
        """A copy holding at most `total` observations at depth 1 (a prior for a new session)."""
        n = sum(self.tried[0]) or 1.0
        k = min(1.0, total / n)
        # the calibration is the estimator's, not the prompt's: kept at up to CALIBRATION_KEEP tokens
        c = min(1.0, CALIBRATION_KEEP / self.tokens_expected) if self.tokens_expected > 0 else 1.0
        return Acceptance([[k * x for x in row] for row in self.accepted], [[k * x for x in row] for row in self.tried],
                          k * self.bonus_hits, k * self.bonus_expected, c * self.tokens_seen, c * self.tokens_expected)


def _grid(v: float) -> list[list[float]]:
    return [[v] * MAX_RANKS for _ in range(MAX_LEVELS)]


@dataclass(frozen=True)
class Topology:
    """A tree's shape: parents, each node's depth (1 = a root child) and rank among its siblings,
    and the nodes expanded per level (each is fed as a row at the level after its own)."""

    parents: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]
    per_level: tuple[int, ...]


def shape_of(parents: list[int] | tuple[int, ...]) -> Topology:
    node_depth = depths(list(parents))
    seen: dict[int, int] = {}
    rank = []
    for p in parents:
        rank.append(seen.get(p, 0))
        seen[p] = rank[-1] + 1
    per_level = [0] * max(node_depth, default=0)
    for p in seen:
        per_level[0 if p == ROOT else node_depth[p]] += 1
    return Topology(tuple(parents), tuple(node_depth), tuple(rank), tuple(per_level))


@lru_cache(maxsize=4096)
def topology(budget: int, depth: int, branches: int = 0) -> Topology:
    """The tree `grow_tree` grows for this shape when the drafter's scores fall off with rank
    (its typical case; the real scores only reorder it)."""
    def expand(nodes, paths, counts):
        return [Children(list(range(c)), [-1.0 * (len(p) + 1) - 0.5 * j for j in range(c)]) for p, c in zip(paths, counts)]

    return shape_of(grow_tree(expand, budget, depth, branches=branches).parents)


def rates(acc: "Acceptance") -> list[list[float]]:
    """[depth - 1][rank] -> P(accepted | parent accepted, elder siblings rejected)."""
    pooled = [acc.pooled(r) for r in range(MAX_RANKS)]
    return [[acc._at(d, r, pooled[r]) for r in range(MAX_RANKS)] for d in range(MAX_LEVELS)]


def _rate(table: list[list[float]], depth: int, rank: int) -> float:
    return table[min(depth, MAX_LEVELS) - 1][min(rank, MAX_RANKS - 1)]


def expected_tokens(t: Topology, table: list[list[float]]) -> float:
    """1 (the bonus) + the expected accepted nodes of a tree (`rates` table)."""
    reach: dict[int, float] = {ROOT: 1.0}
    miss: dict[int, float] = {}  # parent -> P(every child so far rejected)
    total = 1.0
    for i, p in enumerate(t.parents):  # parents come before children
        a = _rate(table, t.depth[i], t.rank[i])
        before = miss.get(p, 1.0)
        reach[i] = reach[p] * before * a
        miss[p] = before * (1.0 - a)
        total += reach[i]
    return total


@dataclass(frozen=True)
class Plan:
    budget: int  # 0: no speculation (an empty tree)
    depth: int
    outcomes: tuple[int, ...] = ()  # k (main-path tokens accepted) of the predrafts to make, likeliest first
    branches: int = 0
    tokens_per_step: float = 1.0
    step_s: float = 0.0
    hit: float = 0.0
    feed: bool = False  # no speculation: the drafter feeds the committed tokens beside the verifier's steps
    run: int = 0  # no speculation: the one-row steps the plan priced (`plan`'s plain_run)
    informed: bool = True  # planned with verifications measured (`Costs.verify_known`), not from the priors
    predicted_s: float = 0.0  # step_s before its kind's measured period ratio (what periods are measured against)

    @property
    def overlapped(self) -> bool:
        """Whether the plan puts drafter work beside the verification."""
        return bool(self.outcomes) or self.feed

    @property
    def kind(self) -> str:
        """Which of PERIOD_KINDS its steps are measured as."""
        return _kind(self.budget, self.outcomes, self.feed)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0


def _kind(budget: int, outcomes: tuple[int, ...], feed: bool) -> str:
    return OVERLAPPED if outcomes or feed else PLAIN if budget == 0 else SPECULATIVE


def _priced(ratios: dict[str, float], predicted: float, budget: int, depth: int, outcomes: tuple[int, ...] = (),
            feed: bool = False, **rest) -> Plan:
    """A plan whose step is its `predicted` step times its kind's measured period ratio (`ratios`:
    `Costs.period_ratio` of each kind, taken once per `plan`)."""
    return Plan(budget, depth, outcomes, step_s=predicted * ratios[_kind(budget, outcomes, feed)],
                predicted_s=predicted, feed=feed, **rest)


def shapes(budget_cap: int, depth_cap: int) -> list[tuple[int, int]]:
    """Candidate (budget, depth): every depth up to the cap, as a chain and as trees of 2-4
    children per level where the budget allows."""
    out = []
    for d in range(1, depth_cap + 1):
        for b in sorted({d, 2 * d, 3 * d, 4 * d, budget_cap}):
            if d <= b <= budget_cap:
                out.append((b, d))
    return out


def outcome_odds(t: Topology, table: list[list[float]]) -> list[tuple[int, float, int]]:
    """(k, P(exactly the first k main-path tokens accepted, none of the others), children the
    tree has at that point: the ranks a bonus candidate there starts after)."""
    kids = children_of_parents(list(t.parents))
    out, node, reach, k = [], ROOT, 1.0, 0
    while True:
        children = kids.get(node, [])
        stop = 1.0
        for r in range(len(children)):
            stop *= 1.0 - _rate(table, k + 1, r)
        out.append((k, reach * stop, len(children)))
        if not children:
            return out
        reach *= _rate(table, k + 1, 0)
        node, k = children[0], k + 1


def plan(costs: Costs, acc: Acceptance, budget_cap: int, depth_cap: int, pipelined: bool,
         batched: bool, fixed: bool = False, speculate: bool = False, plain_run: int = 1,
         sharing: float = 1.0, shares_cores: bool = False) -> Plan:
    """The best plan for the next step (see the module docstring); `fixed`: the caps are the shape,
    only the predrafts are planned; `batched`: the drafter grows several predrafts in one call
    (`draft_many`), else one call each. Not speculating at all (`Plan.budget` 0: an empty tree, a
    run of `plain_run` one-row steps with one round trip) is a candidate unless `fixed` or
    `speculate` (a probe: the acceptance it would be judged by comes only from trees that are
    verified). `sharing`: the sessions this drafter drafts for at once (>= 1): it drafts them in
    turn, so every tree and predraft of one session waits for the others' (a step's drafting
    costs `sharing` times its own), while one-row steps need no drafting: as a verifier batches
    more sessions, speculation pays less, and none at all once the drafter is the bottleneck.
    `shares_cores`: the verifier's threads take the cores the drafter runs on (both on one machine,
    each with every core); drafter work beside a verification then takes its own time after it
    (an overlapped step costs V + P, a plain run's feeding its own time), so overlapping can win
    only by what a predraft hit saves, never by running beside the verification."""
    cands = [(budget_cap, depth_cap)] if fixed else shapes(budget_cap, depth_cap)
    table = rates(acc)
    calibration = acc.bonus_calibration
    scale = acc.tokens_calibration
    best: Plan | None = None  # the best plan that overlaps nothing ...
    ahead: Plan | None = None  # ... and the best that puts drafter work beside the verification
    ratios = {k: costs.period_ratio(k) for k in PERIOD_KINDS}
    if not (fixed or speculate):
        # the drafter feeds each committed token once anyway: later, before the next tree, or
        # (pipelined) beside the verifier's steps, at the measured price of overlapping
        step = costs.one_row_s() + costs.link_s / max(1, plain_run)
        run = max(1, plain_run)
        best = _priced(ratios, step + costs.draft(0.0, 0.0, 1.0, 0.0), 0, 0, run=run)
        if pipelined:
            feed = costs.draft(0.0, 0.0, 1.0, 0.0) if shares_cores else 0.0
            ahead = _priced(ratios, step + feed, 0, 0, feed=True, run=run)
    for b, d in cands:
        t = topology(b, d)
        e = min(1.0 + len(t.parents), 1.0 + scale * (expected_tokens(t, table) - 1.0))
        v = costs.verify_s(1 + len(t.parents), False) + costs.link_s
        # a fresh tree after a miss first feeds what the step committed (e - 1 tokens beyond the bonus)
        fresh = sharing * costs.draft(len(t.per_level), sum(t.per_level), e - 1.0, 1.0)
        options = [_priced(ratios, v + fresh, b, d, tokens_per_step=e)]
        if pipelined and t.parents:
            v = costs.verify_s(1 + len(t.parents), True) + costs.link_s
            odds = sorted(outcome_odds(t, table), key=lambda o: -o[1])
            for branches in range(1, MAX_BRANCHES + 1):
                pre_levels = topology(*predraft_shape(b, d, branches)).per_level
                levels, rows = len(pre_levels), sum(pre_levels)
                hit, chosen = 0.0, []
                for k, p, w in odds[:MAX_OUTCOMES]:
                    hit += p * min(1.0, calibration * bonus_hit(table, k + 1, w, branches))
                    chosen.append(k)
                    m, held = len(chosen), max(chosen)  # the session first feeds the path it holds
                    # one outcome is one single-tree call (DraftAhead.predraft), several one
                    # draft_many call, or one call each
                    pre = sharing * (costs.many(levels, m * rows, held) if batched and m > 1
                                     else m * costs.draft(levels, rows, held / m, 1.0))
                    step = (v + pre if shares_cores else max(v, pre)) + (1.0 - hit) * fresh
                    options.append(_priced(ratios, step, b, d, tuple(chosen), branches=branches,
                                           tokens_per_step=e, hit=hit))
        for p in options:
            if p.overlapped:
                if ahead is None or p.tokens_per_s > ahead.tokens_per_s:
                    ahead = p
            elif best is None or p.tokens_per_s > best.tokens_per_s:
                best = p
    margin = OVERLAP_MARGIN if costs.verify_known else 0.0  # no measurement yet: the priors' bet
    if ahead is not None and (best is None or ahead.tokens_per_s > (1.0 + margin) * best.tokens_per_s):
        best = ahead
    assert best is not None
    return best if costs.verify_known else replace(best, informed=False)


def bonus_hit(table: list[list[float]], depth: int, after: int, branches: int) -> float:
    """P(the bonus at `depth` is one of the predraft's `branches` candidates, which come after the
    `after` children the tree had there: those were rejected, so the bonus is none of them)."""
    miss = 1.0
    for r in range(after, after + branches):
        miss *= 1.0 - _rate(table, depth, r)
    return 1.0 - miss


PREDRAFT_MAX_BUDGET = 64


def predraft_shape(budget: int, depth: int, branches: int = MAX_BRANCHES) -> tuple[int, int, int]:
    """Shape of a predraft, (budget, depth, branches) for `grow_tree`: `branches` candidates for
    the bonus token, each with a tree of the asked shape under it (smaller where the budget would
    pass PREDRAFT_MAX_BUDGET), one level deeper than asked."""
    sub = min(budget, PREDRAFT_MAX_BUDGET // branches - 1)
    return branches * (sub + 1), depth + 1, branches


def draft_work(trees) -> tuple[int, int]:
    """(levels, rows) of one draft call that produced `trees` (grown together): the deepest tree's
    depth, and every expanded node (each fed as a row at the level after its own)."""
    levels = rows = 0
    for t in trees:
        parents = list(t.parents)
        levels = max(levels, max(depths(parents), default=0))
        rows += len(set(parents))
    return levels, rows


