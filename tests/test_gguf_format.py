"""The `gguf` weight format (specmesh.quant): a GGUF's tensors at the size they ship, multiplied by
specmesh's integer kernel (specmesh.kernels.qdot: Q4_0/Q4_1/Q4_K, Q6_K) or ggml's own dot products
(specmesh.kernels.ggml: Q8_0 and the other types). The codes are the file's exactly; a product is
the kernel's stated arithmetic on 8-bit activations; rows are batch-invariant; greedy speculation
equals plain decoding in this format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from transformers import LlamaConfig

from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.kernels import attention, ggml, qdot
from specmesh.loader import model_from_hf
from specmesh.quant import QuantLinear, SuperCodes, WeightFormat, fuse_qdot, gguf_int4_codes, gguf_q6k_codes
from specmesh.sampling import SamplingParams
from specmesh.tree import depths, tree_attention_mask
from tests.tiny_models import random_hf_model

pytestmark = pytest.mark.skipif(not qdot.available(), reason=f"integer kernel unavailable: {qdot.reason()}")


def _kquant_blocks(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random Q4_K / Q5_K / Q6_K bytes with sane fp16 scales (gguf cannot quantize to K-quants)."""
    rng = np.random.default_rng(seed)
    size = {T.Q4_K: 144, T.Q5_K: 176, T.Q6_K: 210}[qtype]
    raw = rng.integers(0, 256, (n, k // 256 * size), dtype=np.uint8)
    b = raw.reshape(-1, size)
    f16 = lambda lo, hi: rng.uniform(lo, hi, b.shape[0]).astype(np.float16).view(np.uint8).reshape(-1, 2)  # noqa: E731
    if qtype in (T.Q4_K, T.Q5_K):
        b[:, 0:2], b[:, 2:4] = f16(1e-3, 1e-2), f16(1e-3, 1e-2)
    else:
        b[:, 208:210] = f16(1e-4, 1e-3)
    return raw


def _reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The kernel's stated arithmetic in float64: x quantized per 32 inputs (xq = round(x 127 / max|x|)),
    y = sum over groups of (scale * q + offset) . xq * dx."""
    m, k = x.shape
    blocks = x.double().view(m, k // 32, 32)
    dx = (blocks.abs().amax(-1, keepdim=True) / 127).float().double()
    xq = torch.where(dx > 0, (blocks / torch.where(dx > 0, dx, 1)).round(), 0).clamp(-127, 127)
    xd = (xq * dx).view(m, k)
    gs = k // scale.shape[1]
    w = q.double().view(q.shape[0], -1, gs) * scale.double()[..., None] + offset.double()[..., None]
    return xd @ w.view(q.shape[0], k).t()


@pytest.mark.parametrize("bits", [4, 6, 8])
def test_the_integer_kernel_computes_its_stated_arithmetic(bits):
    g = torch.Generator().manual_seed(bits)
    n, k, gs = 45, 512, qdot.GROUP[bits]  # n not a multiple of 8: padded rows are dropped
    lo, hi = qdot.CODES[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16)
    scale, offset = torch.rand(n, k // gs, generator=g) * 0.01, torch.randn(n, k // gs, generator=g) * 0.01
    layer = QuantLinear.from_codes(q, scale, offset, bits, None)
    x = torch.randn(7, k, generator=g)
    want = _reference(x, q, scale, offset)
    got = layer(x).double()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    w = q.float().view(n, -1, gs) * scale[..., None] + offset[..., None]
    assert torch.equal(layer.dequantized(), w.view(n, k))  # the layout round-trips


@pytest.mark.parametrize("bits,planes", [(4, 2), (6, 1), (8, 2)])
def test_super_block_scales_compute_the_stated_arithmetic(bits, planes):
    """The K-quants' own form: scale = d * sc, bias = dm * mn (mn = sc with one plane), one fp32
    product each, then the same sums as with fp32 pairs."""
    g = torch.Generator().manual_seed(10 + bits)
    n, k, gs = 45, 512, qdot.GROUP[bits]
    lo, hi = qdot.CODES[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16)
    d, dm = torch.rand(n, k // 256, generator=g) * 1e-3, -torch.rand(n, k // 256, generator=g) * 1e-3
    sc = torch.randint(-64, 64, (n, k // gs), generator=g, dtype=torch.int8)
    mn = torch.randint(0, 64, (n, k // gs), generator=g, dtype=torch.int8) if planes == 2 else None
    layer = QuantLinear.from_super(SuperCodes(q, d, dm, sc, mn, bits), None)
    scale = d.repeat_interleave(256 // gs, 1) * sc.float()
    offset = dm.repeat_interleave(256 // gs, 1) * (sc if mn is None else mn).float()
    x = torch.randn(6, k, generator=g)
    want = _reference(x, q, scale, offset)
    assert (layer(x).double() - want).abs().max() <= 1e-5 * want.abs().max()
    w = q.float().view(n, -1, gs) * scale[..., None] + offset[..., None]
    assert torch.equal(layer.dequantized(), w.view(n, k))
    per_group = QuantLinear.from_codes(q, scale, offset, bits, None)  # the same weights, fp32 pairs
    assert torch.equal(layer(x), per_group(x)) and layer.nbytes() < per_group.nbytes()


def test_k_quant_codes_are_the_files_weights():
    n, k = 16, 512
    raw = _kquant_blocks(T.Q6_K, n, k)
    assert torch.equal(gguf_q6k_codes(raw, n, k).dequantize(), torch.from_numpy(dequantize(raw, T.Q6_K)).view(n, k))
    rng = np.random.default_rng(3)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[0, :32] = np.linspace(-1, 1, 32)  # a block that uses -128 in Q8_0
    for qtype in (T.Q4_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_0, T.Q4_1):
        raw = _kquant_blocks(qtype, n, k, seed=3) if qtype in (T.Q4_K, T.Q6_K) else quantize(w, qtype)
        ref = torch.from_numpy(dequantize(raw, qtype)).view(n, k)
        layer = QuantLinear.from_gguf(raw, qtype, k, None)
        assert layer.kernel == "specmesh-qdot", qtype
        # q * scale + offset, the offset folded per group: a few fp32 roundings off gguf's own formula
        assert (layer.dequantized() - ref).abs().max() <= 1e-6 * ref.abs().max(), qtype
        if qtype in (T.Q4_K, T.Q6_K):  # held as shipped: about the file's bytes, not fp32 pairs per group
            assert layer.supergroups > 0 and layer.nbytes() <= 1.1 * raw.nbytes, qtype


def _layers(k: int = 256, n: int = 72) -> dict[str, QuantLinear]:
    rng = np.random.default_rng(7)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    out = {"Q4_K": QuantLinear.from_gguf(_kquant_blocks(T.Q4_K, n, k), T.Q4_K, k, None),
           "Q6_K": QuantLinear.from_gguf(_kquant_blocks(T.Q6_K, n, k), T.Q6_K, k, None),
           "Q4_0": QuantLinear.from_gguf(quantize(w, T.Q4_0), T.Q4_0, k, torch.randn(n))}
    out["Q8_0"] = QuantLinear.from_gguf(quantize(w, T.Q8_0), T.Q8_0, k, None)
    out["Q5_1"] = QuantLinear.from_gguf(quantize(w, T.Q5_1), T.Q5_1, k, None)
    if ggml.available():  # a type only ggml multiplies
        out["Q5_K"] = QuantLinear.from_gguf(_kquant_blocks(T.Q5_K, n, k), T.Q5_K, k, None)
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_are_batch_invariant(threads):
    """Row i of an M-row product is bit-identical to row i alone, on either kernel."""
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(2))
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, layer in _layers().items():
            full = layer(x)
            for m in (2, 3, 4, 5, 9):
                assert torch.equal(layer(x[:m]), full[:m]), name
            for i in range(x.shape[0]):
                assert torch.equal(layer(x[i:i + 1])[0], full[i]), name
    finally:
        torch.set_num_threads(old)


def test_a_product_is_close_to_the_files_weights_times_x():
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(4))
    for name, layer in _layers().items():
        want = x @ layer.dequantized().t() + (0 if layer.bias is None else layer.bias)
        err = (layer(x) - want).norm() / want.norm()
        assert err < 0.02, (name, float(err))  # 8-bit activations: ~0.5% here


@pytest.mark.skipif(not ggml.available(), reason=f"ggml unavailable: {ggml.reason()}")
def test_ggml_layers_keep_the_files_bytes():
    raw = _kquant_blocks(T.Q5_K, 40, 512)  # a type only ggml multiplies
    layer = QuantLinear.from_gguf(raw, T.Q5_K, 512, None)
    assert layer.kernel == "ggml" and np.array_equal(layer.blocks.numpy(), raw)
    assert torch.equal(layer.dequantized(), torch.from_numpy(dequantize(raw, T.Q5_K)).view(40, 512))


def test_fused_products_are_bit_identical_and_hold_the_weights_once():
    rng = np.random.default_rng(0)
    k = 256

    def layer(n, bias):
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return QuantLinear.from_gguf(quantize(w, T.Q4_0), T.Q4_0, k, torch.randn(n) if bias else None)

    parts = [layer(64, True), layer(16, True), layer(16, True)]
    x = torch.randn(5, k)
    separate = [p(x) for p in parts]
    fused = fuse_qdot(parts)
    assert fused is not None and fused.out_features == 96
    for got, want in zip(fused(x).split([64, 16, 16], -1), separate):
        assert torch.equal(got, want)
    for p, want in zip(parts, separate):  # the parts now view the fused buffers, values unchanged
        assert p.qd_codes.untyped_storage().data_ptr() == fused.qd_codes.untyped_storage().data_ptr()
        assert torch.equal(p(x), want)
    assert fuse_qdot([layer(64, True), layer(64, False)]) is None  # bias on one only
    assert fuse_qdot([layer(60, False), layer(64, False)]) is None  # not whole 8-row blocks
    q8 = QuantLinear.from_gguf(quantize(rng.standard_normal((64, k)).astype(np.float32), T.Q8_0), T.Q8_0, k, None)
    assert fuse_qdot([layer(64, False), q8]) is None  # another layout


def _tiny_gguf_target(seed: int = 5, heads: int = 4, mixed: bool = False):
    """A tiny random Llama with every Linear in `gguf` blocks (Q4_0, the head Q8_0); `mixed`: with
    attention biases, v and down in other layouts (Q8_0, Q5_0), as GGUF K-quant mixes ship them
    (q/k/v then split over products, some with a bias)."""
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, tie_word_embeddings=False,
                      eos_token_id=1, attention_bias=mixed)
    sd = {k: v for k, v in random_hf_model(cfg, seed=seed).state_dict().items() if not k.endswith("o_proj.bias")}
    model = model_from_hf(cfg, sd)  # q/k/v biases, as Qwen2 has them
    info = WeightFormat("gguf")
    other = {"v_proj": T.Q8_0, "down_proj": T.Q5_0} if mixed else {}
    for name, m in list(model.named_modules()):
        if isinstance(m, torch.nn.Linear):
            qtype = T.Q8_0 if name == "lm_head" else other.get(name.rsplit(".", 1)[-1], T.Q4_0)
            layer = QuantLinear.from_gguf(quantize(m.weight.detach().numpy(), qtype), qtype, m.in_features, m.bias)
            parent, child = name.rsplit(".", 1) if "." in name else ("", name)
            setattr(model.get_submodule(parent), child, layer)
            info.ship(layer.kernel, qtype.name)
    model.weight_format = info
    return model


def _forwards(model) -> list[torch.Tensor]:
    """Logits of a prefill (causal, 12 rows), a decode step and a 9-node tree over a fresh cache."""
    from specmesh.model import causal_mask

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 128, (12,), generator=g)
    cache = model.new_cache()
    out = [model(prompt, torch.arange(12), cache, 0, causal_mask(0, 12))]
    cache.commit(list(range(12)))
    out.append(model(torch.tensor([7]), torch.tensor([12]), cache, 12))
    cache.commit([12])
    parents = [-1, -1, 0, 0, 1, 2, 2, 4, 5]
    mask = torch.ones(9, 13 + 9, dtype=torch.bool)
    mask[:, 13:] = tree_attention_mask(parents)
    tokens = torch.randint(0, 128, (9,), generator=g)
    out.append(model(tokens, torch.tensor([12 + d for d in depths(parents)]), cache, 13, mask))
    return out


@pytest.mark.skipif(not attention.available(), reason=f"row kernel unavailable: {attention.reason()}")
@pytest.mark.parametrize("mixed", [False, True])
def test_the_lean_step_equals_the_module_path_to_the_bit(monkeypatch, mixed):
    """Every product on the integer kernel: a forward calls the same ops from a plan made once
    (`specmesh.model._lean_layers`, one call of the glue library's layer loop), with the same
    results as the module path, to the bit, also with biases and q/k/v in several layouts; a
    replaced layer makes a new plan (here none: an fp32 layer is not on the kernel)."""
    import specmesh.model as model_mod

    model = _tiny_gguf_target(heads=2, mixed=mixed)  # head dim 32: the row kernel takes it
    if mixed:  # q/k in one product and v in another; every layout in use
        assert len(model._lean_plan().layers[0].qkv) == 2
        assert {m.bits for m in model.modules() if hasattr(m, "bits")} >= {4, 6, 8}
    assert model._lean_plan() is not None
    calls = []
    lean = model_mod._lean_layers
    monkeypatch.setattr(model_mod, "_lean_layers", lambda *a: calls.append(1) or lean(*a))
    got = _forwards(model)
    assert len(calls) == 3
    monkeypatch.setattr(model_mod.Transformer, "_lean_plan", lambda self: None)
    want = _forwards(model)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    monkeypatch.undo()
    attn = model.model.layers[1].self_attn
    attn.o_proj = torch.nn.Linear(64, 64, bias=False)
    assert model._lean_plan() is None


def test_greedy_speculation_equals_plain_decoding_in_gguf():
    model = _tiny_gguf_target()
    assert "specmesh-qdot" in model.weight_format.describe()
    g = torch.Generator().manual_seed(0)
    for i in range(2):
        ids = torch.randint(2, 128, (7,), generator=g).tolist() * 2
        plain = generate(model, ids, SamplingParams(), StopConditions(40)).token_ids
        assert len(plain) == 40
        for drafter in (NgramDrafter(), OracleDrafter(ids + plain, 0.7, 128, seed=i)):
            for spec in (SpecConfig(4, 4), SpecConfig(8, 3)):
                out = generate(model, ids, SamplingParams(), StopConditions(40), drafter, spec).token_ids
                assert out == plain, (type(drafter).__name__, spec)


def test_bundled_gguf_loads_as_shipped():
    from specmesh.loader import bundled_target_path, load_model

    path = bundled_target_path()
    m = load_model(path, "gguf")
    card = m.weight_format.describe()
    assert card == "gguf (specmesh-qdot: 210 Q4_1, 1 Q8_0)", card  # the tied head too: nothing fp32
    ref = load_model(path)  # transformers' dequantization, fp32
    tokens = torch.tensor([1, 504, 3458, 282, 260, 1345, 314, 253, 2630, 30, 198])
    pos = torch.arange(len(tokens))
    got, want = m(tokens, pos, m.new_cache(32), 0), ref(tokens, pos, ref.new_cache(32), 0)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.8, float(agree)  # the same weights; 8-bit activations move near-ties only


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_packed_weights_load_equal_to_the_bit_and_follow_the_file(tmp_path, monkeypatch, role):
    import os
    import shutil

    from specmesh import loader

    gguf = tmp_path / "model.gguf"
    shutil.copy(loader.bundled_target_path(), gguf)
    monkeypatch.setattr(loader, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(loader, "auto_format", lambda path: "gguf")  # the drafter's path to its 4-bit requantization

    def load():
        return loader.load_gguf(gguf, "gguf") if role == "target" else loader.load_drafter_weights(gguf, "auto")

    def logits(m):
        tokens = torch.tensor([1, 504, 3458, 282, 260, 1345, 314, 253, 2630, 30, 198])
        return m(tokens, torch.arange(len(tokens)), m.new_cache(32), 0)

    built = load()  # built from the file, then kept
    (blob,) = (tmp_path / "cache" / "packed").glob("*.pt")
    built_fn = loader._build_gguf
    monkeypatch.setattr(loader, "_build_gguf", lambda *a: pytest.fail("built again, not read from the cache"))
    kept = load()
    assert kept.weight_format == built.weight_format
    assert torch.equal(logits(kept), logits(built))
    assert type(kept.lm_head) is type(built.lm_head) and kept.lm_head.qd_codes.dtype == built.lm_head.qd_codes.dtype
    # a changed file is a new entry, built afresh; the old one is dropped
    monkeypatch.setattr(loader, "_build_gguf", built_fn)
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    assert torch.equal(logits(load()), logits(built))
    assert [p.name for p in (tmp_path / "cache" / "packed").glob("*.pt")] != [blob.name]
    assert len(list((tmp_path / "cache" / "packed").glob("*"))) == 1

    class Built(Exception):
        pass

    def build(*args):
        raise Built

    monkeypatch.setenv(loader.WEIGHT_CACHE_ENV, "0")  # off: built every time, the kept entry not read
    monkeypatch.setattr(loader, "_build_gguf", build)
    with pytest.raises(Built):
        load()


def test_gguf_is_refused_for_a_checkpoint_without_blocks():
    from specmesh.drafters import bundled_drafter_path
    from specmesh.loader import load_model

    with pytest.raises(ValueError, match="gguf"):
        load_model(bundled_drafter_path(), "gguf")


def test_a_drafter_is_requantized_to_4_bits_and_stays_a_drafter():
    from specmesh.drafters.model import ModelDrafter
    from specmesh.loader import requantize_to_4bit

    target, draft = _tiny_gguf_target(), requantize_to_4bit(_tiny_gguf_target(seed=6))
    assert all(m.bits == 4 for m in draft.modules() if isinstance(m, QuantLinear))
    assert draft.lm_head.qd_sb.dtype == torch.half  # fp16 pairs: 5 bits a weight
    assert draft.weight_format.describe() == "gguf (specmesh-qdot: 14 Q4_0; requantized: 1 Q8_0)"
    ids = list(range(2, 12)) * 2
    plain = generate(target, ids, SamplingParams(), StopConditions(30)).token_ids
    out = generate(target, ids, SamplingParams(), StopConditions(30), ModelDrafter(draft), SpecConfig(8, 3)).token_ids
    assert out == plain


@pytest.fixture
def thread_budget():
    from specmesh import kernels

    before = torch.get_num_threads(), kernels._Threads.budget
    yield kernels
    torch.set_num_threads(before[0])
    kernels._Threads.budget = before[1]


def test_a_model_on_the_kernel_pool_takes_the_budget_and_torch_one_thread(thread_budget):
    """`fit_threads`: every product on specmesh's pool -> the pool gets the budget, torch's own ops
    one thread; any product left on torch's GEMM -> torch keeps the budget. Outputs do not change."""
    from specmesh.runtime import fit_threads

    kernels = thread_budget
    pooled, ids = _tiny_gguf_target(), list(range(2, 12))
    kernels.set_threads(1)
    one = generate(pooled, ids, SamplingParams(), StopConditions(12)).token_ids
    kernels.set_threads(2)
    assert fit_threads(pooled) == "2 (kernels 2, torch ops 1)"
    assert (torch.get_num_threads(), kernels.pool_threads()) == (1, 2)
    assert generate(pooled, ids, SamplingParams(), StopConditions(12)).token_ids == one

    mixed = _tiny_gguf_target()
    mixed.lm_head = torch.nn.Linear(64, 128, bias=False)  # one product on torch's GEMM
    assert fit_threads(mixed) == "2" and torch.get_num_threads() == 2
    assert fit_threads(pooled, mixed) == "2" and fit_threads() == "2"
    from specmesh.drafters.model import ModelDrafter  # a drafter counts by the model it holds; an n-gram one holds none
    assert fit_threads(pooled, ModelDrafter(pooled)) == fit_threads(pooled, NgramDrafter(), None) == "2 (kernels 2, torch ops 1)"
    assert fit_threads(pooled, ModelDrafter(mixed)) == "2"
    with pytest.raises(ValueError, match="torch_ops"):
        kernels.set_threads(2, 3)
