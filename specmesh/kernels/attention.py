"""Exact per-row attention on the CPU (`row_attention.cpp`): each query row attends over exactly the
key slots it sees, read in place from the KV cache, in one fixed order of fp32 operations.

Why: a tree's rows must equal one-token decoding bit for bit (`specmesh.model._attention_by_row`).
With torch's SDPA that took a gathered, contiguous copy of every row's keys and values per layer,
and one SDPA call per row: on a 1.5B model at a few hundred tokens of context, a third of what an
extra verified row cost. Here the row's slots are a list (offsets and slots, CSR), the query heads
of one K/V head share each load, and work items (K/V head, row) run on the kernel pool.

Built and cached like the other kernels (`specmesh.kernels`: same flags and cache directory,
`SPECMESH_KERNELS=0` turns it off); where it cannot load, `available()` is False and the model
keeps the SDPA path. fp32 only, head dim a multiple of 32.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from specmesh import kernels as _k

_SOURCE = Path(__file__).with_name("row_attention.cpp")
_HEADERS = [Path(__file__).with_name("pool.h")]


class _State:
    """Process-wide, like `specmesh.kernels._State`."""
    op = None
    tried = False
    reason = ""


def library_path() -> Path:
    return _k.keyed_library("row_attention", _SOURCE, _HEADERS)


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    if why := _k.unsupported():
        _State.reason = why
        return False
    try:
        torch.ops.load_library(str(_k.build_library(library_path(), _SOURCE, "row attention kernel")))
        _State.op = torch.ops.specmesh_attention.row_attention
    except (OSError, RuntimeError) as e:
        _State.reason = str(e)
    return _State.op is not None


def available() -> bool:
    return load()


def reason() -> str:
    return _State.reason


def runs(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `row_attention` takes these tensors (else the caller's own path)."""
    return (q.dtype == keys.dtype == torch.float32 and q.device.type == "cpu" and q.shape[-1] % 32 == 0
            and keys.stride(-1) == 1 and keys.stride(-2) == keys.shape[-1] and available())


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                  slots: torch.Tensor) -> torch.Tensor:
    """q [H, T, D], keys/values [H_kv, S, D] (slots D apart, e.g. a `KVCache.view`), offsets [T + 1]
    and slots int64: row t sees slots[offsets[t]:offsets[t + 1]], in that order. -> [H, T, D]."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    return _State.op(q, keys, values, offsets, slots, 1.0 / math.sqrt(q.shape[-1]), _k.pool_threads())
