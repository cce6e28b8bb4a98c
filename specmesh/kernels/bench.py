"""`python -m specmesh.kernels --bench`: the kernel against torch's GEMM at several thread counts on
random fp32 weights of given shapes, for the README and loadtest/results (not used at run time).

Each shape gets enough distinct weights (at least `COLD_BYTES` in all) that a call reads its weight
from memory, as a forward over a whole model does. Calls are interleaved (kernel / torch, thread
counts, shapes, rounds), so a busy neighbour on a shared machine slows both sides alike; the
result keeps the median and the minimum over rounds (the minimum is the closest to an idle machine).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from specmesh.kernels import dispatch

QWEN_1_5B = ((1536, 1536), (256, 1536), (8960, 1536), (1536, 8960))  # q/o, k/v, gate/up, down
ROWS = (1, 2, 5, 9, 17)
COLD_BYTES = 96 << 20  # above the 32 MB L3 of this project's EPYC machines


def bench(kernel, shapes=QWEN_1_5B, rows=ROWS, threads=(1, 2), rounds: int = 15) -> dict:
    before = torch.get_num_threads()
    g = torch.Generator().manual_seed(0)
    weights = {s: [torch.randn(*s, generator=g) for _ in range(max(1, -(-COLD_BYTES // (s[0] * s[1] * 4))))]
               for s in shapes}
    xs = {(s, m): torch.randn(m, s[1], generator=g) for s in shapes for m in rows}
    times: dict = {(s, t, m, p): [] for s in shapes for t in threads for m in rows for p in ("kernel", "torch")}
    i = 0
    try:
        with torch.inference_mode():
            for r in range(rounds):
                for t in threads:
                    torch.set_num_threads(t)
                    for s in shapes:
                        for m in rows:
                            for p in ("kernel", "torch") if (r + m) % 2 == 0 else ("torch", "kernel"):
                                w = weights[s][i % len(weights[s])]
                                i += 1
                                t0 = time.perf_counter()
                                (kernel if p == "kernel" else F.linear)(xs[(s, m)], w, None)
                                times[(s, t, m, p)].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    out: dict = {"cpu": dispatch.cpu_model(), "flags": dispatch.cpu_flags(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rounds": rounds, "shapes": {}}
    for s in shapes:
        per = out["shapes"].setdefault(dispatch.shape_name(*s), {})
        for t in threads:
            for m in rows:
                k, tt = times[(s, t, m, "kernel")][1:], times[(s, t, m, "torch")][1:]  # round 0 warms up
                per.setdefault(str(t), {})[str(m)] = {
                    "kernel_us": round(statistics.median(k) * 1e6, 1), "torch_us": round(statistics.median(tt) * 1e6, 1),
                    "ratio": round(statistics.median(k) / statistics.median(tt), 3),
                    "kernel_us_min": round(min(k) * 1e6, 1), "torch_us_min": round(min(tt) * 1e6, 1),
                    "ratio_min": round(min(k) / min(tt), 3)}
    return out


def table(result: dict) -> str:
    """Markdown: kernel/torch time ratio per shape and rows, per thread count (median; min)."""
    shapes = list(result["shapes"])
    threads = list(next(iter(result["shapes"].values())))
    rows = list(next(iter(next(iter(result["shapes"].values())).values())))
    lines = ["| shape NxK | threads | " + " | ".join(f"M={m}" for m in rows) + " |",
             "|---|---|" + "---|" * len(rows)]
    for s in shapes:
        for t in threads:
            cells = [f"{c['ratio']:.2f} ({c['ratio_min']:.2f})" for c in result["shapes"][s][t].values()]
            lines.append(f"| {s} | {t} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
