"""`python -m specmesh.kernels`: build (or find) the kernel library now and say whether it is used.

`--report` prints this machine's dispatch tables for this torch thread count (`--threads`): per
weight shape and row count, the fp32 kernel's and torch's median time and the choice; per layout
and row count, which build of the integer kernel runs (AVX2 or AVX512-VNNI) and their times. `--target PATH`
loads that model first, which times its shapes if the table lacks them.
"""

import argparse
import sys

import torch

from specmesh import kernels
from specmesh.kernels import dispatch

parser = argparse.ArgumentParser(prog="python -m specmesh.kernels")
parser.add_argument("--report", action="store_true", help="print the dispatch table (kernel vs torch per shape)")
parser.add_argument("--threads", type=int, default=None, help="torch threads the table is for (default: torch's)")
parser.add_argument("--target", default=None, help="a model path: tune for its weight shapes first")
parser.add_argument("--bench", metavar="OUT.json", default=None,
                    help="kernel vs torch at 1 and 2 threads on Qwen2.5-1.5B shapes, written to OUT.json")
args = parser.parse_args()
if args.threads:
    kernels.set_threads(args.threads)
if kernels.load():
    print(f"specmesh kernels: active ({kernels.library_path()}, dispatch {kernels.describe()['mode']})")
else:
    print(f"specmesh kernels: not used ({kernels.reason()})")
from specmesh.kernels import q4  # noqa: E402 - the 4-bit kernel, built here too (the CPU image)

print(f"specmesh 4-bit kernel: {f'active ({q4.library_path()})' if q4.load() else f'not used ({q4.reason()})'}")
from specmesh.kernels import ggml, qdot  # noqa: E402 - the integer kernel (--dtype gguf), and ggml's where installed

print(f"specmesh integer kernel: {f'active ({qdot.library_path()})' if qdot.load() else f'not used ({qdot.reason()})'}")
if qdot.available() and args.report:  # which build runs per layout and row count, timed on this machine
    d = qdot.describe()
    print(f"integer kernel variants {', '.join(d['variants'])} at {d['threads']} threads: {d['choice']}")
    for bits, cells in d.get("timed_us", {}).items():
        print(f"  {bits}-bit, us per call by rows: " + "; ".join(
            f"{v} " + " ".join(f"{m}:{us:.0f}" for m, us in by_rows.items()) for v, by_rows in cells.items()))
print(f"ggml kernels: {f'active ({ggml.provider()})' if ggml.load() else f'not used ({ggml.reason()})'}")
from specmesh.kernels import attention, glue  # noqa: E402 - exact row attention, layer glue (fp32 CPU)

print(f"row attention kernel: {f'active ({attention.library_path()})' if attention.load() else f'not used ({attention.reason()})'}")
print(f"glue kernels: {f'active ({glue.library_path()})' if glue.available() else f'not used ({glue.reason()})'}")
if args.report or args.target:
    if args.target:
        from specmesh.loader import load_model

        load_model(args.target)
    if kernels.active():
        lib = kernels.library_path()
        path = dispatch.table_path(lib, dispatch.table_key(lib))
        print(f"table: {path}")
        dispatch.report(dispatch.read_table(path))
if args.bench and kernels.active():
    import json

    from specmesh.kernels import bench

    result = bench.bench(kernels.kernel_linear)
    with open(args.bench, "w") as f:
        json.dump(result, f, indent=1)
    print(bench.table(result))
sys.exit(0)
