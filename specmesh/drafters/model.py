"""Model drafter: any small causal LM that shares the target's tokenizer, on our runtime.

Each session keeps its own KV cache of the committed context. A draft step feeds the tokens
committed since the last step, then grows the tree level by level: one forward per level over the
nodes being expanded (tree mask over the scratch slots), so a depth-D tree costs D forwards.
`draft_many` grows trees rooted at several points of the context in the same D forwards (the
outcomes of a step, predrafted together: `specmesh.drafters.predraft`).
Nodes of the last tree that the verifier accepted keep their K/V: commit moves their scratch
slots into the committed prefix instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.drafters.base import Children, bind_guide, children_from_probs, drafter_probs, grow_trees, node_mask
from specmesh.drafters.head_cut import ContextVocab
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams
from specmesh.tree import ROOT, DraftTree


class ModelDrafter:
    name = "model"
    needs_features = False

    def __init__(self, model: Transformer) -> None:
        self.model = model

    def open(self, context: list[int], features: torch.Tensor | None = None) -> "ModelDraftSession":
        if not context:
            raise ValueError("context: a draft session needs at least one token")
        return ModelDraftSession(self.model, list(context))


class ModelDraftSession:
    def __init__(self, model: Transformer, context: list[int]) -> None:
        self.model = model
        self.context = context
        self.cache = model.new_cache(len(context) + 64)
        self._slot_of: dict[tuple[int, ...], int] = {}  # last tree: path from root -> scratch slot
        # a cut head: the context's tokens it lacks are scored beside it (kept after a rollback)
        self._vocab = ContextVocab(model.head_cut) if model.head_cut is not None else None
        if self._vocab is not None:
            self._vocab.add(context)

    def close(self) -> None:
        self.cache = None  # type: ignore[assignment]
        self._slot_of = {}

    @property
    def behind(self) -> int:
        """Committed tokens not in the cache yet, the pending one aside: the next draft feeds them."""
        return max(0, len(self.context) - 1 - self.cache.length)

    def rollback(self, num_tokens: int) -> None:
        assert 1 <= num_tokens <= len(self.context)
        del self.context[num_tokens:]
        self.cache.truncate(min(self.cache.length, num_tokens - 1))  # the last token stays pending
        self._slot_of = {}

    def commit(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        # Reuse K/V of accepted nodes fed while drafting (same tokens, same positions, same
        # ancestors: same K/V). The last token always stays pending, to give the next root's logits.
        slots = []
        for k in range(1, len(tokens)):
            slot = self._slot_of.get(tuple(tokens[:k]))
            if slot is None:
                break
            slots.append(slot)
        self.cache.commit(slots)
        self._slot_of = {}
        self.context.extend(tokens)
        if self._vocab is not None:
            self._vocab.add(tokens)

    def predictions(self, first: int) -> list[int]:
        """Feed the context not yet in the cache, as a draft does, and return the drafter's greedy
        choice for every committed token from index `first` on, each given the tokens before it (the
        last entry: its choice for the next token). `first` must be past the cache (nothing is fed
        twice). Under greedy decoding, where they agree with the committed tokens is exactly what a
        chain drafted at those points would have had accepted."""
        assert self.cache.length < first <= len(self.context), (self.cache.length, first, len(self.context))
        self._slot_of = {}
        return self._feed_from(first).argmax(-1).tolist()

    def _feed_from(self, low: int) -> torch.Tensor:
        """Feed the context not yet in the cache, from token `low - 1` on at least; logits
        [n - low + 1, V]: row r proposes the token after the first low + r."""
        cache, n = self.cache, len(self.context)
        start = min(cache.length, low - 1)
        cache.truncate(start)
        logits = self.model(
            torch.tensor(self.context[start:]), torch.arange(start, n), cache, start,
            logits_rows=slice(low - 1 - start, None), exact=False,
            extra_vocab=self._vocab.value if self._vocab is not None else None,
        )
        cache.commit(list(range(start, n)))
        return logits

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        return self.draft_many([len(self.context)], budget, depth, params, generator, [exclude_root], branches,
                               guide)[0]

    def draft_scored(self, first: int, budget: int, depth: int, params: SamplingParams,
                     generator: torch.Generator, guide=None) -> tuple[DraftTree, list[int]]:
        """`draft`, and from the same feed the drafter's greedy choice for every committed token
        from index `first` (>= 1) on, as `predictions` gives them: a row of the head more per
        token (and the rows fed again where the cache held them already)."""
        trees, choices = self._grow([len(self.context)], budget, depth, params, generator, [()], 0, guide, first)
        return trees[0], choices

    def draft_many(self, roots: Sequence[int], budget: int, depth: int, params: SamplingParams,
                   generator: torch.Generator, excludes: Sequence[Sequence[int]], branches: int = 0,
                   guide=None) -> list[DraftTree]:
        """Trees rooted at several points of the context, one forward per level for all of them:
        each node sees the context up to its own tree's root and its own ancestors."""
        return self._grow(roots, budget, depth, params, generator, excludes, branches, guide)[0]

    def _grow(self, roots: Sequence[int], budget: int, depth: int, params: SamplingParams,
              generator: torch.Generator, excludes: Sequence[Sequence[int]], branches: int, guide,
              scored: int | None = None) -> tuple[list[DraftTree], list[int]]:
        """`draft_many`, and the greedy choices for the committed tokens from index `scored` on."""
        cache, model = self.cache, self.model
        extra = self._vocab.value if self._vocab is not None else None
        self._slot_of = {}
        n = len(self.context)
        low = min(roots) if scored is None else min(min(roots), scored)
        assert 1 <= low and max(roots) <= n, (roots, n)
        # 1. feed the context not yet in the cache, from the shallowest root's (or scored) token on
        # at least: row r of the logits proposes the token after the first low + r
        logits = self._feed_from(low)  # [n - low + 1, V]
        choices = logits[scored - low:n - low].argmax(-1).tolist() if scored is not None else []
        root_probs = drafter_probs(logits, params)  # [n - low + 1, V]
        slot_of: dict[tuple[int, tuple[int, ...]], int] = {}  # (tree, path from its root) -> scratch slot
        next_slot = n

        def expand(trees: list[int], nodes: list[int], paths: list[tuple[int, ...]],
                   counts: list[int]) -> list[Children]:
            # 2. feed the nodes being expanded (the roots' rows are fed already): each sees the
            # context up to its tree's root and its own ancestors
            nonlocal next_slot
            fed = [i for i, node in enumerate(nodes) if node != ROOT]
            probs = rows = None
            if fed:
                at, next_slot = next_slot, next_slot + len(fed)
                fed_paths = [paths[i] for i in fed]
                fed_trees = [trees[i] for i in fed]
                mask = node_mask(fed_paths, [roots[t] for t in fed_trees], at, slot_of, fed_trees)  # [T, S]
                toks = torch.tensor([p[-1] for p in fed_paths])  # [T]
                pos = torch.tensor([roots[t] - 1 + len(p) for t, p in zip(fed_trees, fed_paths)])  # [T]
                rows = model(toks, pos, cache, at, mask, exact=False, extra_vocab=extra)  # [T, V]
                probs = drafter_probs(rows, params)
                for row, (t, path) in enumerate(zip(fed_trees, fed_paths)):
                    slot_of.setdefault((t, path), at + row)
            row_of = {i: row for row, i in enumerate(fed)}
            return [children_from_probs(root_probs[roots[t] - low], c, params, generator,
                                        logits=logits[roots[t] - low]) if node == ROOT else
                    children_from_probs(probs[row_of[i]], c, params, generator, logits=rows[row_of[i]])
                    for i, (t, node, c) in enumerate(zip(trees, nodes, counts))]

        trees = grow_trees(expand, [(budget, depth, ex, branches) for ex in excludes],
                           bind_guide(guide, self.context, roots, generator))
        if list(roots) == [n]:  # a plain draft: commit reuses the K/V of the nodes it accepts
            self._slot_of = {path: slot for (_, path), slot in slot_of.items()}
        return trees, choices
