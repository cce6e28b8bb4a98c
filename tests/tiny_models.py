"""Seeded random transformers models for tests: every parameter (norms and biases included) is
far from its default init, so logits are O(1) and a wrong weight or a missing bias shows."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM


def random_hf_model(cfg, seed: int = 0):
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:  # biases
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return hf


def tiny_transformer(seed: int = 0, weight_std: float | None = None):
    """specmesh's own Transformer, tiny (GQA, q/k/v biases), seeded: biases N(0, 0.1); with
    `weight_std`, every matrix N(0, weight_std) too (peaked logits: greedy chains a drafter can follow)."""
    from specmesh.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=True, max_position_embeddings=512)
    torch.manual_seed(seed)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    m = Transformer(cfg, inv_freq).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and "norm" not in name:
                p.normal_(0.0, 0.1)  # non-zero q/k/v biases
            elif p.dim() == 2 and weight_std is not None:
                p.normal_(0.0, weight_std)
    return m


def tiny_distillation_setup(vocab: int = 96, examples: int = 24):
    """A tiny random Llama target and distillation examples of it: its own greedy continuations of
    random prompts with its top-8 at every continuation position (the format of
    specmesh.distill.data). Returns (config, transformers model, our Transformer, examples)."""
    from transformers import LlamaConfig

    from specmesh.engine import StopConditions, generate
    from specmesh.loader import model_from_hf
    from specmesh.sampling import SamplingParams

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=1)
    hf = random_hf_model(cfg, seed=3)
    target = model_from_hf(cfg, hf.state_dict())
    g = torch.Generator().manual_seed(0)
    out_examples = []
    for _ in range(examples):
        prompt = torch.randint(2, vocab, (6,), generator=g).tolist()
        out = generate(target, prompt, SamplingParams(), StopConditions(24)).token_ids
        tokens = torch.tensor(prompt + out)
        with torch.no_grad():
            p = torch.softmax(hf(tokens[None]).logits[0, len(prompt) - 1:-1], -1)
        v, i = p.topk(8, -1)
        out_examples.append({"tokens": tokens.to(torch.int32), "start": len(prompt), "topk_ids": i.to(torch.int32),
                             "topk_p": v.half(), "kind": "chat"})
    return cfg, hf, target, out_examples
