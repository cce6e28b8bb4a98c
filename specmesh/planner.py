"""Speculation planned from measured costs: pure functions over what a process has measured.

Inputs, each measured on the machine at hand as the work runs (nothing assumes a wider level or a
bigger tree is free; the priors below only hold until the first measurements):
- `LinearCost`: seconds as a linear function of work, fitted online by exponentially weighted least
  squares. The drafter's cost of one draft call is `a * levels + b * rows + c` (rows: the nodes fed
  over all its levels, so `b` is what width costs; `c`: catching up on the committed tokens); the
  target's verification is `a + b * rows` (rows = the pending token + the tree's nodes).
- `Acceptance`: per depth and sibling rank, how often a drafted node was accepted given that its
  parent was and its elder siblings were not (Beta counts over the session's own history, started
  from a prior: the drafter's recent sessions).

`plan` picks, for one step, the tree shape (budget, depth) within the caps and, when pipelining,
which outcomes of the step to predraft and with how many bonus candidates (`branches`), or no
predrafting at all, maximising expected tokens per second:
- tokens per step E(shape) = 1 + sum over nodes of P(node accepted) on the shape's topology
  (`grow_tree`'s, with the drafter's scores ranking siblings);
- sequential: a step takes V + D (V = verification plus the link, D = drafting the tree);
- pipelined with predrafts S: the predrafts take P(S) and run while the step is verified; on a hit
  (probability h(S): the outcome is in S and the bonus is one of the predraft's candidates) the next
  tree is ready at max(V, P); on a miss the drafter drafts afresh after that: max(V, P) + D.
This module knows nothing of sessions, transport or models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from specmesh.drafters.base import Children, grow_tree
from specmesh.tree import ROOT, depths

MAX_OUTCOMES = 8  # predrafts per step considered at most
MAX_BRANCHES = 2  # bonus candidates with a tree under them, per predraft
MAX_RANKS = 8  # sibling ranks tracked (deeper ranks share the last)
MAX_LEVELS = 17  # depths tracked (a predraft is one level deeper than a tree)
PRIOR_ACCEPT = (0.5, 0.15)  # prior acceptance of rank 0 and of later ranks, before any evidence
PRIOR_WEIGHT = 2.0  # observations the prior is worth


class LinearCost:
    """seconds ~ coef . features, fitted by exponentially weighted least squares. Directions the
    data do not pin down (say width, when only chains were drafted) keep the prior's shape, scaled
    to the data (a weak ridge toward `prior * s`, s fitting the prior to the mean sample), so a
    prior never has to be right about magnitudes, only about how the terms compare."""

    def __init__(self, prior: tuple[float, ...], forget: float = 0.97, strength: float = 1e-4) -> None:
        self.prior = list(prior)
        self.forget = forget
        self.strength = strength
        n = len(prior)
        self._xx = [[0.0] * n for _ in range(n)]
        self._xy = [0.0] * n
        self._x = [0.0] * n
        self._y = 0.0
        self.samples = 0
        self.coef = list(prior)

    def add(self, features: tuple[float, ...], seconds: float) -> None:
        if not (seconds >= 0 and math.isfinite(seconds)):
            return
        n, f = len(self.prior), self.forget
        for i in range(n):
            self._x[i] = f * self._x[i] + (1 - f) * features[i]
            self._xy[i] = f * self._xy[i] + (1 - f) * features[i] * seconds
            for j in range(n):
                self._xx[i][j] = f * self._xx[i][j] + (1 - f) * features[i] * features[j]
        self._y = f * self._y + (1 - f) * seconds
        self.samples += 1
        self.coef = self._fit()

    def _fit(self) -> list[float]:
        n = len(self.prior)
        guess = sum(p * x for p, x in zip(self.prior, self._x))
        scale = self._y / guess if guess > 0 else 1.0
        lam = [self.strength * max(self._xx[i][i], 1e-30) for i in range(n)]  # relative, per term
        a = [[self._xx[i][j] + (lam[i] if i == j else 0.0) for j in range(n)] for i in range(n)]
        b = [self._xy[i] + lam[i] * scale * self.prior[i] for i in range(n)]
        coef = _solve(a, b)
        if coef is None:
            return self.coef
        return [max(c, 0.0) for c in coef]  # work never saves time

    def __call__(self, *features: float) -> float:
        return sum(c * x for c, x in zip(self.coef, features))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a x = b by Gaussian elimination with partial pivoting (tiny systems); None if singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [x - k * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


@dataclass
class Costs:
    """What one process has measured: its drafter's calls (`draft`: one tree; `draft_many`: trees
    at several roots at once, whose first forward feeds every root), the target's verifications
    (reported by the verifier with each commit) and the link's share of a step (the time from
    sending a tree to its commit, less the verification)."""

    draft: LinearCost = field(default_factory=lambda: LinearCost((0.002, 0.0002, 0.0)))  # levels, rows, 1
    draft_many: LinearCost = field(default_factory=lambda: LinearCost((0.002, 0.0002, 0.0)))
    verify: LinearCost = field(default_factory=lambda: LinearCost((0.02, 0.002)))  # 1, rows
    # the same while the drafter predrafted beside it: on a CPU the two share memory bandwidth
    # (and maybe a core), so an overlapped verification can cost more than one alone
    verify_overlapped: LinearCost = field(default_factory=lambda: LinearCost((0.02, 0.002)))
    link_s: float = 0.002

    def verify_s(self, rows: float, overlapped: bool) -> float:
        """A verification's cost by rows, overlapped with predrafting or not (each fit stands in for
        the other until that one has samples)."""
        use_overlapped = self.verify_overlapped.samples and (overlapped or not self.verify.samples)
        return (self.verify_overlapped if use_overlapped else self.verify)(1.0, rows)

    def many(self, levels: float, rows: float) -> float:
        """A draft_many call's cost: its own fit once measured, the single-tree fit until then."""
        fit = self.draft_many if self.draft_many.samples else self.draft
        return fit(levels, rows, 1.0)

    def add_link(self, seconds: float) -> None:
        if seconds >= 0 and math.isfinite(seconds):
            self.link_s = 0.8 * self.link_s + 0.2 * seconds


@dataclass
class Acceptance:
    """Beta counts of acceptance per (depth, sibling rank): accepted[d][r] of tried[d][r]."""

    accepted: list[list[float]] = field(default_factory=lambda: _grid(0.0))
    tried: list[list[float]] = field(default_factory=lambda: _grid(0.0))

    def rate(self, depth: int, rank: int) -> float:
        d, r = min(depth, MAX_LEVELS) - 1, min(rank, MAX_RANKS - 1)
        prior = PRIOR_ACCEPT[0] if r == 0 else PRIOR_ACCEPT[1]
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

    def merge_into(self, other: "Acceptance", weight: float = 1.0) -> None:
        for d in range(MAX_LEVELS):
            for r in range(MAX_RANKS):
                other.accepted[d][r] += weight * self.accepted[d][r]
                other.tried[d][r] += weight * self.tried[d][r]

    def decay(self, total: float) -> None:
        """Halve the history once it holds more than `total` depth-1 trials (recent sessions count)."""
        if sum(self.tried[0]) > total:
            for grid in (self.accepted, self.tried):
                for row in grid:
                    row[:] = [0.5 * x for x in row]

    def scaled(self, total: float) -> "Acceptance":
        """A copy holding at most `total` observations at depth 1 (a prior for a new session)."""
        n = sum(self.tried[0]) or 1.0
        k = min(1.0, total / n)
        return Acceptance([[k * x for x in row] for row in self.accepted], [[k * x for x in row] for row in self.tried])


def _grid(v: float) -> list[list[float]]:
    return [[v] * MAX_RANKS for _ in range(MAX_LEVELS)]


def children_of_parents(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


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
    return [[acc.rate(d, r) for r in range(MAX_RANKS)] for d in range(1, MAX_LEVELS + 1)]


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
    budget: int
    depth: int
    outcomes: tuple[int, ...] = ()  # k (main-path tokens accepted) of the predrafts to make, likeliest first
    branches: int = 0
    tokens_per_step: float = 1.0
    step_s: float = 0.0
    hit: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0


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
         batched: bool, fixed: bool = False) -> Plan:
    """The best plan for the next step (see the module docstring); `fixed`: the caps are the shape,
    only the predrafts are planned; `batched`: the drafter grows all predrafts in one call
    (`draft_many`), else one call each."""
    cands = [(budget_cap, depth_cap)] if fixed else shapes(budget_cap, depth_cap)
    table = rates(acc)
    best: Plan | None = None
    for b, d in cands:
        t = topology(b, d)
        e = expected_tokens(t, table)
        v = costs.verify_s(1 + len(t.parents), False) + costs.link_s
        fresh = costs.draft(len(t.per_level), sum(t.per_level), 1.0)
        options = [Plan(b, d, (), 0, e, v + fresh)]
        if pipelined and t.parents:
            v = costs.verify_s(1 + len(t.parents), True) + costs.link_s
            odds = sorted(outcome_odds(t, table), key=lambda o: -o[1])
            for branches in range(1, MAX_BRANCHES + 1):
                pre_levels = topology(*predraft_shape(b, d, branches)).per_level
                levels, rows = len(pre_levels), sum(pre_levels)
                hit, chosen = 0.0, []
                for k, p, w in odds[:MAX_OUTCOMES]:
                    hit += p * _bonus_hit(table, k + 1, w, branches)
                    chosen.append(k)
                    m = len(chosen)
                    pre = costs.many(levels, m * rows) if batched else m * costs.draft(levels, rows, 1.0)
                    step = max(v, pre) + (1.0 - hit) * fresh
                    options.append(Plan(b, d, tuple(chosen), branches, e, step, hit))
        for p in options:
            if best is None or p.tokens_per_s > best.tokens_per_s:
                best = p
    assert best is not None
    return best


def _bonus_hit(table: list[list[float]], depth: int, after: int, branches: int) -> float:
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


