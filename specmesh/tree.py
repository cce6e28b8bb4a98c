"""Draft trees: the flat, validated structure a drafter proposes and a verifier checks.

Vocabulary (used across specmesh): the **target** model is the one whose output we must reproduce;
the **draft** model (drafter) proposes tokens. A **tree** holds draft **nodes**; node i has a
token and a **parent** (-1 = child of the last committed token, the *root*). The **depth** of a
root child is 1. A **path** is a root-to-node chain. Verification **accepts** a path of nodes and
adds one **bonus** token sampled from the target; **commit** makes them part of the session.

For lossless *sampling*, every expanded node (the root included, as index -1) carries the exact
distribution q its children were drawn from, sparse: `q_ids[m]`, `q_probs[m]` for node
`q_nodes[m]`. Children of a node are independent draws from that q (duplicates allowed), and how
many children a node has must not depend on their values: that is what the recursive rejection
sampler in `sampling.py` relies on. Greedy verification ignores q.

Besides validation and masks, the generic operations on a tree: its main path, a node's subtree
re-rooted, a tree trimmed to a shape (what turns a predraft into the next step's tree).

This module knows nothing about models, caches or transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROOT = -1


class InvalidTreeError(ValueError):
    """A draft tree that must not be verified. The message names the offending field."""


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # [N]
    parents: list[int]  # [N], each < its own index; ROOT (-1) for children of the root
    # Sparse exact proposal distributions, one entry per expanded node (sampling only).
    q_nodes: list[int] = field(default_factory=list)  # [M], node index or ROOT
    q_ids: list[list[int]] = field(default_factory=list)  # [M][K_m]
    q_probs: list[list[float]] = field(default_factory=list)  # [M][K_m], sums to 1

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def empty() -> "DraftTree":
        return DraftTree(tokens=[], parents=[])

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        return DraftTree(tokens=list(tokens), parents=list(range(-1, len(tokens) - 1)))


def depths(parents: list[int]) -> list[int]:
    """Depth of every node (root children have depth 1). Parents must precede children."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p == ROOT else out[p] + 1)
    return out


def children_of(tree: DraftTree) -> dict[int, list[int]]:
    """Node index (or ROOT) -> its children's indices, in tree order."""
    kids: dict[int, list[int]] = {ROOT: []}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
        kids.setdefault(i, [])
    return kids


def children_of_parents(parents: list[int]) -> dict[int, list[int]]:
    """Node index (or ROOT) -> its children's indices, in tree order; leaves absent."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(p, []).append(i)
    return kids


def path_to(parents: list[int], node: int) -> list[int]:
    """Node indices from the first level down to `node` (inclusive)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def validate_tree(
    tree: DraftTree,
    vocab_size: int,
    max_nodes: int,
    max_depth: int | None = None,
    need_q: bool = False,
) -> None:
    """Raise InvalidTreeError naming the field if the tree must not be verified.

    `need_q`: sampling verification needs q for every node that has children, and every child
    token must have positive probability under its parent's q.
    """
    n = len(tree.tokens)
    if len(tree.parents) != n:
        raise InvalidTreeError(f"parents: length {len(tree.parents)} != tokens length {n}")
    if n > max_nodes:
        raise InvalidTreeError(f"tokens: tree has {n} nodes, limit is {max_nodes}")
    for i, t in enumerate(tree.tokens):
        if not 0 <= t < vocab_size:
            raise InvalidTreeError(f"tokens[{i}]: id {t} outside vocabulary [0, {vocab_size})")
    for i, p in enumerate(tree.parents):
        if not ROOT <= p < i:
            raise InvalidTreeError(f"parents[{i}]: {p} must be -1 or a node index below {i}")
    if max_depth is not None and n and max(depths(tree.parents)) > max_depth:
        raise InvalidTreeError(f"parents: tree depth exceeds limit {max_depth}")
    m = len(tree.q_nodes)
    if len(tree.q_ids) != m or len(tree.q_probs) != m:
        raise InvalidTreeError("q_ids/q_probs: must have one entry per q_nodes entry")
    q_of: dict[int, dict[int, float]] = {}
    for j, node in enumerate(tree.q_nodes):
        if not ROOT <= node < n:
            raise InvalidTreeError(f"q_nodes[{j}]: {node} is not a node index or -1")
        if node in q_of:
            raise InvalidTreeError(f"q_nodes[{j}]: node {node} listed twice")
        ids, probs = tree.q_ids[j], tree.q_probs[j]
        if len(ids) != len(probs) or not ids:
            raise InvalidTreeError(f"q_probs[{j}]: needs one probability per id, at least one")
        for t in ids:
            if not 0 <= t < vocab_size:
                raise InvalidTreeError(f"q_ids[{j}]: id {t} outside vocabulary [0, {vocab_size})")
        if len(set(ids)) != len(ids):
            raise InvalidTreeError(f"q_ids[{j}]: duplicate ids")
        if any(not (p >= 0.0) for p in probs) or abs(sum(probs) - 1.0) > 1e-3:
            raise InvalidTreeError(f"q_probs[{j}]: must be non-negative and sum to 1")
        q_of[node] = dict(zip(ids, probs))
    if need_q:
        for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)):
            q = q_of.get(p)
            if q is None:
                raise InvalidTreeError(f"q_nodes: no proposal distribution for node {p}")
            if q.get(t, 0.0) <= 0.0:
                raise InvalidTreeError(f"tokens[{i}]: id {t} has zero probability under its q")


def tree_attention_mask(parents: list[int]) -> torch.Tensor:
    """Boolean [N, N] mask: node i may attend to node j iff j is i or an ancestor of i."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
    for i, p in enumerate(parents):
        if p != ROOT:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


# --- re-rooting and trimming (a predraft's subtree becomes the next step's tree) ---

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
