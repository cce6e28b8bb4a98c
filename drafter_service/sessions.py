"""The drafter service's session table: session id -> DraftAhead, bounded, least recently used out.

Memory is bounded by `max_sessions` (each session may hold a KV cache) and `max_total_tokens`
(the committed tokens of all sessions, which their caches hold): beyond either, the least
recently used other sessions are evicted; sessions idle for longer than `idle_timeout_s` are
evicted by `sweep` (called on every change and periodically by the server). Evicting closes the
session, which frees its cache; a later request for it gets an error. Shared by all streams of the
service.

Evicted sessions are closed outside the table's lock: closing waits for the session's own unit
of work in progress, and no thread holds a session's lock while it takes the table's.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from specmesh.drafters.predraft import DraftAhead


BUSY_S = 2.0  # a session that asked this recently counts as served beside the others (`busy`)


class SessionStore:
    def __init__(self, max_sessions: int, idle_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, max_total_tokens: int | None = None) -> None:
        assert max_sessions >= 1 and idle_timeout_s > 0
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.max_total_tokens = max_total_tokens  # None: no bound on tokens
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: OrderedDict[str, tuple[DraftAhead, float]] = OrderedDict()  # LRU first
        self.evicted = 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def put(self, session_id: str, session: DraftAhead) -> None:
        """Add (or replace) a session as the most recently used; evict beyond the bound."""
        with self._lock:
            old = self._sessions.pop(session_id, None)
            self._sessions[session_id] = (session, self._clock())
            out = self._expired_locked() + self._over_locked()
        if old is not None and old[0] is not session:
            old[0].close()
        self._close(out)

    def get(self, session_id: str, touch: bool = True) -> DraftAhead | None:
        """The session, or None if unknown (never opened, closed or evicted). `touch` marks it
        used now; predrafting does not, so that it cannot keep an abandoned session alive."""
        with self._lock:
            out = self._expired_locked()  # first: an expired session is gone, not revived
            entry = self._sessions.get(session_id)
            if entry is not None and touch:
                self._sessions[session_id] = (entry[0], self._clock())
                self._sessions.move_to_end(session_id)
                out += self._over_locked()  # it may have grown since it was last counted
        self._close(out)
        if entry is None or entry[0].closed:
            return None
        return entry[0]

    def busy(self, window_s: float = BUSY_S) -> int:
        """Sessions with a request in the last `window_s` (at least 1): those the drafter drafts
        for in turn now (a session in a run of plain steps asks for nothing and drops out)."""
        now = self._clock()
        with self._lock:
            return max(1, sum(1 for _, at in self._sessions.values() if now - at <= window_s))

    def pop(self, session_id: str) -> None:
        """Remove and close a session (no-op if unknown)."""
        with self._lock:
            entry = self._sessions.pop(session_id, None)
        if entry is not None:
            entry[0].close()

    def sweep(self) -> int:
        """Evict sessions idle for longer than the timeout; return how many."""
        with self._lock:
            out = self._expired_locked()
        self._close(out)
        return len(out)

    def close_all(self) -> None:
        with self._lock:
            out = [s for s, _ in self._sessions.values()]
            self._sessions.clear()
        for s in out:
            s.close()

    def _over_locked(self) -> list[DraftAhead]:
        """Evict least recently used sessions, never the most recent one, while over a bound."""
        out = []
        tokens = sum(s.position for s, _ in self._sessions.values()) if self.max_total_tokens else 0
        while len(self._sessions) > 1 and (len(self._sessions) > self.max_sessions
                                           or (self.max_total_tokens and tokens > self.max_total_tokens)):
            session = self._sessions.popitem(last=False)[1][0]
            tokens -= session.position
            out.append(session)
        self.evicted += len(out)
        return out

    def _expired_locked(self) -> list[DraftAhead]:
        now, out = self._clock(), []
        while self._sessions:
            sid, (session, used) = next(iter(self._sessions.items()))
            if now - used <= self.idle_timeout_s:
                break
            del self._sessions[sid]
            out.append(session)
        self.evicted += len(out)
        return out

    @staticmethod
    def _close(sessions: list[DraftAhead]) -> None:
        for s in sessions:
            s.close()
