"""Tensor parallelism: shard an already-built `Transformer` in place for one rank of N.

Megatron-style column/row split per decoder layer, one all-reduce after each row-parallel layer:
- **column-parallel** (each rank keeps a slice of the output rows): `q_proj`, `k_proj`, `v_proj`
  (and their biases, for Qwen2) and the MLP's `gate_proj`, `up_proj`;
- **row-parallel** (each rank keeps the matching slice of the input columns): `o_proj` and
  `down_proj`; their partial outputs are summed across ranks by `model.tp_all_reduce`.
- **replicated**: embeddings, norms and `lm_head`. The vocabulary is not split: a replicated
  `lm_head` keeps the logits whole on every rank, so rank 0 computes them itself with no gather
  (the other ranks skip the head entirely), and the embedding needs no all-reduce either.

Attention heads are split by whole GQA groups: each rank gets some K/V heads and exactly the query
heads that attend to them, so attention stays local. Groups are split **unevenly** where they must
be: SmolLM2-135M has 3 K/V heads (9 query heads), so TP=2 gives ranks 2+1 K/V heads and 6+3 query
heads. The MLP's intermediate size is split as evenly as possible. `Attention` infers its local
head count from the weight shapes and `Transformer.new_cache` sizes K/V heads from `k_proj`, so
nothing else in the model changes; `model.config` keeps the global (unsharded) sizes.

This module knows nothing of processes or transport: `all_reduce` is any function that sums a
tensor across ranks (`tp_all_reduce` over a torch.distributed group in production, threads in
tests). Starting the ranks and driving them lives in `verifier_service/tp_group.py`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from specmesh.model import AllReduce, ModelConfig, Transformer


def shard_sizes(n: int, world: int) -> list[int]:
    """Split `n` items over `world` ranks as evenly as possible, larger shards first."""
    if world < 1 or n < 0:
        raise ValueError(f"shard_sizes: need n >= 0 and world >= 1, got n={n}, world={world}")
    base, extra = divmod(n, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def _span(sizes: list[int], rank: int, unit: int = 1) -> tuple[int, int]:
    """(offset, length) of `rank`'s shard, in items of `unit` rows/columns each."""
    return sum(sizes[:rank]) * unit, sizes[rank] * unit


def _keep_rows(linear: nn.Linear, offset: int, length: int) -> None:
    """Column-parallel: keep output rows [offset, offset+length) of the weight (and bias)."""
    linear.weight = nn.Parameter(linear.weight.detach()[offset:offset + length].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach()[offset:offset + length].clone(), requires_grad=False)
    linear.out_features = length


def _keep_cols(linear: nn.Linear, offset: int, length: int) -> None:
    """Row-parallel: keep input columns [offset, offset+length); the outputs are partial sums."""
    # A bias would be added once per rank and so counted N times by the all-reduce.
    assert linear.bias is None, "row-parallel layers must have no bias"
    linear.weight = nn.Parameter(linear.weight.detach()[:, offset:offset + length].clone(), requires_grad=False)
    linear.in_features = length


def check_world_size(cfg: ModelConfig, world_size: int) -> None:
    """ValueError unless `cfg` can be split over `world_size` ranks (one K/V head each at least)."""
    if world_size < 1:
        raise ValueError(f"tp: world size must be >= 1, got {world_size}")
    if cfg.num_kv_heads < world_size:
        raise ValueError(
            f"tp: {world_size} ranks but the model has only {cfg.num_kv_heads} K/V heads; "
            f"heads are split by whole GQA groups, so use at most {cfg.num_kv_heads} ranks"
        )


def apply_tp(model: Transformer, rank: int, world_size: int, all_reduce: AllReduce | None) -> Transformer:
    """Shard `model` in place for `rank` of `world_size` and install `all_reduce`; returns it.

    Replaces the sharded parameters with new (sliced) tensors, never writing into the old ones,
    so models sharing their original weights (built from one state dict) stay intact.
    """
    cfg = model.config
    check_world_size(cfg, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"tp: rank {rank} outside [0, {world_size})")
    assert cfg.num_heads % cfg.num_kv_heads == 0, "query heads come in whole GQA groups"
    if world_size == 1:
        model.tp_all_reduce = None
        return model
    if all_reduce is None:
        raise ValueError("tp: world_size > 1 needs an all_reduce")
    d = cfg.head_dim
    group = cfg.num_heads // cfg.num_kv_heads
    kv_off, kv_len = _span(shard_sizes(cfg.num_kv_heads, world_size), rank, d)
    q_off, q_len = kv_off * group, kv_len * group  # the query heads of exactly these K/V heads
    ff_off, ff_len = _span(shard_sizes(cfg.intermediate_size, world_size), rank)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _keep_rows(attn.q_proj, q_off, q_len)
        _keep_rows(attn.k_proj, kv_off, kv_len)
        _keep_rows(attn.v_proj, kv_off, kv_len)
        _keep_cols(attn.o_proj, q_off, q_len)
        _keep_rows(mlp.gate_proj, ff_off, ff_len)
        _keep_rows(mlp.up_proj, ff_off, ff_len)
        _keep_cols(mlp.down_proj, ff_off, ff_len)
    model.tp_all_reduce = all_reduce
    return model


def tp_all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `x` across the ranks of `group` (the default group when None), in place; returns it.

    Bind the group with `functools.partial(tp_all_reduce, group=...)` to get an `AllReduce`.
    """
    dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x
