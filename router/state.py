"""Session and registry state in Redis (redis-py asyncio), shared by every router replica.

No router holds state that another needs: a session alternating between routers sees one binding,
one history. The registry and session keys (`P ep:{address}`, `P endpoints`, `P bind:{session}`,
`P hist:{session}`), their sizes, TTLs and encodings are the registry contract, specmesh.registry,
which verifiers and drafters write through too (`P` = the prefix, default `specmesh:`; with API
keys configured `{session}` is `<key id>/<session id>`: `scoped_session`). The router's own
keys:

- `P load:{address}` (hash, TTL 10 min refreshed on every change): `turns`, `tokens` = turns in
  flight and their context tokens, summed over all routers.
- `P rr` (string, no TTL): round-robin counter (INCR).
- `P gen` (string, no TTL): this Redis's generation, a random id written by the first router that
  finds it missing. A router that remembered another id knows Redis lost its data
  (a restart without persistence, a flush) since it last looked.
- `P keysess:{key id}` (zset, ~60 B + session id per member; TTL = session TTL, refreshed every
  turn; only with `--max-sessions-per-key`): the live sessions of one API key, scored by the
  time (router clock, ms) their last turn started and ended. Members older than the session TTL
  are pruned before every count, so a session stops counting when its binding lapses. The key id
  is the first 16 hex digits of sha256(API key): no secret appears in key names.

Binding writes are first-writer-wins: a new binding is written only if none exists; a rebinding
only if the stored epoch is still the one the writer read (compare-and-set in one Lua script), so
two routers placing one session at once agree on the winner's binding.
History is written when the first token of a turn arrives (so a refused turn leaves none) and then
appended chunk by chunk. A router killed mid-turn leaves its `load:` increments until that key's
TTL lapses with no traffic (the counters are a placement hint, never a correctness input).

Sessions per key: a turn of a session not yet in its key's set is admitted only while the set
holds fewer than the limit (prune, count, add: one Lua script, so concurrent routers never admit
past it); a session already in it always is. CloseSession removes it from the caller's set.

After Redis lost its data the verifiers' copies are authoritative: each verifier's heartbeat,
finding its own `ep:` entry gone, first writes `bind:` and `hist:` back for every session it holds
(only where no binding exists: specmesh.registry `Heartbeat.republish`), then registers; a
router that finds the generation changed waits for the verifiers it knew to register again before
placing an unbound session (router.turns). Sessions are bound to a verifier, so with several
verifiers each session comes back from the one that holds it.

Connections: redis-py retries a command on a connection or timeout error with backoff
(specmesh.registry `retry_options`: a restarted Redis costs reconnecting, not a request) and
pings a connection idle for `HEALTH_CHECK_S` before use. Any Redis failure left after that is
raised as `StateUnavailable` (UNAVAILABLE / 503 at the edge).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.errors import Kind, RouterError
from router.policies import Load
from specmesh.registry import (
    DEFAULT_PREFIX,
    SESSION_TTL_S,
    TOKEN,
    Binding,
    Endpoint,
    Keys,
    binding_from_json,
    binding_to_json,
    endpoint_from_json,
    endpoint_to_json,
    pack_tokens,
    retry_options,
    unpack_tokens,
)

LOAD_TTL_S = 600.0

# KEYS[1] = a key's session set; ARGV = session id, now ms, TTL ms, limit. Returns {admitted 0/1,
# live sessions after the call}.
_ADMIT_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
local n = redis.call('ZCARD', KEYS[1])
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == false then
  if n >= tonumber(ARGV[4]) then
    return {0, n}
  end
  n = n + 1
end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return {1, n}
"""

# KEYS[1] = binding key; ARGV = expected epoch (0 = none), new binding JSON, TTL ms.
# Writes when there is no binding or its epoch is the expected one; returns the stored binding.
_BIND_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cjson.decode(cur)['epoch'] == tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return ARGV[2]
end
return cur
"""


class StateUnavailable(RouterError):
    def __init__(self, cause: Exception) -> None:
        super().__init__(Kind.UNAVAILABLE, f"redis: unavailable ({type(cause).__name__}: {cause})")


class RouterState:
    """Typed operations on the registry's keys and the router's own. Every method raises
    StateUnavailable on Redis errors."""

    def __init__(self, client: aioredis.Redis, prefix: str = DEFAULT_PREFIX, session_ttl_s: float = SESSION_TTL_S) -> None:
        self.r = client
        self.keys = Keys(prefix)
        self.session_ttl_ms = int(session_ttl_s * 1000)
        self._bind = client.register_script(_BIND_LUA)
        self._admit = client.register_script(_ADMIT_LUA)

    @classmethod
    def from_url(cls, url: str, prefix: str = DEFAULT_PREFIX, session_ttl_s: float = SESSION_TTL_S,
                 timeout_s: float = 2.0) -> RouterState:
        client = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                   **retry_options())
        return cls(client, prefix, session_ttl_s)

    async def close(self) -> None:
        await self.r.aclose()

    async def ping(self) -> None:
        try:
            await self.r.ping()
        except RedisError as e:
            raise StateUnavailable(e) from e

    async def generation(self) -> str:
        """This Redis's generation id (written now if missing: see the module docstring)."""
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.set(self.keys.generation, uuid.uuid4().hex, nx=True)
                p.get(self.keys.generation)
                _, gen = await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return gen.decode()

    # -- registry ------------------------------------------------------------------------------
    async def register(self, e: Endpoint, ttl_s: float) -> None:
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.set(self.keys.endpoint(e.address), endpoint_to_json(e), px=int(ttl_s * 1000))
                p.zadd(self.keys.index, {e.address: time.time()})
                await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def deregister(self, address: str) -> None:
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.delete(self.keys.endpoint(address))
                p.zrem(self.keys.index, address)
                await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def endpoints(self) -> list[Endpoint]:
        """Live endpoints (heartbeat not expired); prunes expired ones from the index."""
        try:
            addrs = [a.decode() for a in await self.r.zrange(self.keys.index, 0, -1)]
            if not addrs:
                return []
            raws = await self.r.mget([self.keys.endpoint(a) for a in addrs])
            stale = [a for a, raw in zip(addrs, raws, strict=True) if raw is None]
            if stale:
                await self.r.zrem(self.keys.index, *stale)
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return [endpoint_from_json(raw) for raw in raws if raw is not None]

    # -- sessions ------------------------------------------------------------------------------
    async def session(self, session_id: str) -> tuple[Binding | None, list[int]]:
        """The session's binding (None if unbound) and token history ([] if none)."""
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.get(self.keys.binding(session_id))
                p.get(self.keys.history(session_id))
                raw, hist = await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return (binding_from_json(raw) if raw else None), unpack_tokens(hist)

    async def bind(self, session_id: str, new: Binding, expected: Binding | None) -> Binding:
        """Store `new` if the session is unbound or still bound as `expected`; return the binding
        that is stored now (the winner's, when another writer came first)."""
        try:
            stored = await self._bind(keys=[self.keys.binding(session_id)],
                                      args=[expected.epoch if expected else 0, binding_to_json(new),
                                            self.session_ttl_ms])
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return binding_from_json(stored)

    async def write_history(self, session_id: str, ids: Sequence[int], replace: bool) -> bool:
        """Append `ids` to the history (or replace it with them); refresh the session's TTLs.
        Whether the session is still bound (False: Redis lost it, and an append made a history of
        `ids` alone)."""
        k_hist, k_bind = self.keys.history(session_id), self.keys.binding(session_id)
        try:
            async with self.r.pipeline(transaction=True) as p:
                if replace:
                    p.set(k_hist, pack_tokens(ids))
                elif ids:
                    p.append(k_hist, pack_tokens(ids))
                p.pexpire(k_hist, self.session_ttl_ms)
                p.pexpire(k_bind, self.session_ttl_ms)
                return bool((await p.execute())[-1])
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def history_length(self, session_id: str) -> int:
        try:
            return (await self.r.strlen(self.keys.history(session_id))) // TOKEN.itemsize
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def forget(self, session_id: str) -> Binding | None:
        """Delete the session's binding and history; return the binding it had."""
        try:
            async with self.r.pipeline(transaction=True) as p:
                p.get(self.keys.binding(session_id))
                p.delete(self.keys.binding(session_id), self.keys.history(session_id))
                raw, _ = await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return binding_from_json(raw) if raw else None

    # -- sessions per API key ------------------------------------------------------------------
    async def admit_session(self, key_id: str, session_id: str, limit: int) -> tuple[bool, int]:
        """Count `session_id` among `key_id`'s live sessions unless that makes more than `limit`
        (a session already counted is always admitted and refreshed); (admitted, live sessions)."""
        try:
            ok, n = await self._admit(keys=[self.keys.key_sessions(key_id)],
                                      args=[session_id, int(time.time() * 1000), self.session_ttl_ms, limit])
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return bool(ok), int(n)

    async def touch_session(self, key_id: str, session_id: str) -> None:
        """Refresh a counted session's time (at the end of its turn): it counts as long as its binding."""
        k = self.keys.key_sessions(key_id)
        try:
            async with self.r.pipeline(transaction=False) as p:
                p.zadd(k, {session_id: int(time.time() * 1000)}, xx=True)
                p.pexpire(k, self.session_ttl_ms)
                await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def release_session(self, key_id: str, session_id: str) -> None:
        try:
            await self.r.zrem(self.keys.key_sessions(key_id), session_id)
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    # -- loads ---------------------------------------------------------------------------------
    async def add_load(self, addresses: Iterable[str], turns: int, tokens: int) -> None:
        """Add (or, negative, remove) in-flight turns and their context tokens."""
        try:
            async with self.r.pipeline(transaction=False) as p:
                for a in addresses:
                    if a:
                        p.hincrby(self.keys.load(a), "turns", turns)
                        p.hincrby(self.keys.load(a), "tokens", tokens)
                        p.pexpire(self.keys.load(a), int(LOAD_TTL_S * 1000))
                await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc

    async def loads(self, addresses: Sequence[str]) -> dict[str, Load]:
        try:
            async with self.r.pipeline(transaction=False) as p:
                for a in addresses:
                    p.hmget(self.keys.load(a), "turns", "tokens")
                rows = await p.execute()
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
        return {a: Load(max(0, int(t or 0)), max(0, int(q or 0))) for a, (t, q) in zip(addresses, rows, strict=True)}

    async def next_seq(self) -> int:
        try:
            return int(await self.r.incr(self.keys.round_robin))
        except RedisError as exc:
            raise StateUnavailable(exc) from exc
