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
