"""The integer small-M CPU kernel (`qdot_gemm.cpp`): y = x @ W.T with W as unsigned integer codes
and one fp32 (scale, bias) pair per group of a row, w = q * scale + bias, and x quantized per row
to int8 in blocks of 32 (as llama.cpp quantizes activations for GGUF blocks). Three layouts
(`bits`): 4-bit codes in groups of 32 (GGUF Q4_0, Q4_1, Q4_K); codes 0..63, a byte each, in groups
of 16 (6: Q6_K, and Q5_0/Q5_1 as pairs of groups); signed byte codes in groups of 16 (8: Q8_0).
Integer dot products (AVX2 maddubs), a block of 8 output rows unpacked once for up
to 4 activation rows: an extra row costs a fraction of the first, which is what tree verification
and batching pay.

`pack(q, scale, bias, bits)` repacks once, at load time, into the kernel's layout (see the .cpp);
`linear(x, packed)` multiplies. Built and cached like the other kernels (`specmesh.kernels`,
`SPECMESH_KERNELS=0` turns it off); where it cannot load, `available()` is False and `reason()`
says why. Every output is a fixed sequence of operations whatever the other rows, the tiling or
the thread count (batch invariance). This module knows codes and tensors, nothing of models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh import kernels as _k

_SOURCE = Path(__file__).with_name("qdot_gemm.cpp")
_HEADERS = [Path(__file__).with_name("pool.h")]
LANES = 8  # output rows per block
GROUP = {4: 32, 6: 16, 8: 16}  # layout -> inputs per (scale, bias) group
CODES = {4: (0, 15), 6: (0, 63), 8: (-128, 127)}  # layout -> code range


class _State:
    """Process-wide, like `specmesh.kernels._State`."""
    op = None
    tried = False
    reason = ""


@dataclass
class Packed:
    """The kernel's weight layout: codes [N/8, K/GS, 4, 32] uint8, sb [N/8, K/GS, 2, 8] fp32."""
    codes: torch.Tensor
    sb: torch.Tensor
    n: int
    k: int
    bits: int


def library_path() -> Path:
    return _k.keyed_library("qdot_gemm", _SOURCE, _HEADERS)


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    if why := _k.unsupported():
        _State.reason = why
        return False
    try:
        torch.ops.load_library(str(_k.build_library(library_path(), _SOURCE, "integer CPU kernel")))
        _State.op = torch.ops.specmesh_qdot.qdot_linear
    except (OSError, RuntimeError) as e:
        _State.reason = str(e)
    return _State.op is not None


def available() -> bool:
    return load()


def reason() -> str:
    return _State.reason


def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> Packed:
    """From w = q * scale + bias: q [N, K] integer codes in CODES[bits], scale and bias
    [N, K / GROUP[bits]] fp32."""
    n, k = q.shape
    gs = GROUP[bits]
    if k % 32:
        raise ValueError(f"integer kernel: K {k} is not a multiple of 32")
    lo, hi = CODES[bits]
    if int(q.min()) < lo or int(q.max()) > hi:
        raise ValueError(f"integer kernel: layout {bits} holds codes {lo}..{hi}")
    q = q.to(torch.int16).to(torch.int8).view(torch.uint8) if bits == 8 else q.to(torch.uint8)  # bytes
    nb, g = -(-n // LANES), k // gs
    pad = nb * LANES - n
    q = torch.nn.functional.pad(q.to(torch.uint8), (0, 0, 0, pad))  # [NB*8, K], zero rows: y = 0 there
    scale = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
    bias = torch.nn.functional.pad(bias.float(), (0, 0, 0, pad))
    if bits == 4:  # k = 32 g + 8 c + 4 h + i -> byte (c, 4 r + i) = q[h=0] | q[h=1] << 4
        qv = q.view(nb, LANES, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [NB, G, c, r, i, h]
        codes = (qv[..., 0] | (qv[..., 1] << 4)).reshape(nb, g, 4, 32).contiguous()
    else:  # k = 16 g + 4 c + i -> byte (c, 4 r + i)
        codes = q.view(nb, LANES, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(nb, g, 4, 32).contiguous()
    sb = torch.stack([scale.view(nb, LANES, g).permute(0, 2, 1), bias.view(nb, LANES, g).permute(0, 2, 1)],
                     2).contiguous()  # [NB, G, 2, 8]
    return Packed(codes, sb, n, k, bits)


def linear(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """y [M, N] = x [M, K] fp32 @ W.T, W as `pack` left it; call only when `available()`."""
    if _State.op is None:
        load()
    return _State.op(x, codes, sb, n, bits)
