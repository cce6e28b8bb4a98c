"""Settings of one verifier process, parsed once at the entry point and passed down."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field

from specmesh.device import DTYPES
from specmesh.kernels import cpu_count
from specmesh.service import DEFAULT_LOG_LEVEL, add_log_level_arg
from specmesh.service_token import add_token_arg
from specmesh.tls import PeerTls, ServerTls, add_peer_args, add_server_args, peer_from_args, server_from_args
from verifier_service.tp_join import parse_hostport


@dataclass(frozen=True)
class VerifierConfig:
    host: str = "127.0.0.1"
    log_level: str = DEFAULT_LOG_LEVEL
    port: int = 0                      # 0 = a free port (printed on start)
    target: str | None = None          # HF folder, .safetensors or .gguf; None = bundled SmolLM2
    tp: int = 1                        # tensor-parallel ranks (gloo on CPU, NCCL with CUDA)
    tp_listen: str = ""                # HOST:PORT of rank 0's TP store, for ranks elsewhere ("" = local, free port)
    tp_local_ranks: int = 0            # ranks started on this machine, rank 0 included (0 = all --tp)
    tp_start_timeout_s: float = 600.0  # every TP rank joined and loaded within this, else exit
    threads: int = 1                   # torch threads per rank
    device: str = "auto"               # auto (cuda when available) | cpu | cuda (rank r on cuda:r)
    dtype: str = "float32"             # weights and KV cache: float32 | bfloat16 | float16 (specmesh.device)
    drafter: str = ""                  # default drafter host:port ("" = none unless the request names one)
    drafter_allow: tuple[str, ...] = ()  # other drafters a request may name (besides registered ones)
    budget: int = 8                    # default cap on draft nodes per step (the drafter's planner picks within)
    depth: int = 4                     # default cap on tree depth
    pipelining: str = "auto"           # drafters predraft the next step: auto | on | off (`pipelines`)
    batching: str = "auto"             # TP=1: sessions share forwards (specmesh.batching): on | off | auto
    draft_deadline_s: float = 1.0      # cap on the wait for a tree (derived from the drafter's measured answers)
    reconnect_s: float = 2.0           # retry a failed drafter after this long
    max_sessions: int = 64             # sessions whose KV cache is kept (LRU beyond)
    max_context_tokens: int = 8192     # history + new tokens of a turn
    max_new_tokens: int = 2048         # upper bound for max_tokens
    max_message_bytes: int = 64 << 20  # gRPC message size limit (long prompts)
    grace_s: float = 5.0               # graceful shutdown: in-flight streams get this long
    redis_url: str = ""                # register with the router registry there ("" = don't)
    metrics_port: int = 0              # Prometheus /metrics on this port (0 = off)
    tls: ServerTls = field(default_factory=ServerTls)  # the gRPC port (routers dial it); off = plaintext
    peer_tls: PeerTls = field(default_factory=PeerTls)  # the links to drafters; off = plaintext

    def pipelines(self, drafter: str) -> bool:
        """Whether steps drafted by `drafter` (HOST:PORT) predraft the next step while this one is
        verified. auto: yes, unless that drafter runs on this machine (a loopback address) while
        this verifier's threads already take every core: the two would only contend for the cores,
        and taking turns gives each phase all of them (`specmesh up` starts its services so; README,
        "Threads and pipelining")."""
        if self.pipelining != "auto":
            return self.pipelining == "on"
        return not (on_this_machine(drafter) and self.threads * (self.tp_local_ranks or self.tp) >= cpu_count())

    @property
    def batched(self) -> bool:
        """Whether sessions share forwards: TP=1 only; `auto` = with more than one torch thread."""
        return self.tp == 1 and (self.batching == "on" or (self.batching == "auto" and self.threads > 1))


def on_this_machine(address: str) -> bool:
    """Whether HOST:PORT names a loopback address."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _address_list(value: str) -> tuple[str, ...]:
    """"a:1, b:*" -> ("a:1", "b:*") (argparse applies it to the string default too)."""
    return tuple(a.strip() for a in value.split(",") if a.strip())


def parse_args(argv: list[str] | None = None) -> VerifierConfig:
    env = os.environ.get
    d = VerifierConfig()
    p = argparse.ArgumentParser(prog="python -m verifier_service", description="specmesh verifier (target model)")
    p.add_argument("--host", default=env("SPECMESH_HOST", d.host))
    p.add_argument("--port", type=int, default=int(env("SPECMESH_PORT", d.port)))
    p.add_argument("--target", default=env("SPECMESH_TARGET", d.target))
    p.add_argument("--tp", type=int, default=int(env("SPECMESH_TP", d.tp)))
    p.add_argument("--tp-listen", default=env("SPECMESH_TP_LISTEN", d.tp_listen),
                   help="HOST:PORT where TP ranks on other machines join (e.g. 0.0.0.0:29500)")
    p.add_argument("--tp-local-ranks", type=int, default=int(env("SPECMESH_TP_LOCAL_RANKS", d.tp_local_ranks)),
                   help="TP ranks started here, rank 0 included (default: all --tp); the others join at "
                   "--tp-listen (python -m verifier_service.tp_group)")
    p.add_argument("--tp-start-timeout-s", type=float,
                   default=float(env("SPECMESH_TP_START_TIMEOUT_S", d.tp_start_timeout_s)))
    p.add_argument("--threads", type=int, default=int(env("SPECMESH_THREADS", d.threads)))
    p.add_argument("--device", default=env("SPECMESH_DEVICE", d.device),
                   help="auto (cuda when available) | cpu | cuda: TP ranks on cuda:LOCAL_RANK over NCCL; "
                        "--tp 1 on cuda initialises a one-rank NCCL group too")
    p.add_argument("--dtype", choices=tuple(DTYPES), default=env("SPECMESH_DTYPE", d.dtype),
                   help="weights and KV cache (float32 keeps greedy output bitwise the target's; see specmesh.device)")
    p.add_argument("--drafter-addr", dest="drafter", default=env("SPECMESH_DRAFTER_ADDR", d.drafter),
                   help="default drafter host:port")
    p.add_argument("--drafter", dest="drafter_deprecated", default=None,
                   help="deprecated: the old name of --drafter-addr (on the drafter service and the CLI, "
                        "--drafter is a drafter kind)")
    p.add_argument("--drafter-allow", type=_address_list, default=env("SPECMESH_DRAFTER_ALLOW", ""),
                   help="comma list of host:port a request's drafter_address may name, besides --drafter-addr and "
                        "the drafters registered in --redis-url's registry (anything else is refused)")
    p.add_argument("--tree-budget", dest="budget", type=int, default=int(env("SPECMESH_TREE_BUDGET", d.budget)),
                   help="cap on draft nodes per step; the drafter's planner picks each step's shape within the caps")
    p.add_argument("--depth", type=int, default=int(env("SPECMESH_DEPTH", d.depth)), help="cap on tree depth")
    p.add_argument("--pipelining", choices=("auto", "on", "off"), default=env("SPECMESH_PIPELINING", d.pipelining),
                   help="drafters predraft the next step while this one is verified (auto: on, except with a "
                        "drafter on this machine while --threads x local TP ranks take every core: then they "
                        "take turns; a request can still turn it off: speculation.no_pipelining)")
    p.add_argument("--no-pipelining", dest="pipelining", action="store_const", const="off", help="= --pipelining off")
    p.add_argument("--batching", choices=("auto", "on", "off"), default=env("SPECMESH_BATCHING", d.batching),
                   help="--tp 1: concurrent sessions share forwards (auto: on with --threads > 1; with one "
                        "thread, concurrent per-session forwards use the other cores instead)")
    p.add_argument("--draft-deadline-s", type=float, default=float(env("SPECMESH_DRAFT_DEADLINE_S", d.draft_deadline_s)),
                   help="the longest wait for a tree; each step waits what the drafter's measured answer times "
                        "make likely, within it (a request's own draft_deadline_s is kept as asked)")
    p.add_argument("--reconnect-s", type=float, default=float(env("SPECMESH_RECONNECT_S", d.reconnect_s)),
                   help="retry a failed drafter after this long")
    p.add_argument("--max-sessions", type=int, default=int(env("SPECMESH_MAX_SESSIONS", d.max_sessions)))
    p.add_argument("--max-context-tokens", type=int,
                   default=int(env("SPECMESH_MAX_CONTEXT_TOKENS", d.max_context_tokens)))
    p.add_argument("--max-new-tokens", type=int, default=int(env("SPECMESH_MAX_NEW_TOKENS", d.max_new_tokens)))
    p.add_argument("--grace-s", type=float, default=float(env("SPECMESH_GRACE_S", d.grace_s)))
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", d.redis_url),
                   help="register and heartbeat in the router registry (router.register)")
    p.add_argument("--metrics-port", type=int, default=int(env("SPECMESH_METRICS_PORT", d.metrics_port)),
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = off)")
    add_server_args(p, env)
    add_peer_args(p, env, "drafters")
    add_token_arg(p, env)
    add_log_level_arg(p)
    a = p.parse_args(argv)
    if a.tp < 1 or a.threads < 1:
        p.error("--tp and --threads must be >= 1")
    if not 0 <= a.tp_local_ranks <= a.tp:
        p.error(f"--tp-local-ranks must be in 1..{a.tp} (0 = all)")
    if a.device not in ("auto", "cpu", "cuda"):
        p.error(f"--device: expected auto, cpu or cuda, got {a.device!r} (rank r uses cuda:r; choose the GPUs "
                "with CUDA_VISIBLE_DEVICES)")
    if a.tp_listen:
        try:
            parse_hostport(a.tp_listen)
        except ValueError as e:
            p.error(f"--tp-listen: {e}")
    elif 0 < a.tp_local_ranks < a.tp:
        p.error("--tp-local-ranks below --tp needs --tp-listen HOST:PORT (where the other ranks join)")
    a = vars(a)
    old = a.pop("drafter_deprecated")
    if old is not None:
        print("verifier_service: --drafter is deprecated, use --drafter-addr", file=sys.stderr)
        a["drafter"] = old
    token = a.pop("service_token")  # required of routers, sent to drafters
    cfg = VerifierConfig(tls=server_from_args(a, token), peer_tls=peer_from_args(a, token), **a)
    try:
        cfg.tls.validate()
        cfg.peer_tls.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg
