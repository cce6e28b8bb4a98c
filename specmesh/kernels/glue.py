"""The small steps between a decoder layer's products as one op each (`glue.cpp`): RMSNorm, the
residual add with the next RMSNorm, rotary embedding of q and k (with the move to head-major
layout), and SiLU(gate) * up. torch spends 5 to 12 small ops on each; a decode step of a 0.5B
drafter issued about 40 a layer, a third of its time.

Every output row is one fixed sequence of fp32 operations on its own input row, whatever the other
rows or the thread count, so rows stay batch-invariant (what tree verification relies on). The
numbers are not torch's to the last bit (another reduction order, another exp), so a process uses
one path for all its forwards: this one wherever `runs` holds, else the caller's torch code.

Built and cached like the other kernels (`specmesh.kernels`; `SPECMESH_KERNELS=0` turns it off);
where it cannot load, `available()` is False and the model keeps its torch code.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specmesh import kernels as _k

_SOURCE = Path(__file__).with_name("glue.cpp")
_HEADERS = [Path(__file__).with_name("pool.h"), Path(__file__).with_name("simd.h")]

_OP = _k.CompiledOp("glue", _SOURCE, _HEADERS, "glue kernels", "specmesh_glue", "rms_norm")


def library_path() -> Path:
    return _OP.library_path()


def available() -> bool:
    return _OP.load()


def reason() -> str:
    return _OP.reason


def runs(x: torch.Tensor, *others: torch.Tensor) -> bool:
    """Whether these ops take rows like `x` ([T, width] fp32 on the CPU, width a multiple of 8) with
    `others` (the op's other inputs and weights): not where autograd needs a gradient through them
    (the ops have no backward; training keeps torch's code, as `kernels.linear` does)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *others)):
        return False
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.shape[1] % 8 == 0 and available()


def _ops():
    return torch.ops.specmesh_glue


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops().rms_norm(_rows(x), weight, eps, _k.pool_threads())


def add_rms_norm(h: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + a, rms_norm(h + a))."""
    return _ops().add_rms_norm(_rows(h), _rows(a), weight, eps, _k.pool_threads())


def rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq * D], k and v [T, Hk * D] (views of one product's output do) -> q and k rotated,
    and v, as [H, T, D] each, contiguous."""
    return _ops().rope(_rows(q), _rows(k), _rows(v), cos, sin, head_dim, _k.pool_threads())


def rope_into(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              head_dim: int, kc: torch.Tensor, vc: torch.Tensor, start: int) -> torch.Tensor:
    """`rope`, with rotated k and v stored at slots [start, start + T) of one cache layer (kc, vc
    [Hk, capacity, D], `KVCache.layer`) rather than returned: q rotated, [H, T, D]."""
    return _ops().rope_into(_rows(q), _rows(k), _rows(v), cos, sin, head_dim, kc, vc, start, _k.pool_threads())


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _ops().silu_mul(_rows(gate), _rows(up), _k.pool_threads())


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
