"""Placement policies: which verifier (and drafter) serves a session's next turn.

Pure functions of small dataclasses, one signature, picked by name from `POLICIES`:

    place(meta: RequestMeta, endpoints: Sequence[Endpoint], loads: Mapping[str, Load],
          current: Binding | None) -> Binding

- `endpoints` are the live registry entries (verifiers and drafters, from their heartbeats);
- `loads` are the routers' own in-flight counters per address (shared through Redis): turns in
  flight and their **queued context tokens** (a turn counts the whole context the verifier must
  hold and attend over, not only what it prefills);
- `current` is the session's binding, None for a new session or a one-shot request.

A binding whose verifier and drafter are kept is returned unchanged (same epoch); any change bumps
the epoch. No verifier left -> `NoVerifierError`. This module knows nothing of Redis or gRPC: its
Endpoint, Binding and Role are the registry's data types (specmesh.registry).

Policies (verifiers; drafters are placed the same way by all of them, see `_drafter`):
- `sticky-least-tokens` (default): keep the bound verifier unless it is gone or overloaded —
  at capacity while another is not, or its queued tokens exceed an absolute threshold **and**
  `overload_ratio` times what the session would face on the least loaded other verifier
  including re-prefilling its own context (so moving is worth its cost). Otherwise the verifier
  with the least queued context tokens; ties by context held in KV caches, sessions, then a hash
  of (session, address) so that idle verifiers share new sessions.
- `least-requests`: no affinity; fewest turns in flight (production-stack's default).
- `round-robin`: no affinity; verifiers in address order, `meta.seq` picks one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from specmesh.registry import Binding, Endpoint, Role


@dataclass(frozen=True)
class Load:
    """Routers' in-flight counters for one address."""
    in_flight: int = 0           # turns in flight
    queued_tokens: int = 0       # context tokens of those turns


@dataclass(frozen=True)
class Overload:
    """When a bound verifier counts as overloaded (both must hold)."""
    tokens: int = 32768          # absolute: queued context tokens above this
    ratio: float = 2.0           # relative: above ratio x (least other + this session's context)


@dataclass(frozen=True)
class RequestMeta:
    session_id: str = ""         # "" = one-shot
    context_tokens: int = 0      # tokens the verifier must hold for this turn (history + new)
    model: str = ""              # only endpoints of this model ("" = any)
    seq: int = 0                 # a counter shared by routers (round-robin only)
    exclude: frozenset[str] = frozenset()  # addresses that failed during this turn
    overload: Overload = field(default_factory=Overload)


class PolicyName(StrEnum):
    STICKY_LEAST_TOKENS = "sticky-least-tokens"
    LEAST_REQUESTS = "least-requests"
    ROUND_ROBIN = "round-robin"


class NoVerifierError(LookupError):
    """No live verifier can take the request."""


def _candidates(meta: RequestMeta, endpoints: Sequence[Endpoint], role: Role) -> list[Endpoint]:
    return [e for e in endpoints if e.role == role and e.address not in meta.exclude
            and (not meta.model or not e.model or e.model == meta.model)]


def _tiebreak(session_id: str, address: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session_id}|{address}".encode(), digest_size=8).digest(), "big")


def _load(loads: Mapping[str, Load], address: str) -> Load:
    return loads.get(address, Load())


def _full(e: Endpoint, loads: Mapping[str, Load]) -> bool:
    return e.capacity > 0 and _load(loads, e.address).in_flight >= e.capacity


def _least_tokens(meta: RequestMeta, cands: list[Endpoint], loads: Mapping[str, Load]) -> Endpoint:
    room = [e for e in cands if not _full(e, loads)] or cands
    return min(room, key=lambda e: (_load(loads, e.address).queued_tokens, e.kv_tokens, e.active_sessions,
                                    _tiebreak(meta.session_id, e.address)))


def overloaded(meta: RequestMeta, bound: Endpoint, others: list[Endpoint], loads: Mapping[str, Load]) -> bool:
    """Whether moving the session off `bound` is worth re-prefilling its context elsewhere."""
    if not others:
        return False
    if _full(bound, loads) and any(not _full(e, loads) for e in others):
        return True
    queued = _load(loads, bound.address).queued_tokens
    elsewhere = min(_load(loads, e.address).queued_tokens for e in others) + meta.context_tokens
    return queued > meta.overload.tokens and queued > meta.overload.ratio * elsewhere


def _drafter(meta: RequestMeta, endpoints: Sequence[Endpoint], loads: Mapping[str, Load],
             current: Binding | None) -> str:
    """Drafters: sticky per session while alive, else the least loaded; "" when none registered."""
    cands = _candidates(meta, endpoints, Role.DRAFTER)
    if current is not None and current.drafter and any(e.address == current.drafter for e in cands):
        return current.drafter
    if not cands:
        return ""
    return min(cands, key=lambda e: (_load(loads, e.address).in_flight, e.active_sessions,
                                     _tiebreak(meta.session_id, e.address))).address


def _bind(verifier: str, drafter: str, current: Binding | None) -> Binding:
    if current is None:
        return Binding(verifier, drafter, 1)
    if (current.verifier, current.drafter) == (verifier, drafter):
        return current
    return Binding(verifier, drafter, current.epoch + 1)


def _verifiers(meta: RequestMeta, endpoints: Sequence[Endpoint]) -> list[Endpoint]:
    cands = _candidates(meta, endpoints, Role.VERIFIER)
    if not cands:
        raise NoVerifierError("no live verifier" + (f" for model {meta.model!r}" if meta.model else ""))
    return cands


def sticky_least_tokens(meta: RequestMeta, endpoints: Sequence[Endpoint], loads: Mapping[str, Load],
                        current: Binding | None) -> Binding:
    cands = _verifiers(meta, endpoints)
    bound = next((e for e in cands if current is not None and e.address == current.verifier), None)
    others = [e for e in cands if e is not bound]
    if bound is not None and not overloaded(meta, bound, others, loads):
        chosen = bound
    else:
        chosen = _least_tokens(meta, others or cands, loads)
    return _bind(chosen.address, _drafter(meta, endpoints, loads, current), current)


def least_requests(meta: RequestMeta, endpoints: Sequence[Endpoint], loads: Mapping[str, Load],
                   current: Binding | None) -> Binding:
    cands = _verifiers(meta, endpoints)
    chosen = min(cands, key=lambda e: (_load(loads, e.address).in_flight, _load(loads, e.address).queued_tokens,
                                       _tiebreak(meta.session_id, e.address)))
    return _bind(chosen.address, _drafter(meta, endpoints, loads, current), current)


def round_robin(meta: RequestMeta, endpoints: Sequence[Endpoint], loads: Mapping[str, Load],
                current: Binding | None) -> Binding:
    cands = sorted(_verifiers(meta, endpoints), key=lambda e: e.address)
    chosen = cands[meta.seq % len(cands)]
    return _bind(chosen.address, _drafter(meta, endpoints, loads, current), current)


Policy = Callable[[RequestMeta, Sequence[Endpoint], Mapping[str, Load], Binding | None], Binding]

POLICIES: dict[PolicyName, Policy] = {
    PolicyName.STICKY_LEAST_TOKENS: sticky_least_tokens,
    PolicyName.LEAST_REQUESTS: least_requests,
    PolicyName.ROUND_ROBIN: round_robin,
}


def get_policy(name: str) -> Policy:
    try:
        return POLICIES[PolicyName(name)]
    except ValueError:
        raise ValueError(f"policy: unknown {name!r}; one of {', '.join(p.value for p in PolicyName)}") from None
