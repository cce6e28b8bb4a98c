"""The registry contract: how a verifier or drafter registers in the Redis that routers share, and
the key names and encodings every writer and reader of that Redis uses. The services write it
(`start_heartbeat` from their entry points when given a Redis URL), the `router.register` sidecar
writes it for drafters that are not specmesh's, the router reads it (router.state).

Keys (`Keys`; `P` = the prefix, default `specmesh:`, $SPECMESH_REDIS_PREFIX; session ids and
addresses are used as they are — Redis keys are binary-safe; session ids are at most 256
characters; a router with API keys scopes them as `<key id>/<session id>`):

- `P ep:{address}` (string, ~200 B, TTL = `TTL_S`, 6 s, beat every `INTERVAL_S`, 2 s): JSON
  Endpoint {address, role, model, capacity, active_sessions, kv_tokens}.
- `P endpoints` (zset, no TTL): index of registered addresses; members whose `ep:` key expired
  are pruned on read.
- `P bind:{session}` (string, ~100 B, TTL = session TTL, default `SESSION_TTL_S`, 1 h, refreshed
  every turn): JSON Binding {"verifier", "drafter", "epoch"}.
- `P hist:{session}` (string, 4 B/token: 8k tokens = 32 KiB; session TTL, refreshed every turn):
  the token history as packed little-endian int32.

The router's own keys (`load:`, `rr`, `gen`, `keysess:`) are named in `Keys` too, one namespace;
what they hold: router.state.

Heartbeat: a daemon thread re-writes the endpoint's `ep:` entry every `interval_s` with a TTL of
`ttl_s`, so a process that dies (even kill -9) drops out of placement within `ttl_s`. A Redis
outage only logs; beats resume when it is back. A verifier passes `held` (its sessions): a beat
that finds the endpoint's own entry gone (Redis lost its data, or beats stopped for longer than
the TTL) first writes each held session's binding and history back where Redis has no binding for
it (`REPUBLISH_LUA`), then registers, so a router that sees the verifier registered again also
sees its sessions.

A transport edge, like specmesh.client: it imports redis (the synchronous client in a thread: the
services are thread-based), not grpc; it knows nothing of placement nor of the router.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from pathlib import Path

import numpy as np
import redis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "specmesh:"
PREFIX_ENV = "SPECMESH_REDIS_PREFIX"
ADVERTISE_ENV = "SPECMESH_ADVERTISE_ADDR"
INTERVAL_S = 2.0
TTL_S = 6.0
SESSION_TTL_S = 3600.0  # binding and history live this long after a session's last turn (default)
TOKEN = np.dtype("<i4")  # a token of `hist:`
RETRIES, RETRY_BASE_S, RETRY_CAP_S = 8, 0.02, 1.0  # ~4 s of attempts: a restart, not an outage
HEALTH_CHECK_S = 10
Held = tuple[str, list[int], str]  # a session a verifier holds: (id, tokens, drafter address or "")


class Role(StrEnum):
    VERIFIER = "verifier"
    DRAFTER = "drafter"


@dataclass(frozen=True)
class Endpoint:
    """A registry entry, as its process last reported it."""
    address: str                 # host:port the router dials
    role: Role
    model: str = ""              # served / drafted-for model name ("" = any)
    capacity: int = 0            # turns it serves at once (0 = unbounded)
    active_sessions: int = 0     # sessions it holds (KV caches)
    kv_tokens: int = 0           # tokens held across those sessions (0 = not reported)


@dataclass(frozen=True)
class Binding:
    """Which verifier (and drafter) serve a session; `epoch` grows with every change."""
    verifier: str
    drafter: str = ""            # "" = the verifier's own default (or none)
    epoch: int = 1


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def endpoint(self, address: str) -> str:
        return f"{self.prefix}ep:{address}"

    @property
    def index(self) -> str:
        return f"{self.prefix}endpoints"

    def binding(self, session_id: str) -> str:
        return f"{self.prefix}bind:{session_id}"

    def history(self, session_id: str) -> str:
        return f"{self.prefix}hist:{session_id}"

    def load(self, address: str) -> str:
        return f"{self.prefix}load:{address}"

    @property
    def round_robin(self) -> str:
        return f"{self.prefix}rr"

    def key_sessions(self, key_id: str) -> str:
        return f"{self.prefix}keysess:{key_id}"

    @property
    def generation(self) -> str:
        return f"{self.prefix}gen"


def endpoint_to_json(e: Endpoint) -> str:
    d = asdict(e)
    d["role"] = e.role.value
    return json.dumps(d, separators=(",", ":"))


def endpoint_from_json(raw: str | bytes) -> Endpoint:
    d = json.loads(raw)
    return Endpoint(address=d["address"], role=Role(d["role"]), model=d.get("model", ""),
                    capacity=int(d.get("capacity", 0)), active_sessions=int(d.get("active_sessions", 0)),
                    kv_tokens=int(d.get("kv_tokens", 0)))


def binding_to_json(b: Binding) -> str:
    return json.dumps({"verifier": b.verifier, "drafter": b.drafter, "epoch": b.epoch}, separators=(",", ":"))


def binding_from_json(raw: str | bytes) -> Binding:
    d = json.loads(raw)
    return Binding(d["verifier"], d.get("drafter", ""), int(d["epoch"]))


def pack_tokens(ids: Sequence[int]) -> bytes:
    return np.asarray(ids, dtype=TOKEN).tobytes()


def unpack_tokens(data: bytes | None) -> list[int]:
    return np.frombuffer(data, dtype=TOKEN).tolist() if data else []


def retry_options(sync: bool = False) -> dict:
    """redis-py client options of every specmesh client (router: asyncio; heartbeats: `sync`):
    retry a command after a connection or timeout error (a restarted server, a stale pooled
    connection)."""
    retry = SyncRetry if sync else AsyncRetry
    return {"retry": retry(ExponentialWithJitterBackoff(cap=RETRY_CAP_S, base=RETRY_BASE_S), RETRIES),
            "retry_on_error": [RedisConnectionError, RedisTimeoutError],
            "health_check_interval": HEALTH_CHECK_S}


# KEYS = binding, history; ARGV = binding JSON, packed tokens, TTL ms. A verifier's copy of a
# session, written back only where Redis holds no binding for it (after Redis lost its data).
REPUBLISH_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
return 1
"""


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
    """Writes `endpoint` (updated by `load()`) every `interval_s` until `stop()`; a beat is skipped
    while `alive()` says False (the sidecar's health check)."""

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


def connect(redis_url: str) -> redis.Redis:
    """The synchronous client of a heartbeat (and of the sidecar)."""
    return redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0,
                                **retry_options(sync=True))


def start_heartbeat(redis_url: str, role: str, address: str, model: str = "", capacity: int = 0,
                    load: Callable[[], dict] | None = None, prefix: str | None = None,
                    interval_s: float = INTERVAL_S, ttl_s: float = TTL_S,
                    held: Callable[[], list[Held]] | None = None) -> Heartbeat:
    """Register `address` and keep it registered from a daemon thread; `stop()` deregisters.
    `load()` returns fields of Endpoint to refresh each beat (active_sessions, kv_tokens); `held()`
    the sessions to write back after Redis lost them (see the module docstring).
    `prefix` None = $SPECMESH_REDIS_PREFIX, else the default (as the router's --redis-prefix)."""
    ep = Endpoint(address=address, role=Role(role), model=model, capacity=capacity)
    return Heartbeat(connect(redis_url), ep, load, interval_s, ttl_s, _prefix(prefix), held=held).start()


def _prefix(prefix: str | None) -> str:
    """The registry's key prefix: `prefix`, else $SPECMESH_REDIS_PREFIX, else the default."""
    return prefix if prefix is not None else os.environ.get(PREFIX_ENV, DEFAULT_PREFIX)


def registered_role(client: redis.Redis, address: str, prefix: str | None = None) -> Role | None:
    """The role `address` holds in the registry (a live heartbeat), or None. Raises RedisError.
    `prefix` None = $SPECMESH_REDIS_PREFIX, else the default."""
    raw = client.get(Keys(_prefix(prefix)).endpoint(address))
    return None if raw is None else endpoint_from_json(raw).role
