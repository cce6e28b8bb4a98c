"""Settings of the drafter service: one frozen dataclass, parsed once at the entry point
(`python -m drafter_service`, flags or SPECMESH_* environment variables) and passed down."""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.device import DTYPES
from specmesh.drafters import parse_drafter_spec
from specmesh.service import DEFAULT_LOG_LEVEL
from specmesh.tls import ServerTls

DEFAULT_VOCAB_SIZE = 49152  # the bundled SmolLM2's vocabulary (oracle only)
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class DrafterServiceConfig:
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
    dtype: str = "float32"  # model drafters: specmesh.device.DTYPES (auto: runtime.load_model_drafter)
    max_streams: int = 64  # concurrent Draft streams (one worker thread each)
    grace_s: float = 2.0  # on SIGTERM/SIGINT: let streams finish this long, then cancel
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

    def validate(self) -> None:
        """Raise ValueError naming the setting if one is bad."""
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
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port: must be in [0, 65535], got {self.metrics_port}")
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
        if kind != "model" and (self.device != "auto" or self.dtype != "float32"):
            raise ValueError("device, dtype: only a model drafter computes (ngram and oracle run on the CPU)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: expected one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams: must be >= 1, got {self.max_streams}")
        if self.redis_url and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url: redis://HOST:PORT/DB, got {self.redis_url!r}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s: must be >= 0, got {self.grace_s}")
        self.tls.validate()
