"""deploy/ray end to end, as a user runs it: a local Ray instance (2 CPUs, one `drafter_gpu`), a
real redis-server, and `python -m deploy.ray.launch --address <that instance>` placing a drafter,
a verifier TP group of 2 ranks (placement group, STRICT_PACK) and a router as Ray actors. One generation
through the router uses the drafter; SIGTERM stops every process, which deregisters from Redis.
Skips when `ray` is not installed (it is not a dependency of specmesh)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from specmesh.client import Client
from specmesh.registry import Keys

ray = pytest.importorskip("ray", reason="ray is not installed: `pip install ray` to run deploy/ray's e2e test")

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
KEY = "ray-test-key"
ROUTER = re.compile(r"router grpc (\S+) http (\S+)")


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server.url


@pytest.fixture(scope="module")
def ray_address():
    ctx = ray.init(num_cpus=2, resources={"drafter_gpu": 1}, include_dashboard=False, log_to_driver=False,
                   namespace="specmesh-test")
    yield ctx.address_info["gcs_address"]
    ray.shutdown()


class Launcher:
    """The launcher as a child process; its output drained into `lines`."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self.p = subprocess.Popen([sys.executable, "-m", "deploy.ray.launch", *args], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))
        threading.Thread(target=lambda: self.lines.extend(self.p.stdout), daemon=True).start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            assert self.p.poll() is None, f"launcher exited {self.p.returncode}:\n{''.join(self.lines[-40:])}"
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} after {timeout}s:\n{''.join(self.lines[-40:])}")

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(timeout=30)


def test_generation_through_a_router_placed_on_ray(redis_url, ray_address):
    r = redis.Redis.from_url(redis_url)
    keys = Keys()
    launcher = Launcher("--address", ray_address, "--namespace", "specmesh-test", "--redis-url", redis_url,
                        "--api-key", KEY, "--router-port", "0", "--router-http-port", "0",
                        "--router-cpus", "0.5", "--drafter-cpus", "0.5", "--tp", "2", "--cpus-per-rank", "0.5",
                        "--start-timeout-s", "150")
    try:
        assert "tp=2" in launcher.wait_for(r"specmesh-ray: ready.*", timeout=170).group(0)
        grpc_addr = ROUTER.search("".join(launcher.lines)).group(1)

        # Placement: the verifier's group is a STRICT_PACK placement group; the drafter took the
        # custom resource; both registered in Redis.
        groups = ray.util.placement_group_table()
        mine = [g for g in groups.values() if g["name"] == "specmesh-verifier-0" and g["state"] == "CREATED"]
        assert len(mine) == 1 and mine[0]["strategy"] == "STRICT_PACK" and len(mine[0]["bundles"]) == 2
        assert ray.available_resources().get("drafter_gpu", 0) == 0
        deadline = time.monotonic() + 10   # first heartbeats
        while len(r.zrange(keys.index, 0, -1)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(r.zrange(keys.index, 0, -1)) == 2, r.zrange(keys.index, 0, -1)

        prompt = "one two three four five one two three four five one two three four five one two three"
        with Client(grpc_addr, api_key=KEY, timeout=120) as client:
            out = client.complete(prompt, max_tokens=12, temperature=0.0)
        assert 0 < out.usage.completion_tokens <= 12 and out.token_ids
        assert out.speculation.drafted_tokens > 0, out.speculation  # the Ray-placed drafter drafted

        launcher.p.send_signal(signal.SIGTERM)
        assert launcher.p.wait(timeout=90) == 0, "".join(launcher.lines[-40:])
        assert any("specmesh-ray: stopped" in line for line in launcher.lines)
        # Stopped gracefully, the verifier and the drafter's sidecar deregistered (a killed process
        # would leave its address in the index until a router prunes it).
        assert r.zrange(keys.index, 0, -1) == []
        assert not [g for g in ray.util.placement_group_table().values()
                    if g["name"] == "specmesh-verifier-0" and g["state"] != "REMOVED"]
    finally:
        launcher.kill()
        r.close()
