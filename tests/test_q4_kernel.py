"""specmesh's 4-bit CPU kernel (specmesh.kernels.q4): x @ dequantized-weights up to fp32 summation
order for odd shapes, every row bit-identical whatever the other rows and the thread count, the
int4 format uses it (fp32 activations), and greedy speculation equals plain decoding through it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig

from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.kernels import q4
from specmesh.loader import model_from_hf, quantize_model
from specmesh.quant import Int4Codes, QuantLinear, int4_kernel, quantize_int4
from specmesh.sampling import SamplingParams
from tests.tiny_models import random_hf_model

pytestmark = pytest.mark.skipif(not q4.available(), reason=f"4-bit kernel unavailable: {q4.reason()}")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


def _codes(n: int, k: int, seed: int) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 1e-3
    zero = torch.randn(n, k // 32, generator=g) * 0.05
    return Int4Codes(q, scale, zero)


def _apply(x: torch.Tensor, c: Int4Codes) -> torch.Tensor:
    p = q4.pack(c.q, c.scale, c.zero)
    return q4.q4_linear(x, p.codes, p.sb, p.n)


@pytest.mark.parametrize("n,k", [(1, 32), (7, 64), (13, 96), (100, 256), (264, 1536), (77, 2048)])
def test_kernel_is_x_times_dequantized_weights(n, k, threads):
    c = _codes(n, k, seed=n + k)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    ref = (x.double() @ c.dequantize().double().t())  # [17, N], exact up to fp64 rounding
    for m in range(1, 18):
        y = _apply(x[:m], c)
        assert y.shape == (m, n) and y.dtype == torch.float32
        # fp32 sums over K terms: error ~ sqrt(K) * 2^-24 * sum |x w|
        bound = 1e-6 * (x[:m].double().abs() @ c.dequantize().double().abs().t()) + 1e-7
        assert ((y.double() - ref[:m]).abs() <= bound).all(), m


@pytest.mark.parametrize("n,k", [(13, 96), (264, 1536), (1000, 512)])
def test_rows_are_bitwise_batch_invariant(n, k, threads):
    c = _codes(n, k, seed=3)
    p = q4.pack(c.q, c.scale, c.zero)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([q4.q4_linear(x[i:i + 1], p.codes, p.sb, n) for i in range(17)])  # [17, N]
    for m in range(1, 18):
        assert torch.equal(q4.q4_linear(x[:m], p.codes, p.sb, n), alone[:m]), m
        assert torch.equal(q4.q4_linear(x[17 - m:], p.codes, p.sb, n), alone[17 - m:]), m


def test_rows_do_not_depend_on_the_thread_count():
    c = _codes(520, 1536, seed=4)
    p = q4.pack(c.q, c.scale, c.zero)
    x = torch.randn(9, 1536)
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = q4.q4_linear(x, p.codes, p.sb, 520)
        torch.set_num_threads(2)
        assert torch.equal(q4.q4_linear(x, p.codes, p.sb, 520), one)
    finally:
        torch.set_num_threads(old)


def test_int4_layers_use_the_kernel_with_fp32_activations():
    torch.manual_seed(0)
    w, b = torch.randn(40, 128) * 0.05, torch.randn(40)
    layer = QuantLinear.from_float(w, b, "int4")
    assert layer.kernel == int4_kernel() == "specmesh-q4"
    x = torch.randn(3, 128)
    want = x.double() @ quantize_int4(w).dequantize().double().t() + b.double()
    got = layer(x)
    # bf16 activations (torch's path) would be off by ~1e-3 relative; fp32 is ~1e-7
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_kernels_off_falls_back_to_torch_int4pack():
    code = ("from specmesh.quant import QuantLinear, int4_kernel; from specmesh.kernels import q4; import torch;"
            "l = QuantLinear.from_float(torch.randn(16, 64), None, 'int4');"
            "print(int4_kernel(), l.kernel, tuple(l(torch.randn(2, 64)).shape)); print(q4.reason())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SPECMESH_KERNELS": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["torch-int4pack torch-int4pack (2, 16)", "disabled by SPECMESH_KERNELS=0"]


def test_greedy_speculation_equals_plain_decoding_through_the_kernel():
    # vocab 131: the LM head's rows are not a multiple of the kernel's 8-row block
    cfg = LlamaConfig(vocab_size=131, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1)
    model = quantize_model(model_from_hf(cfg, random_hf_model(cfg, seed=7).state_dict()), "int4")
    assert model.weight_format.describe() == "int4 (specmesh-q4; requantized: 15 F32)"
    assert model.lm_head.kernel == "specmesh-q4"
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        ids = torch.randint(2, 131, (7,), generator=g).tolist() * 2
        plain = generate(model, ids, SamplingParams(), StopConditions(40)).token_ids
        assert len(plain) == 40
        for drafter in (NgramDrafter(), OracleDrafter(ids + plain, 0.7, 131, seed=i)):
            for spec in (SpecConfig(4, 4), SpecConfig(8, 3), SpecConfig(16, 4)):
                out = generate(model, ids, SamplingParams(), StopConditions(40), drafter, spec).token_ids
                assert out == plain, (type(drafter).__name__, spec)
