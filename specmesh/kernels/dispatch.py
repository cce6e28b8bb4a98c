"""Kernel dispatch by measurement: per weight shape, the small-M kernel or torch's GEMM, whichever
this machine runs faster, timed once per machine and cached.

`kernels.tune(module)` collects the fp32 CPU `nn.Linear` weights of a loaded model, groups them by shape
(N, K), and for every shape not in the cached table times the kernel against `F.linear` at
`TUNE_ROWS` row counts: interleaved calls, each on the next weight of that shape in the model (so a
weight is read from memory, as in a forward over the whole model, not from cache), a median of a
few repetitions (`TUNE_ROWS_LARGE` only for a ~1 GB vocabulary head), a few seconds per model. The table is a JSON
file beside the compiled library, one per key: CPU model, its SIMD flags (avx2/fma/avx512*/amx*),
torch's thread count, torch's version and the library's own hash. A later process with the same
key reads it and times nothing.

**One path per model, for every row count.** A row's result through the kernel does not depend
on the other rows in the call; through torch's GEMM it does (MKL takes different code for one
row, 2-3 rows and 4+ rows, and their results differ in the last bits).
specmesh.batching runs several sessions' rows in one forward and relies on each session's result
being what its own forward gives: true bit for bit on every shape whose choice is the kernel for
all row counts, and broken by a per-row-count choice (a session's one decode row alone and in a
batch of 10 would take different code). So each shape's verdict (`choose`) sums its medians over
`TUNE_ROWS`, and torch wins only by more than `MARGIN` (noise must not cost the invariance). And
one model takes one path for all its shapes (`model_choice`, weighted by its weights): a model
that mixes them measured slower than either path alone, the two thread pools contending.
A model whose shapes all choose the kernel has `describe()["batch_invariant"]`; a shape that
chooses torch has torch's numerics, as with `SPECMESH_KERNELS=0`. Greedy output is the same
either way up to ties at the last bits: a tree's rows and one-token decodes already differ there
on both paths (attention over other row counts rounds differently, ~1e-6). The table keeps the
per-row times, and `describe()` reports what a per-row choice would have saved (`per_m_gain`).

This module knows weights and timings, not models: it walks `nn.Linear` modules, nothing else.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

TUNE_ROWS = (1, 2, 3, 5, 9, 17)  # decode, small trees, the default 8-node tree + pending token, SMALL_M_MAX
TUNE_ROWS_LARGE = (1, 5, 17)  # for a weight over LARGE_BYTES (a 150k-vocabulary head: ~1 GB, 0.1 s a call)
LARGE_BYTES = 256 << 20
PAGE_FLOATS = 1024  # 4 KB
TABLE_VERSION = 3  # part of the key: a change to how shapes are timed retimes them
RUNS = 4  # alternating runs of each path per row count (`time_shape`)
MARGIN = 0.05  # torch must be this much faster over TUNE_ROWS to give up the kernel's batch invariance
MIN_SAVING_US = 2.0  # ... and save this much per call: below it, the difference is call overhead and noise
REP_BUDGET_S = 0.03  # timing budget per (shape, rows, path): 3 repetitions for a 1 GB head, 9 for small ones
DELAY_ENV = {"kernel": "SPECMESH_KERNEL_TEST_DELAY_US", "torch": "SPECMESH_TORCH_TEST_DELAY_US"}  # tests only

Linear = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD features that decide which code either path can run."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f in ("avx2", "fma", "f16c") or f.startswith(("avx512", "amx")))
    except OSError:
        pass
    cap = torch.backends.cpu.get_cpu_capability().lower()
    return ["avx2", "f16c", "fma"] if cap in ("avx2", "avx512") else [cap]  # every AVX2 CPU has FMA and F16C


def _delays_us() -> dict[str, float]:
    return {path: float(os.environ.get(env) or 0) for path, env in DELAY_ENV.items()}


def table_key(library: Path) -> dict:
    key = {"version": TABLE_VERSION, "cpu": cpu_model(), "flags": cpu_flags(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "library": library.stem}
    delays = {p: d for p, d in _delays_us().items() if d}
    if delays:  # a table timed with a test delay must never be taken for a real one
        key["test_delay_us"] = delays
    return key


def table_path(library: Path, key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return library.parent / f"dispatch-{digest}.json"


def read_table(path: Path) -> dict:
    """{"key": ..., "shapes": {"NxK": entry}}; an empty table when absent or unreadable."""
    try:
        table = json.loads(path.read_text())
        if isinstance(table.get("shapes"), dict):
            return table
    except (OSError, ValueError):
        pass
    return {"shapes": {}}


def _write_table(path: Path, table: dict) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)


def cached_json(folder: Path, stem: str, key: dict, compute: Callable[[], dict]) -> tuple[dict, float]:
    """A measurement cached as `folder/<stem>-<hash of key>.json`: read it, or `compute()` it now
    (one process at a time: two services starting together must not time each other's load) and
    write it. Returns (result, seconds spent computing: 0 when cached)."""
    path = folder / f"{stem}-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"
    try:
        return json.loads(path.read_text())["result"], 0.0
    except (OSError, ValueError, KeyError):
        pass
    folder.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return json.loads(path.read_text())["result"], 0.0
        except (OSError, ValueError, KeyError):
            pass
        t0 = time.perf_counter()
        result = compute()
        spent = time.perf_counter() - t0
        _write_table(path, {"key": key, "result": result})
    return result, spent


def shape_name(n: int, k: int) -> str:
    return f"{n}x{k}"


def linear_weights(module: nn.Module) -> dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """(N, K) -> the distinct (weight, bias) pairs of that shape that `kernels.linear` could serve."""
    found: dict[tuple[int, int], list] = {}
    seen: set[int] = set()
    for m in module.modules():
        w = getattr(m, "weight", None)
        if (not isinstance(m, nn.Linear) or not isinstance(w, torch.Tensor) or w.dim() != 2
                or w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous()
                or w.data_ptr() in seen):
            continue
        seen.add(w.data_ptr())
        found.setdefault((w.shape[0], w.shape[1]), []).append((w.detach(), None if m.bias is None else m.bias.detach()))
    return found


def _timed(fn: Linear, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, delay_s: float) -> float:
    t0 = time.perf_counter()
    fn(x, w, b)
    if delay_s:
        time.sleep(delay_s)
    return time.perf_counter() - t0


def time_shape(pairs: list[tuple[torch.Tensor, torch.Tensor | None]], kernel: Linear,
               rows: tuple[int, ...] = TUNE_ROWS) -> dict:
    """Median microseconds per call of `kernel` and `F.linear` at each row count, in alternating
    runs of calls of one path (call by call alternation would time each path while the other's
    threads still spin from the call before: libgomp's workers keep a core busy after a GEMM and
    make the next kernel call look up to 2x slower than it runs among its own kind)."""
    delays = {p: d * 1e-6 for p, d in _delays_us().items()}
    k = pairs[0][0].shape[1]
    g = torch.Generator().manual_seed(0)
    small_w, small_b = pairs[0][0][:64].contiguous(), None if pairs[0][1] is None else pairs[0][1][:64]
    out: dict[str, dict[str, float]] = {"kernel_us": {}, "torch_us": {}}
    i = 0
    for m in rows:
        x = torch.randn(m, k, generator=g)  # [m, K]
        kernel(x, small_w, small_b), F.linear(x, small_w, small_b)  # first calls: code paths, buffers
        times: dict[str, list[float]] = {"kernel": [], "torch": []}
        reps = 3  # calls per run
        for r in range(RUNS):
            for path in ("kernel", "torch") if r % 2 == 0 else ("torch", "kernel"):
                fn = kernel if path == "kernel" else F.linear
                for _ in range(reps):
                    w, b = pairs[i % len(pairs)]
                    i += 1  # the next call reads another weight of this shape, as a forward would
                    times[path].append(_timed(fn, x, w, b, delays[path]))
            if r == 0:
                reps = max(3, min(9, int(REP_BUDGET_S / max(times["kernel"][0], times["torch"][0]))))
        out["kernel_us"][str(m)] = round(statistics.median(times["kernel"]) * 1e6, 1)
        out["torch_us"][str(m)] = round(statistics.median(times["torch"]) * 1e6, 1)
    return out


def choose(entry: dict) -> str:
    """'kernel' or 'torch' for a timed shape: one path for every row count (module docstring)."""
    kernel, torch_ = sum(entry["kernel_us"].values()), sum(entry["torch_us"].values())
    saving = (kernel - torch_) / max(1, len(entry["kernel_us"]))
    return "torch" if torch_ < (1 - MARGIN) * kernel and saving >= MIN_SAVING_US else "kernel"


def model_choice(entries: dict[str, dict], counts: dict[str, int]) -> str:
    """'kernel' or 'torch' for a whole model: each shape's mean time per call over the rows timed,
    times how many weights of that shape the model has (`counts`), summed; torch only when that
    beats the kernel by more than `MARGIN`. A model that mixes the two runs two thread pools whose
    waits contend: after each of torch's GEMMs its OpenMP workers keep spinning on the cores the
    kernel's threads need (Qwen2.5-Coder 1.5B fp32, 2 threads, Intel Xeon: 3.45 tokens/s mixed
    against 4.04 all kernel and 4.07 all torch)."""
    def total(path: str) -> float:
        return sum(counts[s] * statistics.fmean(e[f"{path}_us"].values()) for s, e in entries.items())

    kernel, torch_ = total("kernel"), total("torch")
    return "torch" if torch_ < (1 - MARGIN) * kernel else "kernel"


def per_m_gain(entry: dict) -> float:
    """The fraction of the chosen path's summed time that choosing per row count would save."""
    chosen = sum(entry[f"{entry['choice']}_us"].values())
    best = sum(min(entry["kernel_us"][m], entry["torch_us"][m]) for m in entry["kernel_us"])
    return round(1 - best / chosen, 3) if chosen else 0.0


def tune_weights(weights: dict, kernel: Linear, library: Path) -> tuple[dict[str, dict], Path, float]:
    """Entries for every shape in `weights`, from the cached table or timed now (then cached).
    Returns (entries by shape name, table path, seconds spent timing)."""
    key = table_key(library)
    path = table_path(library, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    spent = 0.0
    table = read_table(path)
    missing = [s for s in weights if shape_name(*s) not in table["shapes"]]
    if missing:
        # One process times at a time: a verifier and a drafter starting together must not time
        # each other's load; the second one then finds the first one's entries.
        with open(path.with_suffix(".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = read_table(path)
            missing = [s for s in weights if shape_name(*s) not in table["shapes"]]
            t0 = time.perf_counter()
            with torch.inference_mode():
                for n, k in missing:
                    for w, _ in weights[(n, k)]:
                        # Fault every page in now (safetensors maps files): a first touch during the
                        # timing costs ms and would land on whichever path read that weight first.
                        w.view(-1)[::PAGE_FLOATS].sum()
                    rows = TUNE_ROWS_LARGE if n * k * 4 > LARGE_BYTES else TUNE_ROWS
                    entry = time_shape(weights[(n, k)], kernel, rows)
                    entry["choice"] = choose(entry)
                    entry["weights"] = len(weights[(n, k)])
                    table["shapes"][shape_name(n, k)] = entry
            spent = time.perf_counter() - t0
            if missing:
                table["key"] = key
                _write_table(path, table)
    return {shape_name(*s): table["shapes"][shape_name(*s)] for s in weights}, path, spent


def summary(entries: dict[str, dict], spent: float, choice: str) -> str:
    """One line: the model's path, and the shapes whose own timing preferred the other one."""
    other = [s for s, e in entries.items() if e["choice"] != choice]
    how = f"timed in {spent:.1f} s" if spent else "cached table"
    path = "small-M kernel" if choice == "kernel" else "torch's GEMM"
    tail = f"; alone, {', '.join(other)} would take the other path" if other else ""
    return (f"specmesh: {path} for all {len(entries)} weight shapes, one path per model ({how}: {cpu_model()}, "
            f"{torch.get_num_threads()} threads{tail})")


def report(table: dict, file=sys.stdout) -> None:
    key = table.get("key", {})
    print(f"CPU: {key.get('cpu', cpu_model())}  flags: {' '.join(key.get('flags', cpu_flags()))}", file=file)
    print(f"torch {key.get('torch', torch.__version__)}, {key.get('threads', torch.get_num_threads())} threads, "
          f"library {key.get('library', '?')}", file=file)
    if not table["shapes"]:
        print("no shapes timed yet for this key: load a model (or pass --target PATH)", file=file)
        return
    print(f"{'shape NxK':>14} {'M':>3} {'kernel us':>10} {'torch us':>10} {'k/t':>5}  choice", file=file)
    for name, e in sorted(table["shapes"].items(), key=lambda kv: [int(v) for v in kv[0].split("x")]):
        for m in e["kernel_us"]:
            k, t = e["kernel_us"][m], e["torch_us"][m]
            print(f"{name:>14} {m:>3} {k:10.1f} {t:10.1f} {k / t if t else 0:5.2f}  {e['choice']}", file=file)
        print(f"{'':>14} per-M choice would save {per_m_gain(e):.1%}", file=file)
