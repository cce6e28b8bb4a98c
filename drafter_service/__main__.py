"""`python -m drafter_service`: parse flags (or SPECMESH_* environment variables) into a
DrafterServiceConfig, set torch's threads, serve until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import os
import sys

from drafter_service.config import DEFAULT_VOCAB_SIZE, DrafterServiceConfig
from specmesh.device import DTYPES
from specmesh.service import add_log_level_arg, setup_logging
from specmesh.service_token import add_token_arg
from specmesh.tls import ServerTls, add_server_args


def _env(name: str, default: str) -> str:
    return os.environ.get(f"SPECMESH_{name}", default)


def build_parser() -> argparse.ArgumentParser:
    d = DrafterServiceConfig()
    p = argparse.ArgumentParser(prog="python -m drafter_service",
                                description="specmesh drafter service (gRPC specmesh.v1.Drafter).")
    p.add_argument("--host", default=_env("HOST", d.host))
    p.add_argument("--port", type=int, default=int(_env("PORT", str(d.port))), help="0 = pick a free port")
    p.add_argument("--drafter", default=_env("DRAFTER", d.drafter), help="ngram | model:PATH | oracle:ALPHA")
    p.add_argument("--oracle-reference", default=os.environ.get("SPECMESH_ORACLE_REFERENCE"),
                   help="oracle: JSON list of token-id sequences (prompt + the target's continuation)")
    p.add_argument("--draft-cost-s", type=float, default=float(_env("DRAFT_COST_S", "0")),
                   help="oracle: seconds to sleep per tree level (a drafter of that cost)")
    p.add_argument("--draft-row-cost-s", type=float, default=float(_env("DRAFT_ROW_COST_S", "0")),
                   help="oracle: seconds to sleep per row of a level, on top (a wider level costs more, as on a CPU)")
    p.add_argument("--vocab-size", type=int, default=int(_env("VOCAB_SIZE", str(DEFAULT_VOCAB_SIZE))),
                   help="oracle: vocabulary size (default: the bundled SmolLM2's)")
    p.add_argument("--seed", type=int, default=int(_env("SEED", "0")), help="oracle: corruption seed")
    p.add_argument("--max-sessions", type=int, default=int(_env("MAX_SESSIONS", str(d.max_sessions))),
                   help="sessions kept (least recently used evicted beyond)")
    p.add_argument("--idle-timeout-s", type=float, default=float(_env("IDLE_TIMEOUT_S", str(d.idle_timeout_s))))
    p.add_argument("--max-context-tokens", type=int,
                   default=int(_env("MAX_CONTEXT_TOKENS", str(d.max_context_tokens))),
                   help="tokens one session may hold; a request beyond is refused")
    p.add_argument("--max-total-tokens", type=int, default=int(_env("MAX_TOTAL_TOKENS", str(d.max_total_tokens))),
                   help="tokens all sessions may hold together (their KV caches); least recently used evicted beyond")
    p.add_argument("--device", default=_env("DEVICE", d.device),
                   help="model drafter: auto (cuda when available) | cpu | cuda")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=_env("DTYPE", d.dtype),
                   help="model drafter's weights (auto: a GGUF as a target loads it; else int4, requantized, when "
                        "it measures faster here: a drafter's numerics only change its acceptance)")
    p.add_argument("--threads", type=int, default=int(_env("THREADS", str(d.threads))), help="torch threads")
    p.add_argument("--max-streams", type=int, default=int(_env("MAX_STREAMS", str(d.max_streams))))
    p.add_argument("--grace-s", type=float, default=float(_env("GRACE_S", str(d.grace_s))))
    p.add_argument("--metrics-port", type=int, default=int(_env("METRICS_PORT", "0")),
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = off)")
    p.add_argument("--tokenizer", default=os.environ.get("SPECMESH_TOKENIZER"),
                   help="the tokenizer shared with the target (HF folder or GGUF), to prune trees to a turn's "
                        "grammar (structured outputs); default: a model drafter's own, if its files hold one; "
                        "none: do not follow grammars")
    p.add_argument("--redis-url", default=_env("REDIS_URL", ""),
                   help="register and heartbeat in the router registry (router.register), deregistered on stop")
    add_server_args(p)
    add_token_arg(p)
    add_log_level_arg(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    cfg = DrafterServiceConfig(
        drafter=args.drafter, host=args.host, port=args.port, oracle_reference=args.oracle_reference,
        draft_cost_s=args.draft_cost_s, draft_row_cost_s=args.draft_row_cost_s, vocab_size=args.vocab_size, seed=args.seed,
        max_sessions=args.max_sessions, idle_timeout_s=args.idle_timeout_s, threads=args.threads,
        max_context_tokens=args.max_context_tokens, max_total_tokens=args.max_total_tokens,
        device=args.device, dtype=args.dtype,
        max_streams=args.max_streams, grace_s=args.grace_s, metrics_port=args.metrics_port,
        tls=ServerTls(args.tls_cert, args.tls_key, args.tls_client_ca, args.service_token),
        tokenizer=args.tokenizer, log_level=args.log_level, redis_url=args.redis_url,
    )
    try:
        cfg.validate()
    except ValueError as exc:
        print(f"drafter_service: {exc}", file=sys.stderr)
        return 2
    from drafter_service.server import serve
    from specmesh import kernels

    kernels.set_threads(cfg.threads)
    try:
        serve(cfg)
    except (ValueError, OSError) as exc:
        print(f"drafter_service: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
