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
