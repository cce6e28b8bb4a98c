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
from specmesh.redis_server import redacted
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


def serve(cfg: RouterConfig) -> None:
    """Load the tokenizer (--tokenizer, else the bundled model's), connect to Redis, serve gRPC and
    HTTP until SIGTERM/SIGINT, stop gracefully."""
    from router.state import RouterState
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.registry import model_name

    path = cfg.tokenizer or str(bundled_target_path())
    tokenizer = load_tokenizer(path)

    async def run() -> None:
        state = RouterState.from_url(cfg.redis_url, cfg.redis_prefix, cfg.session_ttl_s)
        await serve_until_signal(cfg, Router(cfg, state, tokenizer, cfg.model_name or model_name(path)))

    asyncio.run(run())


async def serve_until_signal(cfg: RouterConfig, router: Router) -> None:
    servers = await start(cfg, router)
    http = f" http {cfg.host}:{servers.http_port}" if servers.http_port is not None else ""
    print(f"router listening on {cfg.host}:{servers.port}{http} "
          f"(policy={cfg.policy}, redis={redacted(cfg.redis_url)}, tls={cfg.tls.mode}, "
          f"verifier_tls={'on' if cfg.peer_tls.enabled else 'off'})", flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await stop(servers, router, cfg.grace_s)
