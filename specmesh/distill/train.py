"""Train a drafter for a target by knowledge distillation on the target's own outputs.

The student (our choice, measured in the README): the target's architecture cut to its first
`layers` decoder layers (weights copied from the target), the target's input embeddings shared and
frozen, and a **reduced-vocabulary head** over the `draft_vocab` tokens the target most often
predicts (rows initialised from the target's output embedding). The drafter proposes only those
tokens; its q is exact and zero elsewhere, which the verifier's residual handles, so output stays
lossless. The head is the biggest per-step cost of a small drafter (SmolLM2: 28 M of its 135 M
parameters), so cutting it to 8k rows cuts the draft cost about 3x.

Loss: cross-entropy against the target's top-k distribution at every position (renormalised over
the drafter's vocabulary); on the target's greedy responses the top-1 is the next token.
Checkpoints every `checkpoint_every` steps (model, optimiser, step) let an interrupted run resume.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from specmesh.loader import VOCAB_MAP_KEY


@dataclass
class TrainConfig:
    layers: int = 2
    draft_vocab: int = 8192
    lr: float = 1e-3
    batch_tokens: int = 4096
    minutes: float = 30.0
    max_epochs: int = 8
    warmup_steps: int = 30
    checkpoint_every: int = 25
    seed: int = 0
    extra: dict = field(default_factory=dict)


def choose_vocab(examples: list[dict], size: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The `size` token ids the target predicts most often (its top-1), plus `always` (EOS...)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ex in examples:
        counts.index_add_(0, ex["topk_ids"][:, 0].long(), torch.ones(len(ex["topk_ids"]), dtype=torch.long))
    keep = [int(t) for t in always]
    for t in counts.argsort(descending=True).tolist():
        if len(keep) >= size:
            break
        if t not in keep:
            keep.append(t)
    return torch.tensor(sorted(keep[:size]), dtype=torch.long)


def local_index(vocab_map: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size]: token id -> its row in the drafter's head, -1 for tokens outside it."""
    local_of = torch.full((vocab_size,), -1, dtype=torch.long)
    local_of[vocab_map] = torch.arange(len(vocab_map))
    return local_of


class Student(torch.nn.Module):
    """transformers' LlamaModel/Qwen2Model backbone cut to `layers` + our reduced-vocabulary head."""

    def __init__(self, backbone, head: torch.nn.Linear) -> None:
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h)  # [B, T, Vd]


def build_student(target_hf, layers: int, vocab_map: torch.Tensor) -> Student:
    from transformers import AutoModel

    cfg = target_hf.config.__class__.from_dict(target_hf.config.to_dict())
    cfg.num_hidden_layers = layers
    cfg.tie_word_embeddings = False
    backbone = AutoModel.from_config(cfg)
    src = target_hf.model
    backbone.embed_tokens.weight.data.copy_(src.embed_tokens.weight.data)
    backbone.embed_tokens.weight.requires_grad_(False)
    for i in range(layers):
        backbone.layers[i].load_state_dict(src.layers[i].state_dict())
    backbone.norm.load_state_dict(src.norm.state_dict())
    head = torch.nn.Linear(cfg.hidden_size, len(vocab_map), bias=False)
    head.weight.data.copy_(target_hf.lm_head.weight.data[vocab_map])
    return Student(backbone, head)


def _batches(examples: list[dict], batch_tokens: int, rng: random.Random) -> list[list[dict]]:
    order = sorted(examples, key=lambda e: len(e["tokens"]))
    out, cur, longest = [], [], 0
    for ex in order:
        longest2 = max(longest, len(ex["tokens"]))
        if cur and longest2 * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, longest2 = [], len(ex["tokens"])
        cur.append(ex)
        longest = longest2
    if cur:
        out.append(cur)
    rng.shuffle(out)
    return out


def _collate(batch: list[dict], local_of: torch.Tensor):
    """input ids, attention mask, and per position: teacher local ids [B, T, k], probs, loss mask."""
    t = max(len(e["tokens"]) for e in batch)
    k = batch[0]["topk_ids"].shape[1]
    b = len(batch)
    ids = torch.zeros(b, t, dtype=torch.long)
    att = torch.zeros(b, t, dtype=torch.long)
    tid = torch.zeros(b, t, k, dtype=torch.long)
    tp = torch.zeros(b, t, k)
    for r, e in enumerate(batch):
        n = len(e["tokens"])
        ids[r, :n] = e["tokens"].long()
        att[r, :n] = 1
        rows = e["topk_ids"].long()  # row j predicts tokens[start + j] from the prefix before it
        s = e["start"] - 1
        m = min(len(rows), t - s)
        loc = local_of[rows[:m]]
        p = e["topk_p"][:m].float() * (loc >= 0)
        tid[r, s:s + m] = loc.clamp(min=0)
        tp[r, s:s + m] = p
    z = tp.sum(-1, keepdim=True)
    mask = z[..., 0] > 0
    tp = torch.where(z > 0, tp / z.clamp(min=1e-9), tp)
    return ids, att, tid, tp, mask


def distill_loss(logits: torch.Tensor, tid: torch.Tensor, tp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    logp = F.log_softmax(logits.float(), dim=-1)
    per_pos = -(logp.gather(-1, tid) * tp).sum(-1)
    return (per_pos * mask).sum() / mask.sum().clamp(min=1)


@torch.no_grad()
def evaluate(student: Student, examples: list[dict], vocab_map: torch.Tensor, local_of: torch.Tensor) -> dict:
    """Held-out greedy per-token acceptance: drafter argmax == target argmax, teacher-forced."""
    student.eval()
    hit = total = covered = 0
    for e in examples:
        ids, att, tid, tp, mask = _collate([e], local_of)
        logits = student(ids, att)[0]
        s = e["start"] - 1
        n = len(e["topk_ids"])
        pred = vocab_map[logits[s:s + n].argmax(-1)]
        top1 = e["topk_ids"][:, 0].long()
        hit += int((pred == top1).sum())
        covered += int((local_of[top1] >= 0).sum())
        total += n
    student.train()
    return {"greedy_acceptance": hit / max(total, 1), "vocab_coverage": covered / max(total, 1), "positions": total}


def log_flush(*args, **kwargs) -> None:
    """print, flushed: the training loops' progress line is rewritten in place (no newline)."""
    print(*args, **kwargs, flush=True)


def run_steps(student: torch.nn.Module, plan: list, step_fn, lr: float, warmup_steps: int, minutes: float,
              checkpoint_every: int, ckpt: Path, lr_floor: float = 0.1, log=log_flush) -> dict:
    """The training loop both drafter kinds share: AdamW on the trainable parameters, warmup then
    a cosine decay to `lr_floor` x `lr` planned over the steps the time budget allows (estimated
    after 10 steps), gradient clipping, a checkpoint every `checkpoint_every` steps (rerun to
    resume). `step_fn(batch) -> (loss, progress text)`. Returns the state: step, seconds, losses."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    state = {"step": 0, "seconds": 0.0, "losses": []}
    if ckpt.exists():
        saved = torch.load(ckpt, weights_only=False)
        student.load_state_dict(saved["student"])
        opt.load_state_dict(saved["opt"])
        state = saved["state"]
        log(f"resumed from {ckpt} at step {state['step']}")
    budget = minutes * 60
    total = len(plan)
    student.train()
    t_start = time.perf_counter() - state["seconds"]
    while state["step"] < len(plan):
        step = state["step"]
        elapsed = time.perf_counter() - t_start
        if elapsed > budget:
            log(f"\ntime budget of {minutes} min reached at step {step}")
            break
        if step >= 10:
            total = min(len(plan), int(step * budget / max(elapsed, 1e-9)))
        rate = lr * min(1.0, (step + 1) / warmup_steps)
        rate *= lr_floor + (1 - lr_floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(total, 1))))
        for g in opt.param_groups:
            g["lr"] = rate
        loss, progress = step_fn(plan[step])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        state["step"] = step + 1
        state["losses"].append(round(loss.item(), 4))
        state["seconds"] = time.perf_counter() - t_start
        eta = min(budget - state["seconds"], (total - step - 1) * state["seconds"] / (step + 1))
        log(f"\rstep {step + 1}/{total} loss {loss.item():.3f} {progress} lr {rate:.1e} eta {max(eta, 0) / 60:.1f} min",
            end="")
        if state["step"] % checkpoint_every == 0:
            torch.save({"student": student.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    torch.save({"student": student.state_dict(), "opt": opt.state_dict(), "state": state}, ckpt)
    log("")
    return state


def summary(state: dict) -> dict:
    losses = state["losses"]
    return {"steps": state["step"], "train_seconds": round(state["seconds"], 1),
            "first_loss": losses[0] if losses else None,
            "final_loss": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4)}


def train(student: Student, train_ex: list[dict], eval_ex: list[dict], vocab_map: torch.Tensor,
          vocab_size: int, cfg: TrainConfig, ckpt: Path, log=log_flush) -> dict:
    local_of = local_index(vocab_map, vocab_size)
    rng = random.Random(cfg.seed)
    torch.manual_seed(cfg.seed)
    epochs = [_batches(train_ex, cfg.batch_tokens, rng) for _ in range(cfg.max_epochs)]
    plan = [b for ep in epochs for b in ep]
    dev = student.head.weight.device

    def step(batch: list[dict]):
        ids, att, tid, tp, mask = _collate(batch, local_of)
        loss = distill_loss(student(ids.to(dev), att.to(dev)), tid.to(dev), tp.to(dev), mask.to(dev))
        return loss, f"({int(att.sum())} tokens)"

    state = run_steps(student, plan, step, cfg.lr, cfg.warmup_steps, cfg.minutes, cfg.checkpoint_every, ckpt, log=log)
    result = evaluate(student, eval_ex, vocab_map, local_of)
    result.update(summary(state))
    return result


def export(student: Student, vocab_map: torch.Tensor, target_hf, out: Path, embed_source: dict | None,
           recipe: dict, dtype: torch.dtype = torch.float16) -> None:
    """Write config.json + model.safetensors (+ recipe.json) loadable by `--drafter model:DIR`.

    Weights are stored in fp16 (the drafter only proposes; the target decides), embeddings either
    shared with the target (`embed_source`: its GGUF's sha256) or included.
    """
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    cfg = student.backbone.config.to_dict()
    cfg["architectures"] = [target_hf.config.architectures[0] if target_hf.config.architectures else "LlamaForCausalLM"]
    cfg["tie_word_embeddings"] = False
    spec = {"draft_vocab_size": len(vocab_map)}
    if embed_source:
        spec["embeddings_from_target"] = embed_source
    cfg["specmesh"] = spec
    for key in ("dtype", "torch_dtype", "quantization_config", "_name_or_path", "_model_name_or_path"):
        cfg.pop(key, None)  # the target's loading details (GGUF, cache path) are not the drafter's
    state = {}
    for k, v in student.backbone.state_dict().items():
        if k == "embed_tokens.weight" and embed_source:
            continue
        state["model." + k] = v.detach().to(dtype).contiguous()
    state["lm_head.weight"] = student.head.weight.detach().to(dtype).contiguous()
    state[VOCAB_MAP_KEY] = vocab_map.to(torch.int32).contiguous()
    save_file(state, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    (out / "recipe.json").write_text(json.dumps(recipe, indent=1) + "\n")
