"""Distillation data: the target's own responses to chat prompts, plus text already on the machine.

Every example is one token sequence with the teacher's view of it: for each position from
`start` on, the target's top-k next-token distribution given the prefix (ids + probabilities,
softmax over the full vocabulary, so the k probabilities sum to <= 1). Chat examples are the
target's greedy responses (through its chat template), so at every response position the
top-1 id *is* the next token; corpus examples (Python sources and documentation found on this
machine) are teacher-forced through the target.

Shards are written one batch at a time (`shard-NNNNN.pt`), so an interrupted run resumes where
it stopped.
"""

from __future__ import annotations

import glob
import os
import sysconfig
import time
from pathlib import Path

import torch

from specmesh.model import Segment, Transformer

TOPK = 8


def _progress(done: int, total: int, t0: float, what: str) -> None:
    rate = done / max(time.perf_counter() - t0, 1e-9)
    eta = (total - done) / rate if rate > 0 else 0
    print(f"\r{what}: {done}/{total} [{rate:.1f}/s, eta {eta/60:.1f} min]", end="", flush=True)


@torch.inference_mode()
def greedy_batch(model: Transformer, prompts: list[list[int]], max_new_tokens: int, eos: set[int],
                 features: bool = False) -> list[dict]:
    """Greedy continuations of several prompts at once on our runtime, one example per prompt.

    Each prompt keeps its own KV cache (no padding); every step is one batched forward over the
    rows still running (`Transformer.forward_batch`), so the weights are read once per step for
    all of them. A row stops after an id in `eos` (kept: the drafter should learn when the target
    stops) or `max_new_tokens`. Per response position: the target's top-`TOPK` ids and
    probabilities (softmax over the full vocabulary; ids[:, 0] is the token taken). With
    `features`, also the target's final hidden state (before its norm) at every token, prompt
    included — what a feature drafter trains on — taken from these same forwards.
    """
    dev = model.lm_head.weight.device
    rows = [{"tokens": list(p), "start": len(p), "ids": [], "p": [], "h": [], "done": False} for p in prompts]
    segs = [Segment(torch.tensor(p, device=dev), torch.arange(len(p), device=dev),
                    model.new_cache(len(p) + max_new_tokens + 1), 0, logits_rows=slice(-1, None), want_hidden=features)
            for p in prompts]
    live = list(range(len(rows)))
    while live:
        logits = model.forward_batch([segs[i] for i in live])
        wanted = [out[-1:] for out in logits if out is not None]
        if wanted:
            top_p, top_ids = torch.softmax(torch.cat(wanted).float(), dim=-1).topk(TOPK)
            top_p, top_ids = top_p.half().cpu(), top_ids.to(torch.int32).cpu()
        still, k = [], -1
        for i in live:
            r, s = rows[i], segs[i]
            if features:
                r["h"].append(s.hidden.half().cpu())
            if r["done"]:  # its last token has now been fed (no logits asked): its hidden state is in
                continue
            k += 1
            r["ids"].append(top_ids[k])
            r["p"].append(top_p[k])
            nxt = int(top_ids[k, 0])
            r["tokens"].append(nxt)
            r["done"] = nxt in eos or len(r["ids"]) >= max_new_tokens
            if r["done"] and not features:
                continue
            pos = len(r["tokens"]) - 1
            segs[i] = Segment(torch.tensor([nxt], device=dev), torch.tensor([pos], device=dev), s.cache, pos,
                              logits_rows=None if r["done"] else slice(None), want_hidden=features)
            still.append(i)
        live = still
    out = []
    for r in rows:
        ex = {"tokens": torch.tensor(r["tokens"], dtype=torch.int32), "start": r["start"],
              "topk_ids": torch.stack(r["ids"]), "topk_p": torch.stack(r["p"]), "kind": "chat"}
        if features:
            ex["feats"] = torch.cat(r["h"])  # [len(tokens), hidden]
        out.append(ex)
    return out


def generate_chat(model: Transformer, tokenizer, prompts: list[str], out_dir: Path, max_new_tokens: int,
                  eos: set[int], batch_size: int = 16, max_batches: int = 0, features: bool = False) -> int:
    """The target's greedy responses to `prompts` (through its chat template), in shards under
    out_dir (resumable), generated on our runtime (`greedy_batch`): the model that serves is the
    one whose outputs the drafter learns.

    Prompts are generated shortest first, `batch_size` at a time; `max_batches` > 0 stops after
    that many batches (the shortest prompts). Returns the number of prompts covered.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    from specmesh.runtime import encode_prompt

    ids = [encode_prompt(tokenizer, p, chat=True) for p in prompts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if max_batches > 0:
        batches = batches[:max_batches]
    t0 = time.perf_counter()
    for b, idx in enumerate(batches):
        path = out_dir / f"chat-{b:05d}.pt"
        if path.exists():
            continue
        examples = greedy_batch(model, [ids[i] for i in idx], max_new_tokens, eos, features)
        for e, i in zip(examples, idx):
            e["prompt"] = prompts[i]
        torch.save(examples, path)
        _progress(b + 1, len(batches), t0, "chat batches")
    print()
    return sum(len(b) for b in batches)


def corpus_texts(max_chars: int, seed: int = 0) -> list[str]:
    """Python sources of the standard library and documentation files found on this machine."""
    import random

    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    files += sorted(glob.glob("/usr/share/doc/**/*.md", recursive=True))
    files += sorted(glob.glob("/usr/share/doc/**/*.txt", recursive=True))
    random.Random(seed).shuffle(files)
    out, total = [], 0
    for f in files:
        try:
            text = Path(f).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) < 500:
            continue
        text = text[:6000]
        out.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return out


def teacher_force_corpus(model, tokenizer, texts: list[str], out_dir: Path, seq_len: int = 256,
                         batch_size: int = 16) -> None:
    """Chunks of `texts`, each with the target's top-k at every position, in shards (resumable)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        chunks += [ids[i:i + seq_len] for i in range(0, len(ids) - 32, seq_len)]
    batches = [chunks[i:i + batch_size] for i in range(0, len(chunks), batch_size)]
    t0 = time.perf_counter()
    for b, batch in enumerate(batches):
        path = out_dir / f"corpus-{b:05d}.pt"
        if path.exists():
            continue
        examples = []
        with torch.inference_mode():
            for ids in batch:
                x = torch.tensor([ids])
                p = torch.softmax(model(input_ids=x).logits[0, :-1].float(), dim=-1)
                v, i = p.topk(TOPK, dim=-1)
                examples.append({"tokens": torch.tensor(ids, dtype=torch.int32), "start": 1,
                                 "topk_ids": i.to(torch.int32), "topk_p": v.half(), "kind": "corpus"})
        torch.save(examples, path)
        _progress(b + 1, len(batches), t0, "corpus batches")
    print()


def load_examples(data_dir: Path) -> list[dict]:
    out = []
    for path in sorted(data_dir.glob("*.pt")):
        out.extend(torch.load(path, weights_only=False))
    return out
