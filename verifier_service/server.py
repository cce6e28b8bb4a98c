"""gRPC server of the verifier: port (plaintext, or TLS / mTLS with cfg.tls), message limits,
health, reflection, graceful stop."""

from __future__ import annotations

import signal
import threading

import grpc
from grpc_health.v1 import health

from specmesh.service import grpc_server, set_serving
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.servicer import VerifierServicer
from verifier_service.turns import Verifier

SERVICE_NAME = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


def build_server(verifier: Verifier, max_workers: int = 32) -> tuple[grpc.Server, int, health.HealthServicer]:
    cfg = verifier.cfg
    server, port, hs = grpc_server(
        SERVICE_NAME, lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(VerifierServicer(verifier), s),
        host=cfg.host, port=cfg.port, tls=cfg.tls, max_message_bytes=cfg.max_message_bytes, max_workers=max_workers)
    set_serving(hs, SERVICE_NAME)
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
