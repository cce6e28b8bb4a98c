"""The limits a request is held to, in one place for every surface that checks them (the HTTP
API, the router's and verifier's gRPC, the engine, the drafter service), and the one check of
token ids against a vocabulary. Standard library only: the router reads it without torch."""

from __future__ import annotations

from collections.abc import Iterable

MAX_TREE_NODES = 64   # draft nodes in one step's tree (a speculation budget)
MAX_DEPTH = 16        # levels of one step's tree
MAX_STOP_STRINGS = 16  # stop strings of one request


def check_ids(ids: Iterable[int], vocab_size: int | None, field: str) -> None:
    """ValueError naming `field` when an id is outside [0, vocab_size) (None: any id >= 0)."""
    for t in ids:
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else "[0, 2**31)"
            raise ValueError(f"{field}: token id {t} outside vocabulary {bound}")
