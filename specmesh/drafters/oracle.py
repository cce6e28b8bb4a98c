"""Oracle drafter, for benchmarks only: replays the target's own continuation (computed
beforehand), replacing each proposed token with a wrong one with probability 1 - alpha.

This fixes the per-token acceptance rate at alpha so that system efficiency can be compared with
the theoretical bound of DESIGN.md. Its cost model sleeps, per tree level, `draft_cost_s` +
`draft_row_cost_s` x the rows of that level (the nodes it expands, over all trees grown together
by `draft_many`): a small model drafter whose level is one forward, whose cost barely depends on
its width on an accelerator (row cost 0) and grows with it on a CPU (row cost > 0).
Greedy only in spirit: under sampling it proposes with q one-hot on each proposed token, which is
exact (lossless) but not informative.

A drafter serving many sessions (the drafter service) holds several references: each session
replays the one sharing the longest prefix with its context, re-chosen when the context leaves it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch

from specmesh.drafters.base import Children, ContextSession, bind_guide, grow_trees
from specmesh.sampling import SamplingParams
from specmesh.text import common_prefix
from specmesh.tree import DraftTree


class OracleDrafter:
    name = "oracle"
    needs_features = False

    def __init__(self, reference: list[int], alpha: float, vocab_size: int, seed: int = 0,
                 draft_cost_s: float = 0.0, draft_row_cost_s: float = 0.0) -> None:
        """`reference`: the full token sequence (prompt + the target's continuation)."""
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha: must be in [0, 1], got {alpha}")
        self.references = [list(reference)]
        self.alpha = alpha
        self.vocab_size = vocab_size
        self.seed = seed
        self.draft_cost_s = draft_cost_s
        self.draft_row_cost_s = draft_row_cost_s

    @classmethod
    def from_references(cls, references: Sequence[Sequence[int]], alpha: float, vocab_size: int,
                        seed: int = 0, draft_cost_s: float = 0.0, draft_row_cost_s: float = 0.0) -> "OracleDrafter":
        """An oracle for many sessions: one reference (prompt + continuation) per known prompt."""
        if not references:
            raise ValueError("reference: at least one reference sequence is required")
        drafter = cls(references[0], alpha, vocab_size, seed, draft_cost_s, draft_row_cost_s)
        drafter.references = [list(r) for r in references]
        return drafter

    @property
    def reference(self) -> list[int]:
        return self.references[0]

    def pick(self, context: list[int]) -> list[int]:
        """The reference sharing the longest prefix with `context` (the first one on ties)."""
        return max(self.references, key=lambda ref: common_prefix(ref, context))

    def open(self, context: list[int], features: torch.Tensor | None = None) -> "OracleSession":
        return OracleSession(self, list(context))


class OracleSession(ContextSession):
    def __init__(self, drafter: OracleDrafter, context: list[int]) -> None:
        super().__init__(context)
        self.d = drafter
        self.rng = random.Random(drafter.seed)
        self.ref = drafter.pick(context)

    def _wrong(self, right: int | None, avoid: list[int]) -> int:
        while True:
            t = self.rng.randrange(self.d.vocab_size)
            if t != right and t not in avoid:
                return t

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        return self.draft_many([len(self.context)], budget, depth, params, generator, [exclude_root], branches,
                               guide)[0]

    def draft_many(self, roots: Sequence[int], budget: int, depth: int, params: SamplingParams,
                   generator: torch.Generator, excludes: Sequence[Sequence[int]], branches: int = 0,
                   guide=None) -> list[DraftTree]:
        """Trees rooted at several points of the context, for one level's cost per level in all:
        `draft_cost_s` plus `draft_row_cost_s` per node expanded at that level, in every tree."""
        n = len(self.context)
        if self.ref[:n] != self.context and len(self.d.references) > 1:
            self.ref = self.d.pick(self.context)
        ref = self.ref
        on_track = [ref[:r] == self.context[:r] for r in roots]

        def expand(trees: list[int], _nodes: list[int], paths: list[tuple[int, ...]],
                   counts: list[int]) -> list[Children]:
            cost = self.d.draft_cost_s + self.d.draft_row_cost_s * len(trees)
            if cost:
                time.sleep(cost)
            out = []
            for t, prefix, count in zip(trees, paths, counts):
                base = roots[t]
                pos = base + len(prefix)
                right = (ref[pos] if on_track[t] and pos < len(ref) and tuple(ref[base:pos]) == prefix
                         else None)
                kids: list[int] = []
                for _ in range(count):
                    hit = right is not None and right not in kids and self.rng.random() < self.d.alpha
                    kids.append(right if hit else self._wrong(right, kids))
                lp = [-float(i) for i in range(len(kids))]
                q = (None, None) if params.greedy else (kids[:1], [1.0])
                out.append(Children(kids[:1] if q[0] else kids, lp[:1] if q[0] else lp, *q))
            return out

        return grow_trees(expand, [(budget, depth, ex, branches) for ex in excludes],
                          bind_guide(guide, self.context, roots, generator))
