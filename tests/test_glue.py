"""The glue kernels between a layer's products (specmesh.kernels.glue):

- each op computes what the torch code it replaces computes (checked against float64);
- a row's output is bit-identical whatever the other rows, the thread count, and whether its
  input is a view of a wider product's output;
- the model takes them, its logits agree with its torch path, and greedy decoding through
  speculation stays identical to plain decoding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmesh import kernels
from specmesh.kernels import glue

pytestmark = pytest.mark.skipif(not glue.available(), reason=f"glue kernels unavailable: {glue.reason()}")


@pytest.fixture
def threads():
    before = torch.get_num_threads(), kernels._Threads.budget

    def use(n: int) -> None:
        kernels.set_threads(n)
    yield use
    torch.set_num_threads(before[0])
    kernels._Threads.budget = before[1]


def _norm64(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope64(x, cos, sin, d):  # x [T, H * D] -> [H, T, D]
    x = x.double().view(x.shape[0], -1, d).transpose(0, 1)
    rot = torch.cat((-x[..., d // 2:], x[..., :d // 2]), -1)
    return x * cos.double() + rot * sin.double()


def test_each_op_computes_what_the_torch_code_does():
    g = torch.Generator().manual_seed(0)
    x, a, w = torch.randn(5, 896, generator=g), torch.randn(5, 896, generator=g), torch.rand(896, generator=g) + 0.5
    assert (glue.rms_norm(x, w, 1e-6).double() - _norm64(x, w, 1e-6)).abs().max() < 1e-5
    s, y = glue.add_rms_norm(x, a, w, 1e-6)
    assert torch.equal(s, x + a)
    assert (y.double() - _norm64(x + a, w, 1e-6)).abs().max() < 1e-5

    d, hq, hk = 64, 14, 2
    qkv = torch.randn(5, (hq + 2 * hk) * d, generator=g)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], -1)  # row-strided views, as a fused product gives them
    ang = torch.rand(5, d // 2, generator=g) * 6
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    rq, rk, rv = glue.rope(q, k, v, cos, sin, d)
    assert rq.shape == (hq, 5, d) and rv.shape == (hk, 5, d) and rq.is_contiguous()
    assert (rq.double() - _rope64(q, cos, sin, d)).abs().max() < 1e-5
    assert (rk.double() - _rope64(k, cos, sin, d)).abs().max() < 1e-5
    assert torch.equal(rv, v.reshape(5, hk, d).transpose(0, 1))
    # rope_into: the same q, with k and v stored at cache slots [3, 8); every other slot untouched
    kc, vc = torch.full((hk, 16, d), 7.0), torch.full((hk, 16, d), 7.0)
    assert torch.equal(glue.rope_into(q, k, v, cos, sin, d, kc, vc, 3), rq)
    assert torch.equal(kc[:, 3:8], rk) and torch.equal(vc[:, 3:8], rv)
    assert (kc[:, :3] == 7).all() and (kc[:, 8:] == 7).all() and (vc[:, :3] == 7).all() and (vc[:, 8:] == 7).all()
    with pytest.raises(RuntimeError, match="room for slots"):
        glue.rope_into(q, k, v, cos, sin, d, kc, vc, 12)

    gu = torch.randn(5, 2 * 4864, generator=g) * 4
    gate, up = gu.split([4864, 4864], -1)
    want = F.silu(gate.double()) * up.double()
    assert (glue.silu_mul(gate, up).double() - want).abs().max() < 1e-5 * want.abs().max()


@pytest.mark.parametrize("n", [1, 2])
def test_a_row_is_bit_identical_alone_in_a_batch_and_on_any_thread_count(threads, n):
    threads(n)
    g = torch.Generator().manual_seed(n)
    rows, width = 300, 1536  # enough rows and elements that the ops split them over the pool
    x, a, w = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g), torch.rand(width, generator=g)
    d = 128
    qkv = torch.randn(rows, 16 * d, generator=g)
    q, k, v = qkv.split([12 * d, 2 * d, 2 * d], -1)
    cos, sin = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    batch = (glue.rms_norm(x, w, 1e-5), glue.add_rms_norm(x, a, w, 1e-5), glue.rope(q, k, v, cos, sin, d),
             glue.silu_mul(x, a))
    for t in (0, 7, rows - 1):
        one = slice(t, t + 1)
        assert torch.equal(glue.rms_norm(x[one], w, 1e-5), batch[0][one])
        s, y = glue.add_rms_norm(x[one], a[one], w, 1e-5)
        assert torch.equal(s, batch[1][0][one]) and torch.equal(y, batch[1][1][one])
        for got, want in zip(glue.rope(q[one], k[one], v[one], cos[one], sin[one], d), batch[2]):
            assert torch.equal(got[:, 0], want[:, t])
        assert torch.equal(glue.silu_mul(x[one].clone(), a[one].clone()), batch[3][one])


def test_shapes_it_cannot_take_are_refused_or_left_to_torch():
    assert not glue.runs(torch.randn(3, 12)) and not glue.runs(torch.randn(3, 16, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="weight fp32"):
        glue.rms_norm(torch.randn(2, 16), torch.randn(8), 1e-6)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        glue.rope(torch.randn(2, 24), torch.randn(2, 24), torch.randn(2, 24), torch.randn(2, 24), torch.randn(2, 24), 24)


def test_where_autograd_needs_a_gradient_torch_code_runs():
    """The ops have no backward: a norm over rows that need a gradient (training) keeps torch's code."""
    from specmesh.model import RMSNorm

    norm = RMSNorm(16, 1e-6)
    x = torch.randn(3, 16, requires_grad=True)
    assert not glue.runs(x, norm.weight) and glue.runs(x.detach(), norm.weight.detach())
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.no_grad():
        assert glue.runs(x, norm.weight)


def test_the_model_takes_them_and_agrees_with_its_torch_path(monkeypatch):
    from transformers import LlamaConfig

    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.drafters.model import ModelDrafter
    from specmesh.loader import model_from_hf
    from specmesh.model import Segment
    from specmesh.sampling import SamplingParams
    from tests.tiny_models import random_hf_model

    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    m = model_from_hf(cfg, random_hf_model(cfg, seed=3).state_dict())
    tokens, pos = torch.arange(10, 30), torch.arange(20)
    calls = []
    for name in ("rms_norm", "add_rms_norm", "rope", "rope_into", "silu_mul"):
        real = getattr(glue, name)
        monkeypatch.setattr(glue, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))

    def logits():
        return m(tokens, pos, m.new_cache(32), 0)

    def logits_of(n):
        return m(tokens[:n], pos[:n], m.new_cache(32), 0)

    with_glue = logits()
    assert set(calls) == {"rms_norm", "add_rms_norm", "rope_into", "silu_mul"}  # one cache: k, v rotated into it
    a, b = Segment(tokens, pos, m.new_cache(32), 0), Segment(tokens[:7], pos[:7], m.new_cache(32), 0)
    together = m.forward_batch([a, b])  # two caches: rope, then each segment's write
    assert "rope" in calls  # rows of a batch agree with each alone up to the products' rounding (fp32 weights here)
    assert (together[0] - with_glue).abs().max() < 1e-4 and (together[1] - logits_of(7)).abs().max() < 1e-4
    ids = list(range(3, 12))
    plain = generate(m, ids, SamplingParams(), StopConditions(24)).token_ids
    spec = generate(m, ids, SamplingParams(), StopConditions(24), ModelDrafter(m), SpecConfig(budget=6, depth=3)).token_ids
    assert spec == plain
    monkeypatch.setattr(glue, "runs", lambda *tensors: False)
    assert (with_glue - logits()).abs().max() < 1e-4
