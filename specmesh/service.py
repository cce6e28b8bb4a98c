"""What the router, the verifier and the drafter service share as services.

- **Config.** Each service declares its settings as one frozen dataclass deriving `ServiceConfig`:
  `add_args(p)` declares its own flags, `from_args(argv)` parses flags into the dataclass and
  `validate()`s it (a bad value exits with the parser's usage and a message naming the setting), as
  vLLM's `EngineArgs` does. Every flag `--some-name` also reads the environment variable
  `SPECMESH_SOME_NAME` (the flag wins), and its help says so.
- **Common flags**, with one name, help and default everywhere (`add_common_args`): host, port,
  threads, device, dtype (services that run a model), metrics port (services with an exporter;
  the router serves /metrics on its HTTP port), grace, log level, TLS of the listening port and
  the service token.
- **One gRPC server builder** (`grpc_server`: message limits, the service token, health,
  reflection, TLS port) and one way to stop: `until_signal` + `stop_server`.
- **Logging** configured the same way (`setup_logging`).

Knows nothing of what the services serve.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import fields
from typing import ClassVar, Self

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_LOG_LEVEL = "WARNING"
# --dtype of every entry point that runs a model (services, `specmesh up`, `specmesh generate`): a GGUF
# served as it ships where that measured fastest, anything else float32 (specmesh.device)
DEFAULT_DTYPE = "auto"
ENV_PREFIX = "SPECMESH_"


def env_name(flag: str) -> str:
    """--tree-budget -> SPECMESH_TREE_BUDGET."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def flag(p: argparse.ArgumentParser | argparse._ArgumentGroup, name: str, default, help: str = "",
         env: str | None = None, **kw) -> None:
    """Add `--name`; its default is $SPECMESH_NAME when set (argparse applies `type` to it), else
    `default`; the help names the variable."""
    var = env or env_name(name)
    p.add_argument(name, default=os.environ.get(var, default), help=f"{help} (env {var})".lstrip(), **kw)


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level, env SPECMESH_LOG_LEVEL, the same on every service."""
    flag(p, "--log-level", DEFAULT_LOG_LEVEL, type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
         help="the service's log messages from this level on, to stderr")


def add_common_args(p: argparse.ArgumentParser, d, *, model: bool, metrics: bool) -> None:
    """The flags every service has, defaults from `d` (the config's defaults). `model`: the service
    runs a model (threads, device, dtype); `metrics`: it serves Prometheus metrics on a port."""
    from specmesh.service_token import add_token_arg
    from specmesh.tls import add_server_args

    flag(p, "--host", d.host, help="address to listen on (0.0.0.0: every interface)")
    flag(p, "--port", d.port, type=int, help="gRPC port (0 = a free port, printed on start)")
    if model:
        from specmesh.device import DTYPES  # torch: only services that run a model load it

        flag(p, "--threads", d.threads, type=int, help="torch threads (per TP rank)")
        flag(p, "--device", d.device, help="auto (cuda when available) | cpu | cuda (TP rank r on cuda:r; choose "
                                           "the GPUs with CUDA_VISIBLE_DEVICES)")
        flag(p, "--dtype", d.dtype, choices=tuple(DTYPES),
             help="format of the model's weights (specmesh.device; auto: the fastest measured here that keeps a "
                  "GGUF's own numerics; README, 'Weight formats')")
    if metrics:
        flag(p, "--metrics-port", d.metrics_port, type=int, help="serve Prometheus metrics at "
                                                                 "http://HOST:PORT/metrics (0 = off)")
    flag(p, "--grace-s", d.grace_s, type=float, help="on SIGTERM/SIGINT, in-flight streams get this long to finish, "
                                                     "then are cancelled")
    add_log_level_arg(p)
    add_server_args(p)
    add_token_arg(p)


class ServiceConfig:
    """Base of the services' frozen config dataclasses (see the module docstring)."""

    PROG: ClassVar[str]
    DESCRIPTION: ClassVar[str]

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        """Declare every flag of the service (`add_common_args` for the shared ones)."""
        raise NotImplementedError

    @classmethod
    def from_dict(cls, a: dict) -> Self:
        """The config from `vars(parsed args)` (flags whose names are not fields are popped here)."""
        return cls(**a)

    def validate(self) -> None:
        """Raise ValueError naming the setting if one is bad; the checks shared by every service."""
        names = {f.name for f in fields(self)}
        for name in ("port", "metrics_port"):
            if name in names and not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name}: must be in [0, 65535], got {getattr(self, name)}")
        if "threads" in names and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if "dtype" in names:
            from specmesh.device import DTYPES

            if self.dtype not in DTYPES:
                raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        url = getattr(self, "redis_url", "")
        if url and not url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: redis://HOST:PORT/DB, rediss:// or unix://, got {url!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
        self.tls.validate()

    @classmethod
    def parser(cls) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(prog=cls.PROG, description=cls.DESCRIPTION)
        cls.add_args(p)
        return p

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> Self:
        """Flags (else SPECMESH_* variables, else defaults) -> a validated config; exits with the
        usage and the message on a bad value, as argparse does."""
        p = cls.parser()
        try:
            cfg = cls.from_dict(vars(p.parse_args(argv)))
            cfg.validate()
        except ValueError as e:
            p.error(str(e))
        return cfg


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)


def grpc_server(service: str, add_servicer, *, host: str, port: int, tls, max_message_bytes: int,
                max_send_bytes: int | None = None, max_workers: int = 32, max_rpcs: int | None = None,
                thread_name_prefix: str = "", aio: bool = False):
    """A gRPC server as every specmesh service builds it, not started: message limits both ways,
    the service token's interceptors (where `tls.token` is set; not on `aio` servers, whose
    callers are checked by API keys), `add_servicer(server)`, grpc.health.v1 (`service` and "" set
    SERVING by `set_serving`) and reflection, bound on host:port (plaintext, or TLS / mTLS as
    `tls` says). `max_send_bytes`: when replies may be larger than requests (default: the same).
    Returns (server, bound port, health servicer); OSError when it cannot bind.
    `max_rpcs`: RPCs beyond are refused (RESOURCE_EXHAUSTED) rather than queued (sync only)."""
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    from specmesh import service_token
    from specmesh.tls import add_port

    options = [("grpc.max_send_message_length", max_send_bytes or max_message_bytes),
               ("grpc.max_receive_message_length", max_message_bytes)]
    if aio:
        server = grpc.aio.server(options=options)
        hs = health.aio.HealthServicer()
    else:
        from concurrent import futures

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=thread_name_prefix),
                             options=options, maximum_concurrent_rpcs=max_rpcs,
                             interceptors=service_token.interceptors(tls.token))
        hs = health.HealthServicer()
    add_servicer(server)
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    bound = add_port(server, f"{host}:{port}", tls)
    if bound == 0:
        raise OSError(f"port: cannot bind {host}:{port}")
    return server, bound, hs


def until_signal() -> threading.Event:
    """An event set on SIGTERM or SIGINT (call from the main thread)."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    return done


def stop_server(server, hs, grace_s: float) -> None:
    """Graceful stop of a sync server: NOT_SERVING on health, then in-flight streams get `grace_s`
    to finish, then are cancelled (clients see CANCELLED)."""
    hs.enter_graceful_shutdown()
    server.stop(grace_s).wait()


def set_serving(hs, service: str):
    """Mark `service` and the whole server SERVING (an awaitable on an aio health servicer)."""
    from grpc_health.v1 import health_pb2

    results = [hs.set(name, health_pb2.HealthCheckResponse.SERVING) for name in ("", service)]
    if results and results[0] is not None:  # aio: coroutines
        import asyncio

        return asyncio.gather(*results)
    return None
