"""Settings of one verifier process: one frozen dataclass, parsed once at the entry point from flags
or SPECMESH_* environment variables (`VerifierConfig.from_args`, specmesh.service), and passed down."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import ClassVar

from specmesh.kernels import cpu_count
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES
from specmesh.service import DEFAULT_DTYPE, DEFAULT_LOG_LEVEL, ServiceConfig, add_common_args, flag
from specmesh.tls import PeerTls, ServerTls, add_peer_args, peer_from_args, server_from_args
from verifier_service.tp_join import parse_hostport


@dataclass(frozen=True)
class VerifierConfig(ServiceConfig):
    PROG: ClassVar[str] = "python -m verifier_service"
    DESCRIPTION: ClassVar[str] = "specmesh verifier (target model)"

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
    dtype: str = DEFAULT_DTYPE         # weights: specmesh.device.DTYPES (auto: a GGUF as it ships, on CPU)
    drafter: str = ""                  # default drafter host:port ("" = none unless the request names one)
    drafter_allow: tuple[str, ...] = ()  # other drafters a request may name (besides registered ones)
    budget: int = 8                    # default cap on draft nodes per step (the drafter's planner picks within)
    depth: int = 4                     # default cap on tree depth
    pipelining: str = "auto"           # drafters predraft the next step: auto | on | off (`pipelines`)
    batching: str = "auto"             # CPU: sessions share forwards (specmesh.batching): on | off | auto
    static_shapes: str = "off"         # on: fixed-shape steps over a KV pool, CUDA graphs on a GPU (specmesh.static_steps)
    static_buckets: tuple[int, ...] = (16,)  # their row buckets (one: speculation's output identical by construction)
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

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        d = cls()
        add_common_args(p, d, model=True, metrics=True)
        flag(p, "--target", d.target, help="HF folder, .safetensors or .gguf (default: the bundled SmolLM2)")
        flag(p, "--tp", d.tp, type=int, help="tensor-parallel ranks (gloo on CPU, NCCL with CUDA)")
        flag(p, "--tp-listen", d.tp_listen, help="HOST:PORT where TP ranks on other machines join (e.g. 0.0.0.0:29500)")
        flag(p, "--tp-local-ranks", d.tp_local_ranks, type=int,
             help="TP ranks started here, rank 0 included (0 = all --tp); the others join at --tp-listen "
                  "(python -m verifier_service.tp_group)")
        flag(p, "--tp-start-timeout-s", d.tp_start_timeout_s, type=float,
             help="every TP rank joined and loaded within this, else exit")
        flag(p, "--drafter-addr", d.drafter, dest="drafter", help="default drafter host:port")
        p.add_argument("--drafter", dest="drafter_deprecated", default=None,
                       help="deprecated: the old name of --drafter-addr (on the drafter service and the CLI, "
                            "--drafter is a drafter kind)")
        flag(p, "--drafter-allow", "", type=_address_list,
             help="comma list of host:port a request's drafter_address may name, besides --drafter-addr and "
                  "the drafters registered in --redis-url's registry (anything else is refused)")
        flag(p, "--tree-budget", d.budget, dest="budget", type=int,
             help="cap on draft nodes per step; the drafter's planner picks each step's shape within the caps")
        flag(p, "--depth", d.depth, type=int, help="cap on tree depth")
        flag(p, "--pipelining", d.pipelining, choices=("auto", "on", "off"),
             help="drafters predraft the next step while this one is verified (auto: on, except with a "
                  "drafter on this machine while --threads x local TP ranks take every core: then they "
                  "take turns; a request can still turn it off: speculation.no_pipelining)")
        p.add_argument("--no-pipelining", dest="pipelining", action="store_const", const="off", help="= --pipelining off")
        flag(p, "--batching", d.batching, choices=("auto", "on", "off"),
             help="--tp 1: concurrent sessions share forwards (auto: on with --threads > 1; with one "
                  "thread, concurrent per-session forwards use the other cores instead)")
        flag(p, "--static-shapes", d.static_shapes, choices=("on", "off"),
             help="--tp 1: every forward at a fixed row bucket over a KV pool of --max-sessions regions of "
                  "--max-context-tokens + a tree, captured as CUDA graphs on a GPU (specmesh.static_steps); "
                  "sessions share steps of the largest bucket (--batching auto: on, on any device)")
        flag(p, "--static-buckets", ",".join(map(str, d.static_buckets)), type=_buckets,
             help="comma list of row buckets for --static-shapes (one bucket: output identical to plain "
                  "decoding by construction; several: cheaper decode steps, identity as measured)")
        flag(p, "--draft-deadline-s", d.draft_deadline_s, type=float,
             help="the longest wait for a tree; each step waits what the drafter's measured answer times "
                  "make likely, within it (a request's own draft_deadline_s is kept as asked)")
        flag(p, "--reconnect-s", d.reconnect_s, type=float, help="retry a failed drafter after this long")
        flag(p, "--max-sessions", d.max_sessions, type=int, help="sessions whose KV cache is kept (least recently "
                                                                  "used evicted beyond)")
        flag(p, "--max-context-tokens", d.max_context_tokens, type=int, help="history + new tokens of a turn")
        flag(p, "--max-new-tokens", d.max_new_tokens, type=int, help="upper bound of a request's max_tokens")
        flag(p, "--redis-url", d.redis_url, help="register and heartbeat in the router registry (specmesh.registry)")
        add_peer_args(p, what="drafters")

    @classmethod
    def from_dict(cls, a: dict) -> VerifierConfig:
        old = a.pop("drafter_deprecated")
        if old is not None:
            print("verifier_service: --drafter is deprecated, use --drafter-addr", file=sys.stderr)
            a["drafter"] = old
        token = a.pop("service_token")  # required of routers, sent to drafters
        return cls(tls=server_from_args(a, token), peer_tls=peer_from_args(a, token), **a)

    def validate(self) -> None:
        super().validate()
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device: expected auto, cpu or cuda, got {self.device!r} (rank r uses cuda:r; choose "
                             "the GPUs with CUDA_VISIBLE_DEVICES)")
        if self.tp < 1:
            raise ValueError(f"tp: must be >= 1, got {self.tp}")
        if not 0 <= self.tp_local_ranks <= self.tp:
            raise ValueError(f"tp_local_ranks: must be in 1..{self.tp} (0 = all), got {self.tp_local_ranks}")
        if self.tp_listen:
            try:
                parse_hostport(self.tp_listen)
            except ValueError as e:
                raise ValueError(f"tp_listen: {e}") from None
        elif 0 < self.tp_local_ranks < self.tp:
            raise ValueError("tp_local_ranks: below --tp needs --tp-listen HOST:PORT (where the other ranks join)")
        for name, top in (("budget", MAX_TREE_NODES), ("depth", MAX_DEPTH)):
            if not 1 <= getattr(self, name) <= top:
                raise ValueError(f"{name}: must be in [1, {top}], got {getattr(self, name)}")
        for name in ("max_sessions", "max_context_tokens", "max_new_tokens", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.static_shapes not in ("on", "off"):
            raise ValueError(f"static_shapes: expected on or off, got {self.static_shapes!r}")
        if self.static_shapes == "on" and self.tp > 1:
            raise ValueError("static_shapes: on needs --tp 1 (a pool and graphs per rank are not built)")
        if not self.static_buckets or not all(1 <= b <= MAX_TREE_NODES + 1 for b in self.static_buckets):
            raise ValueError(f"static_buckets: each must be in [1, {MAX_TREE_NODES + 1}], got {self.static_buckets}")
        for name in ("draft_deadline_s", "reconnect_s", "tp_start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        self.peer_tls.validate()

    def pipelines(self, drafter: str) -> bool:
        """Whether steps drafted by `drafter` (HOST:PORT) predraft the next step while this one is
        verified. auto: yes, unless that drafter runs on this machine (a loopback address) while
        this verifier's threads already take every core: the two would only contend for the cores,
        and taking turns gives each phase all of them (`specmesh up` starts its services so; README,
        "Threads and pipelining")."""
        if self.pipelining != "auto":
            return self.pipelining == "on"
        return not self.shares_cores(drafter)

    def shares_cores(self, drafter: str) -> bool:
        """Whether `drafter` (HOST:PORT) runs on this machine while this verifier's threads take
        every core: drafter work then never runs beside a verification for free."""
        return on_this_machine(drafter) and self.threads * (self.tp_local_ranks or self.tp) >= cpu_count()

    @property
    def batched(self) -> bool:
        """Whether sessions share forwards (on a CPU target, at any TP): `auto` = at TP > 1, or with
        more than one torch thread (at TP=1 and one thread, sessions' separate forwards on separate
        cores measured faster; a TP group's forward already takes every rank's cores)."""
        if self.static_shapes == "on":  # auto: on, on any device (one bucket: rows exact however batched)
            return self.batching != "off"
        return self.batching == "on" or (self.batching == "auto" and (self.tp > 1 or self.threads > 1))

    def static_steps(self, model):
        """`model` behind `StaticSteps` sized by this config (--static-shapes on), else itself."""
        if self.static_shapes != "on":
            return model
        from specmesh.static_steps import StaticSteps

        static = StaticSteps(model, limit=self.max_context_tokens + MAX_TREE_NODES + 1, sessions=self.max_sessions,
                             buckets=self.static_buckets)
        r = static.warmup()
        print(f"verifier_service: static shapes: buckets {r['buckets']}, CUDA graphs captured {r['captured']} in "
              f"{r['capture_s']} s, KV pool {r['sessions']} x {r['limit']} slots ({r['pool_bytes'] / 2**20:.0f} MiB)",
              flush=True)
        return static


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of row counts, got {text!r}") from None


def on_this_machine(address: str) -> bool:
    """Whether HOST:PORT names a loopback address."""
    host = address.rsplit(":", 1)[0].strip("[]").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _address_list(value: str) -> tuple[str, ...]:
    """"a:1, b:*" -> ("a:1", "b:*") (argparse applies it to the string default too)."""
    return tuple(a.strip() for a in value.split(",") if a.strip())
