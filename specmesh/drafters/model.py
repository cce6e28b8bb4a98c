"""Model drafter: any small causal LM that shares the target's tokenizer, on our runtime.

Each session keeps its own KV cache of the committed context. A draft step feeds the tokens
committed since the last step, then grows the tree level by level: one forward per level over the
nodes being expanded (tree mask over the scratch slots), so a depth-D tree costs D forwards.
Nodes of the last tree that the verifier accepted keep their K/V: commit moves their scratch
slots into the committed prefix instead of recomputing them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.drafters.base import Children, children_from_probs, grow_tree, node_mask
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams, target_probs
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


def _probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[R, V] logits -> [R, V] the drafter's distribution (the request's temperature when sampling)."""
    if params.greedy:
        return torch.softmax(logits.float(), dim=-1)
    return target_probs(logits, params)


class ModelDraftSession:
    def __init__(self, model: Transformer, context: list[int]) -> None:
        self.model = model
        self.context = context
        self.cache = model.new_cache(len(context) + 64)
        self._slot_of: dict[tuple[int, ...], int] = {}  # last tree: path from root -> scratch slot

    def close(self) -> None:
        self.cache = None  # type: ignore[assignment]
        self._slot_of = {}

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

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = ()) -> DraftTree:
        cache, model = self.cache, self.model
        self._slot_of = {}
        # 1. feed the committed tokens not yet in the cache; the last row proposes the root's children
        n = len(self.context)
        start = cache.length
        logits = model(
            torch.tensor(self.context[start:]), torch.arange(start, n), cache, start,
            logits_rows=slice(-1, None),
        )  # [1, V]
        cache.commit(list(range(start, n)))
        root_probs = _probs(logits, params)[0]  # [V]
        slot_of = self._slot_of
        next_slot = n

        def expand(nodes: list[int], paths: list[tuple[int, ...]], counts: list[int]) -> list[Children]:
            if nodes == [ROOT]:
                return [children_from_probs(root_probs, counts[0], params, generator)]
            # 2. feed the nodes being expanded: each sees the context and its own ancestors
            nonlocal next_slot
            at, next_slot = next_slot, next_slot + len(paths)
            mask = node_mask(paths, n, at, slot_of)  # [T, S]
            toks = torch.tensor([p[-1] for p in paths])  # [T]
            pos = torch.tensor([n - 1 + len(p) for p in paths])  # [T] depth-based positions
            probs = _probs(model(toks, pos, cache, at, mask), params)  # [T, V]
            for row, path in enumerate(paths):
                slot_of.setdefault(path, at + row)
            return [children_from_probs(probs[i], c, params, generator) for i, c in enumerate(counts)]

        return grow_tree(expand, budget, depth, exclude_root)
