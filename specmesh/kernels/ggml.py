"""GGUF blocks multiplied by ggml's own CPU kernels (llama.cpp's), through llama-cpp-python's libggml.

A weight stays the tensor's raw GGUF blocks ([N, row bytes] uint8, exactly the file's bytes), and
`linear(x, w, qtype)` computes x @ W.T the way llama.cpp does: each activation row quantized once to
the type's `vec_dot_type` by ggml's `from_float`, then one ggml `vec_dot` per output
(`ggml_linear.cpp`; pointers from ggml's public `ggml_get_type_traits_cpu`). Every GGUF block type
ggml has a CPU kernel for works (Q4_0/1, Q5_0/1, Q8_0, Q2_K..Q6_K, IQ*), at the size it ships.

The library: `libggml-cpu` of the installed `llama-cpp-python` (the `gguf-kernels` extra), found by
file, without importing `llama_cpp`; `SPECMESH_GGML_LIB` names another libggml-cpu. Where none loads,
`available()` is False and `reason()` says why; callers fall back (specmesh.quant).

Numerics are ggml's, not fp32's: activations are quantized to 8 bits per block as llama.cpp does, so
outputs differ from x @ dequantized-W.T by that rounding (the README's drift table). Each output is a
single vec_dot call whatever the batch, so the product is batch-invariant.
This module knows ggml types and tensors; it knows nothing about models.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from pathlib import Path

import torch

from specmesh import kernels as _k

_SOURCE = Path(__file__).with_name("ggml_linear.cpp")
_HEADERS = [Path(__file__).with_name("pool.h")]


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p),
                ("vec_dot_type", ctypes.c_int), ("nrows", ctypes.c_int64)]


class _State:
    """Process-wide, like `specmesh.kernels._State`."""
    op = None
    tried = False
    reason = ""
    lib: Path | None = None
    cpu = None  # ctypes.CDLL of libggml-cpu
    base = None  # ctypes.CDLL of libggml-base
    types: dict[tuple[int, int], tuple[int, int, int]] = {}  # (ggml type, K) -> `_kernels`


def ggml_library() -> Path | None:
    """libggml-cpu.so: $SPECMESH_GGML_LIB, else the one in the installed llama-cpp-python."""
    if os.environ.get("SPECMESH_GGML_LIB"):
        return Path(os.environ["SPECMESH_GGML_LIB"])
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib" / "libggml-cpu.so"
    return lib if lib.is_file() else None


def library_path() -> Path:
    return _k.keyed_library("ggml_linear", _SOURCE, _HEADERS)


def load() -> bool:
    """Make the kernels available in this process (once); False, with `reason()` set, when they cannot."""
    if _State.tried:
        return _State.op is not None
    _State.tried = True
    if why := _k.unsupported():  # the op is built with the same AVX2 flags as ours
        _State.reason = why
        return False
    lib = ggml_library()
    if lib is None or not lib.is_file():
        _State.reason = "llama-cpp-python is not installed (pip install 'specmesh[gguf-kernels]')"
        return False
    try:
        base = ctypes.CDLL(str(lib.with_name("libggml-base.so")), mode=ctypes.RTLD_GLOBAL)
        cpu = ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        cpu.ggml_cpu_init.restype = None
        cpu.ggml_cpu_init()
        cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
        cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
        base.ggml_row_size.restype = ctypes.c_size_t
        base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        base.ggml_blck_size.restype = ctypes.c_int64
        base.ggml_blck_size.argtypes = [ctypes.c_int]
        torch.ops.load_library(str(_k.build_library(library_path(), _SOURCE, "ggml linear op")))
        _State.op = torch.ops.specmesh_ggml.ggml_linear
        _State.cpu, _State.base, _State.lib = cpu, base, lib
    except (OSError, RuntimeError, AttributeError) as e:
        _State.reason = f"{lib}: {e}"
    return _State.op is not None


def available() -> bool:
    return load()


def reason() -> str:
    return _State.reason


def library() -> str:
    """The libggml-cpu in use (for the model card), '' when none."""
    return str(_State.lib) if _State.lib else ""


def provider() -> str:
    """e.g. 'llama-cpp-python 0.3.36', or the library's path under SPECMESH_GGML_LIB."""
    if os.environ.get("SPECMESH_GGML_LIB"):
        return os.environ["SPECMESH_GGML_LIB"]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"llama-cpp-python {version('llama-cpp-python')}"
    except PackageNotFoundError:
        return library()


def supports(qtype: int, k: int) -> bool:
    """Whether ggml has a CPU kernel for weights of ggml type `qtype` with rows of `k` inputs."""
    if not load():
        return False
    t = _State.cpu.ggml_get_type_traits_cpu(int(qtype)).contents
    if not t.vec_dot or t.nrows != 1:
        return False
    return k % _State.base.ggml_blck_size(int(qtype)) == 0 and k % _State.base.ggml_blck_size(t.vec_dot_type) == 0


def row_bytes(qtype: int, k: int) -> int:
    load()
    return int(_State.base.ggml_row_size(int(qtype), k))


def _kernels(qtype: int, k: int) -> tuple[int, int, int]:
    """(vec_dot, from_float, activation row bytes) for weight type `qtype` and K = k."""
    key = (int(qtype), k)
    if key not in _State.types:
        load()
        t = _State.cpu.ggml_get_type_traits_cpu(int(qtype)).contents
        from_float = _State.cpu.ggml_get_type_traits_cpu(t.vec_dot_type).contents.from_float
        _State.types[key] = (t.vec_dot, from_float, int(_State.base.ggml_row_size(t.vec_dot_type, k)))
    return _State.types[key]


def linear(x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
    """y [M, N] = x [M, K] fp32 @ W.T for W the GGUF blocks w [N, row bytes] of ggml type `qtype`;
    call only when `supports(qtype, K)`."""
    vec_dot, from_float, x_row = _kernels(qtype, int(x.shape[-1]))
    return _State.op(x, w, vec_dot, from_float, x_row, _k.pool_threads())
