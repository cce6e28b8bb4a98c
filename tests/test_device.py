"""specmesh.device: --device / --dtype parsing, and OnDevice, the wrapper that lets CPU-side code
drive a model elsewhere (here on the CPU itself: the same code path, minus the copies' target)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from specmesh.device import OnDevice, parse_dtype, place, resolve_device
from specmesh.loader import model_from_hf
from tests.tiny_models import random_hf_model


def _tiny():
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return model_from_hf(cfg, random_hf_model(cfg).state_dict())


def test_auto_device_is_cuda_only_where_there_is_one() -> None:
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == want
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cuda:x", ""])
def test_unknown_devices_are_refused_naming_the_setting(name: str) -> None:
    with pytest.raises(ValueError, match="device: expected auto, cpu, cuda"):
        resolve_device(name)


def test_cuda_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        assert resolve_device("cuda") == torch.device("cuda", 0)
        with pytest.raises(ValueError, match="GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ValueError, match="device: cuda asked for, but CUDA is not available"):
            resolve_device("cuda")


def test_dtypes() -> None:
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype("int4") == "int4" and parse_dtype("int8") == "int8" and parse_dtype("gguf") == "gguf"  # weight formats (specmesh.quant)
    assert parse_dtype("auto") == "auto"  # measured at load (specmesh.loader.auto_format)
    with pytest.raises(ValueError, match="dtype: expected one of float32, bfloat16, float16, int8, int4, gguf, auto, got 'fp8'"):
        parse_dtype("fp8")


def test_on_device_is_the_model_behind_cpu_tensors() -> None:
    model = _tiny()
    wrapped = OnDevice(model, torch.device("cpu"))
    assert wrapped.config is model.config and wrapped.fc is None  # attributes read through
    tokens, positions = torch.tensor([3, 5, 7, 9]), torch.arange(4)
    want = model(tokens, positions, model.new_cache(8), 0)
    cache = wrapped.new_cache(8)
    logits, hidden = wrapped(tokens, positions, cache, 0, hidden=True)
    assert logits.device.type == "cpu" and torch.equal(logits, want)
    assert hidden.shape == (4, 32) and cache.length == 0  # the caller commits, as with the bare model
    assert place(model, torch.device("cpu")) is model  # on the CPU no wrapper at all


def test_verifier_refuses_a_device_it_does_not_have(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: --device cuda is valid here")  # the CI machine has none
    from verifier_service.__main__ import main

    assert main(["--device", "cuda"]) == 2
    assert "device: cuda asked for, but CUDA is not available" in capsys.readouterr().err


def test_drafter_device_settings_only_for_model_drafters() -> None:
    from drafter_service.config import DrafterServiceConfig

    with pytest.raises(ValueError, match="device, dtype: only a model drafter computes"):
        DrafterServiceConfig(drafter="ngram", device="cuda").validate()
    with pytest.raises(ValueError, match="dtype: expected one of"):
        DrafterServiceConfig(drafter="model:/x", dtype="fp8").validate()
    DrafterServiceConfig(drafter="model:/x", device="cpu", dtype="bfloat16").validate()


def test_verifier_takes_no_gpu_index() -> None:
    from verifier_service.config import VerifierConfig

    with pytest.raises(SystemExit):
        VerifierConfig.from_args(["--device", "cuda:1"])  # rank r is on cuda:r; CUDA_VISIBLE_DEVICES picks the GPUs
    assert VerifierConfig.from_args(["--device", "cpu", "--dtype", "bfloat16"]).dtype == "bfloat16"
