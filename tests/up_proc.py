"""`specmesh up` as a real child process for tests: wait for its ready line, read the endpoints and
pids it prints, signal it, and check that none of its processes is left."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

READY = re.compile(r"^specmesh ready: grpc (\S+) http http://(\S+)$")
ENDPOINT = re.compile(r"^\s+(\S+)\s.*\bpid (\d+)")
METRICS = re.compile(r"\bmetrics (http://\S+/metrics)")


class UpProcess:
    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen([sys.executable, "-m", "specmesh.cli", "up", *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env)
        self.out: list[str] = []
        self.err: list[str] = []
        self._threads = [threading.Thread(target=self._pump, args=(s, buf), daemon=True)
                         for s, buf in ((self.popen.stdout, self.out), (self.popen.stderr, self.err))]
        for t in self._threads:
            t.start()

    @staticmethod
    def _pump(stream, buf: list[str]) -> None:
        for line in stream:
            buf.append(line.rstrip("\n"))

    def wait_ready(self, timeout: float = 240.0) -> tuple[str, str]:
        """(grpc address, http address) from the ready line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.out):
                m = READY.match(line)
                if m:
                    return m.group(1), m.group(2)
            if self.popen.poll() is not None:
                break
            time.sleep(0.1)
        self.kill()
        raise AssertionError(f"specmesh up not ready (exit {self.popen.poll()}):\n{self.output()}")

    def pids(self) -> dict[str, int]:
        """Every process it listed, by name."""
        return {m.group(1): int(m.group(2)) for line in self.out if (m := ENDPOINT.match(line))}

    def metrics_urls(self) -> dict[str, str]:
        """The Prometheus endpoints it listed (verifier, drafters), by name."""
        found = {}
        for line in self.out:
            m, url = ENDPOINT.match(line), METRICS.search(line)
            if m and url:
                found[m.group(1)] = url.group(1)
        return found

    def wait(self, timeout: float = 120.0) -> int:
        code = self.popen.wait(timeout=timeout)
        for t in self._threads:
            t.join(timeout=10)
        return code

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill(self) -> None:
        """Test cleanup: the parent and every process group it started."""
        pids = self.pids().values()
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=30)
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def output(self) -> str:
        return "\n".join(["--- stdout", *self.out, "--- stderr", *self.err])


def alive(pid: int) -> bool:
    """Running (a zombie, or a pid taken by nobody, is not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def in_groups(pgids: set[int]) -> list[int]:
    """Live processes whose process group is one of `pgids` (children's children included)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in pgids:
            found.append(int(d.name))
    return found
