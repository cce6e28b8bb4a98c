"""Weight formats (specmesh.quant): GGUF 4-bit codes map exactly, each format computes what its
dequantized weights say, rows are batch-invariant, and greedy output through speculation equals
plain decoding in the same format (tiny random model; the bundled SmolLM2 GGUF in `slow`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig

from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.loader import model_from_hf, quantize_model
from specmesh.quant import COMPUTE_DTYPE, QuantLinear, gguf_int4_codes, int4_kernel
from tests.tiny_models import random_hf_model

QUANT_FORMATS = ("bf16", "int8", "int4")


def _q4k_blocks(n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K bytes with sane fp16 d / dmin (gguf cannot quantize to Q4_K)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    for lo in (0, 2):
        blocks[:, lo:lo + 2] = rng.uniform(1e-3, 1e-2, blocks.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_gguf_4bit_codes_are_the_files_weights(qtype):
    n, k = 24, 512
    if qtype == T.Q4_K:
        raw = _q4k_blocks(n, k)
    else:
        raw = quantize(np.random.default_rng(1).standard_normal((n, k)).astype(np.float32), qtype)
    codes = gguf_int4_codes(raw, qtype.name, n, k)
    ref = torch.from_numpy(dequantize(raw, qtype)).reshape(n, k)
    assert torch.equal(codes.dequantize(), ref)
    assert gguf_int4_codes(raw, "Q6_K", n, k) is None


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quant_linear_is_its_dequantized_weight(fmt):
    torch.manual_seed(0)
    w, b = torch.randn(96, 256) * 0.05, torch.randn(96)
    layer = QuantLinear.from_float(w, b, fmt)
    deq = layer.dequantized()  # [N, K]
    tol = {"bf16": 0.01, "int8": 0.02, "int4": 0.15}[fmt]  # of the weights' range, by format
    assert (deq - w).abs().max() <= tol * w.abs().max()
    x = torch.randn(5, 256)
    fp32_x = fmt == "int4" and layer.kernel == "specmesh-q4"  # specmesh's kernel takes fp32 activations
    want = (x if fp32_x else x.to(COMPUTE_DTYPE).float()) @ deq.t() + b  # the kernel's inputs, exactly
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    tol = 1e-5 if fp32_x else 2e-2  # fp32 summation order only / bf16 rounding inside torch's kernels
    assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_int4_from_gguf_codes_computes_the_files_weights():
    n, k = 64, 512
    raw = _q4k_blocks(n, k, seed=2)
    ref = torch.from_numpy(dequantize(raw, T.Q4_K)).reshape(n, k)
    layer = QuantLinear.from_int4(gguf_int4_codes(raw, "Q4_K", n, k), None)
    # torch's path: scale and zero held in bf16 (relative rounding <= 2^-9 each); specmesh's kernel
    # keeps them fp32 and computes q * scale + (zero - 8 scale): a few fp32 roundings.
    tol = 1e-6 if layer.kernel == "specmesh-q4" else 2 ** -7
    assert (layer.dequantized() - ref).abs().max() <= tol * ref.abs().max()


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_batch_invariant(fmt, threads):
    """Row i of an M-row product is bit-identical to row i alone: a verified tree's logits equal
    one-token decoding's."""
    torch.manual_seed(1)
    layer = QuantLinear.from_float(torch.randn(320, 512) * 0.05, None, fmt)
    x = torch.randn(17, 512)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        full = layer(x)
        for m in (2, 5, 9):
            assert torch.equal(layer(x[:m]), full[:m])
        for i in range(x.shape[0]):
            assert torch.equal(layer(x[i:i + 1])[0], full[i])
    finally:
        torch.set_num_threads(old)


def _tiny_target(fmt: str):
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, eos_token_id=1)
    return quantize_model(model_from_hf(cfg, random_hf_model(cfg, seed=5).state_dict()), fmt)


@pytest.mark.parametrize("fmt", ("fp32",) + QUANT_FORMATS)
@pytest.mark.usefixtures("kernel_only")
def test_greedy_speculation_equals_plain_decoding_in_each_format(fmt):
    # fp32 on the batch-invariant kernel whatever this machine's timed table says of the tiny shapes
    # (torch's GEMM there is greedy-identical only up to ties); the formats' own products must be
    # batch-invariant themselves (bf16: `kernels.ROW_BY_ROW`). Failed for bf16 before that at 1 thread.
    model = _tiny_target(fmt)
    assert model.weight_format.fmt == fmt
    assert any(isinstance(m, QuantLinear) for m in model.modules()) == (fmt != "fp32")
    draft = _tiny_target("int4")
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        ids = torch.randint(2, 128, (7,), generator=g).tolist() * 2  # repeats: the n-gram drafter hits
        plain = generate(model, ids, _greedy(), StopConditions(40)).token_ids
        assert len(plain) == 40
        drafters = [NgramDrafter(), OracleDrafter(ids + plain, 0.7, 128, seed=i), ModelDrafter(draft)]
        for drafter in drafters:
            for spec in (SpecConfig(4, 4), SpecConfig(8, 3)):
                out = generate(model, ids, _greedy(), StopConditions(40), drafter, spec).token_ids
                assert out == plain, (fmt, type(drafter).__name__, spec)


def _greedy():
    from specmesh.sampling import SamplingParams

    return SamplingParams()


def test_the_tensor_reader_reads_what_ggufs_reader_does():
    """`loader.gguf_tensors` skips the metadata arrays' values (the vocabulary): the tensors it
    returns are gguf's own, the same names, types, shapes, offsets and bytes."""
    from gguf import GGUFReader

    from specmesh.loader import bundled_target_path, gguf_tensors

    path = bundled_target_path()
    fast, stock = gguf_tensors(path), GGUFReader(path).tensors
    assert len(fast) == len(stock) > 0
    for a, b in zip(fast, stock):
        assert (a.name, a.tensor_type, list(a.shape), a.data_offset) == (b.name, b.tensor_type, list(b.shape),
                                                                       b.data_offset)
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data))


@pytest.mark.slow
def test_bundled_gguf_loads_straight_into_each_format():
    from gguf import GGUFReader

    from specmesh.loader import bundled_target_path, load_model

    path = bundled_target_path()
    types = {t.tensor_type.name for t in GGUFReader(path).tensors}
    assert {"Q4_1", "Q8_0"} <= types  # linears Q4_1, the tied embedding / head Q8_0
    ref = load_model(path)  # transformers' dequantization, cached as fp32
    tokens = torch.tensor([1, 504, 3458, 282, 260, 1345, 314, 253, 2630, 30, 198])
    pos = torch.arange(len(tokens))
    want = ref(tokens, pos, ref.new_cache(32), 0)
    direct = load_model(path, "fp32")
    assert torch.equal(direct(tokens, pos, direct.new_cache(32), 0), want)
    m = load_model(path, "int4")
    assert m.weight_format.describe() == f"int4 ({int4_kernel()}; kept fp32: 1 Q8_0)"
    assert not m.weight_format.requantizing
    assert isinstance(m.model.layers[0].mlp.up_proj, QuantLinear)
    got = m(tokens, pos, m.new_cache(32), 0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.8
    assert load_model(path, "int8").weight_format.requantizing
    prompt = tokens.tolist() * 2
    plain = generate(m, prompt, _greedy(), StopConditions(32)).token_ids
    for drafter in (NgramDrafter(), OracleDrafter(prompt + plain, 0.8, m.config.vocab_size)):
        assert generate(m, prompt, _greedy(), StopConditions(32), drafter, SpecConfig(8, 4)).token_ids == plain
