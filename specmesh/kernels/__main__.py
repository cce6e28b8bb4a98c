"""`python -m specmesh.kernels`: build (or find) the kernel library now and say whether it is used."""

import sys

from specmesh import kernels

if kernels.load():
    print(f"specmesh kernels: active ({kernels.library_path()})")
else:
    print(f"specmesh kernels: not used ({kernels.reason()})")
sys.exit(0)
