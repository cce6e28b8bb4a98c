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


_OP = _k.CompiledOp("row_attention", _SOURCE, _HEADERS, "row attention kernel", "specmesh_attention", "row_attention")


def library_path() -> Path:
    return _OP.library_path()


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot."""
    return _OP.load()


def available() -> bool:
    return _OP.load()


def reason() -> str:
    return _OP.reason


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
    return _OP.op(q, keys, values, offsets, slots, 1.0 / math.sqrt(q.shape[-1]), _k.pool_threads())
