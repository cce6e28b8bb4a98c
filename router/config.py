"""Settings of one router process: one frozen dataclass, parsed once at the entry point from flags
or SPECMESH_* environment variables (`RouterConfig.from_args`, specmesh.service), and passed down."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import ClassVar

from router.policies import Overload, PolicyName
from specmesh.registry import DEFAULT_PREFIX, SESSION_TTL_S
from specmesh.service import DEFAULT_LOG_LEVEL, ServiceConfig, add_common_args, flag
from specmesh.tls import PeerTls, ServerTls, add_peer_args, peer_from_args, server_from_args


@dataclass(frozen=True)
class RouterConfig(ServiceConfig):
    PROG: ClassVar[str] = "python -m router"
    DESCRIPTION: ClassVar[str] = "specmesh router (gRPC + OpenAI-compatible HTTP)"

    host: str = "127.0.0.1"
    log_level: str = DEFAULT_LOG_LEVEL
    port: int = 0                        # gRPC (0 = a free port, printed on start)
    http_port: int = 0                   # OpenAI-compatible HTTP (0 = a free port; -1 = off)
    redis_url: str = "redis://127.0.0.1:6379/0"  # redis:// or rediss:// (TLS); password in the URL
    redis_prefix: str = DEFAULT_PREFIX
    tokenizer: str | None = None         # tokenizer path; None = the bundled SmolLM2's
    model_name: str = ""                 # served model name; "" = derived from the tokenizer path
    policy: str = PolicyName.STICKY_LEAST_TOKENS.value
    overload_tokens: int = 32768         # sticky-least-tokens: absolute overload threshold
    overload_ratio: float = 2.0          # sticky-least-tokens: relative overload threshold
    api_keys: tuple[str, ...] = ()       # empty = no authentication
    max_sessions_per_key: int = 0        # live sessions (with a session id) per API key; 0 = unlimited
    max_prompt_tokens: int = 8192        # context of a turn (history + new tokens)
    max_tokens: int = 2048               # upper bound of a request's max_tokens
    max_request_bytes: int = 4 << 20     # serialized request (gRPC) / body (HTTP)
    body_timeout_s: float = 30.0         # HTTP: a body not in after this long gets a 408 (slow clients)
    session_ttl_s: float = SESSION_TTL_S  # binding and history live this long after the last turn
    max_attempts: int = 3                # verifiers tried per turn (before and after the first token)
    default_max_tokens_http: int = 16    # OpenAI's default when a request names none
    grace_s: float = 5.0                 # graceful shutdown: in-flight streams get this long
    tls: ServerTls = field(default_factory=ServerTls)      # both public ports (gRPC, HTTP); off = plaintext
    peer_tls: PeerTls = field(default_factory=PeerTls)     # channels to verifiers; off = plaintext

    @property
    def overload(self) -> Overload:
        return Overload(self.overload_tokens, self.overload_ratio)

    def validate(self) -> None:
        super().validate()
        PolicyName(self.policy)
        for name in ("max_prompt_tokens", "max_tokens", "max_request_bytes", "max_attempts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s: must be > 0, got {self.body_timeout_s}")
        if self.session_ttl_s <= 0:
            raise ValueError(f"session_ttl_s: must be > 0, got {self.session_ttl_s}")
        if self.max_sessions_per_key < 0:
            raise ValueError(f"max_sessions_per_key: must be >= 0, got {self.max_sessions_per_key}")
        if self.max_sessions_per_key and not self.api_keys:
            raise ValueError("max_sessions_per_key: sessions are counted per API key; configure --api-key")
        if self.http_port != -1 and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port: must be in [0, 65535] or -1 (off), got {self.http_port}")
        self.peer_tls.validate()


    @classmethod
    def add_args(cls, p: argparse.ArgumentParser) -> None:
        d = cls()
        add_common_args(p, d, model=False, metrics=False)
        flag(p, "--http-port", d.http_port, type=int,
             help="OpenAI-compatible HTTP API, /health and /metrics (0 = a free port, -1 = no HTTP API)")
        flag(p, "--redis-url", d.redis_url, help="the router registry and session state (redis:// or rediss://; "
                                                 "password in the URL)")
        flag(p, "--redis-prefix", d.redis_prefix, help="prefix of the registry's Redis keys")
        flag(p, "--tokenizer", d.tokenizer, help="tokenizer path (HF folder or .gguf); default: the bundled model's")
        flag(p, "--model-name", d.model_name, help="served model name (default: from the tokenizer path)")
        flag(p, "--policy", d.policy, choices=[n.value for n in PolicyName], help="placement policy")
        flag(p, "--overload-tokens", d.overload_tokens, type=int, help="sticky-least-tokens: absolute overload")
        flag(p, "--overload-ratio", d.overload_ratio, type=float, help="sticky-least-tokens: relative overload")
        p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                       help="accepted bearer key (repeat for several; env SPECMESH_API_KEYS=k1,k2)")
        flag(p, "--max-sessions-per-key", d.max_sessions_per_key, type=int,
             help="live sessions per API key (requests with a session id; one-shots are not counted); "
                  "a new one beyond -> RESOURCE_EXHAUSTED / 429; 0 = unlimited")
        flag(p, "--max-prompt-tokens", d.max_prompt_tokens, type=int, help="context of a turn (history + new tokens)")
        flag(p, "--max-tokens", d.max_tokens, type=int, help="upper bound of a request's max_tokens")
        flag(p, "--max-request-bytes", d.max_request_bytes, type=int, help="serialized request (gRPC) / body (HTTP)")
        flag(p, "--body-timeout-s", d.body_timeout_s, type=float,
             help="HTTP: seconds a request body may take to arrive; then 408 and the connection closes")
        flag(p, "--session-ttl-s", d.session_ttl_s, type=float, help="a session's binding and history live this "
                                                                      "long after its last turn")
        flag(p, "--max-attempts", d.max_attempts, type=int, help="verifiers tried per turn")
        add_peer_args(p, what="verifiers")

    @classmethod
    def from_dict(cls, a: dict) -> RouterConfig:
        keys = a.pop("api_keys") or [k for k in os.environ.get("SPECMESH_API_KEYS", "").split(",") if k]
        # the public ports take API keys; the service token goes to verifiers
        return cls(api_keys=tuple(keys), tls=server_from_args(a), peer_tls=peer_from_args(a, a.pop("service_token")),
                   **a)
