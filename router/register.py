"""Registration of a verifier or drafter in the router's Redis registry: a heartbeat thread that
re-writes the endpoint's entry (`P ep:{address}`, see router.state) every `interval_s` with a TTL
of `ttl_s`, so a process that dies (even kill -9) drops out of placement within `ttl_s`.

Two ways to run it:
- in process: `start_heartbeat(...)` from a service's entry point when it was given a Redis URL
  (the verifier does; `load` reports its sessions);
- as a sidecar: `python -m router.register --redis-url URL --role drafter --address HOST:PORT`
  heartbeats on behalf of a process that has no hook, while that process answers
  grpc.health.v1 Check with SERVING (k8s sidecar pattern); `--peer-ca/--peer-cert/--peer-key`
  when that process serves TLS / mTLS (specmesh.tls).

Uses the synchronous redis client in a daemon thread: the services are thread-based. A Redis
outage only logs; beats resume when it is back. Knows nothing about placement.

A verifier passes `held` (its sessions): a beat that finds the endpoint's own entry gone (Redis
lost its data, or beats stopped for longer than the TTL) first writes each held session's binding
and history back where Redis has no binding for it (router.state `REPUBLISH_LUA`), then registers,
so a router that sees the verifier registered again also sees its sessions.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import redis
from redis.exceptions import RedisError

from router.policies import Binding, Endpoint, Role
from router.state import (
    DEFAULT_PREFIX,
    REPUBLISH_LUA,
    SESSION_TTL_S,
    Keys,
    binding_to_json,
    endpoint_from_json,
    endpoint_to_json,
    pack_tokens,
    retry_options,
)
from specmesh.tls import PLAINTEXT_PEER, PeerTls, add_peer_args, peer_channel, peer_from_args

log = logging.getLogger(__name__)

INTERVAL_S = 2.0
TTL_S = 6.0
Held = tuple[str, list[int], str]  # a session a verifier holds: (id, tokens, drafter address or "")
ADVERTISE_ENV = "SPECMESH_ADVERTISE_ADDR"
PREFIX_ENV = "SPECMESH_REDIS_PREFIX"


def model_name(path: str | os.PathLike) -> str:
    """The name a model is served under: a file's stem, a folder's name
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct.Q4_1)."""
    p = Path(path)
    return p.stem if p.suffix in (".gguf", ".safetensors") else p.name


def advertised_address(host: str, port: int) -> str:
    """Where routers should dial this process: $SPECMESH_ADVERTISE_ADDR, else host:port with a
    wildcard host replaced by this machine's address."""
    if os.environ.get(ADVERTISE_ENV):
        return os.environ[ADVERTISE_ENV]
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{port}"


class Heartbeat:
    """Writes `endpoint` (updated by `load()`) every `interval_s` until `stop()`."""

    def __init__(self, client: redis.Redis, endpoint: Endpoint, load: Callable[[], dict] | None = None,
                 interval_s: float = INTERVAL_S, ttl_s: float = TTL_S, prefix: str = DEFAULT_PREFIX,
                 alive: Callable[[], bool] | None = None, held: Callable[[], list[Held]] | None = None,
                 session_ttl_s: float = SESSION_TTL_S) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(f"heartbeat: need 0 < interval_s ({interval_s}) < ttl_s ({ttl_s})")
        self.client, self.endpoint, self.load = client, endpoint, load
        self.interval_s, self.ttl_s = interval_s, ttl_s
        self.alive, self.held = alive, held
        self.session_ttl_ms = int(session_ttl_s * 1000)  # the router's default; its turns refresh them
        self.keys = Keys(prefix)
        self._republish = client.register_script(REPUBLISH_LUA)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specmesh-heartbeat", daemon=True)

    def beat(self) -> None:
        """One heartbeat (raises RedisError)."""
        e = replace(self.endpoint, **self.load()) if self.load is not None else self.endpoint
        if self.held is not None and not self.client.exists(self.keys.endpoint(e.address)):
            n = self.republish()
            if n:
                log.warning("heartbeat of %s: registry entry was gone; wrote back %d session(s) Redis lacked",
                            e.address, n)
        p = self.client.pipeline(transaction=False)
        p.set(self.keys.endpoint(e.address), endpoint_to_json(e), px=int(self.ttl_s * 1000))
        p.zadd(self.keys.index, {e.address: 0})
        p.execute()

    def republish(self) -> int:
        """Write back the held sessions Redis has no binding for; how many were written."""
        sessions = self.held() if self.held is not None else []
        if not sessions:
            return 0
        p = self.client.pipeline(transaction=False)
        for sid, tokens, drafter in sessions:
            self._republish(keys=[self.keys.binding(sid), self.keys.history(sid)],
                            args=[binding_to_json(Binding(self.endpoint.address, drafter)), pack_tokens(tokens),
                                  self.session_ttl_ms], client=p)
        return sum(int(x) for x in p.execute())

    def deregister(self) -> None:
        p = self.client.pipeline(transaction=False)
        p.delete(self.keys.endpoint(self.endpoint.address))
        p.zrem(self.keys.index, self.endpoint.address)
        p.execute()

    def _run(self) -> None:
        while True:
            try:
                if self.alive is None or self.alive():
                    self.beat()
            except RedisError as exc:
                log.warning("heartbeat of %s: %s", self.endpoint.address, exc)
            if self._stop.wait(self.interval_s):
                return

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, deregister: bool = True) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        if deregister:
            try:
                self.deregister()
            except RedisError as exc:
                log.warning("deregister %s: %s", self.endpoint.address, exc)
        self.client.close()


def start_heartbeat(redis_url: str, role: str, address: str, model: str = "", capacity: int = 0,
                    load: Callable[[], dict] | None = None, prefix: str | None = None,
                    interval_s: float = INTERVAL_S, ttl_s: float = TTL_S,
                    held: Callable[[], list[Held]] | None = None) -> Heartbeat:
    """Register `address` and keep it registered from a daemon thread; `stop()` deregisters.
    `load()` returns fields of Endpoint to refresh each beat (active_sessions, kv_tokens); `held()`
    the sessions to write back after Redis lost them (see the module docstring).
    `prefix` None = $SPECMESH_REDIS_PREFIX, else the default (as the router's --redis-prefix)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0, **retry_options(sync=True))
    ep = Endpoint(address=address, role=Role(role), model=model, capacity=capacity)
    return Heartbeat(client, ep, load, interval_s, ttl_s, _prefix(prefix), held=held).start()


def _prefix(prefix: str | None) -> str:
    """The registry's key prefix: `prefix`, else $SPECMESH_REDIS_PREFIX, else the default."""
    return prefix if prefix is not None else os.environ.get(PREFIX_ENV, DEFAULT_PREFIX)


def registered_role(client: redis.Redis, address: str, prefix: str | None = None) -> Role | None:
    """The role `address` holds in the registry (a live heartbeat), or None. Raises RedisError.
    `prefix` None = $SPECMESH_REDIS_PREFIX, else the default."""
    raw = client.get(Keys(_prefix(prefix)).endpoint(address))
    return None if raw is None else endpoint_from_json(raw).role


def _health_probe(address: str, timeout_s: float, peer: PeerTls = PLAINTEXT_PEER) -> Callable[[], bool]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(peer_channel(address, peer))

    def alive() -> bool:
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    return alive


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m router.register",
                                description="Heartbeat a verifier or drafter into the router registry (sidecar).")
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", ""), required=not env("SPECMESH_REDIS_URL"))
    p.add_argument("--redis-prefix", default=env(PREFIX_ENV, DEFAULT_PREFIX))
    p.add_argument("--role", choices=[r.value for r in Role], required=True)
    p.add_argument("--address", required=True, help="host:port routers dial (health-checked before each beat)")
    p.add_argument("--model", default="", help="model name served / drafted for ('' = any)")
    p.add_argument("--capacity", type=int, default=0)
    p.add_argument("--interval-s", type=float, default=INTERVAL_S)
    p.add_argument("--ttl-s", type=float, default=TTL_S)
    add_peer_args(p, env, "the process (its health check)")
    a = p.parse_args(argv)
    peer = peer_from_args(vars(a))
    try:
        peer.validate()
    except ValueError as e:
        p.error(str(e))
    client = redis.Redis.from_url(a.redis_url, socket_timeout=2.0, socket_connect_timeout=2.0, **retry_options(sync=True))
    ep = Endpoint(address=a.address, role=Role(a.role), model=a.model, capacity=a.capacity)
    hb = Heartbeat(client, ep, None, a.interval_s, a.ttl_s, a.redis_prefix,
                   alive=_health_probe(a.address, min(1.0, a.interval_s), peer))
    import signal

    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    hb.start()
    print(f"router.register: heartbeating {a.role} {a.address} every {a.interval_s}s (ttl {a.ttl_s}s)", flush=True)
    done.wait()
    hb.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
