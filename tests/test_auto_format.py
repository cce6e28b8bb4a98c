"""`--dtype auto`: the format chosen by measurement on this machine (loader.auto_format for targets,
loader.load_drafter_weights for drafters), with the timing itself replaced by a fixed verdict so
both branches are checked; the verdict is cached per machine key."""

from __future__ import annotations

import torch

from specmesh import loader, quant
from specmesh.loader import auto_format, bundled_target_path, load_drafter_weights
from specmesh.quant import QuantLinear


def _verdict(monkeypatch, tmp_path, choice: str) -> list:
    calls = []

    def fake(n: int, k: int) -> dict:
        calls.append((n, k))
        return {"int4_us": {"1": 1.0}, "fp32_us": {"1": 2.0}, "choice": choice}

    monkeypatch.setattr(quant, "int4_vs_fp32", fake)
    monkeypatch.setenv("SPECMESH_KERNEL_DIR", str(tmp_path / choice))
    return calls


def test_a_4bit_gguf_takes_int4_only_where_it_measured_faster(monkeypatch, tmp_path):
    path = bundled_target_path()  # Q4_1 linears, a Q8_0 embedding
    calls = _verdict(monkeypatch, tmp_path, "int4")
    assert auto_format(path) == "int4"
    assert auto_format(path) == "int4" and len(calls) == 1  # cached: timed once per machine key
    assert calls[0] in ((1536, 576), (576, 1536))  # [N, K] of the largest 4-bit Linear: an MLP projection
    _verdict(monkeypatch, tmp_path, "fp32")
    assert auto_format(path) == torch.float32


def test_other_checkpoints_stay_float32(monkeypatch, tmp_path):
    calls = _verdict(monkeypatch, tmp_path, "int4")
    from specmesh.drafters import bundled_drafter_path

    assert auto_format(bundled_drafter_path()) == torch.float32  # safetensors: int4 would requantize
    assert calls == []


def test_a_drafter_may_be_requantized(monkeypatch, tmp_path):
    from specmesh.drafters import bundled_drafter_path

    _verdict(monkeypatch, tmp_path, "int4")
    model = load_drafter_weights(bundled_drafter_path(), "auto")
    assert model.weight_format.fmt == "int4" and any(isinstance(m, QuantLinear) for m in model.modules())
    _verdict(monkeypatch, tmp_path, "fp32")
    model = load_drafter_weights(bundled_drafter_path(), "auto")
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


def test_the_verdict_is_measured_on_real_layers():
    r = quant.int4_vs_fp32(64, 128, copies_bytes=1 << 16)
    assert r["choice"] in ("int4", "fp32") and set(r["int4_us"]) == set(r["fp32_us"]) == {"1", "9"}
    assert all(v > 0 for v in r["int4_us"].values())
