"""The drafter service registers itself in the router registry (`--redis-url`), as the verifier
does, heartbeating its load, and leaves it on SIGTERM: a real redis-server and a real process."""

from __future__ import annotations

import signal
import time

import pytest
import redis

from specmesh.registry import Role, registered_role
from tests.drafter_service.test_drafter_service import Service

pytestmark = pytest.mark.e2e


def wait_for(check, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    return check()


def test_the_drafter_service_registers_itself_and_leaves_on_sigterm(redis_server, tmp_path):
    client = redis.Redis.from_url(redis_server.url)
    svc = Service(tmp_path, "--drafter", "ngram", "--redis-url", redis_server.url)
    try:
        assert wait_for(lambda: registered_role(client, svc.address)) == Role.DRAFTER
        s = svc.stream()
        assert s.ask("a", open=svc_open()).error == ""
        # its load is in the registry: the session it holds
        assert wait_for(lambda: _endpoint(client, svc.address).active_sessions == 1)
        s.close()
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(15) == 0
        assert registered_role(client, svc.address) is None, "deregistered on stop"
    finally:
        svc.stop()


def svc_open():
    from specmesh.v1 import drafter_pb2

    return drafter_pb2.OpenSession(context=[1, 2, 3, 1, 2], budget=4, depth=2, fixed_shape=True)


def _endpoint(client: redis.Redis, address: str):
    from specmesh.registry import DEFAULT_PREFIX, Keys, endpoint_from_json

    return endpoint_from_json(client.get(Keys(DEFAULT_PREFIX).endpoint(address)))
