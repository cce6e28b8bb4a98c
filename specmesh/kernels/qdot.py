"""The integer small-M CPU kernel (`qdot_gemm.cpp`): y = x @ W.T with W as unsigned integer codes
and one fp32 (scale, bias) pair per group of a row, w = q * scale + bias, and x quantized per row
to int8 in blocks of 32 (as llama.cpp quantizes activations for GGUF blocks). Three layouts
(`bits`): 4-bit codes in groups of 32 (GGUF Q4_0, Q4_1, Q4_K); codes 0..63 in 6 bits, groups of 16
(6: Q6_K, and Q5_0/Q5_1 as pairs of groups); signed byte codes in groups of 16 (8: Q8_0). The
(scale, bias) pairs are fp32 per group (`pack`), or, for GGUF K-quants, in the file's own form
(`pack_super`): (d, dm) per super-block (fp16, as the file holds them), int8 multipliers per group.
Integer dot products (AVX2 maddubs), a block of 8 output rows unpacked once for up
to 8 activation rows (10 in the VNNI builds: 9 and 10 rows in one tile, not 8 + 1 or 8 + 2): an
extra row costs a fraction of the first, which is what tree verification and batching pay.

`pack(q, scale, bias, bits)` / `pack_super(...)` repack once, at load time, into the kernel's
layout (see the .cpp); `linear(x, codes, sb, sc, n, bits, s)` multiplies. Built and cached like
the other kernels (`specmesh.kernels`, `SPECMESH_KERNELS=0` turns it off); where it cannot load,
`available()` is False and `reason()` says why.

**Variants, chosen by measurement** (`VARIANTS`): the same source built for AVX2 (maddubs) and,
where the CPU has AVX512-VNNI, for VNNI (dpbusd) on 512-bit registers (two blocks of 8 output rows
each) or on 256-bit ones (one block: no inserts to pair blocks, which a CPU that splits 512-bit
operations in two, AMD Zen 4, pays for nothing). Their integer sums are exact, so their outputs
are bit-identical and the choice can follow the row count without touching batch invariance:
`choice()` times every variant this CPU runs on synthetic Q4_K, Q6_K and Q8_0 layers (interleaved,
weights rotated past the cache) at `ROWS` (every row count to 9, then 11, 13 and 17: one per way
the kernel tiles them) and takes, per layout and row count, the fastest (another variant must beat
AVX2 by `MARGIN`); an untimed row count (10, 12, 14-16, past 17) takes the choice of the next lower
timed one. Timed once per CPU model, flags, thread count, torch and library build (about a second),
cached beside the libraries; `python -m specmesh.kernels --report` prints the table.
`SPECMESH_QDOT=avx2|avx512vnni|avx512vnni-ymm` forces one variant (no timing). Every output is a
fixed sequence of operations whatever the other rows, the tiling or the thread count (batch
invariance). This module knows codes and tensors, nothing of models.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh import kernels as _k
from specmesh.kernels import dispatch as _dispatch

_SOURCE = Path(__file__).with_name("qdot_gemm.cpp")
_HEADERS = [Path(__file__).with_name("pool.h")]
LANES = 8  # output rows per block
GROUP = {4: 32, 6: 16, 8: 16}  # layout -> inputs per (scale, bias) group
CODES = {4: (0, 15), 6: (0, 63), 8: (-128, 127)}  # layout -> code range


_VNNI_FLAGS = ("-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_VNNI_NEEDS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# name -> (extra compiler flags, /proc/cpuinfo flags it needs, its torch.ops namespace)
VARIANTS = {
    "avx2": (("-mf16c",), ("avx2", "fma", "f16c"), "specmesh_qdot"),
    "avx512vnni": (_VNNI_FLAGS, _VNNI_NEEDS, "specmesh_qdot_vnni"),
    # dpbusd on 256-bit registers, one block of 8 output rows at a time (see qdot_gemm.cpp)
    "avx512vnni-ymm": ((*_VNNI_FLAGS, "-DQDOT_YMM"), _VNNI_NEEDS, "specmesh_qdot_vnni256"),
}
# Timed row counts: every one to 9 (decode, small trees, the default 8-node tree + pending token; each
# its own tile shape, and the variants' ranks can flip between neighbouring counts), then one per tiling
# of larger counts in the VNNI builds (9-10: one tile; 11-12: 8 + 3..4; 13-16: 8 + 5..8) and a 16-node
# tree + pending token (17). An untimed count takes the next lower's.
ROWS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 17)
MARGIN = 0.03  # another variant must be this much faster than AVX2 to take a (layout, rows) cell
TEST_DELAY_ENV = "SPECMESH_QDOT_TEST_DELAY_US"  # tests only: "variant:us", a variant made slow


class _State:
    """Process-wide, like `specmesh.kernels._State`."""
    op = None  # the AVX2 build, set once it loaded: `available()`; `linear` runs what `choice()` picked
    ops: dict = {}  # variant name -> its op, for every variant this CPU runs
    choices: dict = {}  # kernel thread count -> {"table": ..., "by_bits": {bits: [op per row count]}}
    tried = False
    reason = ""


@dataclass
class Packed:
    """The kernel's weight layout: codes [N/8, K/GS, 128] uint8 (96 for bits 6); s 0: sb
    [N/8, K/GS, 2, 8] fp32 (scale, bias); sb fp16: [N/8, K/GS/s, 2, 8] (scale, bias), one pair per
    s groups, sc empty; else s > 0: sb [N/8, K/GS/s, 2, 8] (d, dm), fp16 where every value is one,
    else fp32, and sc [N/8, K/GS, P, 8] int8 (sc, and mn when P is 2)."""
    codes: torch.Tensor
    sb: torch.Tensor
    sc: torch.Tensor
    n: int
    k: int
    bits: int
    s: int = 0


def library_path(variant: str = "avx2") -> Path:
    return _k.keyed_library("qdot_gemm" if variant == "avx2" else f"qdot_gemm_{variant}", _SOURCE, _HEADERS,
                            VARIANTS[variant][0])


def runnable() -> list[str]:
    """The variants this CPU can run (by its flags: what it can execute, not what is fastest)."""
    have = set(_dispatch.cpu_flags())
    return [v for v, (_, needs, _) in VARIANTS.items() if set(needs) <= have]


def load() -> bool:
    """Make the kernel available in this process (once): the AVX2 build, and every other variant
    this CPU runs; False, with `reason()` set, when not even the AVX2 build can load."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    if why := _k.unsupported():
        _State.reason = why
        return False
    forced = os.environ.get("SPECMESH_QDOT") or ""
    if forced and forced not in VARIANTS:
        raise ValueError(f"SPECMESH_QDOT: expected one of {', '.join(VARIANTS)}, got {forced!r}")
    variants = runnable()
    if "avx2" not in variants:
        _State.reason = f"the CPU lacks one of {', '.join(VARIANTS['avx2'][1])}"
        return False
    for variant in variants:
        flags, _, namespace = VARIANTS[variant]
        try:
            path = _k.build_library(library_path(variant), _SOURCE, f"integer CPU kernel ({variant})", flags)
            torch.ops.load_library(str(path))
            _State.ops[variant] = getattr(torch.ops, namespace).qdot_linear
        except (OSError, RuntimeError) as e:
            if variant == "avx2":
                _State.reason = str(e)
                return False
            print(f"specmesh: integer kernel variant {variant} unavailable: {e}", file=sys.stderr)
    _State.op = _State.ops.get("avx2")
    if forced and forced not in _State.ops:
        raise ValueError(f"SPECMESH_QDOT={forced}: this CPU or build cannot run it (runs {', '.join(_State.ops)})")
    return _State.op is not None


def _test_delays() -> dict[str, float]:
    spec = os.environ.get(TEST_DELAY_ENV) or ""
    return {v: float(us) * 1e-6 for v, us in (part.split(":") for part in spec.split(",") if part)}


def _timed_layers(bits: int, g: torch.Generator, budget_bytes: int = 64 << 20) -> list[Packed]:
    """Copies of one synthetic layer in `bits`' layout as GGUF loads it (Q4_K, Q6_K super-blocks;
    Q8_0 per-group pairs), as many as fill `budget_bytes`, so a timed call reads from memory."""
    n, k = 4096, 1536
    lo, hi = CODES[bits]
    q = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int16)
    groups = k // GROUP[bits]
    if bits == 8:
        s = torch.rand(n, groups, generator=g) * 1e-3
        first = pack(q, s, torch.zeros_like(s), bits)
    else:
        d = (torch.rand(n, groups // 16 if bits == 6 else groups // 8, generator=g) * 1e-3).half().float()
        sc = torch.randint(-64, 64, (n, groups), generator=g, dtype=torch.int8)
        first = pack_super(q, d, -d, sc, None if bits == 6 else sc, bits)
    copies = max(2, budget_bytes // first.codes.numel())
    return [first] + [Packed(first.codes.clone(), first.sb.clone(), first.sc.clone(), n, k, bits, first.s)
                      for _ in range(copies - 1)]


def time_variants(variants: list[str], reps: int = 7) -> dict:
    """Median microseconds per call of each variant, per layout (bits) and row count (`ROWS`),
    interleaved call by call, each call on the next copy of its layer."""
    import statistics
    import time

    delays = _test_delays()
    threads = _k.pool_threads()
    g = torch.Generator().manual_seed(0)
    out: dict = {}
    for bits in (4, 6, 8):
        layers = _timed_layers(bits, g)
        times = {v: {m: [] for m in ROWS} for v in variants}
        i = 0
        for rep in range(reps + 1):
            for m in ROWS:
                x = torch.randn(m, layers[0].k, generator=g)  # [m, K]
                for v in variants if rep % 2 else variants[::-1]:
                    p = layers[i % len(layers)]
                    i += 1
                    t = time.perf_counter()
                    _State.ops[v](x, p.codes, p.sb, p.sc, p.n, p.bits, p.s, threads)
                    if delays.get(v):
                        time.sleep(delays[v])
                    if rep:  # the first round only warms up
                        times[v][m].append(time.perf_counter() - t)
        out[str(bits)] = {v: {str(m): round(1e6 * statistics.median(t), 1) for m, t in d.items()}
                          for v, d in times.items()}
    return out


def choose(timed: dict) -> dict[str, dict[str, str]]:
    """Per layout and timed row count, the fastest variant; another one must beat AVX2 by MARGIN."""
    def best(cells: dict, m: str) -> str:
        base = cells["avx2"][m] if "avx2" in cells else float("inf")
        fast = min(cells, key=lambda v: cells[v][m])
        return fast if fast == "avx2" or cells[fast][m] < (1 - MARGIN) * base else "avx2"

    return {bits: {str(m): best(cells, str(m)) for m in ROWS} for bits, cells in timed.items()}


def choice() -> dict:
    """This process's choice at its kernel thread count (`specmesh.kernels.pool_threads`):
    {"table": {"timed", "choice", ...}, "by_bits": {bits: [op for row counts 0..ROWS[-1]]}}, timed
    now or read from the cache."""
    threads = _k.pool_threads()
    if threads in _State.choices:
        return _State.choices[threads]
    variants = list(_State.ops)
    forced = os.environ.get("SPECMESH_QDOT") or ""
    if forced:
        table = {"forced": forced, "choice": {str(b): {str(m): forced for m in ROWS} for b in GROUP}}
    elif len(variants) == 1:
        table = {"choice": {str(b): {str(m): variants[0] for m in ROWS} for b in GROUP}}
    else:
        key = {"what": "qdot variants", "rows": list(ROWS), "cpu": _dispatch.cpu_model(), "flags": _dispatch.cpu_flags(),
               "threads": threads, "torch": torch.__version__, "margin": MARGIN,
               "libraries": [library_path(v).name for v in variants], "test_delay": os.environ.get(TEST_DELAY_ENV, "")}

        def measure() -> dict:
            timed = time_variants(variants)
            return {"timed_us": timed, "choice": choose(timed)}

        table, spent = _dispatch.cached_json(library_path().parent, "qdot-variants", key, measure)
        print(f"specmesh: integer kernel {describe_choice(table['choice'])} "
              f"({'timed in %.1f s' % spent if spent else 'cached'}: {_dispatch.cpu_model()}, {threads} threads)",
              file=sys.stderr, flush=True)
    by_bits = {}
    for bits in GROUP:
        cells = table["choice"][str(bits)]
        ops, cur = [], cells[str(ROWS[0])]
        for m in range(ROWS[-1] + 1):
            cur = cells.get(str(m), cur)
            ops.append(_State.ops[cur])
        by_bits[bits] = ops
    _State.choices[threads] = {"table": table, "by_bits": by_bits}
    return _State.choices[threads]


def describe_choice(cells: dict) -> str:
    """e.g. `4-bit: avx512vnni at 1-17 rows; 6-bit: avx2 at 1, avx512vnni at 2-17 rows; ...`."""
    parts = []
    for bits, by_rows in cells.items():
        runs: list[list] = []
        for i, m in enumerate(ROWS):
            hi = ROWS[i + 1] - 1 if i + 1 < len(ROWS) else m
            if runs and runs[-1][0] == by_rows[str(m)]:
                runs[-1][2] = hi
            else:
                runs.append([by_rows[str(m)], m, hi])
        parts.append(f"{bits}-bit: " + ", ".join(f"{v} at {lo}" + (f"-{hi}" if hi > lo else "") for v, lo, hi in runs)
                     + " rows")
    return "; ".join(parts)


def describe() -> dict:
    """Which variant runs for which layout and row count in this process, for benchmark JSON."""
    if not available():
        return {"active": False, "reason": reason()}
    table = choice()["table"]
    return {"active": True, "variants": list(_State.ops), "threads": _k.pool_threads(),
            "choice": describe_choice(table["choice"]), **({"timed_us": table["timed_us"]} if "timed_us" in table else {})}


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


def _fp16_exact(a: torch.Tensor) -> bool:
    return bool(torch.equal(a.half().float(), a))


def pack(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor, bits: int) -> Packed:
    """From w = q * scale + bias: q [N, K] integer codes in CODES[bits], scale and bias
    [N, K / GROUP[bits]] fp32. Where every scale and bias is an fp16 value (GGUF Q4_0, Q4_1, Q5_*,
    Q8_0: the file's own fp16 d and m), they are held as fp16 pairs, one per group or (s 2) per
    two groups that share them (a 32-block in 16-groups): the same numbers in fewer bytes."""
    n, k = q.shape
    nb = -(-n // LANES)
    scale, bias, s = scale.float(), bias.float(), 0
    if _fp16_exact(scale) and _fp16_exact(bias):
        pairs = scale.shape[1] % 2 == 0 and torch.equal(scale[:, 0::2], scale[:, 1::2]) and torch.equal(
            bias[:, 0::2], bias[:, 1::2])
        s = 2 if pairs else 1
        scale, bias = scale[:, ::s], bias[:, ::s]
    sb = torch.stack([_by_block(scale, nb), _by_block(bias, nb)], 2)  # [NB, G (/ s), 2, 8]
    sb = (sb.half() if s else sb).contiguous()
    return Packed(_pack_codes(q, bits), sb, torch.empty(0, dtype=torch.int8), n, k, bits, s)


def pack_super(q: torch.Tensor, d: torch.Tensor, dm: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor | None,
               bits: int) -> Packed:
    """From w = q * (d * sc) + dm * mn per group, a GGUF K-quant's own form: d, dm [N, K / GROUP /
    s] fp32 per super-block of s groups, sc, mn [N, K / GROUP] int8 multipliers (mn None: mn = sc,
    one plane). Where every d and dm is an fp16 value (the file's own fp16 d and dmin; Q6_K's
    -32 d), they are held in fp16: the same numbers in half the bytes."""
    n, k = q.shape
    nb, g = -(-n // LANES), k // GROUP[bits]
    s = g // d.shape[1]
    if s * d.shape[1] != g or dm.shape != d.shape or sc.shape != (n, g) or (mn is not None and mn.shape != sc.shape):
        raise ValueError("integer kernel: super-block parameters do not match the codes")
    d, dm = d.float(), dm.float()
    sb = torch.stack([_by_block(d, nb), _by_block(dm, nb)], 2)  # [NB, G/s, 2, 8]
    sb = (sb.half() if _fp16_exact(d) and _fp16_exact(dm) else sb).contiguous()
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
    elif not p.sc.numel():  # fp16 (scale, bias) pairs
        scale, bias = (rows(p.sb[:, :, j]).float().repeat_interleave(p.s, 1) for j in (0, 1))
    else:
        d, dm = (rows(p.sb[:, :, j]).float().repeat_interleave(p.s, 1) for j in (0, 1))
        sc = rows(p.sc[:, :, 0]).float()
        mn = rows(p.sc[:, :, 1]).float() if p.sc.shape[2] == 2 else sc
        scale, bias = d * sc, dm * mn
    return q[:p.n], scale[:p.n], bias[:p.n]


def linear(x: torch.Tensor, codes: torch.Tensor, sb: torch.Tensor, sc: torch.Tensor, n: int, bits: int,
           s: int) -> torch.Tensor:
    """y [M, N] = x [M, K] fp32 @ W.T, W as `pack` / `pack_super` left it (a `Packed`'s fields);
    call only when `available()`."""
    threads = _k.pool_threads()
    return op_for(x.shape[0], bits, threads)(x, codes, sb, sc, n, bits, s, threads)


def op_for(m: int, bits: int, threads: int):
    """The op `linear` runs for `m` rows of `bits` codes at `threads` kernel threads (`choice()`'s
    pick); call only when `available()`."""
    chosen = _State.choices.get(threads)
    if chosen is None:
        if _State.op is None:
            load()
        chosen = choice()
    ops = chosen["by_bits"][bits]
    return ops[m if m < len(ops) else -1]
