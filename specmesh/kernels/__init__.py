"""Optional native kernels for the CPU runtime, built on first use, dispatched by measurement.

One kernel today, `small_gemm.cpp`: fp32 `y = x @ w.T` for x with few rows (a verification tree,
a decode step). It reads each weight block once for all rows, so a few rows cost about one, and it
computes every row the same way whatever the other rows (batch invariance), which lets
specmesh.batching verify sessions together with each session's result unchanged to the bit.
Whether it beats torch's GEMM depends on the CPU and the thread count, so it is not assumed:
`tune(model)` (called by the loader once the weights are in) times both per weight shape on this
machine and caches the choice (`specmesh.kernels.dispatch`); `linear` then looks the shape up.
Shapes never tuned (a model built by hand, TP shards) use the kernel.

The source is compiled with the system C++ compiler against the installed torch the first time a
model is loaded (~30 s on 2 cores), into `$SPECMESH_CACHE/kernels/` under a key of the source,
the torch version and the flags; later processes load the cached library. `SPECMESH_KERNEL_DIR`
moves that directory (the CPU image builds the kernel into itself: `python -m specmesh.kernels`).
`SPECMESH_KERNELS`: `auto` (default) measured; `1` the kernel for every shape, never timed (exact
batch invariance whatever the speed); `0` torch only. Without a compiler or on a CPU without
AVX2/FMA, `linear` is `torch.nn.functional.linear` and a one-line warning says why. Nothing here
knows about models beyond their `nn.Linear` weights.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specmesh.kernels import dispatch as _dispatch
from specmesh.paths import cache_root

SMALL_M_MAX = 17  # rows of a verification step: a 16-node tree + the pending token
# On the CPU torch's bf16/fp16 GEMM computes a row differently with the rows beside it (its one-row
# path is not its many-row one: a tiny bf16 model's greedy speculation left plain decoding at its
# 9th token, at 1 thread), so a tree's rows would not equal one-token decoding. Up to SMALL_M_MAX
# rows (a verification) `linear` makes each row its own product there, as a decode step computes
# it: exact, at a weight read per row (a tree costs its rows in these dtypes).
ROW_BY_ROW = (torch.bfloat16, torch.float16)
_SOURCE = Path(__file__).with_name("small_gemm.cpp")
_POOL = Path(__file__).with_name("pool.h")  # included by both kernels' sources
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w"]


class _Threads:
    budget = 0  # `set_threads`'s budget; 0: none given, the pool follows torch's thread count


def set_threads(budget: int, torch_ops: int | None = None) -> None:
    """This process's CPU thread budget: every product on specmesh's kernels may use `budget`
    threads (one pool per kernel library, the caller's thread included), torch's own ops
    `torch_ops` (default: `budget`; `specmesh.runtime.fit_threads` picks it for a model)."""
    if budget < 1 or (torch_ops is not None and not 1 <= torch_ops <= budget):
        raise ValueError(f"threads: need 1 <= torch_ops <= budget, got budget={budget} torch_ops={torch_ops}")
    torch.set_num_threads(torch_ops or budget)
    _Threads.budget = budget


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, else the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pool_threads() -> int:
    """Threads one product on specmesh's kernels may use: `set_threads`'s budget, else torch's count."""
    return _Threads.budget or torch.get_num_threads()


def describe_threads() -> str:
    """The thread budget and its split, e.g. `1`, or `2 (kernels 2, torch ops 1)`."""
    pool, ops = pool_threads(), torch.get_num_threads()
    return f"{pool}" + (f" (kernels {pool}, torch ops {ops})" if ops != pool else "")


def machine_key() -> dict:
    """What, besides a model's own layout (`layout_key`), decides what its forward costs in this
    process: the CPU, the thread split, torch, the kernel choices timed here (the fp32 dispatch
    table, the integer kernel's variants) and specmesh's own code (`code_key`)."""
    from specmesh.kernels import qdot

    return {"cpu": _dispatch.cpu_model(), "flags": _dispatch.cpu_flags(), "threads": describe_threads(),
            "torch": torch.__version__, "fp32": [str(_State.table), sorted(map(list, _State.torch_shapes))],
            "qdot": qdot.choice()["table"]["choice"] if qdot.available() else None, "code": code_key()}


@functools.cache
def code_key() -> str:
    """A hash of specmesh's sources (`source_hash` of the package), once per process: costs measured
    by one version of the code are not another's (a faster forward left a kept one-row step 30% too
    dear, and the planner drafted trees that lost)."""
    return source_hash(Path(__file__).resolve().parent.parent)


def source_hash(root: Path) -> str:
    """A hash of the Python and C++ sources under `root` (their paths and bytes)."""
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp", ".h") and p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def layout_key(module: nn.Module) -> str:
    """A hash of what a module's forward costs follow from, its values aside: every submodule's
    class, every parameter's and buffer's name, shape, dtype and device, and the weight format."""
    import hashlib

    h = hashlib.sha256(str(getattr(module, "weight_format", None) and module.weight_format.describe()).encode())
    for name, m in module.named_modules():
        h.update(f"{name}:{type(m).__name__};".encode())
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type};".encode())
    return h.hexdigest()[:32]


class _State:
    """Process-wide, like torch's own backend settings: one dispatch table per process."""
    op = None  # torch.ops.specmesh.small_linear once loaded
    tried = False
    reason = ""  # why the kernel is not in use
    mode = "auto"  # SPECMESH_KERNELS: auto | 1 (forced) | 0 (off)
    torch_shapes: frozenset = frozenset()  # (N, K) whose products go to torch's GEMM
    entries: dict = {}  # shape name -> timed entry, for the shapes tuned in this process
    table: Path | None = None


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECMESH_KERNEL_DIR") or cache_root() / "kernels")


def keyed_library(stem: str, source: Path, headers: list[Path], flags: tuple[str, ...] = ()) -> Path:
    """Where the library built from `source` (including `headers`) with the extra compiler `flags`
    is cached: keyed by their bytes, the compiler flags, torch, Python and the machine."""
    key = hashlib.sha256(
        source.read_bytes() + b"".join(h.read_bytes() for h in headers)
        + " ".join(_FLAGS + list(flags) + [torch.__version__, sys.version, platform.machine()]).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"{stem}-{key}.so"


def unsupported() -> str:
    """Why specmesh's compiled kernels cannot run in this process ('' when they can):
    SPECMESH_KERNELS=0, or a CPU without AVX2/FMA (they are built with -mavx2 -mfma)."""
    if (os.environ.get("SPECMESH_KERNELS") or "auto") == "0":
        return "disabled by SPECMESH_KERNELS=0"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2/FMA"
    return ""


def library_path() -> Path:
    return keyed_library("small_gemm", _SOURCE, [_POOL])


def _compile(out: Path, source: Path = _SOURCE, flags: tuple[str, ...] = ()) -> None:
    """Compile `source` into a private temporary file, then rename: concurrent builders never share a file."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *_FLAGS, *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=specmesh_kernels"]
        cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
        cmd += [str(source), "-o", str(tmp_out)]
        cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)


def build_library(path: Path, source: Path, what: str, flags: tuple[str, ...] = ()) -> Path:
    """Compile `source` (with the extra `flags`) into `path` if it is not cached yet (saying so: it
    takes ~30 s); `path`."""
    if not path.is_file():
        print(f"specmesh: compiling the {what} (once, ~30 s) ...", file=sys.stderr, flush=True)
        _compile(path, source, flags)
    return path


class CompiledOp:
    """One op of a specmesh kernel library (`source`, including `headers`), built on first use and
    cached like the others; `load()` once per process. Where it cannot load, `op` stays None and
    `reason` says why (`unsupported()`, or the build's or loader's error)."""

    def __init__(self, stem: str, source: Path, headers: list[Path], what: str, namespace: str, name: str) -> None:
        self.stem, self.source, self.headers, self.what = stem, source, headers, what
        self.namespace, self.name = namespace, name
        self.op = None
        self.tried = False
        self.reason = ""

    def library_path(self) -> Path:
        return keyed_library(self.stem, self.source, self.headers)

    def load(self) -> bool:
        if self.tried:
            return self.op is not None
        self.tried = True
        if why := unsupported():
            self.reason = why
            return False
        try:
            torch.ops.load_library(str(build_library(self.library_path(), self.source, self.what)))
            self.op = getattr(getattr(torch.ops, self.namespace), self.name)
        except (OSError, RuntimeError) as e:
            self.reason = str(e)
        return self.op is not None


def build() -> Path:
    """Compile the kernel library if it is not cached yet; return its path."""
    return build_library(library_path(), _SOURCE, "small-M CPU kernel")


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    mode = os.environ.get("SPECMESH_KERNELS") or "auto"
    if mode not in ("auto", "1", "0"):
        raise ValueError(f"SPECMESH_KERNELS: expected auto, 1 or 0, got {mode!r}")
    _State.mode = mode
    if why := unsupported():
        _State.reason = why
        return False
    try:
        torch.ops.load_library(str(build()))
        _State.op = torch.ops.specmesh.small_linear
    except (OSError, RuntimeError) as e:
        _State.reason = str(e)
        print(f"specmesh: small-M kernel unavailable, using torch's GEMM: {e}", file=sys.stderr)
    return _State.op is not None


def active() -> bool:
    return _State.op is not None


def reason() -> str:
    return _State.reason


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel itself, whatever the dispatch table says (timing, tests)."""
    y = _State.op(x, weight, pool_threads())
    return y if bias is None else y + bias


def tune(module: nn.Module) -> None:
    """Choose kernel or torch for the fp32 CPU `nn.Linear` weights of `module`, one path for all of
    them (`dispatch.model_choice`), from the cached table or by timing now (seconds, once per
    machine); one line on stderr says what was chosen."""
    if _State.op is None or _State.mode != "auto":
        return
    weights = _dispatch.linear_weights(module)
    if not weights:
        return
    entries, _State.table, spent = _dispatch.tune_weights(weights, kernel_linear, library_path())
    choice = _dispatch.model_choice(entries, {_dispatch.shape_name(*s): len(ws) for s, ws in weights.items()})
    # each shape's entry as this model runs it ("choice"), its own timing's verdict kept apart
    _State.entries = {**_State.entries, **{s: {**e, "choice": choice, "shape_choice": e["choice"]}
                                           for s, e in entries.items()}}
    mine = frozenset(weights)
    _State.torch_shapes = (_State.torch_shapes - mine) | (mine if choice == "torch" else frozenset())
    print(_dispatch.summary(entries, spent, choice), file=sys.stderr, flush=True)


def describe() -> dict:
    """What `linear` does in this process, for startup lines and benchmark JSON."""
    shapes = {s: {**e, "per_m_gain": _dispatch.per_m_gain(e)} for s, e in _State.entries.items()}
    return {
        "mode": {"auto": "measured", "1": "forced", "0": "off"}[_State.mode],
        "active": active(), "reason": _State.reason,
        "cpu": _dispatch.cpu_model(), "flags": _dispatch.cpu_flags(), "threads": torch.get_num_threads(),
        "torch": torch.__version__, "table": str(_State.table) if _State.table else None,
        "rows_timed": list(_dispatch.TUNE_ROWS), "shapes": shapes,
        # every fp32 product of <= SMALL_M_MAX rows goes through the kernel: rows independent of each other
        "batch_invariant": active() and not _State.torch_shapes,
    }


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the small-M kernel when it applies (fp32 CPU, 2-D x of <= SMALL_M_MAX rows)
    and the dispatch table does not send this weight shape to torch; bf16/fp16 weights on the CPU
    one row at a time up to SMALL_M_MAX rows (`ROW_BY_ROW`)."""
    op = _State.op
    if (op is None or x.dim() != 2 or x.shape[0] > SMALL_M_MAX or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_contiguous()
            or weight.shape in _State.torch_shapes
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        if weight.dtype in ROW_BY_ROW and x.dim() == 2 and 1 < x.shape[0] <= SMALL_M_MAX and x.device.type == "cpu":
            return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])
        return F.linear(x, weight, bias)
    y = op(x, weight, pool_threads())
    return y if bias is None else y + bias
