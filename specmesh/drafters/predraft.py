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

Which outcomes, in which order: this session's history of outcomes (how many tokens of the main
path were accepted, with a prior) ranks them; the likeliest are predrafted, as many as fit before
the commit is expected (the time from sending a tree to its commit and the time of one predraft
are measured as the session goes: `paced`). A drafter that grows trees rooted at several points
of its context together (`draft_many`: model drafters, the oracle) predrafts all of them in one
`predraft()` call, in the forwards of one (a level costs one forward whatever its width on an
accelerator); the others predraft one per call, deepest first (each further one only rolls the
session back, which every drafter can do). The first call always runs.

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
from dataclasses import dataclass

import torch

from specmesh.drafters.base import DraftSession, common_prefix
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import ROOT, DraftTree, children_of, depths

PREDRAFT_MAX_BUDGET = 64
PREDRAFT_BRANCHES = 2  # bonus candidates with a tree under them, per predraft
PREDRAFT_MAX_OUTCOMES = 8  # predrafts per tree sent, at most
MAX_DEPTH = 16  # outcome history buckets (deeper outcomes share the last)


def main_path(tree: DraftTree) -> list[int]:
    """Node indices from the root to a leaf, always following the first child (empty tree: [])."""
    kids = children_of(tree)
    path: list[int] = []
    node = ROOT
    while kids[node]:
        node = kids[node][0]
        path.append(node)
    return path


def subtree(tree: DraftTree, node: int) -> DraftTree:
    """The descendants of `node`, re-rooted: `node` becomes the root (its children get parent -1,
    its q becomes the root's q); indices keep their relative order; other q entries are dropped."""
    assert 0 <= node < len(tree), f"node {node} outside a tree of {len(tree)} nodes"
    new_index = {node: ROOT}
    tokens: list[int] = []
    parents: list[int] = []
    for i in range(node + 1, len(tree)):
        p = tree.parents[i]
        if p in new_index:
            new_index[i] = len(tokens)
            tokens.append(tree.tokens[i])
            parents.append(new_index[p])
    return _with_q(tree, tokens, parents, new_index)


def trim_nodes(tree: DraftTree, budget: int, depth: int) -> list[int]:
    """Indices (ascending) of the nodes `trim` keeps: first the main path down to `depth`, then
    other nodes in index order, each only if its parent is kept and it is at most `depth` deep,
    until `budget` nodes are kept.

    The kept set is closed under parents, and each node keeps a prefix of its children in index
    order (its first child, then those before the cut), how many depending on positions only,
    never on their tokens: what lossless sampling needs. The main path comes first so that a
    re-rooted predraft keeps its full depth (level order alone would spend the budget on width).
    """
    node_depth = depths(tree.parents)
    kids = children_of(tree)
    keep: set[int] = set()
    node = ROOT
    while kids[node] and len(keep) < budget and node_depth[kids[node][0]] <= depth:
        node = kids[node][0]
        keep.add(node)
    for i, p in enumerate(tree.parents):
        if len(keep) >= budget:
            break
        if node_depth[i] <= depth and (p == ROOT or p in keep):
            keep.add(i)
    return sorted(keep)


def trim(tree: DraftTree, budget: int, depth: int) -> DraftTree:
    """The tree cut to at most `budget` nodes and `depth` levels (see `trim_nodes`)."""
    new_index = {ROOT: ROOT}
    tokens: list[int] = []
    parents: list[int] = []
    for i in trim_nodes(tree, budget, depth):
        new_index[i] = len(tokens)
        tokens.append(tree.tokens[i])
        parents.append(new_index[tree.parents[i]])
    return _with_q(tree, tokens, parents, new_index)


def _with_q(tree: DraftTree, tokens: list[int], parents: list[int], new_index: dict[int, int]) -> DraftTree:
    """A tree of the kept nodes carrying the q of every kept node that still has children."""
    expanded = set(parents)
    q_nodes, q_ids, q_probs = [], [], []
    for old, ids, probs in zip(tree.q_nodes, tree.q_ids, tree.q_probs):
        new = new_index.get(old)
        if new is not None and new in expanded:
            q_nodes.append(new)
            q_ids.append(list(ids))
            q_probs.append(list(probs))
    return DraftTree(tokens, parents, q_nodes, q_ids, q_probs)


def predraft_shape(budget: int, depth: int) -> tuple[int, int, int]:
    """Shape of a predraft, (budget, depth, branches) for `grow_tree`: PREDRAFT_BRANCHES candidates
    for the bonus token, each with a tree of the asked shape under it (smaller where the budget
    would pass PREDRAFT_MAX_BUDGET), one level deeper than asked."""
    sub = min(budget, PREDRAFT_MAX_BUDGET // PREDRAFT_BRANCHES - 1)
    return PREDRAFT_BRANCHES * (sub + 1), depth + 1, PREDRAFT_BRANCHES


def pick_predrafted(predraft: DraftTree, bonus: int, budget: int, depth: int, min_depth: int = 1) -> DraftTree | None:
    """The tree under the first root child of `predraft` with token `bonus` that has children,
    trimmed to the requested shape; None when there is none, or when it is less than `min_depth`
    deep. `min_depth` > 1 is for greedy decoding only: under sampling, choosing a subtree by its
    depth would choose it by the draws below it (their scores shape the tree), and verification
    needs every node's children to be plain draws from its q."""
    kids = children_of(predraft)
    for c in kids[ROOT]:
        if predraft.tokens[c] == bonus and kids[c]:
            tree = trim(subtree(predraft, c), budget, depth)
            return tree if max(depths(tree.parents), default=0) >= min_depth else None
    return None


def useful_depth(depth: int, params: SamplingParams) -> int:
    """The shallowest predrafted tree worth sending instead of a fresh draft: half the requested
    depth for greedy decoding (a one-token tree answered at once loses to a full tree answered a
    draft later whenever drafting costs less than verifying: the regime pipelining is for);
    any depth under sampling (see `pick_predrafted`)."""
    return (depth + 1) // 2 if params.greedy else 1


def next_tree_from(predraft: DraftTree, bonus: int, budget: int, depth: int, params: SamplingParams) -> DraftTree | None:
    """The tree for the next step that `predraft` gives once `bonus` is known, or None: the one
    rule the drafter and a verifier taking a pushed predraft both apply, so they pick the same tree."""
    return pick_predrafted(predraft, bonus, budget, depth, useful_depth(depth, params))


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
    of its main path), rooted after `position` tokens; its root's children are bonus candidates."""

    step: int
    accepted: list[int]
    position: int
    tree: DraftTree


@dataclass(frozen=True)
class StepTree:
    """A tree to send: for `step`, rooted after the first `position` committed tokens."""

    step: int
    position: int
    tree: DraftTree
    predrafted: bool = False


class SessionClosedError(ValueError):
    """The session was closed (or evicted) while a request for it was on its way."""


class DraftAhead:
    """One served session: open -> first(); then commit()/extend() -> the next tree; predraft()
    in between when pipelined, until it returns False. Steps count the trees sent: 0, 1, 2, ...
    `paced`: stop predrafting when the next predraft would likely end after the commit arrives
    (a drafter busy with it would delay a miss); `max_outcomes`: at most this many per tree;
    `push`: the service sends predrafts as they are made (`take_fresh`), kept here for it."""

    def __init__(self, session: DraftSession, context_len: int, params: SamplingParams, pipelined: bool,
                 paced: bool = True, max_outcomes: int = PREDRAFT_MAX_OUTCOMES, push: bool = False) -> None:
        assert context_len >= 1, "a session needs at least one committed token"
        self.session = session
        self.params = params
        self.pipelined = pipelined
        self.push = push  # the service pushes its predrafts (take_fresh); only kept here
        self.paced = paced
        self.max_outcomes = max_outcomes
        self.generator = draft_generator(params)
        self.position = context_len  # committed tokens (the draft session may hold more: H[:k])
        self.step = -1  # step of the tree last sent
        self.steps = 0
        self.hits = 0
        self.predrafts = 0
        self._lock = threading.Lock()
        self._tree: DraftTree | None = None
        self._shape = (1, 1)
        self._path: list[int] = []  # H: the main path's tokens of the tree last sent
        self._predrafts: dict[tuple[int, ...], DraftTree] = {}  # H[:k] -> P_k (never replaced: it may be out)
        self._fresh: list[Predraft] = []  # made since the last take_fresh()
        self._plan: list[int] | None = None  # k of the predrafts still to do (None: not planned yet)
        self._held = 0  # tokens of H the session holds beyond `position`
        self._closed = False
        # outcome history (with a prior): all of H accepted, or only its first k tokens
        self._full, self._partial = 1.0, [0.6 * 0.5 ** k for k in range(MAX_DEPTH + 1)]
        self._sent_at = 0.0
        self._window_s: float | None = None  # sending a tree -> its commit (moving average)
        self._unit_s: float | None = None  # one unit of predrafting (moving average)

    def first(self, budget: int, depth: int) -> StepTree:
        with self._lock:
            self._check_open()
            assert self._tree is None, "first() is called once, right after opening"
            return self._send(self._draft(budget, depth), budget, depth, False)

    def commit(self, step: int, accepted: list[int], bonus: int, budget: int, depth: int,
               features: torch.Tensor | None = None, took: bool = False,
               arrived_at: float | None = None) -> StepTree:
        """The verifier's outcome of the tree for `step`; returns the tree for step + 1. `features`:
        the target's for accepted + [bonus] (feature drafters only). `took`: the verifier already
        took the tree for step + 1 from this outcome's predraft (pushed to it: `take_fresh`); the
        tree returned is that same one, and a ValueError says that there is none. `arrived_at`:
        when the commit reached the service (`time.perf_counter()`), for pacing: a commit that
        waited for a predraft in progress came that much sooner than it is handled."""
        with self._lock:
            self._check_open()
            if step != self.step:
                raise ValueError(f"step: expected {self.step} (the tree last sent), got {step}")
            pred = self._predrafts.get(tuple(accepted))
            tree = next_tree_from(pred, bonus, budget, depth, self.params) if pred is not None else None
            if took and tree is None:
                raise ValueError(f"took_predraft: no predraft of step {step} has a tree for "
                                 f"{len(accepted)} accepted tokens and bonus {bonus}")
            arrived = time.perf_counter() if arrived_at is None else arrived_at
            self._window_s = _average(self._window_s, arrived - self._sent_at)
            self._count_outcome(accepted)
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
                return self._send(tree, budget, depth, True)
            return self._send(self._draft(budget, depth), budget, depth, False)

    def extend(self, tokens: list[int], budget: int, depth: int, keep: int = 0,
               features: torch.Tensor | None = None) -> StepTree:
        """New committed tokens that did not come from verification, after keeping only the first
        `keep` committed ones (0 = all); returns a fresh tree for the next step. The tree last sent
        (never committed) is dropped."""
        with self._lock:
            self._check_open()
            keep = keep or self.position
            if not 1 <= keep <= self.position:
                raise ValueError(f"keep: must be in [1, {self.position}] (the committed tokens), got {keep}")
            if self._held or not tokens or keep < self.position:
                # an empty extension re-drafts at the same point: let the session re-feed its last token
                self.session.rollback(keep)
            self.session.commit(list(tokens), features)
            self.position = keep + len(tokens)
            self._held = 0
            return self._send(self._draft(budget, depth), budget, depth, False)

    @property
    def _batched(self) -> bool:
        """The draft session grows trees at several roots at once (`draft_many`)."""
        return hasattr(self.session, "draft_many")

    @property
    def wants_predraft(self) -> bool:
        return (self.pipelined and not self._closed and self._tree is not None
                and (self._plan is None or bool(self._plan)))

    def predraft(self) -> bool:
        """One unit of predrafting for the tree last sent (one outcome, or every planned outcome at
        once with `draft_many`); False when there was nothing (more) to do. An empty tree is not
        predrafted: with nothing to accept, the bonus alone decides."""
        with self._lock:
            if not self.wants_predraft:
                return False
            if self._plan is None:
                self._plan = self._make_plan()
            if not self._plan:
                return False
            if self.paced and self._predrafts and self._window_s is not None and self._unit_s is not None:
                if time.perf_counter() - self._sent_at + self._unit_s > self._window_s:
                    self._plan = []  # it would likely end after the commit arrives
                    return False
            t = time.perf_counter()
            if self._batched:
                ks, self._plan = self._plan, []
            else:
                ks = [self._plan.pop(0)]
            if not self._hold(max(ks)):
                ks = [0]
                if () in self._predrafts:
                    return False
            budget, depth, branches = predraft_shape(*self._shape)
            excludes = [() if k == len(self._path) else self._children_on_path(k) for k in ks]
            if len(ks) == 1:
                trees = [self.session.draft(budget, depth, self.params, self.generator, excludes[0], branches)]
            else:  # every planned outcome at once: one expansion per level for all of them
                trees = self.session.draft_many([self.position + k for k in ks], budget, depth,
                                                self.params, self.generator, excludes, branches)
            for k, tree in zip(ks, trees):
                self._predrafts[tuple(self._path[:k])] = tree
                self._fresh.append(Predraft(self.step, self._path[:k], self.position + k, tree))
            self.predrafts += len(ks)
            self._unit_s = _average(self._unit_s, time.perf_counter() - t)
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
                self._plan = []
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

    def _count_outcome(self, accepted: list[int]) -> None:
        k = common_prefix(accepted, self._path)
        if k == len(accepted):  # a prefix of the main path (else a side branch: not predrafted)
            if k == len(self._path):
                self._full += 1.0
            else:
                self._partial[min(k, MAX_DEPTH)] += 1.0

    def _make_plan(self) -> list[int]:
        """The likeliest outcomes worth a predraft, deepest first: as many as are expected to fit
        one after the other, or up to `max_outcomes` for a drafter that drafts them all at once
        (one unit of work, whose cost barely depends on how many outcomes it holds on an
        accelerator; the first unit always runs)."""
        n = len(self._path)
        if n == 0:
            return []
        odds = {k: self._partial[min(k, MAX_DEPTH)] for k in range(n)}
        odds[n] = self._full
        fits = self.max_outcomes
        if self.paced and self._window_s is not None and self._unit_s and not self._batched:
            fits = min(fits, max(1, int((self._window_s - (time.perf_counter() - self._sent_at)) / self._unit_s)))
        likeliest = sorted(odds, key=lambda k: -odds[k])[:fits]
        return sorted(likeliest, reverse=True)

    def _children_on_path(self, k: int) -> list[int]:
        """Tokens of the children the tree last sent has at the k-th node of its main path."""
        assert self._tree is not None
        node = ROOT if k == 0 else main_path(self._tree)[k - 1]
        return [self._tree.tokens[c] for c in children_of(self._tree)[node]]

    def _draft(self, budget: int, depth: int) -> DraftTree:
        return self.session.draft(budget, depth, self.params, self.generator)

    def _send(self, tree: DraftTree, budget: int, depth: int, predrafted: bool) -> StepTree:
        self.step += 1
        self.steps += 1
        self._tree = tree
        self._shape = (budget, depth)
        self._path = [tree.tokens[i] for i in main_path(tree)]
        self._predrafts = {}
        self._fresh = []
        self._plan = None
        self._sent_at = time.perf_counter()
        return StepTree(self.step, self.position, tree, predrafted)


def _average(old: float | None, new: float, weight: float = 0.2) -> float:
    return new if old is None else (1 - weight) * old + weight * new
