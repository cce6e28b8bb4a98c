"""The exact row-attention kernel (specmesh.kernels.attention), what the model's batch invariance
rests on:

- row_attention computes softmax(q K^T / sqrt(D)) V over each row's own key slots (checked against
  float64), with GQA;
- a row's output is bit-identical whatever the other rows, where its keys sit in the cache and the
  thread count: a tree's row equals that token decoded alone once its path is committed;
- the model takes it, and its logits agree with the per-row SDPA path it replaced.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specmesh import kernels, model as model_mod
from specmesh.kernels import attention

pytestmark = pytest.mark.skipif(not attention.available(), reason=f"row attention unavailable: {attention.reason()}")


def _reference(q, keys, values, rows):
    """float64 attention of each row over its slots."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[0] // keys.shape[0]
    for t, slots in enumerate(rows):
        for h in range(q.shape[0]):
            k, v = keys[h // group, slots].double(), values[h // group, slots].double()
            w = torch.softmax(k @ q[h, t].double() / q.shape[-1] ** 0.5, 0)
            out[h, t] = w @ v
    return out


def _csr(rows):
    offsets = torch.tensor([0] + np.cumsum([len(r) for r in rows]).tolist())
    return offsets, torch.tensor([s for r in rows for s in r], dtype=torch.long)


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 4, 32), (12, 2, 128), (14, 2, 64), (9, 3, 64)])
def test_rows_attend_over_exactly_their_slots(heads, kv_heads, d):
    g = torch.Generator().manual_seed(heads)
    cap = 40
    cache_k, cache_v = torch.randn(kv_heads, cap, d, generator=g), torch.randn(kv_heads, cap, d, generator=g)
    rows = [list(range(20)) + [20], list(range(20)) + [20, 22], list(range(20)) + [21, 25, 26], list(range(7))]
    q = torch.randn(heads, len(rows), d, generator=g)
    got = attention.row_attention(q, cache_k, cache_v, *_csr(rows))
    assert (got.double() - _reference(q, cache_k, cache_v, rows)).abs().max() < 1e-5


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_is_bit_identical_alone_elsewhere_and_in_a_batch(threads):
    """Tree row (keys: prefix + scattered ancestor slots, among other rows) == the same token decoded
    alone after commit (the same keys moved to consecutive slots)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, prefix = 12, 2, 128, 37
    keys, values = torch.randn(kv_heads, 64, d, generator=g), torch.randn(kv_heads, 64, d, generator=g)
    tree = [list(range(prefix)) + [prefix], list(range(prefix)) + [prefix, prefix + 1],
            list(range(prefix)) + [prefix, prefix + 3], list(range(prefix)) + [prefix, prefix + 3, prefix + 5]]
    q = torch.randn(heads, len(tree), d, generator=g)
    before = torch.get_num_threads(), kernels._Threads.budget
    kernels.set_threads(threads)
    try:
        batch = attention.row_attention(q, keys, values, *_csr(tree))
        for t, slots in enumerate(tree):
            alone = attention.row_attention(q[:, t:t + 1], keys, values, *_csr([slots]))
            assert torch.equal(alone[:, 0], batch[:, t])
            # committed: the row's keys copied to consecutive slots in another cache, then decoded
            k2, v2 = torch.randn(kv_heads, 64, d, generator=g), torch.randn(kv_heads, 64, d, generator=g)
            k2[:, :len(slots)], v2[:, :len(slots)] = keys[:, slots], values[:, slots]
            moved = attention.row_attention(q[:, t:t + 1], k2, v2, *_csr([list(range(len(slots)))]))
            assert torch.equal(moved[:, 0], batch[:, t])
    finally:
        torch.set_num_threads(before[0])
        kernels._Threads.budget = before[1]


def test_bad_slots_are_refused():
    q, kv = torch.randn(2, 1, 32), torch.randn(1, 8, 32)
    with pytest.raises(RuntimeError, match="slot out of range"):
        attention.row_attention(q, kv, kv, torch.tensor([0, 2]), torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="sees a key"):
        attention.row_attention(q, kv, kv, torch.tensor([0, 0]), torch.tensor([], dtype=torch.long))


def test_the_model_takes_the_kernel_and_agrees_with_sdpa(monkeypatch):
    """The same logits, to rounding, with the kernel and with the per-row SDPA path it replaced."""
    from tests.tiny_models import random_hf_model
    from transformers import LlamaConfig
    from specmesh.loader import model_from_hf

    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    m = model_from_hf(cfg, random_hf_model(cfg, seed=3).state_dict())
    tokens, pos = torch.arange(10, 30), torch.arange(20)
    mask = model_mod.causal_mask(12, 8)
    calls = []
    real = attention.row_attention
    monkeypatch.setattr(attention, "row_attention", lambda *a: calls.append(1) or real(*a))

    def logits():
        cache = m.new_cache(32)
        m(tokens[:12], pos[:12], cache, 0, logits_rows=None)
        cache.commit(list(range(12)))
        return m(tokens[12:], pos[12:], cache, 12, mask)

    with_kernel = logits()
    assert calls
    monkeypatch.setattr(attention, "runs", lambda q, k: False)
    assert (with_kernel - logits()).abs().max() < 1e-4
