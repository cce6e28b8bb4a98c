"""Drafters: `model` (a small causal LM), `ngram` (prompt lookup), `oracle` (benchmarks only).

`make_drafter(spec, ...)` parses the CLI/config form: none | ngram | model:PATH | oracle:ALPHA,
after `resolve_auto` has turned `auto` into one of them.
"""

from __future__ import annotations

from pathlib import Path

from specmesh.drafters.base import Children, Drafter, DraftSession, grow_tree
from specmesh.drafters.ngram import NgramDrafter
from specmesh.drafters.oracle import OracleDrafter

__all__ = ["Children", "Drafter", "DraftSession", "grow_tree", "NgramDrafter", "OracleDrafter", "parse_drafter_spec", "resolve_auto",
           "bundled_drafter_path"]

BUNDLED_DRAFTER = "smollm2_135m"  # trained by `specmesh train-drafter` for the bundled SmolLM2 (recipe.json)


def bundled_drafter_path() -> Path:
    """The drafter shipped in this package for the bundled target (see its recipe.json)."""
    return Path(__file__).parent / BUNDLED_DRAFTER


def resolve_auto(spec: str, target: str | None) -> str:
    """'auto' -> the shipped trained drafter when the target is the bundled model, else 'ngram'."""
    if spec != "auto":
        return spec
    if target is None and (bundled_drafter_path() / "config.json").is_file():
        return f"model:{bundled_drafter_path()}"
    return "ngram"


def parse_drafter_spec(spec: str) -> tuple[str, str]:
    """'none' | 'ngram' | 'model:PATH' | 'oracle:ALPHA' -> (kind, argument). ValueError otherwise."""
    kind, _, arg = spec.partition(":")
    if kind in ("none", "ngram") and not arg:
        return kind, ""
    if kind == "model" and arg:
        return kind, arg
    if kind == "oracle":
        try:
            alpha = float(arg)
        except ValueError:
            alpha = -1.0
        if 0.0 <= alpha <= 1.0:
            return kind, arg
        raise ValueError(f"drafter: oracle needs an alpha in [0, 1], e.g. oracle:0.8, got {spec!r}")
    raise ValueError(f"drafter: expected none, ngram, model:PATH or oracle:ALPHA, got {spec!r}")
