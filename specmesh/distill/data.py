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

TOPK = 8


class _TopK:
    """A logits processor that records the top-k of every generation step and changes nothing."""

    def __init__(self, k: int) -> None:
        self.k, self.steps = k, []

    def __call__(self, input_ids, scores):
        p = torch.softmax(scores.float(), dim=-1)
        v, i = p.topk(self.k, dim=-1)
        self.steps.append((i.to(torch.int32), v.half()))
        return scores


def _progress(done: int, total: int, t0: float, what: str) -> None:
    rate = done / max(time.perf_counter() - t0, 1e-9)
    eta = (total - done) / rate if rate > 0 else 0
    print(f"\r{what}: {done}/{total} [{rate:.1f}/s, eta {eta/60:.1f} min]", end="", flush=True)


def generate_chat(model, tokenizer, prompts: list[str], out_dir: Path, max_new_tokens: int,
                  batch_size: int = 48, max_batches: int = 0) -> int:
    """Greedy responses of the target to `prompts`, in shards under out_dir (resumable).

    Prompts are generated shortest first, `batch_size` at a time; `max_batches` > 0 stops after
    that many batches (the shortest prompts). Returns the number of prompts covered.
    """
    from transformers import LogitsProcessorList

    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in prompts]
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if max_batches > 0:
        batches = batches[:max_batches]
    eos = tokenizer.eos_token_id
    t0 = time.perf_counter()
    for b, idx in enumerate(batches):
        path = out_dir / f"chat-{b:05d}.pt"
        if path.exists():
            continue
        enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
        rec = _TopK(TOPK)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 logits_processor=LogitsProcessorList([rec]), pad_token_id=tokenizer.pad_token_id)
        plen = enc.input_ids.shape[1]
        ids = torch.stack([s[0] for s in rec.steps], dim=1)  # [B, steps, k]
        probs = torch.stack([s[1] for s in rec.steps], dim=1)
        examples = []
        for row, i in enumerate(idx):
            prompt = enc.input_ids[row][enc.attention_mask[row].bool()]
            resp = out[row, plen:]
            n = len(resp)
            hits = (resp == eos).nonzero()
            if len(hits):
                n = int(hits[0]) + 1  # keep the EOS: the drafter should learn when the target stops
            tokens = torch.cat([prompt, resp[:n]]).to(torch.int32)
            examples.append({"tokens": tokens, "start": len(prompt), "topk_ids": ids[row, :n].clone(),
                             "topk_p": probs[row, :n].clone(), "kind": "chat", "prompt": prompts[i]})
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
