"""`python -m drafter_service --drafter ngram|model:PATH|oracle:ALPHA ...` (flags or SPECMESH_*
environment variables: DrafterServiceConfig): serve until SIGTERM/SIGINT."""

from __future__ import annotations

import sys

from drafter_service.config import DrafterServiceConfig
from specmesh.service import setup_logging


def main(argv: list[str] | None = None) -> int:
    cfg = DrafterServiceConfig.from_args(argv)
    setup_logging(cfg.log_level)
    from drafter_service.server import serve

    try:
        serve(cfg)
    except (ValueError, OSError) as exc:
        print(f"drafter_service: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
