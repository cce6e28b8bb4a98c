"""Weight-format micro-benchmark: one Linear's y = x @ w.T per format, few rows, this CPU.

Formats: fp32 `F.linear` (MKL), fp32 through specmesh's small-M kernel (`specmesh.kernels.linear`,
what the runtime uses today), bf16 `F.linear`, int8 weight-only with per-channel scales
(`torch._weight_int8pack_mm`), 4-bit weight-only with group size 32
(`torch.ops.aten._weight_int4pack_mm_for_cpu` after `_convert_weight_to_int4pack_for_cpu`), each
with fp32 and with bf16 activations, and torchao's int8 / int4 weight-only configs where torchao
imports, and specmesh's own 4-bit kernel (`specmesh_q4`: `specmesh.kernels.q4`, the same 4-bit
codes, fp32 activations, fp32 scales), and `--dtype gguf`'s kernels: specmesh's integer kernel on
4-bit codes and on Q8_0 blocks (`qdot_4bit`, `qdot_q8_0`) and ggml's (llama.cpp's) dot products on
Q4_0 / Q8_0 blocks (`ggml_q4_0`, `ggml_q8_0`, where llama-cpp-python is installed). Shapes are Qwen2.5-1.5B's (q/o, k/v, gate/up, down, LM head); rows M as a decode step
(1) and verification trees (2..17).

Cells are interleaved round by round (every format on a shape, then the next shape) so a shared
machine's noise hits all formats alike; each cell reports the median over rounds of the median
time per call. Batch invariance: row i of an M-row product compared bit for bit with row i
computed alone (`max_abs_diff` 0.0 means invariant on that shape).

Usage: python -m loadtest.bench_formats [--quick] [--rounds N] [--formats a,b] [--shapes NxK,...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specmesh.kernels.dispatch import cpu_flags, cpu_model

SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960), (151936, 1536)]  # (N out, K in)
ROWS = [1, 2, 5, 9, 17]
GROUP = 32
# fp32-activation int kernels and torchao run 3-25x slower than fp32 on the small shapes (measured here):
# timed only on shapes up to this many weights, so the LM head does not take minutes per cell.
SLOW_FORMATS = ("int8_x32", "int4_x32", "torchao_int8", "torchao_int8_x16", "torchao_int4_x16")
SLOW_MAX_WEIGHTS = 1536 * 1536

Op = Callable[[torch.Tensor], torch.Tensor]


def _int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit, group 32: w ~ (q - 8) * scale + zero (torch's CPU int4pack formula)."""
    n, k = w.shape
    g = w.view(n, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)  # [N, K/G]
    scale = ((hi - lo) / 15).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).view(n, k)
    zero = lo + 8 * scale
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.t(), zero.t()], -1).contiguous()  # [K/G, N, 2]
    return packed, sz


def _int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.abs().amax(1) / 127).clamp_min(1e-8)  # [N]
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def make_ops(w: torch.Tensor, with_torchao: bool) -> dict[str, Op]:
    from specmesh import kernels
    from specmesh.kernels import q4

    w16 = w.bfloat16()
    q8, s8 = _int8(w)
    p4, sz4 = _int4(w)
    s8b, sz4b = s8.bfloat16(), sz4.bfloat16()
    ops: dict[str, Op] = {
        "fp32": lambda x: F.linear(x, w),
        "fp32_smallm": lambda x: kernels.linear(x, w),
        "bf16": lambda x: F.linear(x.bfloat16(), w16),
        "int8_x32": lambda x: torch._weight_int8pack_mm(x, q8, s8),
        "int8_x16": lambda x: torch._weight_int8pack_mm(x.bfloat16(), q8, s8b),
        "int4_x32": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, p4, GROUP, sz4),
        "int4_x16": lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), p4, GROUP, sz4b),
    }
    if q4.available():
        from specmesh.quant import quantize_int4

        c = quantize_int4(w)  # the same asymmetric group-32 codes as `_int4`
        pk = q4.pack(c.q, c.scale, c.zero)
        ops["specmesh_q4"] = lambda x: q4.q4_linear(x, pk.codes, pk.sb, pk.n)
    from specmesh.kernels import ggml, qdot

    if qdot.available():  # --dtype gguf: the integer kernel on 4-bit codes and on Q8_0's signed bytes
        import numpy as np
        from gguf import GGMLQuantizationType as T
        from gguf.quants import quantize

        from specmesh.quant import QuantLinear, quantize_int4

        c = quantize_int4(w)
        ops["qdot_4bit"] = QuantLinear.from_codes(c.q, c.scale, c.zero - 8 * c.scale, 4, None)
        raw = {t: torch.from_numpy(np.ascontiguousarray(quantize(w.numpy(), t))) for t in (T.Q4_0, T.Q8_0)}
        ops["qdot_q8_0"] = QuantLinear.from_gguf(raw[T.Q8_0].numpy(), T.Q8_0, w.shape[1], None)
        if ggml.available():  # llama.cpp's own dot products on the same blocks
            ops["ggml_q4_0"] = lambda x: ggml.linear(x, raw[T.Q4_0], int(T.Q4_0))
            ops["ggml_q8_0"] = lambda x: ggml.linear(x, raw[T.Q8_0], int(T.Q8_0))
    if with_torchao:
        ops.update(_torchao_ops(w))
    return ops


def _torchao_ops(w: torch.Tensor) -> dict[str, Op]:
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    out: dict[str, Op] = {}
    for name, cfg, dt in (("torchao_int8", lambda: Int8WeightOnlyConfig(), torch.float32),
                          ("torchao_int8_x16", lambda: Int8WeightOnlyConfig(), torch.bfloat16),
                          ("torchao_int4_x16", lambda: Int4WeightOnlyConfig(group_size=GROUP,
                                                                            int4_packing_format="opaque"),
                           torch.bfloat16)):
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).to(dt)
        with torch.no_grad():
            lin.weight.copy_(w)
        try:
            quantize_(lin, cfg())
            with torch.inference_mode():
                lin(torch.zeros(1, w.shape[1], dtype=dt))
        except Exception as e:  # noqa: BLE001 - a config this torch/torchao pair lacks is a result, not a crash
            print(f"  {name}: unavailable ({type(e).__name__}: {str(e)[:120]})")
            continue
        out[name] = (lambda m, d: lambda x: m(x.to(d)))(lin, dt)
    return out


def time_call(op: Op, x: torch.Tensor, budget_s: float) -> float:
    """Median seconds per call over at least 3 calls filling about `budget_s`."""
    op(x)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        op(x)
        times.append(time.perf_counter() - t0)
        if len(times) >= 50:
            break
    return statistics.median(times)


def invariance(op: Op, x: torch.Tensor) -> float:
    """Max |row i of op(x) - op(x[i:i+1])| over rows: 0.0 = batch-invariant."""
    full = op(x).float()
    return max((full[i] - op(x[i:i + 1]).float()[0]).abs().max().item() for i in range(x.shape[0]))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two small shapes, M in 1,5, one round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--budget", type=float, default=0.15, help="seconds per cell per round")
    ap.add_argument("--no-torchao", action="store_true")
    ap.add_argument("--formats", default="", help="only these formats (comma list; fp32 is always timed)")
    ap.add_argument("--shapes", default="", help="only these NxK shapes (comma list)")
    ap.add_argument("--out", default="loadtest/results/bench_formats.json")
    args = ap.parse_args(argv)
    from specmesh import kernels
    from specmesh.kernels import q4

    kernels.load()
    q4.load()
    shapes, rows = (SHAPES[:2], [1, 5]) if args.quick else (SHAPES, ROWS)
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    only = set(args.formats.split(",")) | {"fp32"} if args.formats else None
    rounds = 1 if args.quick else args.rounds
    with_torchao = not args.no_torchao
    try:
        import torchao  # noqa: F401
    except ImportError:
        with_torchao = False
    gen = torch.Generator().manual_seed(0)
    samples: dict[tuple, list[float]] = {}
    inv: dict[tuple, float] = {}
    torch.set_grad_enabled(False)
    for shape in shapes:
        n, k = shape
        w = torch.randn(n, k, generator=gen) * 0.02
        ops = make_ops(w, with_torchao and n * k <= SLOW_MAX_WEIGHTS)
        if n * k > SLOW_MAX_WEIGHTS:
            ops = {name: op for name, op in ops.items() if name not in SLOW_FORMATS}
        if only:
            ops = {name: op for name, op in ops.items() if name in only}
        xs = {m: torch.randn(m, k, generator=gen) for m in rows}
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            for name, op in ops.items():
                inv[(threads, shape, name)] = invariance(op, xs[max(rows)])
            for _ in range(rounds):
                for m in rows:
                    for name, op in ops.items():
                        samples.setdefault((threads, shape, m, name), []).append(
                            time_call(op, xs[m], args.budget))
            print(f"{shape} threads={threads} done", flush=True)
        del ops, w
    cells = []
    for (threads, shape, m, name), ts in samples.items():
        base = statistics.median(samples[(threads, shape, m, "fp32")])
        t = statistics.median(ts)
        cells.append({"threads": threads, "N": shape[0], "K": shape[1], "M": m, "format": name,
                      "ms": round(t * 1e3, 4), "vs_fp32": round(base / t, 3),
                      "rounds_ms": [round(x * 1e3, 4) for x in ts]})
    result = {
        "cpu": cpu_model(), "cpu_flags": cpu_flags(), "torch": torch.__version__,
        "torchao": __import__("torchao").__version__ if with_torchao else None,
        "small_m_kernel": kernels.active(), "q4_kernel": q4.available(), "rounds": rounds, "group_size": GROUP,
        "cells": cells,
        "batch_invariance": [{"threads": t, "N": s[0], "K": s[1], "format": f, "M": max(rows),
                              "max_abs_diff": d} for (t, s, f), d in inv.items()],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    _print_summary(result)
    return result


def _print_summary(result: dict) -> None:
    print(f"cpu: {result['cpu']} {result['cpu_flags']}")
    fmts = list(dict.fromkeys(c["format"] for c in result["cells"]))
    for threads in sorted({c["threads"] for c in result["cells"]}):
        print(f"\nthreads={threads}: ms per call (x faster than fp32)")
        print("N,K,M".ljust(18) + "".join(f.rjust(18) for f in fmts))
        keyed = {(c["N"], c["K"], c["M"], c["format"]): c for c in result["cells"] if c["threads"] == threads}
        for (n, k, m) in dict.fromkeys((c["N"], c["K"], c["M"]) for c in result["cells"]):
            row = f"{n},{k},{m}".ljust(18)
            for f in fmts:
                c = keyed.get((n, k, m, f))
                row += (f"{c['ms']:.3f} ({c['vs_fp32']:.2f}x)" if c else "-").rjust(18)
            print(row)
    bad = sorted({(b["format"], b["threads"]) for b in result["batch_invariance"] if b["max_abs_diff"] != 0.0})
    print("\nnot batch-invariant (format, threads):", bad or "none")


if __name__ == "__main__":
    main()
