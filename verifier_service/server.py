"""gRPC server of the verifier: port (plaintext, or TLS / mTLS with cfg.tls), message limits,
health, reflection, graceful stop."""

from __future__ import annotations

import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specmesh import service_token
from specmesh.tls import add_port
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.servicer import VerifierServicer
from verifier_service.turns import Verifier

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def build_server(verifier: Verifier, max_workers: int = 32) -> tuple[grpc.Server, int, health.HealthServicer]:
    cfg = verifier.cfg
    opts = [("grpc.max_send_message_length", cfg.max_message_bytes),
            ("grpc.max_receive_message_length", cfg.max_message_bytes)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=opts,
                         interceptors=service_token.interceptors(cfg.tls.token))
    verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(verifier), server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection([SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = add_port(server, f"{cfg.host}:{cfg.port}", cfg.tls)
    if port == 0:
        raise OSError(f"port: cannot bind {cfg.host}:{cfg.port}")
    for name in ("", SERVICE_NAME):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, hs


def serve_until_signal(server: grpc.Server, hs: health.HealthServicer, grace_s: float) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING and stop with a grace period:
    in-flight streams get `grace_s` to finish, then are cancelled (clients see CANCELLED)."""
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    server.start()
    done.wait()
    hs.enter_graceful_shutdown()
    server.stop(grace_s).wait()
