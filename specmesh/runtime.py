"""Wiring from names and paths to core objects: the target, its tokenizer, prompts, drafters.

Shared by the CLI, the services and the benchmarks, so that "--drafter model:PATH" or a default
target means the same thing everywhere.
"""

from __future__ import annotations

import torch

from specmesh.device import place
from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.drafters.base import Drafter
from specmesh.engine import StopConditions, generate
from specmesh.loader import bundled_target_path, load_drafter_weights, load_model, load_tokenizer
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams


def fit_threads(*served) -> str:
    """Split this process's thread budget (`specmesh.kernels.set_threads`; else torch's thread
    count) for what it serves, and say how: models, or drafters holding one (`.model`; an n-gram
    or oracle drafter, or None, holds no weights). When every matrix product of every model runs
    on specmesh's kernel pool (a GGUF as shipped, `int4` on specmesh's kernel), the pool takes the
    budget and torch's own ops (attention, norms, a few percent of a step) run on one thread:
    torch's OpenMP workers, spinning after each of those small ops, otherwise hold the cores the
    pool's next product needs (README, "Threads"). Otherwise torch takes the whole budget."""
    from specmesh import kernels
    from specmesh.quant import products_on_pool

    models = [m for m in (s if isinstance(s, torch.nn.Module) else getattr(s, "model", None) for s in served)
              if isinstance(m, torch.nn.Module)]
    budget = kernels.pool_threads()
    kernels.set_threads(budget, 1 if models and all(products_on_pool(m) for m in models) else budget)
    return kernels.describe_threads()


def load_target(path: str | None):
    """(model, tokenizer) for a local path, or the bundled SmolLM2 when `path` is None."""
    p = path or bundled_target_path()
    return load_model(p), load_tokenizer(p)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if not text:
        raise ValueError("prompt: must not be empty")
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer.encode(text, add_special_tokens=False)


def reference_continuation(model: Transformer, prompt_ids: list[int], stop: StopConditions) -> list[int]:
    """prompt + the target's own greedy continuation (what the oracle drafter replays)."""
    return list(prompt_ids) + generate(model, prompt_ids, SamplingParams(), stop).token_ids


def make_drafter(kind: str, arg: str, target: Transformer, reference: list[int] | None = None,
                 seed: int = 0, dtype: torch.dtype | str = torch.float32, head: int | None = None) -> Drafter | None:
    """The drafter `kind:arg` names for `target`; a model drafter's weights as `dtype`, its head
    cut to `head` tokens (`load_model_drafter`)."""
    if kind == "none":
        return None
    if kind == "ngram":
        return NgramDrafter()
    if kind == "oracle":
        assert reference is not None, "the oracle drafter needs the reference continuation"
        return OracleDrafter(reference, float(arg), target.config.vocab_size, seed=seed)
    if kind == "model":
        drafter = load_model_drafter(arg, dtype=dtype, head=head)
        vocab = drafter.model.config.vocab_size
        if vocab != target.config.vocab_size:
            raise ValueError(f"drafter: vocabulary {vocab} != target's {target.config.vocab_size}")
        if drafter.needs_features and drafter.feature_dim != target.config.hidden_size:
            raise ValueError(f"drafter: takes {drafter.feature_dim}-wide target features, the target's hidden "
                             f"size is {target.config.hidden_size}")
        return drafter
    raise ValueError(f"drafter: unknown kind {kind!r}")


def load_model_drafter(path: str, device: torch.device | str = "cpu", dtype: torch.dtype | str = torch.float32,
                       head: int | None = None):
    """`model:PATH`: a small causal LM (`ModelDrafter`) or, when its config says specmesh.kind =
    "feature", a feature drafter (`FeatureDrafter`, EAGLE-style); computing on `device`, weights as
    `dtype` (`loader.load_drafter_weights`: "auto" may requantize a drafter and cut its head to
    `head` tokens)."""
    from specmesh.drafters.feature import FeatureDrafter
    from specmesh.drafters.model import ModelDrafter

    if dtype == "auto" and torch.device(device).type != "cpu":
        dtype = torch.float32  # the quantized formats run on CPU kernels only
    draft = place(load_drafter_weights(path, dtype, head), torch.device(device))
    return FeatureDrafter(draft) if draft.fc is not None else ModelDrafter(draft)
