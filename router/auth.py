"""Who may call the router, under what name, and how many live sessions a caller may hold.

- API keys: a request carries `Authorization: Bearer KEY` (HTTP header or gRPC metadata); the key
  is compared in constant time with every configured one. No keys configured: the router is open.
- Key ids: a key is known by its id (`key_id`, a hash prefix), never by the key itself: in Redis
  key names, in the per-key counts, in logs.
- Session scoping: a caller's session ids are its own (`scoped_session`).
- Sessions per key: which sessions count against a key's limit, and what a refusal says. The
  counting itself is in Redis (router.state.admit_session), shared by every router, atomic there.

Pure: no Redis, no gRPC, no HTTP. Failures are RouterErrors; the edges map them to statuses.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import TYPE_CHECKING

from router.errors import Kind, RouterError

if TYPE_CHECKING:
    from router.config import RouterConfig

KEY_ID_CHARS = 16  # hex digits of the key's SHA-256 kept as its id


def key_id(api_key: str) -> str:
    """The id quotas count an API key under (and Redis keys name): never the key itself."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:KEY_ID_CHARS]


def scoped_session(key: str, session_id: str) -> str:
    """The name a session has in Redis and on verifiers: a client's session ids are its own.

    With API keys configured, session "s" of key A and session "s" of key B are two sessions
    ("<key id A>/s", "<key id B>/s"): a key can neither read nor extend another key's context.
    Without keys (key "") the id is used as is. One-shot requests ("") stay one-shot."""
    return f"{key}/{session_id}" if key and session_id else session_id


@dataclass(frozen=True)
class Auth:
    api_keys: tuple[str, ...]            # accepted bearer keys; empty = no authentication
    max_sessions_per_key: int            # live sessions (with a session id) per key; 0 = unlimited
    session_ttl_s: float                 # a session stops counting this long after its last turn

    @classmethod
    def from_config(cls, cfg: RouterConfig) -> Auth:
        return cls(cfg.api_keys, cfg.max_sessions_per_key, cfg.session_ttl_s)

    def authenticate(self, authorization: str | None) -> str:
        """`Bearer KEY` with a configured key, or no keys configured; else UNAUTHENTICATED.
        Returns the key's id (key_id; "" without keys): what quotas are counted under."""
        if not self.api_keys:
            return ""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        ok = scheme.lower() == "bearer" and any(hmac.compare_digest(key.encode(), k.encode())
                                                for k in self.api_keys)
        if not ok:
            raise RouterError(Kind.UNAUTHENTICATED, "authorization: a valid API key is required (Bearer KEY)")
        return key_id(key)

    def counts(self, key_id: str, session_id: str) -> bool:
        """Whether the session counts against its key's live sessions: only with a limit, a key and
        a session id (one-shot requests keep no state and are not counted)."""
        return bool(self.max_sessions_per_key and key_id and session_id)

    def over_quota(self, live: int) -> RouterError:
        """The refusal of a session the key does not hold yet when it holds `live` (at the limit):
        EXHAUSTED and final (retrying soon will not help)."""
        limit = self.max_sessions_per_key
        return RouterError(Kind.EXHAUSTED, f"max_sessions_per_key: this API key already has {live} live sessions "
                                           f"(limit {limit}); reuse one, close one (CloseSession) or let one "
                                           f"expire ({self.session_ttl_s:g} s after its last turn)",
                           code="max_sessions_per_key", final=True)
