"""The router process's servers: gRPC (`specmesh.v1.Router`, health, reflection; grpc.aio) and the
OpenAI-compatible HTTP API (aiohttp), both in one event loop around one `Router`; graceful stop.

With `cfg.tls` both ports serve TLS only (with `client_ca`: mTLS, clients without a certificate
signed by it are refused in the handshake); without it, plaintext as before.

gRPC accepts messages up to twice `max_request_bytes` (+1 MiB) so that a request over the limit
gets INVALID_ARGUMENT naming it; beyond that gRPC's own RESOURCE_EXHAUSTED answers.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass

import grpc
from aiohttp import web
from grpc_health.v1 import health

from router.config import RouterConfig
from router.http_api import build_app
from router.servicer import RouterServicer
from router.turns import Router
from specmesh.service import grpc_server, set_serving
from specmesh.tls import server_ssl_context
from specmesh.v1 import router_pb2, router_pb2_grpc

SERVICE_NAME = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name


@dataclass
class Servers:
    grpc: grpc.aio.Server
    health: health.aio.HealthServicer
    http: web.AppRunner | None
    port: int
    http_port: int | None


async def start(cfg: RouterConfig, router: Router) -> Servers:
    server, port, hs = grpc_server(
        SERVICE_NAME, lambda s: router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(router), s),
        host=cfg.host, port=cfg.port, tls=cfg.tls, max_message_bytes=2 * cfg.max_request_bytes + (1 << 20),
        max_send_bytes=64 << 20, aio=True)
    await server.start()
    router.start_watch()
    await set_serving(hs, SERVICE_NAME)
    runner, http_port = None, None
    if cfg.http_port >= 0:
        runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, cfg.host, cfg.http_port,
                           ssl_context=server_ssl_context(cfg.tls) if cfg.tls.enabled else None)
        await site.start()
        http_port = runner.addresses[0][1]  # the bound port when 0 was asked
    return Servers(server, hs, runner, port, http_port)


async def stop(servers: Servers, router: Router, grace_s: float) -> None:
    """NOT_SERVING, then in-flight gRPC streams get `grace_s` to finish; HTTP likewise."""
    await servers.health.enter_graceful_shutdown()
    stops = [servers.grpc.stop(grace_s)]
    if servers.http is not None:
        stops.append(servers.http.cleanup())
    await asyncio.gather(*stops)
    await router.close()


async def serve_until_signal(cfg: RouterConfig, router: Router, announce) -> None:
    servers = await start(cfg, router)
    announce(servers)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await stop(servers, router, cfg.grace_s)
