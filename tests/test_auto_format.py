"""`--dtype auto`: the format chosen by measurement on this machine (loader.auto_format for targets,
loader.load_drafter_weights for drafters), with the timing itself replaced by a fixed verdict so
both branches are checked; the verdict is cached per machine key."""

from __future__ import annotations

import pytest
import torch

from specmesh import loader, quant
from specmesh.kernels import qdot
from specmesh.loader import auto_format, bundled_target_path, load_drafter_weights
from specmesh.quant import QuantLinear


def _verdict(monkeypatch, tmp_path, choice: str) -> list:
    calls = []

    def fake(n: int, k: int, formats: tuple[str, ...]) -> dict:
        calls.append((n, k, formats))
        return {**{f"{f}_us": {"1": 1.0} for f in formats}, "choice": choice}

    monkeypatch.setattr(quant, "time_formats", fake)
    monkeypatch.setenv("SPECMESH_KERNEL_DIR", str(tmp_path / choice))
    return calls


@pytest.mark.parametrize("choice", ["gguf", "int4"])
def test_a_4bit_gguf_takes_a_quantized_format_only_where_it_measured_faster(monkeypatch, tmp_path, choice):
    path = bundled_target_path()  # Q4_1 linears, a Q8_0 embedding
    calls = _verdict(monkeypatch, tmp_path, choice)
    assert auto_format(path) == choice
    assert auto_format(path) == choice and len(calls) == 1  # cached: timed once per machine key
    n, k, formats = calls[0]
    assert (n, k) in ((1536, 576), (576, 1536))  # [N, K] of the largest quantized Linear: an MLP projection
    assert formats == (("gguf",) if qdot.available() else ()) + ("int4", "fp32")
    _verdict(monkeypatch, tmp_path, "fp32")
    assert auto_format(path) == torch.float32


def test_other_checkpoints_stay_float32(monkeypatch, tmp_path):
    calls = _verdict(monkeypatch, tmp_path, "int4")
    from specmesh.drafters import bundled_drafter_path

    assert auto_format(bundled_drafter_path()) == torch.float32  # safetensors: int4 would requantize
    assert calls == []


def test_a_drafter_may_be_requantized(monkeypatch, tmp_path):
    from specmesh.drafters import bundled_drafter_path

    calls = _verdict(monkeypatch, tmp_path, "int4")
    model = load_drafter_weights(bundled_drafter_path(), "auto")
    assert model.weight_format.fmt == "int4" and any(isinstance(m, QuantLinear) for m in model.modules())
    assert calls[0][2] == (("q8",) if qdot.available() else ()) + ("int4", "fp32")
    _verdict(monkeypatch, tmp_path, "fp32")
    model = load_drafter_weights(bundled_drafter_path(), "auto")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.skipif(not qdot.available(), reason="the integer kernel does not build here: q8 is not offered")
def test_a_float_drafter_may_take_8bit_codes_on_the_integer_kernel(monkeypatch, tmp_path):
    """`q8`: every Linear of a float drafter as 8-bit codes (16 inputs per fp16 scale) on the
    integer kernel; its logits stay close to fp32's and its greedy picks nearly all the same
    (a drafter's numerics only move its acceptance)."""
    from specmesh.drafters import bundled_drafter_path

    _verdict(monkeypatch, tmp_path, "fp32")
    ref = load_drafter_weights(bundled_drafter_path(), "auto")
    _verdict(monkeypatch, tmp_path, "q8")
    model = load_drafter_weights(bundled_drafter_path(), "auto")
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, QuantLinear))]
    assert linears and all(isinstance(m, QuantLinear) and m.kernel == "specmesh-qdot" and m.bits == 8 for m in linears)
    assert model.weight_format.describe() == f"gguf (requantized: {len(linears)} F32)"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, ref.config.hidden_size, generator=g)
    want, got = ref.lm_head(x), model.lm_head(x)
    assert (got - want).norm() < 0.02 * want.norm()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_the_verdict_is_measured_on_real_layers():
    formats = (("gguf", "q8") if qdot.available() else ()) + ("int4", "fp32")
    r = quant.time_formats(64, 128, formats, copies_bytes=1 << 16)
    assert r["choice"] in formats
    for f in formats:
        assert set(r[f"{f}_us"]) == {"1", "9"} and all(v > 0 for v in r[f"{f}_us"].values())


def test_make_drafter_loads_a_model_drafter_in_the_format_asked(monkeypatch, tmp_path):
    """`specmesh generate --dtype X --drafter model:PATH` passes X to the drafter too: it loaded in
    fp32 whatever --dtype said (a GGUF drafter then cost several times its own 4-bit forward)."""
    from specmesh.drafters import bundled_drafter_path
    from specmesh.runtime import make_drafter

    _verdict(monkeypatch, tmp_path, "int4")
    target = torch.nn.Module()
    target.config = type("C", (), {"vocab_size": 49152, "hidden_size": 576})()
    for dtype, quantized in (("auto", True), (torch.float32, False)):
        drafter = make_drafter("model", str(bundled_drafter_path()), target, dtype=dtype)
        assert any(isinstance(m, QuantLinear) for m in drafter.model.modules()) == quantized, dtype
