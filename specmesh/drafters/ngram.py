"""N-gram (prompt lookup) drafter: proposes what followed earlier occurrences of the context's
suffix. No model, no accelerator: it runs on CPU-only pods.

Greedy: up to `budget` nodes from the most recent distinct continuations, merged into a trie
(siblings where earlier occurrences disagree). Sampling: a chain from the most recent match, each
child proposed with q = one-hot on it (exact, so verification stays lossless).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from specmesh.drafters.base import Children, ContextSession, bind_guide, grow_tree
from specmesh.sampling import SamplingParams
from specmesh.tree import DraftTree

MAX_MATCHES = 16


class NgramDrafter:
    name = "ngram"
    needs_features = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("ngram: need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def open(self, context: list[int], features: torch.Tensor | None = None) -> "NgramSession":
        return NgramSession(self, list(context))


def find_continuations(context: list[int], max_ngram: int, min_ngram: int, length: int) -> list[list[int]]:
    """Continuations (<= `length` tokens) that followed earlier occurrences of the context's
    longest matching suffix, most recent first, distinct.

    The occurrences are found with whole-array comparisons (numpy), not a Python loop over the
    context: a step costs microseconds at a few thousand tokens of context, where the loop took
    milliseconds per step (the prompt-lookup case: long documents)."""
    n_ctx = len(context)
    if n_ctx < 2:
        return []
    a = np.asarray(context, dtype=np.int64)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = a[n_ctx - n:]
        match = a[:n_ctx - n] == suffix[0]  # match[s]: context[s:s + n] == suffix, s < n_ctx - n
        for k in range(1, n):
            match &= a[k:n_ctx - n + k] == suffix[k]
        found: list[list[int]] = []
        for start in np.flatnonzero(match)[::-1].tolist():  # most recent first
            cont = context[start + n:start + n + length]
            if cont and cont not in found:
                found.append(cont)
                if len(found) >= MAX_MATCHES:
                    break
        if found:
            return found
    return []


class NgramSession(ContextSession):
    def __init__(self, drafter: NgramDrafter, context: list[int]) -> None:
        super().__init__(context)
        self.d = drafter

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        conts = find_continuations(self.context, self.d.max_ngram, self.d.min_ngram, depth)
        if not conts:
            return DraftTree.empty()
        if not params.greedy:
            conts = conts[:1]
        def expand(_nodes: list[int], paths: list[tuple[int, ...]], counts: list[int]) -> list[Children]:
            out = []
            for prefix, count in zip(paths, counts):
                n = len(prefix)
                nxt: list[int] = []
                for c in conts:
                    if len(c) > n and tuple(c[:n]) == prefix and c[n] not in nxt:
                        nxt.append(c[n])
                nxt = nxt[:count]
                q = ([nxt[0]], [1.0]) if (nxt and not params.greedy) else (None, None)
                out.append(Children(nxt, [0.0] * len(nxt), *q))
            return out

        return grow_tree(expand, budget, depth, exclude_root, branches,
                         bind_guide(guide, self.context, [len(self.context)], generator))
