"""`python -m router --port P --http-port H --redis-url URL [--api-key K ...] [--policy NAME] ...`
(flags or SPECMESH_* environment variables: RouterConfig): loads only the tokenizer (of the bundled
model, or --tokenizer PATH), connects to Redis, serves gRPC and HTTP until SIGTERM/SIGINT. Prints
`router listening on HOST:PORT http HOST:H`."""

from __future__ import annotations

import sys

from router.config import RouterConfig
from specmesh.service import setup_logging


def main(argv: list[str] | None = None) -> int:
    cfg = RouterConfig.from_args(argv)
    setup_logging(cfg.log_level)
    from router.server import serve

    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
