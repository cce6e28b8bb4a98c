"""The verifier process: loads the target (one rank, or a TP group), serves it over gRPC (port
plaintext or TLS / mTLS with cfg.tls, message limits, health, reflection), registers in the router
registry, and stops gracefully on SIGTERM/SIGINT."""

from __future__ import annotations

import sys
import threading

import grpc
import torch
from grpc_health.v1 import health

from specmesh.service import grpc_server, set_serving, stop_server, until_signal
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
from verifier_service.config import VerifierConfig
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


def load_target(cfg: VerifierConfig, path: str, device: torch.device, dtype):
    """(model, process-group backend or "none", batched): one rank here, or a TP group (ranks on
    this machine and those that join at --tp-listen); TPStartError / TimeoutError when a rank
    is missing, refused or crashed."""
    from specmesh import kernels
    from specmesh.loader import load_model
    from specmesh.runtime import fit_threads

    static = cfg.static_shapes == "on"

    def batching(model):
        # specmesh.batching drives a CPU model, or static steps on any device (their rows are exact
        # however they are grouped, and a batch is one step of their largest bucket)
        batched = cfg.batched and (device.type == "cpu" or static)
        if batched and not static and cfg.batching == "auto" and not kernels.describe()["batch_invariant"]:
            # batched rows must compute as they would alone; some weight shapes take torch's GEMM here
            print("verifier_service: batching off: this machine's products are not batch-invariant "
                  "(kernels.describe()); --batching on forces it", file=sys.stderr, flush=True)
            batched = False
        if batched:
            from specmesh.batching import BatchingTarget

            model = BatchingTarget(model, max_rows=max(cfg.static_buckets)) if static else BatchingTarget(model)
        return model, batched

    grouped = cfg.tp > 1 or device.type == "cuda"  # a TPModel: several ranks, or the one-rank NCCL group
    if not grouped:
        model = load_model(path, dtype)
        fit_threads(model)
        model, batched = batching(cfg.static_steps(model))
        return model, "none", batched
    from verifier_service.tp_group import start_tp

    if dtype == "auto":
        dtype = torch.float32  # the quantized formats run on one CPU rank only (tp.py shards float weights)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if 0 < cfg.tp_local_ranks < cfg.tp:
        print(f"verifier_service: waiting for tp ranks {cfg.tp_local_ranks}..{cfg.tp - 1} to join at "
              f"{cfg.tp_listen} (python -m verifier_service.tp_group --master HOST:PORT --rank R --world {cfg.tp})",
              flush=True)
    model = start_tp(path, cfg.tp, threads_per_rank=cfg.threads, listen=cfg.tp_listen or None,
                     local_ranks=cfg.tp_local_ranks or None, start_timeout_s=cfg.tp_start_timeout_s,
                     backend=backend, dtype=dtype)
    model.model = cfg.static_steps(model.model)  # rank 0's forward (--tp 1: its only one)
    model, batched = batching(model)  # every rank runs the batch's forward (tp_group's BATCH op)
    return model, backend, batched


def serve(cfg: VerifierConfig) -> int:
    """Load, serve until SIGTERM/SIGINT, stop gracefully; the process's exit status."""
    from specmesh import kernels
    from specmesh.device import parse_dtype, resolve_device
    from specmesh.loader import bundled_target_path, load_tokenizer
    from verifier_service.tp_join import TPStartError

    kernels.set_threads(cfg.threads)
    try:
        device, dtype = resolve_device(cfg.device), parse_dtype(cfg.dtype)
    except ValueError as e:
        print(f"verifier_service: {e}", file=sys.stderr, flush=True)
        return 2
    path = cfg.target or str(bundled_target_path())
    tokenizer = load_tokenizer(path)
    try:
        model, backend, batched = load_target(cfg, path, device, dtype)
    except (TimeoutError, TPStartError) as e:  # a rank missing, refused or crashed: say which, exit
        print(f"verifier_service: {e}", file=sys.stderr, flush=True)
        return 1
    grouped = backend != "none"
    from verifier_service.metrics import MeteredVerifier, start_exporter
    verifier = (MeteredVerifier if cfg.metrics_port else Verifier)(cfg, model, tokenizer)
    if cfg.metrics_port:  # Prometheus text at http://host:metrics_port/metrics
        start_exporter(cfg.host, cfg.metrics_port, verifier.metrics.render)
    server, port, hs = build_server(verifier)
    print("verifier_service: step by rows (ms), measured here (or kept: engine.target_steps) for drafters' planners: "
          + ", ".join(f"{r}: {s * 1e3:.1f}" for r, s in verifier.steps.points()), flush=True)
    fmt = getattr(model, "weight_format", None)  # the model card: which weights, and what was requantized
    weights = fmt.describe() if fmt is not None else cfg.dtype
    print(f"verifier_service listening on {cfg.host}:{port} (tp={cfg.tp}, {device}, {weights}, "
          f"process group {backend}, threads/rank={kernels.describe_threads()}, batching {'on' if batched else 'off'}, "
          f"pipelining {cfg.pipelining})", flush=True)
    beat = None
    if cfg.redis_url:  # router registry: heartbeat from a daemon thread, deregistered on stop
        from specmesh.registry import advertised_address, model_name, start_heartbeat

        beat = start_heartbeat(cfg.redis_url, "verifier", advertised_address(cfg.host, port), model_name(path),
                               load=lambda: {"active_sessions": len(verifier.sessions)}, held=verifier.sessions.held)
    stopping = threading.Event()
    if grouped:  # a broken group cannot recover: say so to health checks and leave the registry
        threading.Thread(target=_watch_group, args=(model, hs, beat, stopping), daemon=True, name="tp-health").start()
    try:
        done = until_signal()
        server.start()
        done.wait()
        stop_server(server, hs, cfg.grace_s)
    finally:
        stopping.set()
        if beat is not None:
            beat.stop()
        verifier.shutdown()
        if grouped:
            model.shutdown()
    return 0


def _watch_group(model, hs, beat, stopping: threading.Event, every_s: float = 1.0) -> None:
    """Once the TP group is broken (a rank died or stalled: every Generate fails from then on),
    report NOT_SERVING on grpc.health.v1 (the k8s probes restart the pod) and deregister from
    the router's registry instead of heartbeating on."""
    from grpc_health.v1 import health_pb2

    while model.healthy:
        if stopping.wait(every_s):
            return
    print("verifier_service: the TP group is broken: health NOT_SERVING, deregistered", file=sys.stderr, flush=True)
    for name in ("", SERVICE_NAME):
        hs.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    if beat is not None:
        beat.stop()

