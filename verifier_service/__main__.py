"""`python -m verifier_service --port P --tp N --target PATH --drafter-addr HOST:PORT ...` (flags or
SPECMESH_* environment variables: VerifierConfig): serve until SIGTERM/SIGINT.

TP over machines: `--tp N --tp-local-ranks K --tp-listen 0.0.0.0:29500` here, and ranks K..N-1
elsewhere with `python -m verifier_service.tp_group --master THIS_HOST:29500 --rank K --world N`."""

from __future__ import annotations

import sys

from specmesh.service import setup_logging
from verifier_service.config import VerifierConfig


def main(argv: list[str] | None = None) -> int:
    cfg = VerifierConfig.from_args(argv)
    setup_logging(cfg.log_level)
    from verifier_service.server import serve

    return serve(cfg)


if __name__ == "__main__":
    sys.exit(main())
