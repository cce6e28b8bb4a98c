"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5) over a slot-addressed KV cache.

One forward serves every phase: **prefill** (causal over new tokens), **decode** (one token),
**tree verification** (a boolean tree mask plus depth-based positions) and a drafter's level-by-level
tree building. Callers say where the new tokens' K/V go (`start` slot) and what each may see
(`mask`); the cache's commit keeps the accepted path.

Module and parameter names mirror transformers' `LlamaForCausalLM`, so a transformers state dict
loads as is, and `tp.py` can shard the projections in place: attention infers its local head
count from the weight shapes, and `tp_all_reduce` (None on one rank) sums row-parallel outputs.
This module knows nothing about files, tokenizers, sampling or transport (see `loader.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from specmesh import kernels
from specmesh.kernels import attention, glue
from specmesh.kv_cache import KVCache

ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int
    architecture: str = "llama"
    sliding_window: int | None = None  # attention window, where the config turns one on
    draft_vocab_size: int | None = None  # drafters only: the LM head scores this many tokens (vocab_map)
    feature_input: bool = False  # feature drafters only: input = fc([target feature; token embedding])

    @staticmethod
    def from_hf(cfg) -> "ModelConfig":
        """From a transformers PretrainedConfig of a supported architecture."""
        if cfg.model_type not in ARCHITECTURES:
            raise ValueError(f"model_type: {cfg.model_type!r} not supported, use one of {ARCHITECTURES}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        window = getattr(cfg, "sliding_window", None)
        if cfg.model_type == "qwen2" and not getattr(cfg, "use_sliding_window", False):
            window = None
        bias = getattr(cfg, "attention_bias", None)
        if bias is None:
            bias = cfg.model_type == "qwen2"  # Qwen2 has q/k/v biases and no config flag
        return ModelConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            tie_word_embeddings=bool(cfg.tie_word_embeddings),
            attention_bias=bool(bias),
            max_position_embeddings=cfg.max_position_embeddings,
            architecture=cfg.model_type,
            sliding_window=window if window and window < cfg.max_position_embeddings else None,
            draft_vocab_size=(getattr(cfg, "specmesh", None) or {}).get("draft_vocab_size"),
            feature_input=(getattr(cfg, "specmesh", None) or {}).get("kind") == "feature",
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if glue.runs(x, self.weight) and self.weight.dtype == torch.float32:
            return glue.rms_norm(x, self.weight, self.eps)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    def after_add(self, h: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + a, this norm of it): a residual add and the next layer's norm, one op where it runs."""
        if glue.runs(h, a, self.weight) and a.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return glue.add_rms_norm(h, a, self.weight, self.eps)
        h = h + a
        return h, self(h)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Segment:
    """One session's part of a (batched) forward: its new tokens and where they go."""
    tokens: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cache: KVCache
    start: int  # slot of the first token
    mask: torch.Tensor | None = None  # [T, start + T] bool; None = causal
    logits_rows: torch.Tensor | slice | None = field(default_factory=lambda: slice(None))  # None = no logits
    features: torch.Tensor | None = None  # [T, hidden] feature drafters: the target features fed with the tokens
    want_hidden: bool = False  # fill `hidden` with the final hidden states (before the norm), [T, hidden]
    hidden: torch.Tensor | None = None
    exact: bool = True  # rows bitwise as if decoded alone (`_attention_by_row`); drafters need not
    row_keys: tuple[torch.Tensor, torch.Tensor] | None = None  # rows attended alone: `_row_slots`, once per forward
    # a reduced-vocabulary head (`vocab_map`): tokens scored beside it for this segment, and their
    # head rows ([N] ids, [N, hidden]): a drafter's session context (`HeadCut`)
    extra_vocab: tuple[torch.Tensor, torch.Tensor] | None = None


class Linear(nn.Linear):
    """nn.Linear whose few-row products go through `specmesh.kernels` (same weights, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.bias)


Products = list[tuple[nn.Module, list[int] | None]]  # a layer, and the outputs it splits into (None: one)


def _fusion_plan(owner: nn.Module, layers: tuple[nn.Module, ...]) -> Products:
    """`layers` as the products that compute them: consecutive layers that `quant.fuse_qdot` joins
    become one fused layer, its output split into theirs. The plan is made at the first call and
    again whenever `owner`'s layers were replaced (a loader requantizing them); it is kept out of
    the module tree, so state dicts and module walks see only `layers`."""
    plan = owner.__dict__.get("_fused")
    if plan is None or len(plan[0]) != len(layers) or any(a is not b for a, b in zip(plan[0], layers)):
        from specmesh.quant import fuse_qdot, fusion_key

        runs: list[list[nn.Module]] = []
        for m in layers:
            key = fusion_key(m)
            if runs and key is not None and fusion_key(runs[-1][-1]) == key:
                runs[-1].append(m)
            else:
                runs.append([m])
        fused = [fuse_qdot(r) if len(r) > 1 else None for r in runs]
        plan = (layers, [(r[0], None) if f is None else (f, [m.out_features for m in r]) for f, r in zip(fused, runs)])
        owner.__dict__["_fused"] = plan
    return plan[1]


def _apply_products(products: Products, x: torch.Tensor,
                    apply: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """Each product's output (`apply(layer, x)`), split where it stands for several layers."""
    outs: list[torch.Tensor] = []
    for m, splits in products:
        y = apply(m, x)
        if splits is None:
            outs.append(y)
        else:
            outs.extend(y.split(splits, -1))
    return outs


def _call(m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return m(x)


def _side_by_side(owner: nn.Module, layers: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each of `layers` applied to x, consecutive layers that `quant.fuse_qdot` can join run as one
    product (q/k/v, gate/up: decode steps pay per product, not only per weight byte)."""
    return _apply_products(_fusion_plan(owner, layers), x, _call)


ROW_ATTENTION_MAX = 64  # segments of up to this many rows attend row by row (`_attention_by_row`)


def _row_slots(mask: torch.Tensor | None, start: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's key slots, ascending, as (offsets [T + 1], slots) int64: row i sees
    slots[offsets[i]:offsets[i + 1]]. `mask` None: one row that sees slots [0, start]."""
    if mask is None:
        return torch.tensor([0, start + 1], device=device), torch.arange(start + 1, device=device)
    offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.long, device=device)
    torch.cumsum(mask.sum(1), 0, out=offsets[1:])
    return offsets, mask.nonzero()[:, 1].contiguous()


def _attention_by_row(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      row_keys: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Attention of q [H, T, D] over keys/values [H_kv, S, D], each row computed alone over exactly
    the keys it sees, in slot order: the same computation, on the same values, as decoding that
    token by itself. A batched kernel sums over a row's keys in an order that depends on T and on
    where the masked-out keys lie, so a tree's rows would differ from one-token decoding in the
    last bits; with 8-bit activations (`gguf`) such bits can flip a rounding and grow into different
    tokens. Decode steps and trees are small; prefills of more than ROW_ATTENTION_MAX rows use the
    batched kernel (run alike for plain and speculative decoding). `row_keys`: `_row_slots`.
    On the CPU in fp32, `specmesh.kernels.attention` reads the keys in place; elsewhere each row's
    keys and values are gathered into a contiguous copy for one SDPA call per row."""
    offsets, slots = row_keys
    if attention.runs(q, keys):
        return attention.row_attention(q, keys, values, offsets, slots)
    gqa = q.shape[0] != keys.shape[0]
    out = []
    for i in range(q.shape[1]):
        mine = slots[offsets[i]:offsets[i + 1]]
        k_i, v_i = keys.index_select(1, mine), values.index_select(1, mine)
        out.append(F.scaled_dot_product_attention(q[:, i:i + 1].unsqueeze(0), k_i.unsqueeze(0), v_i.unsqueeze(0),
                                                  enable_gqa=gqa)[0])  # [H, 1, D]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def _row_kernel_takes(cache: KVCache) -> bool:
    """Whether `specmesh.kernels.attention` runs on this cache's tensors (`attention.runs`, asked of
    one layer's keys: queries share their dtype, device and head dim). Inexact segments (drafters)
    then attend row by row as well: on a CPU the kernel is faster than batched SDPA at every width
    up to ROW_ATTENTION_MAX (a model drafter's level, one row to a predraft's 64)."""
    keys = cache.layer(0)[0]
    return attention.runs(keys, keys)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.head_dim = d
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]: the rows of every segment, one after another
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        segments: list[Segment],
        layer: int,
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = _side_by_side(self, (self.q_proj, self.k_proj, self.v_proj), x)
        written = False  # k and v already in the (one) segment's cache
        if glue.runs(q, k, v) and d % 16 == 0 and cos.dtype == torch.float32:
            if len(segments) == 1 and segments[0].cache.k.dtype == torch.float32:
                s = segments[0]
                q = glue.rope_into(q, k, v, cos, sin, d, *s.cache.layer(layer), s.start)  # [H, T, D]
                written = True
            else:
                q, k, v = glue.rope(q, k, v, cos, sin, d)  # [H, T, D], [H_kv, T, D] x 2
        else:
            q = q.view(t, -1, d).transpose(0, 1)  # [H, T, D] (local heads under TP)
            k = k.view(t, -1, d).transpose(0, 1)  # [H_kv, T, D]
            v = v.view(t, -1, d).transpose(0, 1)  # [H_kv, T, D]
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
        outs, row = [], 0
        for s in segments:  # projections are shared by the batch; attention is per cache
            n = s.tokens.shape[0]
            if not written:
                s.cache.write(layer, s.start, k[:, row:row + n], v[:, row:row + n])
            keys, values = s.cache.view(layer, s.start + n)  # [H_kv, S, D] each
            if s.row_keys is not None:
                outs.append(_attention_by_row(q[:, row:row + n], keys, values, s.row_keys))
            else:
                outs.append(F.scaled_dot_product_attention(
                    q[:, row:row + n].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
                    attn_mask=s.mask, enable_gqa=q.shape[0] != keys.shape[0],
                )[0])  # [H, n, D]
            row += n
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # [H, T, D]
        return self.o_proj(out.transpose(0, 1).reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _side_by_side(self, (self.gate_proj, self.up_proj), x)
        return self.down_proj(glue.silu_mul(gate, up) if glue.runs(gate, up) else F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    """The decoder. `forward` returns logits only for the rows asked for (none for prefill)."""

    def __init__(self, cfg: ModelConfig, inv_freq: torch.Tensor, rope_scaling: float = 1.0) -> None:
        super().__init__()
        kernels.load()  # once per process: builds or loads the small-M CPU kernel, else torch's GEMM
        self.config = cfg
        self.model = _Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size or cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)  # [head_dim / 2]
        # A reduced-vocabulary head (drafters): lm_head row j scores token vocab_map[j]; the others
        # get logit -inf (probability 0, which the verifier's residual accounts for exactly).
        self.vocab_map: torch.Tensor | None = None
        self.head_cut = None  # a drafter's head cut at load (`specmesh.drafters.head_cut.HeadCut`)
        self.rope_scaling = rope_scaling
        self.tp_all_reduce: AllReduce | None = None  # set by tp.apply_tp
        # Feature drafters (EAGLE-style, `specmesh.drafters.feature`): each row's input is
        # fc([a target hidden state; the embedding of the token that followed it]).
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True) if cfg.feature_input else None

    def new_cache(self, capacity: int = 256) -> KVCache:
        attn = self.model.layers[0].self_attn
        local_kv_heads = attn.k_proj.out_features // attn.head_dim
        p = self.model.norm.weight  # the activations' dtype: Linear weights may be in a quantized format
        return KVCache(self.config.num_layers, local_kv_heads, attn.head_dim, capacity, p.dtype, p.device)

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        return (emb.cos() * self.rope_scaling).to(dtype), (emb.sin() * self.rope_scaling).to(dtype)

    def forward(
        self,
        tokens: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        cache: KVCache,
        start: int,
        mask: torch.Tensor | None = None,  # [T, start + T] bool; None = causal
        logits_rows: torch.Tensor | slice | None = slice(None),
        features: torch.Tensor | None = None,
        hidden: bool = False,
        exact: bool = True,
        extra_vocab: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """Write the tokens' K/V at slots [start, start+T) and return logits [R, vocab]; with
        `hidden`, (logits, final hidden states [T, hidden] before the norm: the target features a
        feature drafter takes). `features`: a feature drafter's per-row input. `exact=False`
        (drafters): rows need equal one-token decoding only up to rounding, so where the row
        kernel does not run (`_row_kernel_takes`) they take batched SDPA. `extra_vocab`: see
        `Segment`."""
        seg = Segment(tokens, positions, cache, start, mask, logits_rows, features, hidden, exact=exact,
                      extra_vocab=extra_vocab)
        logits = self.forward_batch([seg])[0]
        return (logits, seg.hidden) if hidden else logits

    @torch.inference_mode()
    def forward_batch(self, segments: list[Segment]) -> list[torch.Tensor | None]:
        """One forward over several sessions' tokens (each segment with its own cache): the weights
        are read once for all rows; attention stays per segment. Logits per segment, in order."""
        window = self.config.sliding_window
        for s in segments:
            t = s.tokens.shape[0]
            if window is not None and s.start + t > window:
                # Sliding-window attention is not implemented: refuse rather than silently differ.
                raise ValueError(f"prompt: context of {s.start + t} tokens exceeds this model's attention window "
                                 f"{window}")
            s.cache.ensure_capacity(s.start + t)
            if s.mask is None and t > 1:
                s.mask = causal_mask(s.start, t, s.tokens.device)
            if t <= ROW_ATTENTION_MAX and (s.exact or _row_kernel_takes(s.cache)):  # the same for every layer
                s.row_keys = _row_slots(s.mask, s.start, s.tokens.device)
        tokens = segments[0].tokens if len(segments) == 1 else torch.cat([s.tokens for s in segments])
        positions = segments[0].positions if len(segments) == 1 else torch.cat([s.positions for s in segments])
        cos, sin = self._rope(positions, self.model.norm.weight.dtype)
        h = self.model.embed_tokens(tokens)  # [T, hidden]
        if self.fc is not None:
            if any(s.features is None or s.features.shape != (s.tokens.shape[0], h.shape[1]) for s in segments):
                raise ValueError("features: a feature drafter needs one target feature per token")
            feats = torch.cat([s.features for s in segments]) if len(segments) > 1 else segments[0].features
            h = self.fc(torch.cat([feats.to(h.device, h.dtype), h], dim=-1))  # [T, hidden]
        lean = self._lean_plan() if len(segments) == 1 and self.tp_all_reduce is None else None
        if lean is not None and _lean_takes(segments[0], h, cos):
            h = _lean_layers(lean, segments[0], h, cos, sin)
        else:
            reduce = self.tp_all_reduce
            layers = self.model.layers
            x = layers[0].input_layernorm(h)
            for i, layer in enumerate(layers):  # each residual add runs with the norm after it
                a = layer.self_attn(x, cos, sin, segments, i)
                h, x = layer.post_attention_layernorm.after_add(h, reduce(a) if reduce else a)
                m = layer.mlp(x)
                m = reduce(m) if reduce else m
                if i + 1 < len(layers):
                    h, x = layers[i + 1].input_layernorm.after_add(h, m)
                else:
                    h = h + m
        picked, row = [], 0  # the rows each segment wants logits for; one lm_head product for all
        for s in segments:
            n = s.tokens.shape[0]
            if s.want_hidden:
                s.hidden = h[row:row + n]
            picked.append(None if s.logits_rows is None else h[row:row + n][s.logits_rows])
            row += n
        wanted = [(p, s.extra_vocab) for p, s in zip(picked, segments) if p is not None]
        if not wanted:
            return [None] * len(segments)
        sizes = [p.shape[0] for p, _ in wanted]
        logits = iter(self._logits(torch.cat([p for p, _ in wanted]), list(zip(sizes, (e for _, e in wanted))))
                      .split(sizes))
        return [None if p is None else next(logits) for p in picked]

    def _lean_plan(self) -> "_LeanPlan | None":
        """This model's `_LeanPlan`, made at the first call and again once a layer's modules were
        replaced; None where a layer is not all on the integer kernel and the glue kernels
        (`forward_batch` also leaves TP groups to the module path)."""
        cached = self.__dict__.get("_lean")
        if cached is not None and all(tuple(d.values()) == snap for d, snap in cached[0]):
            return cached[1]
        layers = self.model.layers
        watched = [layers._modules] + [d for layer in layers for d in
                                       (layer._modules, layer.self_attn._modules, layer.mlp._modules)]
        plan = _lean_layers_of(self)
        self.__dict__["_lean"] = ([(d, tuple(d.values())) for d in watched], plan)
        return plan

    def _logits(self, h: torch.Tensor, parts: list[tuple[int, tuple[torch.Tensor, torch.Tensor] | None]] = ()):
        """Logits [R, vocab] of the rows `h`; `parts`: consecutive runs of them (rows, the run's
        `Segment.extra_vocab`), whose extra tokens are scored beside a reduced head."""
        x = self.model.norm(h)
        logits = self.lm_head(x).float()
        if self.vocab_map is None:
            return logits  # [R, vocab]
        full = logits.new_full((logits.shape[0], self.config.vocab_size), float("-inf"))
        full[:, self.vocab_map] = logits
        row = 0
        for n, extra in parts:
            if extra is not None:
                ids, weight = extra
                full[row:row + n, ids] = x[row:row + n].float() @ weight.t()
            row += n
        return full  # [R, vocab]


# --- the lean step ---------------------------------------------------------------------------------
# A decode step or tree on the CPU is a few hundred small kernel calls; the Python around each
# (module calls, the checks of which path runs, fusion plans) cost about 150 us a layer, a tenth of
# a 1.5B target's step and a quarter of a 0.5B drafter's. Where every product of every layer runs
# on the integer kernel (`specmesh.kernels.qdot`, a GGUF served as it ships) and the glue and row
# attention kernels run, one segment's forward calls those same ops, in the same order with the
# same inputs, from a plan made once, in one call of the glue library's layer loop (glue.cpp
# `lean_layers`: the Python loop over them still issued about 40 op calls a layer):
# bit-identical to the module path, which stays the reference (and what runs anywhere else).


@dataclass(frozen=True)
class _LeanLayer:
    qkv: Products  # each product a QuantLinear on the integer kernel
    o: nn.Module
    gate_up: Products
    down: nn.Module
    input_norm: RMSNorm
    post_norm: RMSNorm
    head_dim: int


def _lean_products(owner: nn.Module, layers: tuple[nn.Module, ...]) -> Products | None:
    products = _fusion_plan(owner, layers)
    return products if all(_on_qdot(m) for m, _ in products) else None


def _on_qdot(m: nn.Module) -> bool:
    from specmesh.quant import QuantLinear

    return isinstance(m, QuantLinear) and m.fmt == "gguf" and m.kernel == "specmesh-qdot"


def _lean_layers_of(model: "Transformer") -> "_LeanPlan | None":
    if not (glue.available() and attention.available()):
        return None
    cfg, plan = model.config, []
    if cfg.head_dim % 32 or cfg.hidden_size % 8:
        return None
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _lean_products(attn, (attn.q_proj, attn.k_proj, attn.v_proj))
        gate_up = _lean_products(mlp, (mlp.gate_proj, mlp.up_proj))
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (qkv is None or gate_up is None or not _on_qdot(attn.o_proj) or not _on_qdot(mlp.down_proj)
                or any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms)):
            return None
        plan.append(_LeanLayer(qkv, attn.o_proj, gate_up, mlp.down_proj, *norms, attn.head_dim))
    return _lean_plan_of(plan)


def _lean_takes(s: Segment, h: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether this forward's one segment runs the lean step: rows attended one by one on the row
    kernel, fp32 activations and cache on the CPU, no gradient."""
    return (s.row_keys is not None and _row_kernel_takes(s.cache) and h.dtype == cos.dtype == torch.float32
            and h.device.type == "cpu" and not torch.is_grad_enabled())


@dataclass(frozen=True)
class _LeanPlan:
    """The layers of a lean step as `specmesh_glue::lean_layers` (glue.cpp) takes them, made once
    with the plan: every layer's norm weights and products' buffers in one tensor list, their
    widths, layouts and splits in one int list, the norms' eps (input, post) per layer."""
    layers: list[_LeanLayer]
    tensors: list[torch.Tensor]
    meta: list[int]
    eps: list[float]


def _lean_plan_of(layers: list[_LeanLayer]) -> _LeanPlan:
    tensors: list[torch.Tensor] = [layers[0].input_norm._parameters["weight"]]
    meta: list[int] = []
    eps: list[float] = []
    none = torch.empty(0)

    def product(m: nn.Module, splits: list[int] | None) -> None:
        b = m._buffers
        tensors.extend([b["qd_codes"], b["qd_sb"], b["qd_sc"], none if b["bias"] is None else b["bias"]])
        meta.extend([m.out_features, m.bits, m.supergroups, len(splits or ()), *(splits or ())])

    for i, L in enumerate(layers):
        eps.extend([L.input_norm.eps, L.post_norm.eps])
        tensors.append(L.post_norm._parameters["weight"])
        for group, single in ((L.qkv, L.o), (L.gate_up, L.down)):
            meta.append(len(group))
            for m, splits in group:
                product(m, splits)
            product(single, None)
        if i + 1 < len(layers):
            tensors.append(layers[i + 1].input_norm._parameters["weight"])
    return _LeanPlan(layers, tensors, meta, eps)


def _lean_layers(plan: _LeanPlan, s: Segment, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The decoder layers of `Transformer.forward_batch` for one segment: h [T, hidden] after the
    last layer (before the final norm), in one call of the glue library's layer loop, each product
    on the integer kernel variant picked for these rows (`qdot.op_for`)."""
    from specmesh.kernels import qdot

    th = kernels.pool_threads()
    t = h.shape[0]
    ops = [qdot.op_for(t, bits, th)._qualified_op_name for bits in (4, 6, 8)]
    offsets, slots = s.row_keys
    return torch.ops.specmesh_glue.lean_layers(h, cos, sin, plan.tensors, plan.meta, plan.eps, s.cache.k, s.cache.v,
                                               offsets, slots, s.start, plan.layers[0].head_dim, *ops, th)


def causal_mask(start: int, t: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, start+T] bool: every new token sees the whole prefix and the new tokens up to itself."""
    mask = torch.ones(t, start + t, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    return mask
