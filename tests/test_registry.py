"""The registry contract on a real redis-server: the heartbeat thread registers, refreshes and
deregisters an endpoint as the router reads it (router.state), a verifier writes back the sessions
Redis lost, the token encoding, model names, and that registering loads nothing of the router."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import redis

from router.state import RouterState
from specmesh.registry import Binding, Endpoint, Heartbeat, Role, model_name, pack_tokens, unpack_tokens
from tests.router.test_state import run

ROOT = Path(__file__).resolve().parents[1]


def test_pack_tokens_is_little_endian_int32():
    assert pack_tokens([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert unpack_tokens(pack_tokens([5, 0, 123456])) == [5, 0, 123456]
    assert unpack_tokens(None) == []


def test_heartbeat_registers_refreshes_and_deregisters(redis_server):
    prefix = f"hb-{uuid.uuid4().hex[:8]}:"
    sessions = [3]
    hb = Heartbeat(redis.Redis.from_url(redis_server.url), Endpoint("v:1", Role.VERIFIER, model="m"),
                   load=lambda: {"active_sessions": sessions[0]}, interval_s=0.1, ttl_s=0.5, prefix=prefix).start()

    async def endpoints(s: RouterState):
        return await RouterState(s.r, prefix).endpoints()
    try:
        time.sleep(0.3)
        assert run(endpoints, redis_server.url) == [Endpoint("v:1", Role.VERIFIER, model="m", active_sessions=3)]
        sessions[0] = 5
        time.sleep(0.8)  # longer than the TTL: only the refreshes keep it registered
        assert run(endpoints, redis_server.url)[0].active_sessions == 5
    finally:
        hb.stop()
    assert run(endpoints, redis_server.url) == []


def test_a_verifier_writes_back_its_sessions_when_redis_lost_them(redis_server):
    """The heartbeat that finds its own entry gone writes each held session's binding and history
    back before registering, but never over a binding Redis still has."""
    prefix = f"wb-{uuid.uuid4().hex[:8]}:"
    held = [("k/a", [5, 6, 7], ""), ("b", [1, 2], "d:9")]
    client = redis.Redis.from_url(redis_server.url)
    hb = Heartbeat(client, Endpoint("v:1", Role.VERIFIER), held=lambda: held, interval_s=0.1, ttl_s=0.5,
                   prefix=prefix, session_ttl_s=60)

    async def sessions(s: RouterState):
        st = RouterState(s.r, prefix)
        return [await st.session(sid) for sid in ("k/a", "b")]
    try:
        run(lambda s: RouterState(s.r, prefix).bind("b", Binding("other:1", "", 4), None), redis_server.url)
        hb.beat()  # first beat: no entry yet, so the held sessions Redis lacks are written
        assert run(sessions, redis_server.url) == [(Binding("v:1", "", 1), [5, 6, 7]), (Binding("other:1", "", 4), [])]
        assert 0 < client.pttl(f"{prefix}hist:k/a") <= 60_000
        client.delete(f"{prefix}bind:k/a", f"{prefix}hist:k/a")
        hb.beat()  # registered: nothing is written back
        assert run(sessions, redis_server.url)[0] == (None, [])
        client.delete(f"{prefix}ep:v:1", f"{prefix}bind:b")
        hb.beat()  # the entry is gone again (Redis lost its data): both come back
        assert run(sessions, redis_server.url) == [(Binding("v:1", "", 1), [5, 6, 7]), (Binding("v:1", "d:9", 1), [1, 2])]
    finally:
        hb.deregister()
        client.close()


def test_model_name_of_paths():
    assert model_name("/x/SmolLM2-135M-Instruct.Q4_1.gguf") == "SmolLM2-135M-Instruct.Q4_1"
    assert model_name("/models/Llama-3.1-8B") == "Llama-3.1-8B"


def test_a_service_registers_without_loading_the_router():
    """Verifiers and drafters heartbeat through specmesh.registry: the router package (and grpc,
    which the registry does not need) stay out of the process."""
    code = ("import sys, specmesh.registry\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('router', 'grpc')))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
