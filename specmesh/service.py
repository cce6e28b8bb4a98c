"""What the router, the verifier and the drafter service share as services: the log-level flag
and logging, and the one gRPC server builder (message limits, the service token, health,
reflection, TLS port)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_LOG_LEVEL = "WARNING"


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level, env SPECMESH_LOG_LEVEL, the same on every service."""
    p.add_argument("--log-level", default=os.environ.get("SPECMESH_LOG_LEVEL", DEFAULT_LOG_LEVEL),
                   type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="the service's log messages from this level on, to stderr (env SPECMESH_LOG_LEVEL)")


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


def set_serving(hs, service: str):
    """Mark `service` and the whole server SERVING (an awaitable on an aio health servicer)."""
    from grpc_health.v1 import health_pb2

    results = [hs.set(name, health_pb2.HealthCheckResponse.SERVING) for name in ("", service)]
    if results and results[0] is not None:  # aio: coroutines
        import asyncio

        return asyncio.gather(*results)
    return None
