"""Optional native kernels for the CPU runtime, built on first use; torch's own ops otherwise.

One kernel today, `small_gemm.cpp`: fp32 `y = x @ w.T` for x with few rows (a verification tree,
a decode step). Measured on this project's 2-core AMD EPYC (AVX2, no AVX-512), MKL's sgemm
takes 1.7-2.2x as long for 2-5 rows as for one row, so the target's forward over a 5-node tree
cost about 2 decode steps (`specmesh bench engine` reports it as `verify_cost`); with this kernel
a 5-node chain costs ~1.15 steps. It also makes each row's result independent of the other rows
in the call (batch invariance), which lets specmesh.batching verify sessions together.

The source is compiled with the system C++ compiler against the installed torch the first time a
model is loaded (~30 s on 2 cores), into `$SPECMESH_CACHE/kernels/` under a key of the source,
the torch version and the flags; later processes load the cached library. `SPECMESH_KERNEL_DIR`
moves that directory (the CPU image builds the kernel into itself: `python -m specmesh.kernels`).
Without a compiler, on a CPU without AVX2/FMA, or with `SPECMESH_KERNELS=0`, `linear` is
`torch.nn.functional.linear` and a one-line warning says why. Nothing here knows about models.
"""

from __future__ import annotations

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

SMALL_M_MAX = 17  # a 16-node tree + the pending token; at 17 rows still faster than MKL on every SmolLM2 shape
_SOURCE = Path(__file__).with_name("small_gemm.cpp")
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w"]


class _State:
    op = None  # torch.ops.specmesh.small_linear once loaded
    tried = False
    reason = ""  # why the kernel is not in use


def _cache_dir() -> Path:
    from specmesh.loader import cache_root

    return Path(os.environ.get("SPECMESH_KERNEL_DIR") or cache_root() / "kernels")


def library_path() -> Path:
    key = hashlib.sha256(
        _SOURCE.read_bytes() + " ".join(_FLAGS + [torch.__version__, sys.version, platform.machine()]).encode()
    ).hexdigest()[:16]
    return _cache_dir() / f"small_gemm-{key}.so"


def _compile(out: Path) -> None:
    """Compile into a private temporary file, then rename: concurrent builders never share a file."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        raise RuntimeError("no C++ compiler on PATH (set CXX)")
    out.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cxx, *_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-DTORCH_EXTENSION_NAME=specmesh_kernels"]
        cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
        cmd += [str(_SOURCE), "-o", str(tmp_out)]
        cmd += [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch", "-ltorch_cpu"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)


def build() -> Path:
    """Compile the kernel library if it is not cached yet; return its path."""
    path = library_path()
    if not path.is_file():
        print("specmesh: compiling the small-M CPU kernel (once, ~30 s) ...", file=sys.stderr, flush=True)
        _compile(path)
    return path


def load() -> bool:
    """Make the kernel available in this process (once); False, with `reason()` set, when it cannot."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    if os.environ.get("SPECMESH_KERNELS", "1") == "0":
        _State.reason = "disabled by SPECMESH_KERNELS=0"
        return False
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        _State.reason = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2/FMA"
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`, through the small-M kernel when it applies (fp32 CPU, 2-D x of <= SMALL_M_MAX rows)."""
    op = _State.op
    if (op is None or x.dim() != 2 or x.shape[0] > SMALL_M_MAX or x.dtype != torch.float32
            or weight.dtype != torch.float32 or x.device.type != "cpu" or not weight.is_contiguous()
            or torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return F.linear(x, weight, bias)
    y = op(x, weight)
    return y if bias is None else y + bias
