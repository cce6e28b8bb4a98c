"""Weight formats for the runtime's Linear layers: fp32, bf16, int8, 4-bit and GGUF blocks as shipped.

A format is how a Linear's weight is stored and which kernel multiplies by it; the rest of the
model (norms, attention, residual stream, KV cache) stays fp32 in every format.

- `fp32`: `specmesh.model.Linear` as it is (the reference).
- `bf16`: weight in bfloat16, `F.linear` on bf16 activations.
- `int8`: int8 codes with one scale per output channel, `torch._weight_int8pack_mm`.
- `int4`: 4-bit codes, one (scale, zero) pair per 32 inputs of a row: w = (q - 8) * scale + zero.
  Two kernels, chosen once per process (`int4_kernel()`):
  - specmesh's own (`specmesh.kernels.q4`, AVX2/FMA, built on first use): fp32 activations, fp32
    scales and zeros, fp32 sums; equals x @ `Int4Codes.dequantize()`.T up to fp32 summation order
    (it adds scale * sum(q x) + (zero - 8 scale) * sum(x) per group) and is batch-invariant;
  - else torch's `_weight_int4pack_mm_for_cpu`: activations, scales and zeros rounded to bf16.

torch's int kernels, and bf16 `F.linear`, take bf16 activations: with fp32 activations torch 2.13's
CPU int kernels fall back to scalar code that runs 10-25x slower than fp32 `F.linear`
(loadtest/bench_formats.py). So on those paths a `QuantLinear` rounds its input to bf16, and its
output back to fp32; scales and zeros are held in bf16 too (the kernels want them in the
activations' dtype).

GGUF blocks that are 4-bit with 32-element groups (Q4_0, Q4_1, Q4_K) map onto `int4` exactly (on
torch's path up to the bf16 rounding of scale and zero; `gguf_int4_codes`): the file's codes are kept, not
requantized. Everything else (Q6_K, Q8_0, Q5_*, F16, ...) has no exact 4-bit or per-channel
int8 form: `int4` keeps those tensors fp32 (the loader's choice), `int8` requantizes them
(`from_float`), and `WeightFormat` records which, for the model card.

- `gguf`: a GGUF tensor's own blocks, every type (Q4_K, Q6_K, Q8_0, Q4_1, ...), byte for byte as in
  the file, multiplied by ggml's CPU kernels, llama.cpp's (`specmesh.kernels.ggml`, through the
  libggml that llama-cpp-python ships): activations quantized per block as llama.cpp does (Q8_K,
  Q8_0, Q8_1), one ggml dot product per output, so batch-invariant. The served numerics are then
  llama.cpp's for that file; tensors ggml has no kernel for (F32) stay fp32.

This module knows tensors and GGUF block layouts; it knows nothing about files, names or models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from specmesh import kernels
from specmesh.kernels import ggml, qdot

FORMATS = ("fp32", "bf16", "int8", "int4", "gguf")
GROUP = 32  # int4 group size: a GGUF 4-bit block is 32 weights
COMPUTE_DTYPE = torch.bfloat16  # the int kernels' fast activation dtype on CPU


@dataclass
class Int4Codes:
    """w[n, k] = (q[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""
    q: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    zero: torch.Tensor  # [N, K / 32] float32

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.q.view(n, k // GROUP, GROUP).float() - 8
        return (g * self.scale[..., None] + self.zero[..., None]).view(n, k)  # [N, K]


def quantize_int4(w: torch.Tensor) -> Int4Codes:
    """Asymmetric round-to-nearest 4-bit with 32-element groups (a requantization)."""
    n, k = w.shape
    g = w.float().view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K/32]
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8).view(n, k)
    return Int4Codes(q, scale, lo + 8 * scale)


def int4_linear(w: torch.Tensor, bias: torch.Tensor | None) -> "QuantLinear":
    """fp32 weights [N, K] as 4-bit codes on the integer kernel (`quantize_int4`), scales and
    offsets rounded to fp16 (the kernel holds them as fp16 pairs: 5 bits a weight). A
    requantization: for drafters."""
    q, scale, offset = _int4_fp16(w)
    return QuantLinear.from_codes(q, scale, offset, 4, bias)


def int4_weights(w: torch.Tensor) -> torch.Tensor:
    """The weights [N, K] that `int4_linear(w)` holds, as fp32."""
    q, scale, offset = _int4_fp16(w)
    n, k = q.shape
    return (q.view(n, k // GROUP, GROUP).float() * scale[..., None] + offset[..., None]).view(n, k)


def _int4_fp16(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c = quantize_int4(w)
    return c.q, c.scale.half().float(), (c.zero - 8 * c.scale).half().float()  # offset: the group's minimum


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ([N, K] int8, [N] float32 scales)."""
    scale = (w.float().abs().amax(1) / 127).clamp_min(1e-12)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def quantize_q8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest 8-bit codes per group of inputs, the integer kernel's 8-bit layout
    (`specmesh.kernels.qdot`, as Q8_0 loads): ([N, K] int16 codes in [-127, 127], [N, K / group]
    scales, each an fp16 value). A requantization: for drafters."""
    group = qdot.GROUP[8]
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale = (g.abs().amax(-1) / 127).half().float()  # fp16 values: the kernel holds them as fp16
    q = torch.where(scale[..., None] > 0, g / scale[..., None].clamp_min(1e-30), torch.zeros(()))
    return q.round().clamp(-127, 127).to(torch.int16).view(n, k), scale


def _nibbles(qs: np.ndarray, half: int) -> np.ndarray:
    """GGUF 4-bit packing: per `2 * half` weights, `half` bytes, low nibbles first, then high."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, half) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(0x0F)).reshape(nb, -1)


def gguf_int4_codes(raw: np.ndarray, qtype_name: str, n: int, k: int) -> Int4Codes | None:
    """The codes and group parameters of a GGUF Q4_0 / Q4_1 / Q4_K tensor ([N, row bytes] uint8),
    exactly as stored; None for any other type."""
    if qtype_name not in _BLOCK:
        return None
    blocks = np.ascontiguousarray(raw).reshape(-1, _BLOCK[qtype_name][1])  # [N * K / block, bytes]
    f16 = lambda b: b.copy().view(np.float16).astype(np.float32)  # noqa: E731 - [blocks, 1]
    if qtype_name == "Q4_0":  # w = d * (q - 8)
        d, qs = blocks[:, :2], blocks[:, 2:]
        q, scale = _nibbles(qs, 16), f16(d)
        zero = np.zeros_like(scale)
    elif qtype_name == "Q4_1":  # w = d * q + m = (q - 8) * d + (m + 8 d)
        d, m, qs = f16(blocks[:, :2]), f16(blocks[:, 2:4]), blocks[:, 4:]
        q, scale, zero = _nibbles(qs, 16), d, m + 8 * d
    else:  # Q4_K, 256 weights in 8 groups: w = d * sc * q - dmin * mn
        from gguf.quants import Q4_K

        d, dmin = f16(blocks[:, :2]), f16(blocks[:, 2:4])
        sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])  # [blocks, 8] each, 6-bit
        q = _nibbles(blocks[:, 16:], 32)
        scale = d * sc.astype(np.float32)
        zero = 8 * scale - dmin * mn.astype(np.float32)
    groups = k // GROUP
    return Int4Codes(torch.from_numpy(q.reshape(n, k).copy()),
                     torch.from_numpy(scale.reshape(n, groups).copy()),
                     torch.from_numpy(zero.reshape(n, groups).copy()))


_BLOCK = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}  # weights, bytes per block


@dataclass
class Int6Codes:
    """A GGUF Q6_K tensor as stored: w[n, k] = (q[n, k] - 32) * scale[n, k // 16], q in 0..63."""
    q: torch.Tensor  # [N, K] uint8
    scale: torch.Tensor  # [N, K / 16] float32 (d * the block's int8 sub-scale)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        return ((self.q.view(n, k // 16, 16).float() - 32) * self.scale[..., None]).view(n, k)


def gguf_q6k_codes(raw: np.ndarray, n: int, k: int) -> Int6Codes:
    """The 6-bit codes and sub-block scales of a GGUF Q6_K tensor ([N, row bytes] uint8). A block
    of 256: ql[128] (low 4 bits), qh[64] (high 2 bits), 16 int8 scales, fp16 d; per half of 128,
    code l + 32 j takes a nibble of ql[l + 32 (j % 2)] (low for j < 2) and bits 2 j of qh[l]."""
    b = np.ascontiguousarray(raw).reshape(-1, 210)
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)  # [blocks, 16]
    d = b[:, 208:210].copy().view(np.float16).astype(np.float32)  # [blocks, 1]
    return Int6Codes(_q6k_q(b, n, k), torch.from_numpy((d * sc).reshape(n, k // 16).copy()))


def _q6k_q(b: np.ndarray, n: int, k: int) -> torch.Tensor:
    """Q6_K blocks [blocks, 210] -> codes [N, K] uint8 in 0..63."""
    ql, qh = b[:, :128].reshape(-1, 2, 64), b[:, 128:192].reshape(-1, 2, 32)
    lo = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], 2)
    hi = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 2)  # [blocks, half, j, 32]
    return torch.from_numpy((lo | (hi << 4)).astype(np.uint8).reshape(n, k).copy())


@dataclass
class SuperCodes:
    """A GGUF K-quant tensor in its own form: w[n, k] = q * (d * sc) + dm * mn per group of GS
    inputs, d and dm fp32 per super-block (256 inputs), sc and mn small integers per group (mn None:
    mn = sc). `bits`: the `specmesh.kernels.qdot` code layout."""
    q: torch.Tensor  # [N, K] int16
    d: torch.Tensor  # [N, K / 256] fp32
    dm: torch.Tensor  # [N, K / 256] fp32
    sc: torch.Tensor  # [N, K / GS] int8
    mn: torch.Tensor | None  # [N, K / GS] int8
    bits: int

    def rows(self, order: torch.Tensor) -> "SuperCodes":
        return SuperCodes(self.q[order], self.d[order], self.dm[order], self.sc[order],
                          None if self.mn is None else self.mn[order], self.bits)


SUPER_TYPES = ("Q4_K", "Q6_K")  # held in the file's own (d, dm, sc, mn) form


def gguf_super_codes(raw: np.ndarray, qtype_name: str, n: int, k: int) -> SuperCodes:
    """The codes, super-block scales and group multipliers of a GGUF Q4_K (w = d sc q - dmin mn) or
    Q6_K (w = d sc (q - 32)) tensor ([N, row bytes] uint8), as stored."""
    f16 = lambda a: torch.from_numpy(a.copy().view(np.float16).astype(np.float32).reshape(n, k // 256))  # noqa: E731
    if qtype_name == "Q4_K":
        from gguf.quants import Q4_K

        b = np.ascontiguousarray(raw).reshape(-1, 144)
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])  # [blocks, 8] each, 0..63
        q = torch.from_numpy(_nibbles(b[:, 16:], 32).reshape(n, k).astype(np.int16))
        i8 = lambda a: torch.from_numpy(a.astype(np.int8).reshape(n, k // 32))  # noqa: E731
        return SuperCodes(q, f16(b[:, :2]), -f16(b[:, 2:4]), i8(sc), i8(mn), 4)
    if qtype_name != "Q6_K":
        raise ValueError(f"gguf_super_codes: {qtype_name} is not a K-quant held in its own form")
    b = np.ascontiguousarray(raw).reshape(-1, 210)
    d = f16(b[:, 208:210])
    sc = torch.from_numpy(b[:, 192:208].copy().view(np.int8).reshape(n, k // 16))
    return SuperCodes(_q6k_q(b, n, k).to(torch.int16), d, -32 * d, sc, None, 6)


BYTE_TYPES = {"Q5_0": 6, "Q5_1": 6, "Q8_0": 8}  # -> specmesh.kernels.qdot layout (Q6_K: SUPER_TYPES)


def gguf_byte_codes(raw: np.ndarray, qtype_name: str, n: int, k: int):
    """(q [N, K] int16, scale, offset [N, K / 16] fp32, layout) with w = q * scale + offset for a
    GGUF Q5_0, Q5_1 or Q8_0 tensor ([N, row bytes] uint8), the file's codes; the 32-blocks'
    parameters repeated over both 16-halves."""
    size = {"Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype_name]
    b = np.ascontiguousarray(raw).reshape(-1, size)
    f16 = lambda lo: b[:, lo:lo + 2].copy().view(np.float16).astype(np.float32)  # noqa: E731 - [blocks, 1]
    d = f16(0)
    if qtype_name == "Q8_0":  # w = d * q, q int8
        q = b[:, 2:].copy().view(np.int8).astype(np.int16)
        offset = np.zeros_like(d)
    else:  # Q5_0: w = d * (q - 16); Q5_1: w = d * q + m; q = nibble | bit of qh << 4
        lo = 4 if qtype_name == "Q5_1" else 2
        qh = b[:, lo:lo + 4].copy().view(np.uint32)  # [blocks, 1]
        bits = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)  # [blocks, 32]
        qs = b[:, lo + 4:].astype(np.int16)
        q = np.concatenate([qs & 0x0F, qs >> 4], 1) | (bits << 4)
        offset = f16(2) if qtype_name == "Q5_1" else -16 * d
    rep = lambda a: torch.from_numpy(np.repeat(a, 2, 1).reshape(n, k // 16).copy())  # noqa: E731
    return torch.from_numpy(q.reshape(n, k).copy()), rep(d), rep(offset), BYTE_TYPES[qtype_name]


def int4_kernel() -> str:
    """Which kernel `int4` layers built in this process use: 'specmesh-q4' or 'torch-int4pack'."""
    from specmesh.kernels import q4

    return "specmesh-q4" if q4.available() else "torch-int4pack"


POOL_KERNELS = ("specmesh-qdot", "specmesh-q4", "ggml")  # kernels that run on specmesh's own thread pool


def products_on_pool(model: nn.Module) -> bool:
    """True when every matrix product of `model` (its Linear layers) runs on a `POOL_KERNELS`
    kernel, none on torch's GEMM: what `specmesh.runtime.fit_threads` asks."""
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    return bool(layers) and all(isinstance(m, QuantLinear) and m.kernel in POOL_KERNELS for m in layers)


class QuantLinear(nn.Module):
    """A Linear in a non-fp32 format (`FORMATS`): fp32 in, fp32 out, `in_features`/`out_features`
    like nn.Linear. Build with `from_float` or `from_int4`. Each output row depends only on its own
    input row in every format here (bench_formats.py checks it), so a tree's rows equal the same
    rows decoded one at a time."""

    def __init__(self, fmt: str, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        if fmt not in FORMATS[1:]:
            raise ValueError(f"format: expected one of {', '.join(FORMATS[1:])}, got {fmt!r}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.kernel = ""  # int4 only: `int4_kernel()` when the layer was built
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @staticmethod
    def from_float(w: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> "QuantLinear":
        """From a float weight [N, K]; int8/int4 requantize it (round to nearest)."""
        n, k = w.shape
        m = QuantLinear(fmt, k, n, bias)
        if fmt == "bf16":
            m.register_buffer("weight", w.detach().to(COMPUTE_DTYPE).contiguous())
        elif fmt == "int8":
            q, s = quantize_int8(w.detach())
            m.register_buffer("qweight", q)
            m.register_buffer("scales", s.to(COMPUTE_DTYPE))
        else:
            m._set_int4(quantize_int4(w.detach()))
        return m

    @staticmethod
    def from_gguf(raw: np.ndarray, qtype, k: int, bias: torch.Tensor | None,
                  rows: torch.Tensor | None = None) -> "QuantLinear | None":
        """From a GGUF tensor's blocks ([N, row bytes] uint8) of type `qtype` (gguf's
        GGMLQuantizationType), output rows reordered by `rows` if given; None when no kernel here
        takes that type (the caller keeps it fp32). Q4_0/Q4_1/Q4_K, Q5_0/Q5_1, Q6_K and Q8_0 go to
        specmesh's integer kernel (`specmesh.kernels.qdot`) with the file's codes and scales; other block
        types to ggml's own dot products (`specmesh.kernels.ggml`, when llama-cpp-python is here)."""
        m = QuantLinear._from_gguf(np.ascontiguousarray(raw, dtype=np.uint8), qtype, k, bias, rows)
        if m is not None:
            m.source = qtype.name  # the GGUF type, for the model card
        return m

    @staticmethod
    def _from_gguf(raw: np.ndarray, qtype, k: int, bias: torch.Tensor | None,
                   rows: torch.Tensor | None) -> "QuantLinear | None":
        n = raw.shape[0]
        name = qtype.name
        if name in _BLOCK or name in BYTE_TYPES or name in SUPER_TYPES:
            if not qdot.available() or k % 32:
                return None
            if name in SUPER_TYPES:
                c = gguf_super_codes(raw, name, n, k)
                return QuantLinear.from_super(c if rows is None else c.rows(rows), bias)
            if name in BYTE_TYPES:
                q, scale, bias_, bits = gguf_byte_codes(raw, name, n, k)
            else:
                c4 = gguf_int4_codes(raw, name, n, k)
                q, scale, bias_ = c4.q, c4.scale, c4.zero - 8 * c4.scale
                bits = 4
            if rows is not None:
                q, scale, bias_ = q[rows], scale[rows], bias_[rows]
            return QuantLinear.from_codes(q, scale, bias_, bits, bias)
        if name in ("F32", "F64") or not ggml.supports(int(qtype), k):
            return None
        if rows is not None:
            raw = raw[rows.numpy()]
        m = QuantLinear("gguf", k, n, bias)
        m.qtype, m.kernel = int(qtype), "ggml"
        m.register_buffer("blocks", torch.from_numpy(raw.copy()))  # [N, row bytes]: the file's bytes
        return m

    @staticmethod
    def from_codes(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                   bias: torch.Tensor | None) -> "QuantLinear":
        """A `gguf` layer on specmesh's integer kernel: w = q * scale + offset per group
        (`specmesh.kernels.qdot.pack`), plus the output `bias`."""
        return QuantLinear._on_qdot(qdot.pack(q, scale, offset, bits), bias)

    @staticmethod
    def from_super(c: SuperCodes, bias: torch.Tensor | None) -> "QuantLinear":
        """A `gguf` layer on specmesh's integer kernel holding a K-quant in its own form
        (`specmesh.kernels.qdot.pack_super`): about the file's bits per weight."""
        return QuantLinear._on_qdot(qdot.pack_super(c.q, c.d, c.dm, c.sc, c.mn, c.bits), bias)

    @staticmethod
    def _on_qdot(p, bias: torch.Tensor | None) -> "QuantLinear":
        m = QuantLinear("gguf", p.k, p.n, bias)
        m.kernel, m.bits, m.supergroups = "specmesh-qdot", p.bits, p.s
        m.register_buffer("qd_codes", p.codes)  # `specmesh.kernels.qdot.Packed`'s fields
        m.register_buffer("qd_sb", p.sb)
        m.register_buffer("qd_sc", p.sc)
        return m

    def _packed(self):
        return qdot.Packed(self.qd_codes, self.qd_sb, self.qd_sc, self.out_features, self.in_features, self.bits,
                           self.supergroups)

    @staticmethod
    def from_int4(codes: Int4Codes, bias: torch.Tensor | None) -> "QuantLinear":
        n, k = codes.q.shape
        m = QuantLinear("int4", k, n, bias)
        m._set_int4(codes)
        return m

    def _set_int4(self, c: Int4Codes) -> None:
        if self.in_features % GROUP:
            raise ValueError(f"int4: in_features {self.in_features} is not a multiple of {GROUP}")
        self.kernel = int4_kernel()
        if self.kernel == "specmesh-q4":
            from specmesh.kernels import q4

            p = q4.pack(c.q, c.scale, c.zero)
            self.register_buffer("q4_codes", p.codes)  # [N/8, K/32, 16, 8] uint8
            self.register_buffer("q4_sb", p.sb)  # [N/8, K/32, 2, 8] fp32 scales, biases
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(c.q.to(torch.int32), 1)  # [N, K/2] uint8
        sz = torch.stack([c.scale.t(), c.zero.t()], -1).to(COMPUTE_DTYPE).contiguous()  # [K/32, N, 2]
        self.register_buffer("qweight", packed)
        self.register_buffer("scale_zero", sz)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.fmt == "gguf":
            lean = x.dim() == 2 and x.dtype == torch.float32  # a decode step's input: no reshape, no copy
            x2 = x if lean else x.reshape(-1, shape[-1]).float()  # [M, K]
            b = self._buffers  # read directly: nn.Module's attribute fallback costs ~1 us a buffer a call
            if self.kernel == "ggml":
                y = ggml.linear(x2, b["blocks"], self.qtype)  # [M, N]
            else:
                y = qdot.linear(x2, b["qd_codes"], b["qd_sb"], b["qd_sc"], self.out_features, self.bits,
                                self.supergroups)
            if b["bias"] is not None:
                y = y + b["bias"]
            return y if lean else y.view(*shape[:-1], self.out_features)
        if self.fmt == "int4" and self.kernel == "specmesh-q4":
            from specmesh.kernels import q4

            x2 = x.reshape(-1, shape[-1]).float()  # [M, K]: fp32 throughout
            y = q4.q4_linear(x2, self.q4_codes, self.q4_sb, self.out_features)  # [M, N]
            if self.bias is not None:
                y = y + self.bias
            return y.view(*shape[:-1], self.out_features)
        x2 = x.reshape(-1, shape[-1]).to(COMPUTE_DTYPE)  # [M, K]
        if self.fmt == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.qweight, GROUP, self.scale_zero)
        elif self.fmt == "int8":
            y = torch._weight_int8pack_mm(x2, self.qweight, self.scales)
        else:
            y = kernels.linear(x2, self.weight)  # bf16: a verification's rows one at a time (`kernels.ROW_BY_ROW`)
        y = y.float()  # [M, N]
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight [N, K] this layer multiplies by (the kernels' own dequantization)."""
        if self.fmt == "bf16":
            return self.weight.float()
        if self.fmt == "gguf":  # the weights' values; the product also rounds the activations to 8 bits
            if self.kernel == "ggml":
                from gguf import GGMLQuantizationType
                from gguf.quants import dequantize

                w = dequantize(self.blocks.numpy(), GGMLQuantizationType(self.qtype))
                return torch.from_numpy(np.asarray(w, dtype=np.float32).reshape(self.out_features, self.in_features).copy())
            q, scale, bias = qdot.unpack(self._packed())
            w = q.float().view(self.out_features, scale.shape[1], -1) * scale[..., None] + bias[..., None]
            return w.view(self.out_features, self.in_features)
        if self.fmt == "int8":
            return self.qweight.float() * self.scales.float()[:, None]
        eye = torch.eye(self.in_features)  # fp32 in, fp32 scales: each output is one weight, exactly
        if self.kernel == "specmesh-q4":
            from specmesh.kernels import q4

            return q4.q4_linear(eye, self.q4_codes, self.q4_sb, self.out_features).t()  # fl(scale * q + bias), the kernel's own arithmetic
        return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.qweight, GROUP, self.scale_zero.float()).t()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"{self.fmt}{' ' + self.kernel if self.kernel else ''}, in_features={self.in_features}, out_features={self.out_features}"


def fusion_key(m: nn.Module):
    """What integer-kernel layers must share to run as one product (`fuse_qdot`); None for any other layer."""
    if not isinstance(m, QuantLinear) or m.kernel != "specmesh-qdot" or m.out_features % qdot.LANES:
        return None
    return (m.in_features, m.bits, m.supergroups, m.qd_sb.dtype, tuple(m.qd_sb.shape[1:]), tuple(m.qd_sc.shape[1:]),
            m.bias is None)


def fuse_qdot(layers) -> QuantLinear | None:
    """One integer-kernel layer whose outputs are `layers`' outputs side by side (their weight rows
    stacked): one product, one quantization of the input and one thread-pool dispatch where there
    were several. Every output is the same fixed sequence of operations as in its own layer (an
    output depends on its own weight row and the input only), so the results are bit-identical.
    None unless there are two layers or more and all are alike (`fusion_key`: same inputs, layout,
    scale form and bias presence, outputs in whole 8-row blocks). The layers' buffers become views
    of the fused ones, so the weights are held once."""
    keys = {fusion_key(m) for m in layers}
    if len(layers) < 2 or len(keys) != 1 or None in keys:
        return None
    first = layers[0]
    cat = lambda name: torch.cat([getattr(m, name) for m in layers])  # noqa: E731
    sc = cat("qd_sc") if first.qd_sc.numel() else first.qd_sc
    p = qdot.Packed(cat("qd_codes"), cat("qd_sb"), sc, sum(m.out_features for m in layers), first.in_features,
                    first.bits, first.supergroups)
    fused = QuantLinear._on_qdot(p, None if first.bias is None else cat("bias"))
    blocks = rows = 0
    for m in layers:
        nb = m.out_features // qdot.LANES
        m.qd_codes = fused.qd_codes[blocks:blocks + nb]
        m.qd_sb = fused.qd_sb[blocks:blocks + nb]
        if sc.numel():
            m.qd_sc = fused.qd_sc[blocks:blocks + nb]
        if m.bias is not None:
            m.bias = fused.bias[rows:rows + m.out_features]
        blocks, rows = blocks + nb, rows + m.out_features
    return fused


@dataclass
class WeightFormat:
    """What a loaded model's Linear weights are, for the model card: the format, which tensors
    were requantized into it and which were kept in fp32 (source type -> count of tensors)."""
    fmt: str
    requantized: dict[str, int] = field(default_factory=dict)
    kept_fp32: dict[str, int] = field(default_factory=dict)
    as_shipped: dict[str, dict[str, int]] = field(default_factory=dict)  # gguf: kernel -> block type -> count
    head: str = ""  # a drafter's cut head (`specmesh.drafters.head_cut`): what it scores

    def ship(self, kernel: str, source_type: str) -> None:
        types = self.as_shipped.setdefault(kernel, {})
        types[source_type] = types.get(source_type, 0) + 1

    def requantize_shipped(self, kernel: str, source_type: str) -> None:
        """One tensor held as shipped on `kernel` was requantized after all."""
        types = self.as_shipped.get(kernel, {})
        if types.get(source_type, 0) > 1:
            types[source_type] -= 1
        else:
            types.pop(source_type, None)
        self.note("", source_type)

    def note(self, module: str, source_type: str) -> None:
        self.requantized[source_type] = self.requantized.get(source_type, 0) + 1

    def keep(self, source_type: str) -> None:
        self.kept_fp32[source_type] = self.kept_fp32.get(source_type, 0) + 1

    @property
    def requantizing(self) -> bool:
        """True when some weight is not the checkpoint's own value (beyond bf16 rounding)."""
        return self.fmt in ("int8", "int4", "gguf") and bool(self.requantized)

    def describe(self) -> str:
        """e.g. `int4 (specmesh-q4; kept fp32: 29 Q6_K)`, `int8 (requantized: 196 Q4_K, 29 Q6_K)`,
        `gguf (specmesh-qdot: 168 Q4_K, 29 Q6_K; ggml of llama-cpp-python 0.3.36: 1 Q8_0)`."""
        notes = [int4_kernel()] if self.fmt == "int4" else []
        for kernel, types in sorted(self.as_shipped.items(), reverse=True):
            if kernel == "ggml":
                from specmesh.kernels import ggml

                kernel = f"ggml of {ggml.provider()}"
            notes.append(f"{kernel}: " + ", ".join(f"{n} {t}" for t, n in sorted(types.items())))
        if self.requantizing:
            notes.append("requantized: " + ", ".join(f"{n} {t}" for t, n in sorted(self.requantized.items())))
        if self.kept_fp32:
            notes.append("kept fp32: " + ", ".join(f"{n} {t}" for t, n in sorted(self.kept_fp32.items())))
        if self.head:
            notes.append(f"head: {self.head}")
        return self.fmt + (f" ({'; '.join(notes)})" if notes else "")


class GGUFEmbedding(nn.Module):
    """An embedding table kept as the GGUF's own blocks ([vocab, row bytes] uint8); looked-up rows
    are dequantized on the fly. A table is read a few rows per token, so its format costs no
    bandwidth, and this keeps a 151k x 1536 table at its file size instead of 0.9 GB of fp32."""

    def __init__(self, raw: np.ndarray, qtype, dim: int) -> None:
        super().__init__()
        self.raw, self.qtype, self.embedding_dim = np.asarray(raw), qtype, dim
        self.num_embeddings = self.raw.shape[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        rows = self.raw[tokens.reshape(-1).cpu().numpy()]
        out = np.asarray(dequantize(rows, self.qtype), dtype=np.float32).reshape(*tokens.shape, self.embedding_dim)
        return torch.from_numpy(out.copy())  # [T, dim]


AUTO_ROWS = (1, 9)  # a decode step and the default tree (8 nodes + the pending token)
AUTO_MARGIN = 0.05  # a non-fp32 format must be this much faster than fp32 to be chosen


def _timed_layer(fmt: str, w: torch.Tensor, g: torch.Generator):
    """A layer of weight shape w.shape in `fmt`, called as layer(x)."""
    from specmesh import kernels

    if fmt == "fp32":
        return lambda x: kernels.linear(x, w)  # the measured fp32 choice (small-M kernel or torch)
    if fmt == "q8":  # a float checkpoint's weights as 8-bit codes in the integer kernel (drafters)
        q, s = quantize_q8(w)
        return QuantLinear.from_codes(q, s, torch.zeros_like(s), 8, None)
    if fmt == "gguf":  # 4-bit codes in the integer kernel, as a Q4_K tensor loads
        n, k = w.shape
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int16)
        if k % 256:  # no K-quant of this width: 4-bit codes with fp32 group parameters
            s = torch.rand(n, k // GROUP, generator=g) * 0.01
            return QuantLinear.from_codes(q, s, -8 * s, 4, None)
        d = torch.rand(n, k // 256, generator=g) * 1e-3
        sc = torch.randint(0, 64, (n, k // GROUP), generator=g, dtype=torch.int8)
        return QuantLinear.from_super(SuperCodes(q, d, -d, sc, sc, 4), None)
    return QuantLinear.from_float(w, None, fmt)


def time_formats(n: int, k: int, formats: tuple[str, ...] = ("gguf", "int4", "fp32"),
                 copies_bytes: int = 96 << 20) -> dict:
    """Time a layer of weight shape [n, k] in each of `formats` on this machine: interleaved calls
    at AUTO_ROWS, each on the next of as many copies as fill `copies_bytes` (so the weights come
    from memory, not cache, as in a whole model's forward), medians. Returns {"<fmt>_us": {rows:
    us}, ..., "choice"}: the fastest by the sum over AUTO_ROWS, where anything but fp32 must beat
    fp32 (if timed) by AUTO_MARGIN."""
    import statistics
    import time

    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02  # [N, K]
    bits = {"fp32": 32, "bf16": 16, "int8": 8, "int4": 4, "gguf": 4, "q8": 8}
    layers = {f: [_timed_layer(f, w.clone() if f == "fp32" else w, g)
                  for _ in range(max(2, copies_bytes * 8 // (bits[f] * n * k)))] for f in formats}
    times = {f: {m: [] for m in AUTO_ROWS} for f in formats}
    for rep in range(7):
        for m in AUTO_ROWS:
            x = torch.randn(m, k, generator=g)
            for f in formats:
                layer = layers[f][rep % len(layers[f])]
                t = time.perf_counter()
                layer(x)
                times[f][m].append(time.perf_counter() - t)
    out = {f"{f}_us": {str(m): round(1e6 * statistics.median(v[1:]), 1) for m, v in d.items()} for f, d in times.items()}
    total = {f: sum(out[f"{f}_us"].values()) * (1 if f == "fp32" else 1 + AUTO_MARGIN) for f in formats}
    out["choice"] = min(formats, key=lambda f: total[f])
    return out
