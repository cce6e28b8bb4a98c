"""Settings of one router process: one frozen dataclass, parsed once at the entry point from flags
or SPECMESH_* environment variables, and passed down."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from router.policies import Overload, PolicyName
from specmesh.registry import DEFAULT_PREFIX, SESSION_TTL_S
from specmesh.service import DEFAULT_LOG_LEVEL, add_log_level_arg
from specmesh.service_token import add_token_arg
from specmesh.tls import PeerTls, ServerTls, add_peer_args, add_server_args, peer_from_args, server_from_args


@dataclass(frozen=True)
class RouterConfig:
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
        self.tls.validate()
        self.peer_tls.validate()


def parse_args(argv: list[str] | None = None) -> RouterConfig:
    env = os.environ.get
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="python -m router", description="specmesh router (gRPC + OpenAI-compatible HTTP)")
    p.add_argument("--host", default=env("SPECMESH_HOST", d.host))
    p.add_argument("--port", type=int, default=int(env("SPECMESH_PORT", d.port)))
    p.add_argument("--http-port", type=int, default=int(env("SPECMESH_HTTP_PORT", d.http_port)),
                   help="0 = a free port, -1 = no HTTP API")
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", d.redis_url))
    p.add_argument("--redis-prefix", default=env("SPECMESH_REDIS_PREFIX", d.redis_prefix))
    p.add_argument("--tokenizer", default=env("SPECMESH_TOKENIZER", d.tokenizer),
                   help="tokenizer path (HF folder or .gguf); default: the bundled model's")
    p.add_argument("--model-name", default=env("SPECMESH_MODEL_NAME", d.model_name))
    p.add_argument("--policy", choices=[n.value for n in PolicyName], default=env("SPECMESH_POLICY", d.policy))
    p.add_argument("--overload-tokens", type=int, default=int(env("SPECMESH_OVERLOAD_TOKENS", d.overload_tokens)))
    p.add_argument("--overload-ratio", type=float, default=float(env("SPECMESH_OVERLOAD_RATIO", d.overload_ratio)))
    p.add_argument("--api-key", dest="api_keys", action="append", default=None,
                   help="accepted bearer key (repeat for several); also SPECMESH_API_KEYS=k1,k2")
    p.add_argument("--max-prompt-tokens", type=int, default=int(env("SPECMESH_MAX_PROMPT_TOKENS", d.max_prompt_tokens)))
    p.add_argument("--max-tokens", type=int, default=int(env("SPECMESH_MAX_TOKENS", d.max_tokens)))
    p.add_argument("--max-request-bytes", type=int, default=int(env("SPECMESH_MAX_REQUEST_BYTES", d.max_request_bytes)))
    p.add_argument("--body-timeout-s", type=float, default=float(env("SPECMESH_BODY_TIMEOUT_S", d.body_timeout_s)),
                   help="HTTP: seconds a request body may take to arrive; then 408 and the connection closes")
    p.add_argument("--session-ttl-s", type=float, default=float(env("SPECMESH_SESSION_TTL_S", d.session_ttl_s)))
    p.add_argument("--max-attempts", type=int, default=int(env("SPECMESH_MAX_ATTEMPTS", d.max_attempts)))
    p.add_argument("--max-sessions-per-key", type=int,
                   default=int(env("SPECMESH_MAX_SESSIONS_PER_KEY", d.max_sessions_per_key)),
                   help="live sessions per API key (requests with a session id; one-shots are not counted); "
                        "a new one beyond -> RESOURCE_EXHAUSTED / 429; 0 = unlimited")
    p.add_argument("--grace-s", type=float, default=float(env("SPECMESH_GRACE_S", d.grace_s)))
    add_server_args(p, env)
    add_peer_args(p, env, "verifiers")
    add_token_arg(p, env)
    add_log_level_arg(p)
    a = vars(p.parse_args(argv))
    keys = a.pop("api_keys") or [k for k in env("SPECMESH_API_KEYS", "").split(",") if k]
    # the public ports take API keys; the service token goes to verifiers
    cfg = RouterConfig(api_keys=tuple(keys), tls=server_from_args(a), peer_tls=peer_from_args(a, a.pop("service_token")),
                       **a)
    try:
        cfg.validate()
    except ValueError as e:
        p.error(str(e))
    return cfg
