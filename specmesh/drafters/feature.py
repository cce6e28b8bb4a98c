"""Feature drafter (EAGLE-style): drafts from the target's own hidden states.

A token-level small model must predict the target's next token from the tokens alone. A feature
drafter gets what the target already computed: row j of its input is
`fc([f_j ; embed(t_{j+1})])`, where f_j is the target's final hidden state (before the norm) at
token j — the state from which the target predicted t_{j+1} — and t_{j+1} the token that was then
committed. One decoder layer turns that into a prediction of f_{j+1}, and a reduced-vocabulary LM
head (the target's rows for the most predicted tokens) scores t_{j+2}. Deeper in a draft tree a
node's row takes its parent's *predicted* feature instead of the target's (the drafter is trained
for that: `specmesh.distill.feature`, unrolled over several depths).

The verifier sends f for every committed token but the pending one (the target's forward
computes them anyway): `open(context, features)` with len(context) - 1 rows, then
`commit(tokens, features)` with one row per new token. `commit(tokens)` without features is the
drafting-ahead case (`predraft.DraftAhead`): the tokens are a path of the last tree, and the
drafter's own predictions stand in until the verifier's real features arrive.

Cost per tree level: one layer over the nodes being expanded, plus the reduced head; for the
bundled SmolLM2 (30 layers, 49k-token head) that is about 6% of a target step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.drafters.base import (Children, FeatureRows, bind_guide, children_from_probs, drafter_probs, grow_tree,
                                    node_mask)
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams
from specmesh.tree import ROOT, DraftTree


class FeatureDrafter:
    name = "feature"
    needs_features = True

    def __init__(self, model: Transformer) -> None:
        if model.fc is None:
            raise ValueError("drafter: not a feature drafter (its config has no specmesh.kind = 'feature')")
        self.model = model

    @property
    def feature_dim(self) -> int:
        return self.model.config.hidden_size

    def open(self, context: list[int], features: torch.Tensor | None = None) -> "FeatureDraftSession":
        if not context:
            raise ValueError("context: a draft session needs at least one token")
        if features is None or features.shape != (len(context) - 1, self.feature_dim):
            got = None if features is None else tuple(features.shape)
            raise ValueError(f"features: a feature drafter needs [{len(context) - 1}, {self.feature_dim}] "
                             f"target features for a context of {len(context)} tokens, got {got}")
        return FeatureDraftSession(self.model, list(context), features)


class FeatureDraftSession:
    def __init__(self, model: Transformer, context: list[int], features: torch.Tensor) -> None:
        self.model = model
        self.context = context
        self.features = FeatureRows(features.shape[1], len(context) + 64, torch.float32)
        self.features.append(features)  # len(context) - 1 rows: row j pairs with context[j + 1]
        self.cache = model.new_cache(len(context) + 64)  # row j = the pair (features[j], context[j + 1])
        self._predicted: dict[tuple[int, ...], torch.Tensor] = {}  # last tree: path -> its predicted feature

    def close(self) -> None:
        self.cache = None  # type: ignore[assignment]
        self._predicted = {}

    @property
    def behind(self) -> int:
        """Rows the next draft feeds beyond the one it always feeds (the cache holds a row per pair
        of feature and next token, the last pair's left to re-feed)."""
        return max(0, len(self.context) - 2 - self.cache.length)

    def rollback(self, num_tokens: int) -> None:
        assert 1 <= num_tokens <= len(self.context)
        del self.context[num_tokens:]
        self.features.truncate(num_tokens - 1)
        self.cache.truncate(min(self.cache.length, num_tokens - 1))
        self._predicted = {}

    def commit(self, tokens: list[int], features: torch.Tensor | None = None) -> None:
        """Append `tokens` with the target's features pairing with them. `features` may carry more
        rows than tokens: the extra leading rows replace the features of the tokens committed just
        before (drafted ahead with predicted features, now verified). Without `features` the tokens
        must be a path of the last tree, whose predicted features stand in."""
        if features is None:
            rows = [self._predicted.get(tuple(tokens[:k])) for k in range(len(tokens))]
            if any(r is None for r in rows):
                raise ValueError("features: committed tokens off the last tree need the target's features")
            features = torch.stack(rows) if rows else self.features.view()[:0]  # type: ignore[arg-type]
        extra = features.shape[0] - len(tokens)
        width = self.features.width
        if features.dim() != 2 or features.shape[1] != width or not 0 <= extra < len(self.context):
            raise ValueError(f"features: expected [{len(tokens)}(+k), {width}] for {len(tokens)} "
                             f"tokens, got {tuple(features.shape)}")
        keep = len(self.features) - extra
        self.features.truncate(keep)
        self.features.append(features)
        self.cache.truncate(min(self.cache.length, keep))
        self.context.extend(tokens)
        # the next tree's root is the last committed token: keep what was predicted below it
        t = tuple(tokens)
        self._predicted = {p[len(t):]: f for p, f in self._predicted.items() if p[:len(t)] == t}

    def draft(self, budget: int, depth: int, params: SamplingParams, generator: torch.Generator,
              exclude_root: Sequence[int] = (), branches: int = 0, guide=None) -> DraftTree:
        model, cache = self.model, self.cache
        self._predicted = {}
        n = len(self.context)
        if n < 2:
            return DraftTree.empty()  # no target feature yet
        # 1. feed the rows not yet in the cache (at least the last: its output is the root's)
        start = min(cache.length, n - 2)
        cache.truncate(start)
        logits, hidden = model(
            torch.tensor(self.context[start + 1:]), torch.arange(start + 1, n), cache, start,
            logits_rows=slice(-1, None), features=self.features.view()[start:], hidden=True, exact=False,
        )  # [1, V], [n - 1 - start, H]
        cache.commit(list(range(start, n - 1)))
        root_logits = logits[0]
        root_probs = drafter_probs(logits, params)[0]  # [V]
        predicted = self._predicted
        predicted[()] = hidden[-1]
        slot_of: dict[tuple[int, ...], int] = {}
        next_slot = n - 1

        def expand(nodes: list[int], paths: list[tuple[int, ...]], counts: list[int]) -> list[Children]:
            if nodes == [ROOT]:
                return [children_from_probs(root_probs, counts[0], params, generator, logits=root_logits)]
            # 2. feed the nodes being expanded, each with its parent's predicted feature; each sees
            # the context rows and its own ancestors
            nonlocal next_slot
            at, next_slot = next_slot, next_slot + len(paths)
            mask = node_mask(paths, n - 1, at, slot_of)  # [T, S]
            toks = torch.tensor([p[-1] for p in paths])  # [T]
            pos = torch.tensor([n - 1 + len(p) for p in paths])  # [T] depth-based positions
            feats = torch.stack([predicted[p[:-1]] for p in paths])  # [T, H]
            logits, hidden = model(toks, pos, cache, at, mask, features=feats, hidden=True, exact=False)  # [T, V], [T, H]
            probs = drafter_probs(logits, params)
            for row, path in enumerate(paths):
                slot_of.setdefault(path, at + row)
                predicted.setdefault(path, hidden[row])
            return [children_from_probs(probs[i], c, params, generator, logits=logits[i]) for i, c in enumerate(counts)]

        return grow_tree(expand, budget, depth, exclude_root, branches, bind_guide(guide, self.context, [n], generator))
