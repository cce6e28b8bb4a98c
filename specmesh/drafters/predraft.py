"""Drafting ahead: predraft the next step's tree while the verifier checks the current one.

After a tree T is sent for step t at context length n, let H be its **main path** (the first
child from the root down to a leaf). Verification accepts some path of T, then adds a bonus
token. For each of the likeliest outcomes "the first k tokens of H accepted" (k = |H|: all of
it), the drafter commits H[:k] speculatively and drafts a tree P_k for position n + k, one level
deeper than asked: P_k's root children are the drafter's two likeliest candidates for the bonus
token, and under each it grows a whole tree of the asked shape for step t + 1 (`grow_tree`'s
`branches`: the second candidate, the bonus whenever the drafter's first guess was wrong, gets
a full tree too, not the leftovers of the first's). For k < |H| the bonus cannot be any
child that T has at that node (the verifier rejected them all), so P_k's root excludes them.
When the commit arrives with accepted == H[:k] and a bonus b that is the token of a root child c
of P_k with children, the answer is `subtree(P_k, c)` trimmed to the requested shape, at once;
otherwise the session rolls back to n, takes the committed tokens and drafts afresh.

Which shapes, which outcomes and how many bonus candidates: `specmesh.planner.plan`, over what
this process has measured (`Costs`: its drafter's calls by levels and rows, the target's
verifications by rows as the verifier reports them, the link) and the session's acceptance per
depth and sibling rank (`Acceptance`, started from the drafter's recent sessions). Each tree sent
gets a plan: the next step's shape (within the caps the verifier sends), and the outcomes of this
tree to predraft, or none when pipelining is not predicted to win. A drafter that grows trees
rooted at several points of its context together (`draft_many`: model drafters, the oracle)
predrafts all of them in one `predraft()` call, and the planner prices that call by its levels and
rows (a wider level costs what the drafter measured it to cost); the others predraft one per
call, deepest first (each further one only rolls the session back, which every drafter can do).

Why re-rooting is lossless under sampling: every node's children in P are i.i.d. draws from the
q it reports, and how many children a node gets is decided before they are drawn (grow_tree);
whether c is picked depends only on its own token, on the draws of its level and on the shape
planned from them, never on the draws below it, and the verifier's randomness is independent
of the drafter's. So the subtree under c, with each node's q carried over exactly, is a valid
draft for context + H[:k] + [b]. Dropping excluded root children changes which c exist, not what
lies under them. Trimming (the main path first, so the depth survives, then index order) keeps
for every node a prefix of its children whose length depends on positions only.

Pushing predrafts: a service may send each predraft as it is made (`take_fresh`), so that the
verifier itself picks the subtree under the bonus at the commit, with the same `next_tree_from`,
and starts the next step without a round trip; its commit then says so (`commit(took=True)`) and
the drafter derives the very same tree. A predraft is never replaced once made, so both sides
always pick from the same one.

`DraftAhead` owns one `DraftSession` plus this bookkeeping (step counter, the tree last sent, its
predrafts). It knows nothing of transport, session ids or eviction; a lock makes each call one
atomic unit of work, so a service may call it from several threads.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmesh import planner
from specmesh.costs import Costs
from specmesh.drafters.base import Drafter, DraftSession, guided, turn_guide
from specmesh.drafters.pick import next_tree_from, pick_predrafted, useful_depth
from specmesh.planner import PREDRAFT_MAX_BUDGET, Acceptance, Plan, predraft_shape
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import ROOT, DraftTree, children_of, main_path, subtree, trim, trim_nodes

__all__ = ["PREDRAFT_MAX_BUDGET", "DraftAhead", "Predraft", "StepTree", "SessionClosedError", "main_path",
           "subtree", "trim", "trim_nodes", "predraft_shape", "pick_predrafted", "useful_depth", "next_tree_from",
           "draft_generator", "calibrate", "drafter_samples", "fit_calibration"]
# What the drafter's recent sessions weigh in a new session's acceptance: a few of the session's own
# steps outweigh it, since acceptance differs between prompts (code, prose) far more than within one.
# With MIN_TRIALS, every session first drafts trees of its own (MIN_TRIALS - this depth-1 trials'
# worth) whatever its prior says: at 8, sessions whose prior said plain went plain at once and
# learnt their own acceptance from rare probes only (the Qwen2.5-Coder pair ran a prompt plain at an
# estimated 0.65, its trees accepted at 0.93 where drafted).
PRIOR_OBSERVATIONS = 4.0
RECENT_OBSERVATIONS = 512.0  # the recent sessions' history is halved past this many depth-1 trials
PROBE_EVERY = 8  # plain steps in a row after which one tree is drafted anyway ...
MIN_TRIALS = 8  # ... and trees are drafted until the session's acceptance has this many depth-1 trials (prior included)
MAX_PROBE_EVERY = 64  # each probe after which plain steps still win doubles the gap, up to this
# A plain run's last tokens that a greedy session scores its drafter on as it feeds them (`_feed`):
# each more is a row of the drafter's head in that call
EVIDENCE_ROWS = 8


def draft_generator(params: SamplingParams) -> torch.Generator:
    """The drafter's generator for a session. A request seed is mixed first: the verifier seeds its
    own generator with the same seed, and a drafter drawing the very same random stream would
    correlate its proposals with the verifier's accept/reject draws (not lossless)."""
    if params.seed is None:
        return make_generator(params)
    digest = hashlib.sha256(f"specmesh-drafter:{params.seed}".encode()).digest()
    seed = int.from_bytes(digest[:8], "little") >> 1
    return make_generator(SamplingParams(params.temperature, params.top_p, params.top_k, seed))


@dataclass(frozen=True)
class Predraft:
    """A predraft as made: for the outcome "`accepted` accepted" of the tree of `step` (a prefix
    of its main path), rooted after `position` tokens; its root's children are bonus candidates,
    under each a tree planned `depth` deep."""

    step: int
    accepted: list[int]
    position: int
    tree: DraftTree
    depth: int


@dataclass(frozen=True)
class StepTree:
    """A tree to send: for `step`, rooted after the first `position` committed tokens."""

    step: int
    position: int
    tree: DraftTree
    predrafted: bool = False
    plain: int = 0  # empty tree: one-row steps to take without asking (DraftResponse.plain_steps)


class SessionClosedError(ValueError):
    """The session was closed (or evicted) while a request for it was on its way."""


class DraftAhead:
    """One served session: open -> first(); then commit()/extend() -> the next tree; predraft()
    in between when pipelined, until it returns False. Steps count the trees sent: 0, 1, 2, ...
    `costs`: what this process measured (shared by its sessions; each call here adds to it);
    `recent`: the acceptance of the drafter's recent sessions (shared; the prior of this one, and
    fed by it); `fixed`: trees of exactly the requested shape (only the predrafts are planned);
    `push`: the service sends predrafts as they are made (`take_fresh`), kept here for it;
    `grammar`: the turn's grammar (`specmesh.grammar.Guide`) every tree's nodes must satisfy. The
    trees follow it and the request's penalties (`drafters.base.DraftGuide`). `sharing`: how many
    sessions the process drafts for at once, asked at every plan (`planner.plan`; the drafter
    service's `SessionStore.busy`). `shares_cores`: the verifier runs on the drafter's cores (the
    planner prices work beside a verification as taking its own time after it)."""

    def __init__(self, session: DraftSession, context_len: int, params: SamplingParams, pipelined: bool,
                 push: bool = False, costs: Costs | None = None, recent: Acceptance | None = None,
                 fixed: bool = False, grammar=None, sharing: Callable[[], float] | None = None,
                 shares_cores: bool = False) -> None:
        assert context_len >= 1, "a session needs at least one committed token"
        self.guide = turn_guide(params, context_len, grammar)
        self.session = session
        self.params = params
        self.pipelined = pipelined
        self.push = push  # the service pushes its predrafts (take_fresh); only kept here
        self.fixed = fixed
        self.sharing = sharing  # the sessions this drafter serves at once, for `planner.plan` (None: 1)
        self.shares_cores = shares_cores
        self.costs = costs if costs is not None else Costs()
        self.recent = recent
        self.acceptance = recent.scaled(PRIOR_OBSERVATIONS) if recent is not None else Acceptance()
        self.generator = draft_generator(params)
        self.position = context_len  # committed tokens (the draft session may hold more: H[:k])
        self.step = -1  # step of the tree last sent
        self.steps = 0
        self.hits = 0
        self.predrafts = 0
        self._next: Plan | None = None  # planned for the step after the tree last sent (lazily: `plan`)
        self._caps = (0, 0)  # the (budget, depth) caps that plan is for
        self._lock = threading.RLock()  # reentrant: `plan` is planned under it on first use
        self._tree: DraftTree | None = None
        self._expected = 0.0  # accepted tokens the rates expected of the tree last sent (`_send`)
        self._path: list[int] = []  # H: the main path's tokens of the tree last sent
        self._predrafts: dict[tuple[int, ...], Predraft] = {}  # H[:k] -> P_k (never replaced: it may be out)
        self._fresh: list[Predraft] = []  # made since the last take_fresh()
        self._todo: list[int] = []  # k of the predrafts still to make for the tree last sent (once planned)
        self._held = 0  # tokens of H the session holds beyond `position`
        self._closed = False
        self._sent_at = 0.0
        self._overlapped = False
        self._sent_plan: Plan | None = None  # the plan that chose the tree last sent
        self._period_from: float | None = None  # when the step of the tree last sent began (None: the first)
        self._plain_steps = 0  # empty trees sent in a row
        self._probe_gap = PROBE_EVERY  # plain steps between probes now (`_probe_every`)
        self._probe: Plan | None = None  # the last plan made as a probe
        self._probed = False  # the tree last sent was a probe's
        self._prompt_fed = False  # whether the session has fed the turn's context (the prompt) yet
        # a committed bonus one level below the accepted leaf that the next fresh draft scores the
        # drafter's own choice for (`_beyond`): its index in the context and its depth (0: none)
        self._score_at, self._score_depth = 0, 0
        # the tree last sent is a turn's first: the verifier may prefill the turn's tokens before it
        # verifies it, so its window says nothing of the link, nor its period of a step
        self._turn_start = True

    def first(self, budget: int, depth: int) -> StepTree:
        with self._lock:
            self._check_open()
            assert self._tree is None, "first() is called once, right after opening"
            return self._send_fresh(budget, depth)

    def commit(self, step: int, accepted: list[int], bonus: int, budget: int, depth: int,
               features: torch.Tensor | None = None, took: bool = False,
               arrived_at: float | None = None, verify_s: float = 0.0) -> StepTree:
        """The verifier's outcome of the tree for `step`; returns the tree for step + 1, of at most
        `budget` nodes and `depth` levels. `features`: the target's for accepted + [bonus] (feature
        drafters only). `took`: the verifier already took the tree for step + 1 from this outcome's
        predraft (pushed to it: `take_fresh`); the tree returned is that same one, and a ValueError
        says that there is none. `arrived_at`: when the commit reached the service
        (`time.perf_counter()`; a commit that waited for a predraft in progress came that much
        sooner than it is handled); `verify_s`: the verifier's forward time for that tree (0:
        not reported). Both are measurements for the planner."""
        with self._lock:
            self._check_open()
            if step != self.step:
                raise ValueError(f"step: expected {self.step} (the tree last sent), got {step}")
            pred = self._predrafts.get(tuple(accepted))
            tree = (next_tree_from(pred.tree, bonus, budget, min(depth, pred.depth), self.params)
                    if pred is not None else None)
            if took and tree is None:
                raise ValueError(f"took_predraft: no predraft of step {step} has a tree for "
                                 f"{len(accepted)} accepted tokens and bonus {bonus}")
            if pred is not None:
                self._observe_bonus(accepted, pred, tree is not None)
            arrived = time.perf_counter() if arrived_at is None else arrived_at
            self._measure(accepted, arrived, verify_s)
            self._measure_period(arrived, 1)
            beyond = self._beyond(accepted)
            if beyond and pred is not None and len(accepted) == len(self._path):
                # the predraft's first bonus candidate is the drafter's own choice there
                candidates = children_of(pred.tree)[ROOT]
                if candidates:
                    self._observe_beyond(beyond, pred.tree.tokens[candidates[0]] == bonus)
                beyond = 0
            if pred is not None and self._held >= len(accepted):
                # 1. the session holds the accepted path (a feature drafter holds it with
                # predicted features: the verifier's replace them), and maybe more of the main path
                if self._held > len(accepted):
                    self.session.rollback(self.position + len(accepted))
                self.session.commit([bonus], features)
            else:
                # 2. forget the speculative path, take what was verified
                if self._held:
                    self.session.rollback(self.position)
                self.session.commit(list(accepted) + [bonus], features)
            self.position += len(accepted) + 1
            self._held = 0
            if tree is not None:
                self.hits += 1
                return self._send(tree, budget, depth, True, self._next)
            if beyond:
                self._score_at, self._score_depth = self.position - 1, beyond
            return self._send_fresh(budget, depth)

    def extend(self, tokens: list[int], budget: int, depth: int, keep: int = 0,
               features: torch.Tensor | None = None, grammar=None, same_turn: bool = False,
               arrived_at: float | None = None) -> StepTree:
        """New committed tokens that did not come from verification, after keeping only the first
        `keep` committed ones (0 = all); returns a fresh tree for the next step. The tree last sent
        (never committed) is dropped. A new turn's grammar is `grammar` (None: none); `same_turn`:
        the tokens are the current turn's output (a plain run), its grammar and counts go on.
        `arrived_at`: as for `commit`."""
        with self._lock:
            self._check_open()
            arrived = time.perf_counter() if arrived_at is None else arrived_at
            plain_run = same_turn and self._tree is not None and not self._tree.tokens
            if not same_turn:
                self.guide = turn_guide(self.params, (keep or self.position) + len(tokens), grammar)
            keep = keep or self.position
            if not 1 <= keep <= self.position:
                raise ValueError(f"keep: must be in [1, {self.position}] (the committed tokens), got {keep}")
            if self._held or not tokens or keep < self.position:
                # an empty extension re-drafts at the same point: let the session re-feed its last token
                self.session.rollback(keep)
            self.session.commit(list(tokens), features)
            self.position = keep + len(tokens)
            self._held = 0
            if plain_run:  # the run the empty tree asked for
                if self._prompt_fed and self._behind() > 0:
                    # its tokens are fed now, in a call of their own, and the run's period holds it: the
                    # run's plan priced feeding them, the tree after it prices its own drafting (fed in
                    # that tree's call, a 32-step run's tokens once made the trees' kinds look 1.5x
                    # slower than planned, and predrafting stayed off for the rest of the process)
                    t = time.perf_counter()
                    self._feed(run=len(tokens))
                    arrived += time.perf_counter() - t
                self._measure_period(arrived, len(tokens))
                self._turn_start = False  # the turn's tokens are in: the next window is a step's
            elif same_turn:
                self._period_from = arrived  # tokens of this turn from elsewhere: a step begins now
            else:  # a new turn: the time since the last step was not a step, nor is the first one's
                self._period_from = None  # (the verifier prefills the turn's tokens in its window)
                self._turn_start = True
            self._prompt_fed = self._prompt_fed and same_turn
            return self._send_fresh(budget, depth)

    @property
    def _batched(self) -> bool:
        """The draft session grows trees at several roots at once (`draft_many`)."""
        return hasattr(self.session, "draft_many")

    @property
    def plan(self) -> Plan | None:
        """The plan for the step after the tree last sent: its shape (what a fresh draft at its
        commit uses) and the outcomes of that tree to predraft. Made on first use, not when the
        tree goes out: a service sends the tree first, and a pipelined one plans while the verifier
        checks it (a plan weighs every shape, outcome and bonus count: not free in Python)."""
        with self._lock:
            if self._next is None and self._tree is not None:
                self._next = self._plan(*self._caps)
                self._todo = self._outcomes(self._next) if self.pipelined and self._tree.tokens else []
            return self._next

    @property
    def wants_predraft(self) -> bool:
        with self._lock:
            # on the verifier's cores nothing runs beside a verification for free (the planner never
            # overlaps there), and a plan made now would miss the step's outcome: planned at commit
            if not self.pipelined or self.shares_cores or self._closed or self._tree is None:
                return False
            if not self._tree.tokens:  # a plain run: feed its committed tokens beside it, if so planned
                return self._sent_plan is not None and self._sent_plan.feed and self._behind() > 0
            return bool(self.plan and self._todo)

    def predraft(self) -> bool:
        """One unit of predrafting for the tree last sent (one planned outcome, or every one at
        once with `draft_many`); False when there was nothing (more) to do."""
        with self._lock:
            if not self.wants_predraft:
                return False
            assert self.plan is not None and self._tree is not None
            if not self._tree.tokens:  # no tree out: feed the committed tokens while the verifier steps
                self._feed()
                return True
            if self._batched:
                ks, self._todo = self._todo, []
            else:
                ks = [self._todo.pop(0)]
            if not self._hold(max(ks)):
                ks = [0]
                if () in self._predrafts:
                    return False
            budget, depth, branches = predraft_shape(self.plan.budget, self.plan.depth, self.plan.branches)
            excludes = [() if k == len(self._path) else self._children_on_path(k) for k in ks]
            behind = self._behind()
            t = time.perf_counter()
            if len(ks) == 1:
                trees = [self.session.draft(budget, depth, self.params, self.generator, excludes[0], branches,
                                            **guided(self.guide))]
            else:  # every planned outcome at once: one expansion per level for all of them
                trees = self.session.draft_many([self.position + k for k in ks], budget, depth,
                                                self.params, self.generator, excludes, branches,
                                                **guided(self.guide))
            self._add_draft_cost(trees, time.perf_counter() - t, behind, many=len(ks) > 1)
            self._overlapped = True
            for k, tree in zip(ks, trees):
                made = Predraft(self.step, self._path[:k], self.position + k, tree, self.plan.depth)
                self._predrafts[tuple(made.accepted)] = made
                self._fresh.append(made)
            self.predrafts += len(ks)
            return True

    def _hold(self, k: int) -> bool:
        """Make the draft session hold the committed context plus the first `k` tokens of the main
        path (k = 0: re-draft at the committed point). False when it cannot: a feature drafter keeps
        predicted features for the last tree it drafted only, and after a hit on an earlier
        predraft that is another tree; the session then holds the committed context alone."""
        if self._held > k or k == 0:
            self.session.rollback(self.position + k)
        elif self._held < k:
            try:
                self.session.commit(self._path[self._held:k])
            except ValueError:
                self._todo = []
                self.session.rollback(self.position)
                self._held = 0
                return False
        self._held = k
        return True

    def take_fresh(self) -> list[Predraft]:
        """The predrafts made since the last call (for a service that pushes them as they come)."""
        with self._lock:
            fresh, self._fresh = self._fresh, []
            return fresh

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._predrafts = {}
                self._fresh = []
                self._tree = None
                self.session.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("session_id: the session was closed or evicted")

    def _measure(self, accepted: list[int], arrived: float, verify_s: float) -> None:
        """What the commit of the tree last sent tells the planner: which of its nodes were
        accepted, the verification's cost by rows and the rest of the window (the link)."""
        assert self._tree is not None
        if self._tree.tokens:
            for acc in (self.acceptance, self.recent):
                if acc is not None:
                    acc.observe_tokens(self._expected, len(accepted))
        self._observe(self._tree.parents, _accepted_nodes(self._tree, accepted))
        if verify_s > 0:
            fit = self.costs.verify_overlapped if self._overlapped else self.costs.verify
            fit.add((1.0, 1.0 + len(self._tree)), verify_s)
            if not self._turn_start:
                self.costs.add_link(arrived - self._sent_at - verify_s)
        self._turn_start = False

    def _observe(self, parents: list[int], accepted_nodes: list[int]) -> None:
        """One tree's outcome, verified or as a plain run's tokens tell it, in the session's
        acceptance and its drafter's recent sessions'."""
        self.acceptance.observe(parents, accepted_nodes)
        if self.recent is not None:
            self.recent.observe(parents, accepted_nodes)
            self.recent.decay(RECENT_OBSERVATIONS)

    def _measure_period(self, arrived: float, steps: int) -> None:
        """The step of the tree last sent (`steps` one-row steps for a plain run) took from the
        commit before to `arrived`: against what the plan that chose it predicted."""
        p, began, self._period_from = self._sent_plan, self._period_from, arrived
        if p is not None and p.informed and began is not None:
            self.costs.add_period(p.kind, steps * p.predicted_s, arrived - began)

    def _observe_bonus(self, accepted: list[int], pred: "Predraft", hit: bool) -> None:
        """The outcome of a predraft came: was the bonus among its candidates, against what the
        planner's `bonus_hit` predicted for it (before this step's acceptance is counted)."""
        k = len(accepted)
        after = len(self._children_on_path(k))
        candidates = len(children_of(pred.tree).get(ROOT, []))
        expected = planner.bonus_hit(planner.rates(self.acceptance), k + 1, after, candidates)
        for acc in (self.acceptance, self.recent):
            if acc is not None:
                acc.observe_bonus(expected, hit)

    def _feed(self, run: int = 0) -> None:
        """Feed the committed tokens the draft session has not fed yet, drafting nothing (an empty
        draft call), apart from any timed draft. `run`: the last that many of them are a plain run's
        output, the target's own tokens: a greedy, unguided session whose drafter can say what it
        would have chosen at each (`predictions`: model drafters) scores it on the run's last
        EVIDENCE_ROWS tokens as it feeds them (`_observe_run`), so that a session planned plain goes
        on learning its acceptance between probes, at every depth."""
        n = min(run, EVIDENCE_ROWS, self._behind())
        if n > 0 and self.params.greedy and self.guide is None and hasattr(self.session, "predictions"):
            self._observe_run(self.session.predictions(self.position - n), n)
        else:
            self.session.draft(0, 0, self.params, self.generator)

    def _beyond(self, accepted: list[int]) -> int:
        """The bonus's depth when the accepted path of the tree last sent ends at one of its leaves
        in a greedy, unguided session, else 0. The bonus then sits at the level a deeper tree would
        have drafted next, and the drafter's own choice there (the first bonus candidate of the
        predraft for this outcome, or scored by the next fresh draft: `draft_scored`) against it is
        exactly that node's trial (`_observe_beyond`). Without it a session whose trees stay shallow
        never sees the deeper levels' acceptance, only the prior's guess at it, and a low guess kept
        one-node trees going where chains of four were accepted at every depth."""
        if not accepted or not self.params.greedy or self.guide is not None:
            return 0
        assert self._tree is not None
        nodes = _accepted_nodes(self._tree, accepted)
        return len(accepted) + 1 if len(nodes) == len(accepted) and not children_of(self._tree)[nodes[-1]] else 0

    def _observe_beyond(self, depth: int, accepted: bool) -> None:
        """The trial at `depth` that the bonus below a leaf tells (`_beyond`), in the session's
        acceptance and its drafter's recent sessions' (rank 0: the drafter's first choice)."""
        for acc in (self.acceptance, self.recent):
            if acc is not None:
                acc.observe_at(depth, 0, accepted)

    def _observe_run(self, predicted: list[int], n: int) -> None:
        """The drafter's choices for the last `n` committed tokens, taken as the chains it would
        have drafted there, each as deep as the depth cap allows: from a run's first token, a chain
        accepts while the choices agree; the first that does not is rejected and the committed
        token there is the bonus, the next chain starts after it. A chain cut off by the run's end
        counts only what was seen (no rejection is made up). Under greedy decoding a model drafter
        fed the committed tokens makes exactly the choices such a chain would have (rank 0 at every
        depth); nothing here counts for a sibling rank."""
        tokens = self.session.context[self.position - n:self.position]
        agree = [p == t for p, t in zip(predicted, tokens)]
        depth = max(1, self._caps[1])
        i = 0
        while i < n:
            k = 0
            while k < depth and i + k < n and agree[i + k]:
                k += 1
            size = k if i + k == n else min(depth, k + 1)  # cut off: the k accepted only
            self._observe(list(range(-1, size - 1)), list(range(k)))  # parents: ROOT, then each under the one before
            i += k + 1

    def _behind(self) -> int:
        """Committed tokens the draft session has not fed yet (its next call feeds them first)."""
        return getattr(self.session, "behind", 0)

    def _add_draft_cost(self, trees: list[DraftTree], seconds: float, behind: int, many: bool = False) -> None:
        levels, rows = planner.draft_work(trees)
        if levels:
            fit = self.costs.draft_many if many else self.costs.draft
            fit.add((float(levels), float(rows), float(behind), 1.0), seconds)

    def _plan(self, budget: int, depth: int) -> Plan:
        # after a run of plain steps (`_probe_every`), one speculates anyway: the acceptance that
        # speculation is judged by comes from verified trees (a greedy model drafter's plain runs
        # tell only its first choices' acceptance: `_feed`)
        sharing = self._sharing()
        probe = self._plain_steps >= self._probe_every(sharing) or sum(self.acceptance.tried[0]) < MIN_TRIALS
        # on the verifier's cores no overlapped plan can win (`planner.plan`'s shares_cores) and none
        # is carried out (`wants_predraft`): the session is planned as a sequential one, without
        # pricing predrafts at every commit, where the verifier waits for the plan
        p = planner.plan(self.costs, self.acceptance, budget, depth, self.pipelined and not self.shares_cores,
                         self._batched, self.fixed, speculate=probe, plain_run=self._plain_run(sharing),
                         sharing=sharing)
        if probe:
            self._probe = p
        return p

    def _sharing(self) -> float:
        return max(1.0, float(self.sharing())) if self.sharing is not None else 1.0

    def _probe_every(self, sharing: float) -> int:
        """Plain steps between probes: the session's gap per session the drafter serves at once (a
        probe's drafting delays every one of them). The gap starts at PROBE_EVERY and doubles, up to
        MAX_PROBE_EVERY, each time plain steps are planned right after a probe (its evidence did not
        make trees win); a tree planned on its merits sets it back. A probe is not free: on a CPU a
        tree among plain runs costs its rows, its drafting, the link, and the first plain steps
        after it run slower while the caches refill (one probe per 8 steps cost the SmolLM2 pair
        about 15% against plain decoding)."""
        return self._probe_gap * int(sharing)

    def _plain_run(self, sharing: float | None = None) -> int:
        """One-row steps a tree left out now stands for: the rest of the run up to the next probe."""
        return max(1, self._probe_every(self._sharing() if sharing is None else sharing) - self._plain_steps)

    def _children_on_path(self, k: int) -> list[int]:
        """Tokens of the children the tree last sent has at the k-th node of its main path."""
        assert self._tree is not None
        node = ROOT if k == 0 else main_path(self._tree)[k - 1]
        return [self._tree.tokens[c] for c in children_of(self._tree)[node]]

    def _send_fresh(self, budget: int, depth: int) -> StepTree:
        """Send a tree for the next step drafted now, of the shape planned for it (within the caps):
        the plan its predrafts were made for, unless the caps changed (or no tree was sent yet). When
        not speculating is predicted faster, an empty tree that asks for a run of one-row steps up
        to the next probe (`StepTree.plain`): they need no round trip, and the drafter feeds their
        tokens in one call later."""
        p = (self.plan if self._caps == (budget, depth) else None) or self._plan(budget, depth)
        if p.budget == 0:
            return self._send(DraftTree.empty(), budget, depth, False, p, p.run or self._plain_run())
        if not self._prompt_fed and self._behind() > 0:
            # feed the turn's context in a call of its own: the timed draft call below would count
            # a prefill as drafting (one such call once made the planner's draft cost 5x what
            # drafting costs, and sessions went plain for dozens of steps)
            self._feed()
        self._prompt_fed = True
        behind = self._behind()
        t = time.perf_counter()
        if self._score_at and hasattr(self.session, "draft_scored"):  # the same feed scores the bonus
            tree, choices = self.session.draft_scored(self._score_at, p.budget, p.depth, self.params, self.generator)
            self._observe_beyond(self._score_depth, choices[0] == self.session.context[self._score_at])
        else:
            tree = self.session.draft(p.budget, p.depth, self.params, self.generator, **guided(self.guide))
        self._add_draft_cost([tree], time.perf_counter() - t, behind)
        return self._send(tree, budget, depth, False, p)

    def _send(self, tree: DraftTree, budget: int, depth: int, predrafted: bool, plan: Plan | None,
              plain: int = 0) -> StepTree:
        self.step += 1
        self.steps += 1
        self._score_at = 0  # a bonus not scored by this tree's draft stays unscored
        # by what was planned, not what the drafter found: a planned tree may come out empty (no
        # n-gram match), and that is neither a plain run nor evidence against trees
        planned_tree = plan is not None and plan.budget > 0
        if planned_tree and plan is not self._probe:
            self._probe_gap = PROBE_EVERY  # trees win again
        elif plan is not None and not planned_tree and self._probed:  # plain steps right after a probe
            self._probe_gap = min(2 * self._probe_gap, MAX_PROBE_EVERY)
            plain = self._plain_run()
        self._probed = planned_tree and plan is self._probe
        self._plain_steps = 0 if tree.tokens else self._plain_steps + max(1, plain)
        self._tree = tree
        # what this session's rates expect of the tree now, before its outcome counts (`_measure`)
        self._expected = (planner.expected_tokens(planner.shape_of(tree.parents), planner.rates(self.acceptance)) - 1.0
                          if tree.tokens else 0.0)
        self._path = [tree.tokens[i] for i in main_path(tree)]
        self._predrafts = {}
        self._fresh = []
        self._next, self._caps, self._todo = None, (budget, depth), []
        self._sent_at = time.perf_counter()
        self._overlapped = False  # whether a predraft ran while this tree was being verified
        self._sent_plan = plan
        return StepTree(self.step, self.position, tree, predrafted, plain)

    def _outcomes(self, plan: Plan) -> list[int]:
        """The outcomes of the tree last sent worth a predraft: as many as the plan has, the
        likeliest under this session's acceptance, deepest first (each further one only rolls
        the session back)."""
        if not plan.outcomes:
            return []
        assert self._tree is not None
        odds = planner.outcome_odds(planner.shape_of(self._tree.parents), planner.rates(self.acceptance))
        likeliest = sorted(odds, key=lambda o: -o[1])[:len(plan.outcomes)]
        return sorted((k for k, _, _ in likeliest), reverse=True)


def _accepted_nodes(tree: DraftTree, accepted: list[int]) -> list[int]:
    """The nodes of `tree` along the accepted tokens from the root (the first child with each token:
    under sampling siblings may repeat a token)."""
    kids = children_of(tree)
    out, node = [], ROOT
    for tok in accepted:
        node = next((c for c in kids.get(node, []) if tree.tokens[c] == tok), None)
        if node is None:
            break
        out.append(node)
    return out


CALIBRATION_SHAPES = ((1, 1), (2, 2), (4, 4), (8, 2), (16, 2), (16, 4))  # (budget, depth): levels and width apart
CALIBRATION_FED = (2, PROBE_EVERY)  # committed tokens fed before a tree, up to a plain run's


def calibrate(session: DraftSession, context: list[int], costs: Costs, rounds: int = 2,
              feature_dim: int = 0) -> None:
    """Measure a drafter's cost by levels, rows and fed tokens before the first request
    (`calibration_samples`) and take the shapes of `costs.draft` / `costs.draft_many` from them
    (`fit_calibration`: live calls then only rescale them)."""
    fit_calibration(costs, calibration_samples(session, context, rounds, feature_dim))


def calibration_samples(session: DraftSession, context: list[int], rounds: int = 2,
                        feature_dim: int = 0) -> dict[str, list]:
    """A drafter's calls timed before the first request: chains and wide trees, and trees after
    committed tokens the session never drafted (as after a run of plain steps: it must feed them
    all first), and where the session has `draft_many`, trees at 2 and 4 roots at once; each shape
    `rounds` times after one untimed call. {"draft": [(features, seconds)], "draft_many": [...]}
    (features as `Costs.draft` takes them). `session`: opened on `context` (>= 2 tokens the
    drafter accepts); the caller closes it. `feature_dim`: a feature drafter's, whose commits take
    the target's features (zeros here: what a call costs does not depend on their values)."""
    params = SamplingParams()
    gen = draft_generator(params)
    session.draft(4, 2, params, gen)  # first calls allocate and page weights in
    n = len(context)

    def timed(fed: int, call):
        if fed:
            session.rollback(n)  # forgets the last tree too: nothing below is a drafted path
            tokens = [context[1 + i % (n - 1)] for i in range(fed)]
            session.commit(tokens, torch.zeros(fed, feature_dim) if feature_dim else None)
        behind = getattr(session, "behind", 0)
        t = time.perf_counter()
        trees = call()
        seconds = time.perf_counter() - t
        if fed:
            session.rollback(n)
        return (*map(float, planner.draft_work(trees)), float(behind), 1.0), seconds

    samples = [timed(0, lambda b=b, d=d: [session.draft(b, d, params, gen)]) for b, d in CALIBRATION_SHAPES * rounds]
    samples += [timed(fed, lambda: [session.draft(2, 2, params, gen)]) for fed in CALIBRATION_FED * rounds]
    out = {"draft": samples, "draft_many": []}
    if hasattr(session, "draft_many"):
        def many(roots: int, budget: int, depth: int):
            ends = [n - 1, n] * (roots // 2)
            return lambda: session.draft_many(ends, budget, depth, params, gen, [()] * len(ends))

        shapes = [(0, 2, 4, 2), (0, 2, 8, 4), (0, 4, 4, 2), (0, 4, 8, 3), (8, 2, 4, 2), (8, 4, 8, 3)]
        out["draft_many"] = [timed(fed, many(*shape)) for fed, *shape in shapes * rounds]
    return out


def fit_calibration(costs: Costs, samples: dict[str, list]) -> None:
    """Take `costs.draft` / `costs.draft_many`'s shapes from `calibration_samples`' (or the same
    read back from JSON)."""
    costs.draft.fit_shape([(tuple(f), float(y)) for f, y in samples["draft"]])
    if samples["draft_many"]:
        costs.draft_many.fit_shape([(tuple(f), float(y)) for f, y in samples["draft_many"]])


def drafter_samples(drafter: Drafter, vocab_size: int | None) -> dict[str, list]:
    """`calibration_samples` of a session opened now on a short context (a feature drafter on
    zero features: what a call costs does not depend on their values)."""
    context = list(range(1, 1 + min(16, vocab_size or 16)))
    dim = drafter.feature_dim if drafter.needs_features else 0
    session = drafter.open(context, torch.zeros(len(context) - 1, dim) if dim else None)
    try:
        return calibration_samples(session, context, feature_dim=dim)
    finally:
        session.close()

