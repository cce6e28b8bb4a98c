"""Train a feature drafter (EAGLE-style, `specmesh.drafters.feature`) for a target.

Data: the same examples as the token-level student (`data.py`: the target's greedy chat answers
plus teacher-forced local text, with the target's top-k at every position), plus the target's
final hidden state (before its norm) at every token: chat examples carry theirs from the forwards
that generated them (`data.greedy_batch`); the corpus examples get one teacher-forced forward of
our runtime each, cached next to the data (fp16).

Student: `fc([f_j ; embed(t_{j+1})])` -> one decoder layer (initialised from the target's last)
-> the target's final norm -> a reduced-vocabulary head (the target's rows for the `draft_vocab`
most predicted tokens). Input embeddings are the target's, frozen and not stored.

Training unrolls the drafter over `depths` levels, the way it drafts (EAGLE-3's "training-time
test"): level 0 takes the target's features, level k its own level k-1 outputs; a level-k row
attends to the target-feature rows before it and to its own chain of predictions (one diagonal
per level). Loss per level: soft cross-entropy against the target's top-k for the token k+2
ahead (optionally plus a smooth-L1 pull of the predicted feature toward the target's,
`reg_weight`), levels weighted 0.8^k. Evaluation: per-level greedy acceptance on held-out examples (level 0 is the
first draft token; level k the (k+1)-th, given the k before it were right).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specmesh.distill.train import _batches, local_index, log_flush, run_steps, summary
from specmesh.loader import VOCAB_MAP_KEY
from specmesh.model import DecoderLayer, RMSNorm, Segment, Transformer, _rotate_half, causal_mask

LEVEL_DECAY = 0.8
FEATURE_NOISE = 0.05  # uniform noise on level-0 input features, in units of the features' std


@dataclass
class FeatureTrainConfig:
    draft_vocab: int = 8192
    depths: int = 3
    reg_weight: float = 0.2  # smooth-L1 pull of predicted features toward the target's (0: CE only)
    lr: float = 1e-3
    batch_tokens: int = 2048
    minutes: float = 30.0
    max_epochs: int = 20
    warmup_steps: int = 20
    checkpoint_every: int = 25
    seed: int = 0


@torch.inference_mode()
def target_features(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    """[T] token ids -> [T, hidden] fp16: the target's final hidden states, teacher-forced."""
    t = tokens.long()
    seg = Segment(t, torch.arange(len(t)), model.new_cache(len(t)), 0, causal_mask(0, len(t)), None,
                  want_hidden=True)
    model.forward_batch([seg])
    return seg.hidden.half()


def add_features(model: Transformer, examples: list[dict], path: Path, log=log_flush) -> None:
    """Attach `feats` to every example that has none yet (chat examples generated with
    `features=True` carry theirs), computed once and cached in `path` (resumable by file)."""
    todo = [e for e in examples if "feats" not in e]
    if not todo:
        return
    if path.exists():
        feats = torch.load(path, weights_only=True)
        if len(feats) == len(todo) and all(len(f) == len(e["tokens"]) for f, e in zip(feats, todo)):
            for e, f in zip(todo, feats):
                e["feats"] = f
            return
    t0, feats = time.perf_counter(), []
    for i, e in enumerate(todo):
        feats.append(target_features(model, e["tokens"]))
        e["feats"] = feats[-1]
        if (i + 1) % 20 == 0 or i + 1 == len(todo):
            log(f"\rtarget features: {i + 1}/{len(todo)} [{time.perf_counter() - t0:.0f} s]", end="")
    log("")
    torch.save(feats, path)


class FeatureStudent(torch.nn.Module):
    """fc + decoder layers + norm + reduced head; exported under `Transformer`'s parameter names.

    Row input: fc([f * f_scale ; embed(t) * e_scale]). The two constants put the target's features
    and its token embeddings on a common scale during training (on SmolLM2 the features' std is
    ~260x the embeddings'); export folds them into fc's weights, so the runtime feeds raw features.

    Two initialisations (measured in the README):
    - `from_target`: one layer, the target's last; norm and head rows from the target; fc starts
      as the mean of its two (rescaled) inputs.
    - `from_token_drafter`: a trained token-level drafter (`--kind token`) — its layers, norm, head
      and vocabulary — with fc = [0 ; I]: at the start it *is* that drafter, and training teaches
      it to use the features.
    """

    def __init__(self, layers: list[DecoderLayer], norm: RMSNorm, head_weight: torch.Tensor, embed: torch.Tensor,
                 inv_freq: torch.Tensor, head_dim: int, f_scale: float, e_scale: float) -> None:
        super().__init__()
        h = norm.weight.shape[0]
        self.fc = torch.nn.Linear(2 * h, h, bias=True)
        self.layers = torch.nn.ModuleList(layers)
        self.norm = norm
        self.head = torch.nn.Linear(h, head_weight.shape[0], bias=False)
        self.head.weight.data.copy_(head_weight)
        self.register_buffer("embed", embed.detach().clone(), persistent=False)
        self.register_buffer("inv_freq", inv_freq.detach().clone(), persistent=False)
        self.head_dim, self.f_scale, self.e_scale = head_dim, f_scale, e_scale
        torch.nn.init.zeros_(self.fc.weight)
        torch.nn.init.zeros_(self.fc.bias)

    @staticmethod
    def _copy_layer(src: DecoderLayer, cfg) -> DecoderLayer:
        layer = DecoderLayer(cfg)
        layer.load_state_dict({k: v.detach().clone() for k, v in src.state_dict().items()})
        return layer

    @classmethod
    def from_target(cls, target: Transformer, vocab_map: torch.Tensor, feature_std: float) -> "FeatureStudent":
        cfg, h = target.config, target.config.hidden_size
        norm = RMSNorm(h, cfg.rms_norm_eps)
        norm.load_state_dict(target.model.norm.state_dict())
        embed = target.model.embed_tokens.weight
        s = cls([cls._copy_layer(target.model.layers[-1], cfg)], norm, target.lm_head.weight.data[vocab_map],
                embed, target.inv_freq, cfg.head_dim, 1.0, feature_std / float(embed.detach().std()))
        with torch.no_grad():
            s.fc.weight[:, :h] = torch.eye(h) * 0.5
            s.fc.weight[:, h:] = torch.eye(h) * 0.5
        return s

    @classmethod
    def from_token_drafter(cls, target: Transformer, drafter: Transformer, feature_std: float) -> "FeatureStudent":
        cfg, h = drafter.config, drafter.config.hidden_size
        norm = RMSNorm(h, cfg.rms_norm_eps)
        norm.load_state_dict(drafter.model.norm.state_dict())
        embed = target.model.embed_tokens.weight
        s = cls([cls._copy_layer(layer, cfg) for layer in drafter.model.layers], norm, drafter.lm_head.weight.data,
                embed, drafter.inv_freq, cfg.head_dim, float(embed.detach().std()) / feature_std, 1.0)
        with torch.no_grad():
            s.fc.weight[:, h:] = torch.eye(h)
        return s

    def level(self, feat: torch.Tensor, toks: torch.Tensor, pos: torch.Tensor, kv: list, mask: torch.Tensor):
        """One draft level over a padded batch: feat [B, T, H], toks/pos [B, T]; `kv` holds the
        per-layer K/V of the levels before (this level's is appended); mask [B, 1, T, (levels + 1) T].
        -> predicted features [B, T, H] (the last layer's output, before the norm)."""
        d = self.head_dim
        x = self.fc(torch.cat([feat * self.f_scale, self.embed[toks] * self.e_scale], -1))
        b, t, _ = x.shape
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        mine = []
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            hn = layer.input_layernorm(x)
            q = attn.q_proj(hn).view(b, t, -1, d).transpose(1, 2)
            k = attn.k_proj(hn).view(b, t, -1, d).transpose(1, 2)
            v = attn.v_proj(hn).view(b, t, -1, d).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            mine.append((k, v))
            keys = torch.cat([lv[i][0] for lv in kv] + [k], 2)
            values = torch.cat([lv[i][1] for lv in kv] + [v], 2)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
            x = x + attn.o_proj(o.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        kv.append(mine)
        return x


def _collate(batch: list[dict], local_of: torch.Tensor, depths: int):
    """Padded features/tokens and the teacher's top-k indexed by *token position*."""
    t = max(len(e["tokens"]) for e in batch) - 1
    b, h = len(batch), batch[0]["feats"].shape[1]
    k = batch[0]["topk_ids"].shape[1]
    feat = torch.zeros(b, t + depths, h)
    toks = torch.zeros(b, t + depths + 1, dtype=torch.long)
    lens = torch.zeros(b, dtype=torch.long)
    tid = torch.zeros(b, t + depths + 2, k, dtype=torch.long)
    tp = torch.zeros(b, t + depths + 2, k)
    for r, e in enumerate(batch):
        n = len(e["tokens"])
        feat[r, :n] = e["feats"].float()
        toks[r, :n] = e["tokens"].long()
        lens[r] = n
        rows, s = e["topk_ids"].long(), e["start"]  # topk row m: the target's view of token s + m
        loc = local_of[rows]
        tid[r, s:s + len(rows)] = loc.clamp(min=0)
        tp[r, s:s + len(rows)] = e["topk_p"].float() * (loc >= 0)
    z = tp.sum(-1, keepdim=True)
    tp = torch.where(z > 0, tp / z.clamp(min=1e-9), tp)
    return feat, toks, lens, tid, tp, t


def unrolled(student: FeatureStudent, batch: list[dict], local_of: torch.Tensor, depths: int, sigma: float,
             noise: float = 0.0, reg_weight: float = 0.0) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Losses and (greedy hits, positions) per level for one batch."""
    *tensors, t = _collate(batch, local_of, depths)
    dev = student.head.weight.device
    feat, toks, lens, tid, tp = (x.to(dev) for x in tensors)
    b = feat.shape[0]
    i = torch.arange(t, device=dev)
    causal = (i[None, :] <= i[:, None])[None] & (i[None, :] < (lens[:, None] - 1))[:, None, :]  # [B, T, T]
    diag = torch.eye(t, dtype=torch.bool, device=dev)[None].expand(b, t, t)
    kv: list = []
    g = feat[:, :t]
    if noise:
        g = g + (torch.rand_like(g) - 0.5) * 2 * noise * sigma
    losses, hits = [], []
    for k in range(depths):
        mask = torch.cat([causal] + [diag] * k, -1)[:, None]  # [B, 1, T, (k + 1) T]
        out = student.level(g, toks[:, 1 + k:1 + k + t], (i + 1 + k)[None].expand(b, t), kv, mask)
        logits = student.head(student.norm(out)).float()  # [B, T, Vd]: token 2 + k + row
        t_id, t_p = tid[:, 2 + k:2 + k + t], tp[:, 2 + k:2 + k + t]
        m = (t_p.sum(-1) > 0) & (i[None] + 2 + k < lens[:, None])
        ce = -(F.log_softmax(logits, -1).gather(-1, t_id) * t_p).sum(-1)
        loss = (ce * m).sum() / m.sum().clamp(min=1)
        if reg_weight:
            mr = i[None] + 1 + k < lens[:, None]
            reg = F.smooth_l1_loss(out / sigma, feat[:, 1 + k:1 + k + t] / sigma, reduction="none").mean(-1)
            loss = loss + reg_weight * (reg * mr).sum() / mr.sum().clamp(min=1)
        losses.append(loss)
        hit = (logits.argmax(-1) == t_id[..., 0]) & m & (t_p[..., 0] > 0)
        hits.append((int(hit.sum()), int(m.sum())))
        g = out
    return losses, hits


@torch.no_grad()
def evaluate(student: FeatureStudent, examples: list[dict], local_of: torch.Tensor, depths: int,
             sigma: float) -> dict:
    """Held-out greedy acceptance per level (teacher-forced features at level 0, own predictions after)."""
    student.eval()
    tot = [[0, 0] for _ in range(depths)]
    for j in range(0, len(examples), 8):
        _, hits = unrolled(student, examples[j:j + 8], local_of, depths, sigma)
        for k, (h, n) in enumerate(hits):
            tot[k][0] += h
            tot[k][1] += n
    student.train()
    per_level = [h / max(n, 1) for h, n in tot]
    chain = 1.0 + sum(math.prod(per_level[:k + 1]) for k in range(depths))
    return {"greedy_acceptance": per_level[0], "acceptance_per_level": [round(a, 4) for a in per_level],
            "chain_tokens_per_step": round(chain, 3), "positions": tot[0][1]}


def feature_std(examples: list[dict]) -> float:
    return float(torch.cat([e["feats"].float() for e in examples[:64]]).std())


def train(student: FeatureStudent, train_ex: list[dict], eval_ex: list[dict], vocab_map: torch.Tensor,
          vocab_size: int, cfg: FeatureTrainConfig, ckpt: Path, log=log_flush) -> dict:
    local_of = local_index(vocab_map, vocab_size)
    sigma = feature_std(train_ex)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    plan = [b for _ in range(cfg.max_epochs) for b in _batches(train_ex, cfg.batch_tokens, rng)]

    def step(batch: list[dict]):
        losses, hits = unrolled(student, batch, local_of, cfg.depths, sigma, FEATURE_NOISE, cfg.reg_weight)
        accs = " ".join(f"{h / max(n, 1):.2f}" for h, n in hits)
        return sum(loss * LEVEL_DECAY ** k for k, loss in enumerate(losses)), f"acc/level {accs}"

    state = run_steps(student, plan, step, cfg.lr, cfg.warmup_steps, cfg.minutes, cfg.checkpoint_every, ckpt,
                      lr_floor=0.05, log=log)
    result = evaluate(student, eval_ex, local_of, cfg.depths, sigma)
    result.update(summary(state))
    return result


def export(student: FeatureStudent, vocab_map: torch.Tensor, hf_config: dict, out: Path,
           embed_source: dict | None, recipe: dict, dtype: torch.dtype = torch.float16) -> None:
    """config.json (the target's, one layer, specmesh.kind = "feature") + model.safetensors
    (+ recipe.json), loadable by `--drafter model:DIR` (`specmesh.runtime.load_model_drafter`).
    Embeddings: the target's, named by `embed_source` (its GGUF's sha256), else stored."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config)
    cfg["num_hidden_layers"] = len(student.layers)
    cfg["tie_word_embeddings"] = False
    cfg["specmesh"] = {"kind": "feature", "draft_vocab_size": len(vocab_map)}
    if embed_source:
        cfg["specmesh"]["embeddings_from_target"] = embed_source
    for key in ("dtype", "torch_dtype", "quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version"):
        cfg.pop(key, None)
    state = {f"model.layers.{i}.{k}": v for i, layer in enumerate(student.layers)
             for k, v in layer.state_dict().items()}
    state["model.norm.weight"] = student.norm.weight
    state["lm_head.weight"] = student.head.weight
    h = student.norm.weight.shape[0]
    state["fc.weight"] = torch.cat([student.fc.weight[:, :h] * student.f_scale,
                                    student.fc.weight[:, h:] * student.e_scale], dim=1)  # scales folded in
    state["fc.bias"] = student.fc.bias
    if not embed_source:
        state["model.embed_tokens.weight"] = student.embed
    state = {k: v.detach().to(dtype).contiguous() for k, v in state.items()}
    state[VOCAB_MAP_KEY] = vocab_map.to(torch.int32).contiguous()
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
