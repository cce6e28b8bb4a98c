"""Where a model computes: `--device auto|cpu|cuda[:i]` and `--dtype`, and a wrapper that lets the
CPU-side code (engine, drafters, verifier) drive a model on a GPU unchanged.

The engine, the drafters and the verifier build their small index tensors (tokens, positions, tree
masks) on the CPU and read logits there (sampling, acceptance, the wire). `OnDevice` moves each
forward's inputs to the model's device and its outputs back, and keeps the KV caches on the device
(`new_cache`). Only [rows, vocab] logits (and, for feature drafters, [T, hidden] states) cross
PCIe per forward; the weights and caches stay put.

dtype: `auto` by default at every entry point (`specmesh.service.DEFAULT_DTYPE`: `specmesh up`,
`specmesh generate`, the verifier and drafter services), as vLLM's `--dtype auto` takes the
checkpoint's own dtype: a GGUF is served in the format it ships in (on a CPU,
`loader.auto_format`), an HF or safetensors checkpoint in float32, and a GPU or tensor-parallel
verifier in float32. Losslessness is defined against the target as served: greedy output through
speculation is token for token the same runtime's plain decoding in the same format (README,
"Weight formats"). float32 is the reference numerics (transformers' own forward): a greedy token
is an argmax, and in bfloat16 the few-ulp differences between a one-token decode and a tree
verification (other kernels, other reduction orders) flip near-ties, so speculative and plain
decoding can part ways. `--dtype bfloat16` halves memory traffic and is the usual choice on GPUs
(vLLM's `auto` takes the checkpoint's dtype); with it the output is the target's up to those
numerics, as in every GPU serving engine, unless the verifier runs static shapes with one row
bucket (`--static-shapes on`, `specmesh.static_steps`): then a tree's rows and one-token decoding
run the same kernels at the same shapes, and speculation's output is that runtime's plain
decoding in bf16 too. `--dtype int8|int4`: weight-only quantized Linear
layers (`specmesh.quant`, CPU); a GGUF loads straight into them. `--dtype gguf`: a GGUF's tensors as
shipped, on integer kernels (CPU). `--dtype auto`: on a CPU, the fastest format measured here that
keeps the checkpoint's own weights (`loader.auto_format`: gguf, int4 or float32 for a GGUF, else
float32); float32 on a GPU and under tensor parallelism.
"""

from __future__ import annotations

import torch

# A float dtype puts the whole model in it; a weight format (`specmesh.quant`) only its Linear
# weights, the rest staying fp32. int8 / int4 run on CPU kernels only.
DTYPES: dict[str, torch.dtype | str] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16, "int8": "int8", "int4": "int4",
                                        "gguf": "gguf", "auto": "auto"}


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda:0 when CUDA is available, else cpu; 'cpu', 'cuda', 'cuda:i' as given.
    ValueError naming the setting if CUDA is asked for and absent."""
    if name == "auto":
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:INDEX, got {name!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:INDEX, got {name!r}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name} asked for, but CUDA is not available here (use cpu or auto)")
        dev = torch.device("cuda", dev.index or 0)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {name}, but this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def parse_dtype(name: str) -> torch.dtype | str:
    """A torch float dtype, or a weight format name ("int8", "int4") for `loader.load_model`."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {name!r}") from None


class OnDevice:
    """A `Transformer` on `device` behind the CPU-side model interface (`forward` / `__call__`,
    `new_cache`, `config`; other attributes read through). Inputs may be CPU tensors; logits and
    hidden states come back on the CPU."""

    def __init__(self, model, device: torch.device) -> None:
        self.model = model.to(device)
        self.device = device

    def new_cache(self, capacity: int = 256):
        return self.model.new_cache(capacity)  # sized and placed like the weights: on the device

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, start: int,
                mask: torch.Tensor | None = None, logits_rows: torch.Tensor | slice | None = slice(None),
                features: torch.Tensor | None = None, hidden: bool = False, exact: bool = True):
        dev = self.device
        out = self.model(tokens.to(dev), positions.to(dev), cache, start, None if mask is None else mask.to(dev),
                         logits_rows, None if features is None else features.to(dev), hidden=hidden, exact=exact)
        if hidden:
            return to_cpu(out[0]), to_cpu(out[1])
        return to_cpu(out)

    __call__ = forward

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # config, fc, vocab_map, ...


def to_cpu(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.cpu()


def place(model, device: torch.device):
    """`model` itself on the CPU (no wrapper, no copies), else wrapped in `OnDevice`."""
    fmt = getattr(model, "weight_format", None)
    if device.type != "cpu" and fmt is not None and fmt.fmt in ("int8", "int4", "gguf"):
        raise ValueError(f"dtype: {fmt.fmt} weights run on CPU kernels only; use float32 or bfloat16 on {device}")
    return model if device.type == "cpu" else OnDevice(model, device)
