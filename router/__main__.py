"""`python -m router --port P --http-port H --redis-url URL [--api-key K ...] [--policy NAME]
[--max-sessions-per-key N] [--tls-cert F --tls-key F [--tls-client-ca F]] [--peer-ca F ...]`

Loads only the tokenizer (of the bundled model, or --tokenizer PATH), connects to Redis, serves
gRPC and HTTP until SIGTERM/SIGINT. Prints `router listening on HOST:PORT http HOST:H`.
"""

from __future__ import annotations

import asyncio
import sys

from router.config import parse_args
from specmesh.service import setup_logging


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    setup_logging(cfg.log_level)
    from specmesh.registry import model_name
    from router.server import serve_until_signal
    from router.state import RouterState
    from router.turns import Router
    from specmesh.loader import bundled_target_path, load_tokenizer

    path = cfg.tokenizer or str(bundled_target_path())
    tokenizer = load_tokenizer(path)

    def announce(servers) -> None:
        http = f" http {cfg.host}:{servers.http_port}" if servers.http_port is not None else ""
        print(f"router listening on {cfg.host}:{servers.port}{http} "
              f"(policy={cfg.policy}, redis={_redacted(cfg.redis_url)}, tls={cfg.tls.mode}, "
              f"verifier_tls={'on' if cfg.peer_tls.enabled else 'off'})", flush=True)

    async def run() -> None:
        state = RouterState.from_url(cfg.redis_url, cfg.redis_prefix, cfg.session_ttl_s)
        router = Router(cfg, state, tokenizer, cfg.model_name or model_name(path))
        await serve_until_signal(cfg, router, announce)

    asyncio.run(run())
    return 0


def _redacted(url: str) -> str:
    """The Redis URL without its password."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{'***@' if at else ''}{host}"


if __name__ == "__main__":
    sys.exit(main())
