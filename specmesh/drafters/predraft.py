"""Drafting ahead: predraft the next step's tree while the verifier checks the current one.

After a tree T is sent for step t at context length n, the most likely outcome of verifying it is
that its **main path** H (the first child from the root down to a leaf) is accepted whole. So the
drafter commits H speculatively and drafts a tree P for position n + |H|, one level deeper than
asked and with a larger budget: P's root children are candidates for the verifier's **bonus**
token, and the subtree under each is a tree for step t + 1. When the commit arrives with
accepted == H and a bonus b that is the token of a root child c of P with children, the answer
is `subtree(P, c)` trimmed to the requested shape, at once; otherwise the session rolls back to
n, takes the committed tokens and drafts afresh.

Why re-rooting is lossless under sampling: every node's children in P are i.i.d. draws from the
q it reports, and how many children a node gets is decided before they are drawn (grow_tree);
whether c is picked depends only on its own token, on the draws of its level and on the shape
planned from them, never on the draws below it, and the verifier's randomness is independent
of the drafter's. So the subtree under c, with each node's q carried over exactly, is a valid
draft for context + H + [b]. Trimming (the main path first, so the depth survives, then index
order) keeps for every node a prefix of its children whose length depends on positions only.

`DraftAhead` owns one `DraftSession` plus this bookkeeping (step counter, the tree last sent, at
most one predraft). It knows nothing of transport, session ids or eviction; a lock makes each
call one atomic unit of work, so a service may call it from several threads.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass

import torch

from specmesh.drafters.base import DraftSession
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import ROOT, DraftTree, children_of, depths

PREDRAFT_MAX_BUDGET = 64


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


def predraft_shape(budget: int, depth: int) -> tuple[int, int]:
    """Shape of a predraft: one level deeper (the bonus token's level) and a larger budget."""
    return max(budget, min(PREDRAFT_MAX_BUDGET, 2 * budget)), depth + 1


def pick_predrafted(predraft: DraftTree, bonus: int, budget: int, depth: int) -> DraftTree | None:
    """The tree under the first root child of `predraft` with token `bonus` that has children,
    trimmed to the requested shape; None when there is none."""
    kids = children_of(predraft)
    for c in kids[ROOT]:
        if predraft.tokens[c] == bonus and kids[c]:
            return trim(subtree(predraft, c), budget, depth)
    return None


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
class StepTree:
    """A tree to send: for `step`, rooted after the first `position` committed tokens."""

    step: int
    position: int
    tree: DraftTree
    predrafted: bool = False


@dataclass(frozen=True)
class _Predraft:
    path: list[int]  # H: tokens of the sent tree's main path, committed speculatively
    tree: DraftTree  # P: drafted at position n + len(path)


class SessionClosedError(ValueError):
    """The session was closed (or evicted) while a request for it was on its way."""


class DraftAhead:
    """One served session: open -> first(); then commit()/extend() -> the next tree; predraft()
    in between when pipelined. Steps count the trees sent: 0, 1, 2, ..."""

    def __init__(self, session: DraftSession, context_len: int, params: SamplingParams, pipelined: bool) -> None:
        assert context_len >= 1, "a session needs at least one committed token"
        self.session = session
        self.params = params
        self.pipelined = pipelined
        self.generator = draft_generator(params)
        self.position = context_len  # committed tokens (the draft session may hold more: H)
        self.step = -1  # step of the tree last sent
        self.steps = 0
        self.hits = 0
        self._lock = threading.Lock()
        self._tree: DraftTree | None = None
        self._shape = (1, 1)
        self._predraft: _Predraft | None = None
        self._speculated = False  # the session holds H beyond `position`
        self._tried = False  # predraft done (or found pointless) for the tree last sent
        self._closed = False

    def first(self, budget: int, depth: int) -> StepTree:
        with self._lock:
            self._check_open()
            assert self._tree is None, "first() is called once, right after opening"
            return self._send(self._draft(budget, depth), budget, depth, False)

    def commit(self, step: int, accepted: list[int], bonus: int, budget: int, depth: int,
               features: torch.Tensor | None = None) -> StepTree:
        """The verifier's outcome of the tree for `step`; returns the tree for step + 1. `features`:
        the target's for accepted + [bonus] (feature drafters only)."""
        with self._lock:
            self._check_open()
            if step != self.step:
                raise ValueError(f"step: expected {self.step} (the tree last sent), got {step}")
            pred, tree = self._predraft, None
            if pred is not None and accepted == pred.path:
                # 1. the speculative path was right: the session already holds it (a feature
                # drafter held it with predicted features: the verifier's replace them)
                self.session.commit([bonus], features)
                tree = pick_predrafted(pred.tree, bonus, budget, depth)
            else:
                # 2. a miss: forget the speculative path, take what was verified
                if self._speculated:
                    self.session.rollback(self.position)
                self.session.commit(list(accepted) + [bonus], features)
            self.position += len(accepted) + 1
            self._speculated = False
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
            if self._speculated or not tokens or keep < self.position:
                # an empty extension re-drafts at the same point: let the session re-feed its last token
                self.session.rollback(keep)
            self.session.commit(list(tokens), features)
            self.position = keep + len(tokens)
            self._speculated = False
            return self._send(self._draft(budget, depth), budget, depth, False)

    @property
    def wants_predraft(self) -> bool:
        return self.pipelined and not self._closed and not self._tried and self._tree is not None

    def predraft(self) -> bool:
        """Predraft for the tree last sent (one unit of work); False when there was nothing to do.
        An empty tree is not predrafted: with nothing to accept, the bonus alone decides."""
        with self._lock:
            if not self.wants_predraft:
                return False
            self._tried = True
            assert self._tree is not None
            path = [self._tree.tokens[i] for i in main_path(self._tree)]
            if not path:
                return False
            self.session.commit(path)
            self._speculated = True
            budget, depth = predraft_shape(*self._shape)
            self._predraft = _Predraft(path, self.session.draft(budget, depth, self.params, self.generator))
            return True

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._predraft = None
                self._tree = None
                self.session.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("session_id: the session was closed or evicted")

    def _draft(self, budget: int, depth: int) -> DraftTree:
        return self.session.draft(budget, depth, self.params, self.generator)

    def _send(self, tree: DraftTree, budget: int, depth: int, predrafted: bool) -> StepTree:
        self.step += 1
        self.steps += 1
        self._tree = tree
        self._shape = (budget, depth)
        self._predraft = None
        self._tried = False
        return StepTree(self.step, self.position, tree, predrafted)
