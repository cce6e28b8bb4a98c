"""Sessions held by one verifier: each keeps its target KV cache, and its drafter session, across
turns (LRU-bounded; evicting a session closes its drafter session too).

A follow-up turn prefills only its new tokens. A request carrying the session's full `history`
(sent by the router when it moved the session here) is checked against what we hold: if it
matches, the cache is reused; otherwise the session is rebuilt from the history.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from specmesh.engine import TargetSession
from verifier_service.drafter_link import RemoteDrafts


class SessionBusyError(RuntimeError):
    """Another turn of the same session is still running."""


@dataclass
class Session:
    target: TargetSession | None = None
    drafts: RemoteDrafts | None = None  # its drafter session, kept across turns
    lock: threading.Lock = field(default_factory=threading.Lock)
    named: bool = False                 # a client's session (not a one-shot request's)
    drafter: str = ""                   # the drafter its last turn asked for ("" = the verifier's own)


def _close(s: Session) -> None:
    if s.target is not None:
        s.target.close()
        s.target = None
    if s.drafts is not None:
        s.drafts.close()
        s.drafts = None


class SessionStore:
    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def acquire(self, session_id: str) -> Session:
        """The session (created empty if new), locked for one turn. Release with `release`."""
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None:
                s = self._sessions[session_id] = Session()
            self._sessions.move_to_end(session_id)
            if not s.lock.acquire(blocking=False):
                raise SessionBusyError(f"session_id: session {session_id!r} has a turn in progress")
            self._evict()
            return s

    def release(self, session: Session) -> None:
        session.lock.release()

    def _evict(self) -> None:
        # drop least recently used idle sessions beyond the bound (their KV caches go with them)
        for sid in list(self._sessions):
            if len(self._sessions) <= self.max_sessions:
                return
            s = self._sessions[sid]
            if s.lock.acquire(blocking=False):
                del self._sessions[sid]
                _close(s)
                s.lock.release()

    def drop(self, session_id: str) -> bool:
        """Forget a session; its KV cache is freed once no turn uses it."""
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        if s.lock.acquire(blocking=False):
            _close(s)
            s.lock.release()
        return True

    def held(self) -> list[tuple[str, list[int], str]]:
        """(session id, tokens, drafter) of each named session holding a context with no turn in
        progress: what the heartbeat writes back to Redis after Redis lost it (specmesh.registry)."""
        with self._lock:
            sessions = list(self._sessions.items())
        out = []
        for sid, s in sessions:
            if s.named and s.lock.acquire(blocking=False):
                try:
                    if s.target is not None and s.target.tokens:
                        out.append((sid, list(s.target.tokens), s.drafter))
                finally:
                    s.lock.release()
        return out

    def __len__(self) -> int:
        return len(self._sessions)
