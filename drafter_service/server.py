"""The drafter service's gRPC server: builds the drafter from the settings, serves Drafter plus
grpc.health.v1 (SERVING) and reflection on one port (plaintext, or TLS / mTLS with cfg.tls),
sweeps idle sessions, and stops gracefully (`stop(grace)`) on SIGTERM/SIGINT. No drafting logic
here: that is the servicer's core (`DraftAhead`)."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health

from drafter_service.config import DrafterServiceConfig
from drafter_service.servicer import DrafterServicer
from drafter_service.sessions import SessionStore
from specmesh.costs import Costs
from specmesh.drafters import NgramDrafter, OracleDrafter, parse_drafter_spec
from specmesh.drafters.base import Drafter
from specmesh.drafters.predraft import fit_calibration
from specmesh.engine import drafter_calls
from specmesh.grammar import Grammars
from specmesh.planner import Acceptance
from specmesh.service import grpc_server, set_serving, stop_server, until_signal
from specmesh.v1 import drafter_pb2, drafter_pb2_grpc

log = logging.getLogger(__name__)

DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
MAX_SWEEP_INTERVAL_S = 30.0


def load_references(path: str, vocab_size: int) -> list[list[int]]:
    """The oracle's references: a JSON list of token-id sequences (prompt + continuation)."""
    data = json.loads(Path(path).read_text())
    ok = isinstance(data, list) and data and all(
        isinstance(r, list) and r and all(isinstance(t, int) and 0 <= t < vocab_size for t in r) for r in data)
    if not ok:
        raise ValueError(f"oracle_reference: {path} must hold a non-empty JSON list of non-empty lists "
                         f"of token ids in [0, {vocab_size})")
    return data


def build_drafter(cfg: DrafterServiceConfig) -> tuple[Drafter, int | None]:
    """(drafter, vocabulary size its sessions accept; None = any id >= 0)."""
    kind, arg = parse_drafter_spec(cfg.drafter)
    if kind == "ngram":
        return NgramDrafter(), None
    if kind == "oracle":
        assert cfg.oracle_reference is not None
        refs = load_references(cfg.oracle_reference, cfg.vocab_size)
        oracle = OracleDrafter.from_references(refs, float(arg), cfg.vocab_size, cfg.seed, cfg.draft_cost_s,
                                               cfg.draft_row_cost_s)
        return oracle, cfg.vocab_size
    if kind == "model":
        from specmesh.device import parse_dtype, resolve_device
        from specmesh.runtime import load_model_drafter

        drafter = load_model_drafter(arg, resolve_device(cfg.device), parse_dtype(cfg.dtype), cfg.draft_vocab)
        return drafter, drafter.model.config.vocab_size
    raise ValueError(f"drafter: {cfg.drafter!r} cannot be served")


def build_grammars(cfg: DrafterServiceConfig, vocab_size: int | None) -> Grammars | None:
    """The grammar engine over the tokenizer the drafter shares with its target: `--tokenizer`, else a
    model drafter's own (None when its files hold none, or for `--tokenizer none`: trees are then not
    pruned to grammars)."""
    from specmesh.loader import load_tokenizer

    kind, arg = parse_drafter_spec(cfg.drafter)
    path = cfg.tokenizer
    if path == "none":
        return None
    if path is None and kind == "model":
        try:
            tokenizer = load_tokenizer(arg)
        except Exception as exc:  # the files hold no tokenizer: no grammar support
            log.info("no tokenizer in %s (%s): trees are not pruned to grammars; pass --tokenizer", arg, exc)
            return None
    elif path is None:
        return None
    else:
        try:
            tokenizer = load_tokenizer(path)
        except Exception as exc:
            raise ValueError(f"tokenizer: cannot load {path}: {exc}") from exc
    return Grammars(tokenizer, vocab_size or len(tokenizer))


def start_server(cfg: DrafterServiceConfig, drafter: Drafter, vocab_size: int | None,
                 store: SessionStore, costs: Costs | None = None, recent: Acceptance | None = None,
                 grammars: Grammars | None = None) -> tuple[grpc.Server, health.HealthServicer, int]:
    """A started server (Drafter, health, reflection); returns it, its health servicer and port.
    `grammars`: the engine its sessions' trees are pruned to grammars with (None: not pruned)."""
    # Each Draft stream holds a worker for its lifetime; beyond the bound, RPCs are refused
    # (RESOURCE_EXHAUSTED) rather than left waiting. The extra workers serve health checks.
    workers = cfg.max_streams + 4
    servicer = DrafterServicer(drafter, store, vocab_size, costs, recent, cfg.max_context_tokens, grammars)
    server, port, health_servicer = grpc_server(
        DRAFTER_SERVICE, lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), host=cfg.host,
        port=cfg.port, tls=cfg.tls, max_message_bytes=cfg.max_message_bytes, max_workers=workers, max_rpcs=workers,
        thread_name_prefix="drafter-rpc")
    server.start()
    set_serving(health_servicer, DRAFTER_SERVICE)
    return server, health_servicer, port


def serve(cfg: DrafterServiceConfig) -> None:
    """Run until SIGTERM/SIGINT, then stop gracefully. Prints the listening line once serving."""
    from specmesh import kernels
    from specmesh.runtime import fit_threads

    kernels.set_threads(cfg.threads)
    drafter, vocab_size = build_drafter(cfg)
    grammars = build_grammars(cfg, vocab_size)
    threads = fit_threads(drafter)
    store = SessionStore(cfg.max_sessions, cfg.idle_timeout_s, max_total_tokens=cfg.max_total_tokens)
    costs, recent = Costs(), Acceptance()
    fit_calibration(costs, drafter_calls(drafter, vocab_size))  # measured, or kept from an earlier start here
    if cfg.metrics_port:  # Prometheus text at http://host:metrics_port/metrics
        from drafter_service.metrics import DrafterMetrics, MeteredDrafter, start_exporter
        drafter = MeteredDrafter(drafter, metrics := DrafterMetrics(lambda: len(store)))
        metrics.watch_planner(costs, recent)
        start_exporter(cfg.host, cfg.metrics_port, metrics.render)
    server, health_servicer, port = start_server(cfg, drafter, vocab_size, store, costs, recent, grammars)
    stop = until_signal()
    print(f"drafter_service listening on {cfg.host}:{port}", flush=True)
    beat = None
    if cfg.redis_url:  # router registry: heartbeat from a daemon thread, deregistered on stop
        from specmesh.registry import advertised_address, start_heartbeat

        beat = start_heartbeat(cfg.redis_url, "drafter", advertised_address(cfg.host, port),
                               load=lambda: {"active_sessions": len(store)})
    log.info("drafter %s, at most %d sessions, idle timeout %gs, threads %s", cfg.drafter, cfg.max_sessions,
             cfg.idle_timeout_s, threads)
    sweep_every = min(MAX_SWEEP_INTERVAL_S, cfg.idle_timeout_s / 2)
    while not stop.wait(sweep_every):
        store.sweep()
    log.info("stopping (grace %gs)", cfg.grace_s)
    if beat is not None:
        beat.stop()
    stop_server(server, health_servicer, cfg.grace_s)
    store.close_all()
    sys.stdout.flush()
