"""The 4-bit small-M CPU kernel (`q4_gemm.cpp`): y = x @ W.T with x fp32 and W as 4-bit codes with
one fp32 (scale, bias) pair per 32 inputs of a row, w = q * scale + bias, q in 0..15.

`pack(codes)` repacks a `specmesh.quant.Int4Codes` once, at load time, into the kernel's layout
(blocks of 8 output rows, one vector lane per row; see the .cpp); `q4_linear(x, packed)` multiplies.
Built and cached like the fp32 kernel (`specmesh.kernels`: same compiler flags, same cache
directory, `SPECMESH_KERNELS=0` turns it off); where it cannot load, `available()` is False,
`reason()` says why and one line on stderr said so: callers fall back to torch's int4 kernel.

Every output row is a fixed sequence of fp32 operations whatever the other rows, the tiling or the
thread count (batch invariance), and equals x @ dequantized-weights up to fp32 summation order.
This module knows 4-bit codes and tensors; it knows nothing about models or GGUF.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh import kernels as _k

_SOURCE = Path(__file__).with_name("q4_gemm.cpp")
_HEADERS = [Path(__file__).with_name("pool.h")]
LANES = 8  # output rows per block
GROUP = 32


@dataclass
class PackedInt4:
    """The kernel's weight layout: codes [N/8, K/32, 16, 8] uint8, sb [N/8, K/32, 2, 8] fp32."""
    codes: torch.Tensor
    sb: torch.Tensor
    n: int
    k: int


_OP = _k.CompiledOp("q4_gemm", _SOURCE, _HEADERS, "4-bit CPU kernel", "specmesh_q4", "q4_linear")


def library_path() -> Path:
    return _OP.library_path()


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot
    (said once on stderr unless SPECMESH_KERNELS=0 asked for it)."""
    first = not _OP.tried
    if not _OP.load() and first and (os.environ.get("SPECMESH_KERNELS") or "auto") != "0":
        print(f"specmesh: 4-bit kernel unavailable, using torch's int4pack (bf16 activations): {_OP.reason}",
              file=sys.stderr)
    return _OP.op is not None


def available() -> bool:
    return load()


def reason() -> str:
    return _OP.reason


def pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> PackedInt4:
    """From w = (q - 8) * scale + zero (q [N, K] uint8 0..15, scale/zero [N, K/32] fp32)."""
    n, k = q.shape
    if k % GROUP:
        raise ValueError(f"4-bit kernel: K {k} is not a multiple of {GROUP}")
    nb, g = -(-n // LANES), k // GROUP
    pad = nb * LANES - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))  # [NB*8, K], zero rows: y = 0 there
    scale = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
    bias = torch.nn.functional.pad((zero.float() - 8 * scale[:n]), (0, 0, 0, pad))
    # k = 32 g + 16 h + u; byte (block, g, u, lane) = q[.., h=0] | q[.., h=1] << 4
    qv = q.view(nb, LANES, g, 2, 16).permute(0, 2, 4, 1, 3)  # [NB, G, 16, 8, 2]
    codes = (qv[..., 0] | (qv[..., 1] << 4)).contiguous()  # [NB, G, 16, 8]
    sb = torch.stack([scale.view(nb, LANES, g).permute(0, 2, 1), bias.view(nb, LANES, g).permute(0, 2, 1)],
                     2).contiguous()  # [NB, G, 2, 8]
    return PackedInt4(codes, sb, n, k)


def q4_linear(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, n: int) -> torch.Tensor:
    """y [M, N] = x [M, K] fp32 @ W.T, W as `pack` left it; call only when `available()`."""
    return _OP.op(x, codes, sb, n, _k.pool_threads())
