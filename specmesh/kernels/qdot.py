"""The integer small-M CPU kernel (`qdot_gemm.cpp`): y = x @ W.T with W as unsigned integer codes
and one fp32 (scale, bias) pair per group of a row, w = q * scale + bias, and x quantized per row
to int8 in blocks of 32 (as llama.cpp quantizes activations for GGUF blocks). Three layouts
(`bits`): 4-bit codes in groups of 32 (GGUF Q4_0, Q4_1, Q4_K); codes 0..63 in 6 bits, groups of 16
(6: Q6_K, and Q5_0/Q5_1 as pairs of groups); signed byte codes in groups of 16 (8: Q8_0). The
(scale, bias) pairs are fp32 per group (`pack`), or, for GGUF K-quants, in the file's own form
(`pack_super`): fp32 (d, dm) per super-block, int8 multipliers per group.
Integer dot products (AVX2 maddubs), a block of 8 output rows unpacked once for up
to 8 activation rows: an extra row costs a fraction of the first, which is what tree verification
and batching pay.

`pack(q, scale, bias, bits)` / `pack_super(...)` repack once, at load time, into the kernel's
layout (see the .cpp); `linear(x, codes, sb, sc, n, bits, s)` multiplies. Built and cached like
the other kernels (`specmesh.kernels`, `SPECMESH_KERNELS=0` turns it off); where it cannot load,
`available()` is False and `reason()` says why. Every output is a fixed sequence of operations whatever the other rows, the tiling or
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
    """The kernel's weight layout: codes [N/8, K/GS, 128] uint8 (96 for bits 6); s 0: sb
    [N/8, K/GS, 2, 8] fp32 (scale, bias); s > 0: sb [N/8, K/GS/s, 2, 8] fp32 (d, dm) and sc
    [N/8, K/GS, P, 8] int8 (sc, and mn when P is 2)."""
    codes: torch.Tensor
    sb: torch.Tensor
    sc: torch.Tensor
    n: int
    k: int
    bits: int
    s: int = 0


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


def _pack_codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """q [N, K] -> the kernel's code bytes [N/8, K/GS, 128 or 96], rows past N zero."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"integer kernel: K {k} is not a multiple of 32")
    lo, hi = CODES[bits]
    if int(q.min()) < lo or int(q.max()) > hi:
        raise ValueError(f"integer kernel: layout {bits} holds codes {lo}..{hi}")
    q = q.to(torch.int16).to(torch.int8).view(torch.uint8) if bits == 8 else q.to(torch.uint8)  # bytes
    nb, g = -(-n // LANES), k // GROUP[bits]
    q = torch.nn.functional.pad(q, (0, 0, 0, nb * LANES - n))  # [NB*8, K], zero rows: y = 0 there
    if bits == 4:  # k = 32 g + 8 c + 4 h + i -> byte (c, 4 r + i) = q[h=0] | q[h=1] << 4
        qv = q.view(nb, LANES, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)  # [NB, G, c, r, i, h]
        return (qv[..., 0] | (qv[..., 1] << 4)).reshape(nb, g, 128).contiguous()
    # k = 16 g + 4 c + i -> chunk c byte 4 r + i
    chunks = q.view(nb, LANES, g, 4, 4).permute(0, 2, 3, 1, 4).reshape(nb, g, 4, 32)
    if bits == 8:
        return chunks.reshape(nb, g, 128).contiguous()
    low, top = chunks & 0x0F, chunks >> 4  # bits 6: nibble plane (chunks 0|1, 2|3) and 2-bit plane
    planes = [low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4),
              top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)]
    return torch.cat(planes, 2).contiguous()  # [NB, G, 96]


def _by_block(a: torch.Tensor, nb: int) -> torch.Tensor:
    """[N, G] per-row values -> [NB, G, 8] (rows past N zero)."""
    a = torch.nn.functional.pad(a, (0, 0, 0, nb * LANES - a.shape[0]))
    return a.view(nb, LANES, -1).permute(0, 2, 1)


def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> Packed:
    """From w = q * scale + bias: q [N, K] integer codes in CODES[bits], scale and bias
    [N, K / GROUP[bits]] fp32."""
    n, k = q.shape
    nb = -(-n // LANES)
    sb = torch.stack([_by_block(scale.float(), nb), _by_block(bias.float(), nb)], 2).contiguous()  # [NB, G, 2, 8]
    return Packed(_pack_codes(q, bits), sb, torch.empty(0, dtype=torch.int8), n, k, bits)


def pack_super(q: torch.Tensor, d: torch.Tensor, dm: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None,
               bits: int) -> Packed:
    """From w = q * (d * sc) + dm * mn per group, a GGUF K-quant's own form: d, dm [N, K / GROUP /
    s] fp32 per super-block of s groups, sc, mn [N, K / GROUP] int8 multipliers (mn None: mn = sc,
    one plane)."""
    n, k = q.shape
    nb, g = -(-n // LANES), k // GROUP[bits]
    s = g // d.shape[1]
    if s * d.shape[1] != g or dm.shape != d.shape or sc.shape != (n, g) or (mn is not None and mn.shape != sc.shape):
        raise ValueError("integer kernel: super-block parameters do not match the codes")
    sb = torch.stack([_by_block(d.float(), nb), _by_block(dm.float(), nb)], 2).contiguous()  # [NB, G/s, 2, 8]
    mults = [sc] if mn is None else [sc, mn]
    planes = torch.stack([_by_block(m.to(torch.int8), nb) for m in mults], 2).contiguous()  # [NB, G, P, 8]
    return Packed(_pack_codes(q, bits), sb, planes, n, k, bits, s)


def unpack(p: Packed) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack` / `pack_super`: (q [N, K] int16, scale, bias [N, K / GROUP] fp32),
    scale and bias as the kernel computes them (d * sc, dm * mn in fp32)."""
    nb, g = p.codes.shape[:2]
    if p.bits == 4:  # [NB, G, c, r, i] byte = q[h=0] | q[h=1] << 4, k = 32 g + 8 c + 4 h + i
        c = p.codes.view(nb, g, 4, 8, 4)
        q = torch.stack([c & 0x0F, c >> 4], -1).permute(0, 3, 1, 2, 5, 4).reshape(nb * LANES, p.k).to(torch.int16)
    else:
        if p.bits == 8:
            chunks = p.codes.view(torch.int8).view(nb, g, 4, 32).to(torch.int16)
        else:
            low = p.codes[:, :, :64].view(nb, g, 2, 32)
            top = p.codes[:, :, 64:].view(nb, g, 1, 32)
            nib = torch.stack([low & 0x0F, low >> 4], 3).reshape(nb, g, 4, 32)
            hi = (top >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 3
            chunks = (nib | (hi << 4)).to(torch.int16)
        q = chunks.view(nb, g, 4, 8, 4).permute(0, 3, 1, 2, 4).reshape(nb * LANES, p.k)  # k = 16 g + 4 c + i
    rows = lambda a: a.permute(0, 2, 1).reshape(nb * LANES, -1)  # noqa: E731 - [NB, G, 8] -> [NB*8, G]
    if p.s == 0:
        scale, bias = rows(p.sb[:, :, 0]), rows(p.sb[:, :, 1])
    else:
        d, dm = (rows(p.sb[:, :, j]).repeat_interleave(p.s, 1) for j in (0, 1))
        sc = rows(p.sc[:, :, 0]).float()
        mn = rows(p.sc[:, :, 1]).float() if p.sc.shape[2] == 2 else sc
        scale, bias = d * sc, dm * mn
    return q[:p.n], scale[:p.n], bias[:p.n]


def linear(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, sc: torch.Tensor, n: int, bits: int,
           s: int) -> torch.Tensor:
    """y [M, N] = x [M, K] fp32 @ W.T, W as `pack` / `pack_super` left it (a `Packed`'s fields);
    call only when `available()`."""
    if _State.op is None:
        load()
    return _State.op(x, codes, sb, sc, n, bits, s)
