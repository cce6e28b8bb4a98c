"""Start specmesh services as child processes on this machine (`--port 0`, wait for their
"listening on HOST:PORT" line) and stop them. Used by tests, benchmarks and local clusters."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

LISTEN = re.compile(r"listening on ([\d.]+):(\d+)")
# Set for every service child unless the caller's environment sets it. Left unset, libgomp (torch's
# intra-op pool) has its threads spin for a while after each parallel region, waiting for the next;
# when services share cores (`specmesh up`'s default) that spin takes the CPU from the process that
# has work (README, "Threads and pipelining", has the measurement). An OMP_WAIT_POLICY of the
# caller's own is kept.
SERVICE_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def service_env(extra: dict | None = None) -> dict:
    """The environment of a service child: ours, SERVICE_ENV where ours leaves it unset, then
    `extra` (a None value removes the variable)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key, value in SERVICE_ENV.items():
        env.setdefault(key, value)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@dataclass
class Proc:
    popen: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)

    def kill9(self) -> None:
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait(timeout=30)

    def stop(self, timeout: float = 30.0) -> int | None:
        return terminate(self.popen, timeout)


def terminate(popen: subprocess.Popen, timeout: float) -> int | None:
    """SIGTERM, wait up to `timeout`, SIGKILL if need be; the exit code."""
    if popen.poll() is None:
        popen.send_signal(signal.SIGTERM)
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(timeout=10)
    return popen.returncode


def start(module: str, *args: str, timeout: float = 180.0, env: dict | None = None) -> Proc:
    """`python -m module --port 0 args...` (`env`: variables over `service_env`'s); wait for its
    'listening on HOST:PORT' line."""
    env = service_env(env)
    p = subprocess.Popen([sys.executable, "-m", module, "--port", "0", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:  # keep draining output so the child never blocks on a full pipe
        for line in p.stdout:
            lines.append(line)
            m = LISTEN.search(line)
            if m and not found:
                found.append(f"{m.group(1)}:{m.group(2)}")
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not ready.wait(0.2):
        if time.monotonic() > deadline:
            p.kill()
            raise TimeoutError(f"{module} did not start:\n{''.join(lines[-30:])}")
    if not found:
        p.wait(timeout=10)
        raise RuntimeError(f"{module} exited ({p.returncode}):\n{''.join(lines[-30:])}")
    return Proc(p, found[0], lines)
