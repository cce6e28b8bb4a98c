"""What the router, the verifier and the drafter service share as services: the log-level flag
and how logging is set up (the start of one service layer; see the README's service flags)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_LOG_LEVEL = "WARNING"


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level, env SPECMESH_LOG_LEVEL, the same on every service."""
    p.add_argument("--log-level", default=os.environ.get("SPECMESH_LOG_LEVEL", DEFAULT_LOG_LEVEL),
                   type=str.upper, choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
                   help="the service's log messages from this level on, to stderr (env SPECMESH_LOG_LEVEL)")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=LOG_FORMAT)
