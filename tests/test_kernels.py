"""The small-M CPU kernel: same products as torch, batch-invariant rows, and a clean fallback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specmesh import kernels


def test_kernel_is_active_on_this_machine():
    """CI machines have a compiler and AVX2: the fast path must really be in use, not silently off."""
    if os.environ.get("SPECMESH_KERNELS") == "0":
        pytest.fail("SPECMESH_KERNELS=0 is set for the test run; the kernel tests need it on")
    assert kernels.load(), f"kernel unavailable: {kernels.reason()}"
    assert kernels.active()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("n,k", [(7, 13), (1001, 576), (64, 1536)])
def test_matches_torch_linear(m, n, k):
    kernels.load()
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    ref = F.linear(x.double(), w.double(), b.double())
    got = kernels.linear(x, w, b)
    assert got.shape == (m, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_do_not_depend_on_the_other_rows(threads):
    """Batch invariance: a row's output is bit-identical alone, in any batch, on any thread count."""
    kernels.load()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        x, w = torch.randn(kernels.SMALL_M_MAX, 576, generator=g), torch.randn(2050, 576, generator=g)
        alone = torch.cat([kernels.linear(x[i:i + 1], w) for i in range(x.shape[0])])
        for m in range(1, kernels.SMALL_M_MAX + 1):
            assert torch.equal(kernels.linear(x[:m], w), alone[:m]), m
        assert torch.equal(kernels.linear(x.flip(0), w), alone.flip(0))
    finally:
        torch.set_num_threads(before)


def test_large_batches_and_autograd_use_torch():
    kernels.load()
    x, w = torch.randn(kernels.SMALL_M_MAX + 1, 32), torch.randn(16, 32)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))
    w.requires_grad_(True)
    y = kernels.linear(x[:2], w)
    y.sum().backward()  # the kernel has no autograd: training must go through torch
    assert w.grad is not None and torch.equal(w.grad, x[:2].sum(0).expand(16, 32))


def _probe(env: dict[str, str]) -> str:
    code = ("import torch, torch.nn.functional as F; from specmesh import kernels\n"
            "ok = kernels.load(); x, w = torch.randn(3, 40), torch.randn(9, 40)\n"
            "assert ok or torch.equal(kernels.linear(x, w), F.linear(x, w))\n"
            "print(ok, kernels.reason())\n")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip() + "\n" + done.stderr


def test_disabled_by_environment():
    out = _probe({"SPECMESH_KERNELS": "0"})
    assert out.startswith("False disabled by SPECMESH_KERNELS=0"), out


def test_failed_build_falls_back_with_a_warning(tmp_path):
    """No usable compiler: torch's GEMM, and the user is told why (nothing cached, nothing broken)."""
    out = _probe({"SPECMESH_CACHE": str(tmp_path), "CXX": "false"})
    assert out.startswith("False false failed"), out
    assert "small-M kernel unavailable, using torch's GEMM" in out
    assert not list((tmp_path / "kernels").glob("*.so"))
