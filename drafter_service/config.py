"""Settings of the drafter service: one frozen dataclass, parsed once at the entry point from flags
or SPECMESH_* environment variables (`DrafterServiceConfig.from_args`, specmesh.service), and
passed down."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import ClassVar

from specmesh.drafters import parse_drafter_spec
from specmesh.service import DEFAULT_DTYPE, DEFAULT_LOG_LEVEL, ServiceConfig, add_common_args, flag
from specmesh.tls import ServerTls, server_from_args

DEFAULT_VOCAB_SIZE = 49152  # the bundled SmolLM2's vocabulary (oracle only)
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class DrafterServiceConfig(ServiceConfig):
    PROG: ClassVar[str] = "python -m drafter_service"
    DESCRIPTION: ClassVar[str] = "specmesh drafter service (gRPC specmesh.v1.Drafter)"

    drafter: str = "ngram"  # ngram | model:PATH | oracle:ALPHA
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    oracle_reference: str | None = None  # JSON file: list of token-id sequences (prompt + continuation)
    draft_cost_s: float = 0.0  # oracle only: sleep per tree level
    draft_row_cost_s: float = 0.0  # oracle only: sleep per row of a level, on top
    vocab_size: int = DEFAULT_VOCAB_SIZE  # oracle only (the model drafter takes its own)
    seed: int = 0  # oracle only: seed of its corruption
    max_sessions: int = 256
    idle_timeout_s: float = 600.0
    max_context_tokens: int = 32768  # one session's committed tokens (its KV cache); beyond: refused
    max_total_tokens: int = 262144  # all sessions' committed tokens: least recently used evicted beyond
    threads: int = 1  # torch threads
    device: str = "auto"  # model drafters: auto (cuda when available) | cpu | cuda (specmesh.device)
    dtype: str = DEFAULT_DTYPE  # model drafters: specmesh.device.DTYPES (auto: runtime.load_model_drafter)
    # a GGUF model drafter under dtype auto: head rows kept (specmesh.drafters.head_cut); None: its
    # default (head_cut.DEFAULT_SIZE), 0: the whole head
    draft_vocab: int | None = None
    max_streams: int = 64  # concurrent Draft streams (one worker thread each)
    grace_s: float = 5.0  # on SIGTERM/SIGINT: let streams finish this long, then cancel
    max_message_bytes: int = MAX_MESSAGE_BYTES
    metrics_port: int = 0  # Prometheus /metrics on this port (0 = off)
    tls: ServerTls = field(default_factory=ServerTls)  # the gRPC port (verifiers dial it); off = plaintext
    # the tokenizer the drafter shares with its target (HF folder or GGUF): with it, trees hold
    # only nodes a turn's grammar allows (structured outputs). None: a model drafter's own, when
    # its files hold one; else, or "none", trees are not pruned (verification enforces the grammar)
    tokenizer: str | None = None
    log_level: str = DEFAULT_LOG_LEVEL
    # register and heartbeat in the router registry (as the verifier does; "" = not: a sidecar,
    # `python -m router.register`, can register a drafter that is not specmesh's)
    redis_url: str = ""

    @property
    def kind(self) -> str:
        return parse_drafter_spec(self.drafter)[0]

    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        d = cls()
        add_common_args(p, d, model=True, metrics=True)
        flag(p, "--drafter", d.drafter, help="ngram | model:PATH | oracle:ALPHA")
        flag(p, "--tokenizer", d.tokenizer,
             help="the tokenizer shared with the target (HF folder or GGUF), to prune trees to a turn's grammar "
                  "(structured outputs); default: a model drafter's own, if its files hold one; none: do not "
                  "follow grammars")
        flag(p, "--draft-vocab", d.draft_vocab, type=int,
             help="a GGUF model drafter (dtype auto): keep this many head rows, its most frequent tokens, and score "
                  "each session's context beside them (a cheaper drafter level; the output is unchanged); "
                  "0: the whole head; default: 81920 where the vocabulary is larger")
        flag(p, "--oracle-reference", d.oracle_reference,
             help="oracle: JSON list of token-id sequences (prompt + the target's continuation)")
        flag(p, "--draft-cost-s", d.draft_cost_s, type=float,
             help="oracle: seconds to sleep per tree level (a drafter of that cost)")
        flag(p, "--draft-row-cost-s", d.draft_row_cost_s, type=float,
             help="oracle: seconds to sleep per row of a level, on top (a wider level costs more, as on a CPU)")
        flag(p, "--vocab-size", d.vocab_size, type=int, help="oracle: vocabulary size (default: the bundled SmolLM2's)")
        flag(p, "--seed", d.seed, type=int, help="oracle: corruption seed")
        flag(p, "--max-sessions", d.max_sessions, type=int, help="sessions kept (least recently used evicted beyond)")
        flag(p, "--idle-timeout-s", d.idle_timeout_s, type=float, help="a session idle this long is closed")
        flag(p, "--max-context-tokens", d.max_context_tokens, type=int,
             help="tokens one session may hold; a request beyond is refused")
        flag(p, "--max-total-tokens", d.max_total_tokens, type=int,
             help="tokens all sessions may hold together (their KV caches); least recently used evicted beyond")
        flag(p, "--max-streams", d.max_streams, type=int, help="concurrent Draft streams (one worker thread each)")
        flag(p, "--redis-url", d.redis_url,
             help="register and heartbeat in the router registry (specmesh.registry), deregistered on stop")

    @classmethod
    def from_dict(cls, a: dict) -> DrafterServiceConfig:
        return cls(tls=server_from_args(a, a.pop("service_token")), **a)

    def validate(self) -> None:
        """Raise ValueError naming the setting if one is bad."""
        super().validate()
        kind, _ = parse_drafter_spec(self.drafter)
        if kind == "none":
            raise ValueError("drafter: a drafter service needs a drafter: ngram, model:PATH or oracle:ALPHA")
        if kind == "oracle" and not self.oracle_reference:
            raise ValueError("oracle_reference: the oracle drafter needs --oracle-reference FILE")
        for name in ("draft_cost_s", "draft_row_cost_s"):
            value = getattr(self, name)
            if kind != "oracle" and value:
                raise ValueError(f"{name}: only the oracle drafter models a draft cost")
            if value < 0:
                raise ValueError(f"{name}: must be >= 0, got {value}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size: must be >= 2, got {self.vocab_size}")
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions: must be >= 1, got {self.max_sessions}")
        if not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s: must be > 0, got {self.idle_timeout_s}")
        if self.max_context_tokens < 1:
            raise ValueError(f"max_context_tokens: must be >= 1, got {self.max_context_tokens}")
        if self.max_total_tokens < self.max_context_tokens:
            raise ValueError(f"max_total_tokens: must be >= max_context_tokens ({self.max_context_tokens}), "
                             f"got {self.max_total_tokens}")
        if self.draft_vocab is not None and kind != "model":
            raise ValueError("draft_vocab: only a model drafter has a head to cut")
        if self.draft_vocab is not None and self.draft_vocab < 0:
            raise ValueError(f"draft_vocab: must be >= 0 (0: the whole head), got {self.draft_vocab}")
        if kind != "model" and (self.device != "auto" or self.dtype != DEFAULT_DTYPE):
            raise ValueError("device, dtype: only a model drafter computes (ngram and oracle run on the CPU)")
        if self.max_streams < 1:
            raise ValueError(f"max_streams: must be >= 1, got {self.max_streams}")
