"""`specmesh train-drafter`: data (target's responses + local corpus) -> distillation -> held-out eval -> export.

Every stage resumes: data shards already written are kept, training restarts from its last
checkpoint, so the same command can be run again after an interruption. On CPU the defaults
(1,152 prompts, up to 128 new tokens each, generated on our runtime at ~80 tokens/s; 100k
characters of corpus; a 30-minute training budget) take about an hour for the bundled
SmolLM2-135M target on 2 cores. The shipped drafter's recipe (`recipe.json`) uses more prompts.
With CUDA present, generation and training run on the GPU.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="HF folder, .safetensors or .gguf (default: bundled SmolLM2)")
    p.add_argument("--out", required=True, help="output folder: config.json + model.safetensors + recipe.json")
    p.add_argument("--work", default=None, help="data and checkpoints (default: OUT/work)")
    p.add_argument("--prompts", type=int, default=1152, help="training chat prompts (of 2,966 built in)")
    p.add_argument("--heldout-prompts", type=int, default=96)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--corpus-chars", type=int, default=100_000, help="local Python sources / docs, teacher-forced")
    p.add_argument("--kind", choices=("feature", "token"), default="feature",
                   help="feature: EAGLE-style, drafts from the target's hidden states (one layer); "
                        "token: a small causal LM cut from the target (--layers)")
    p.add_argument("--layers", type=int, default=2, help="token kind: decoder layers (the target's first N)")
    p.add_argument("--depths", type=int, default=2, help="feature kind: draft levels unrolled in training")
    p.add_argument("--init", default="target",
                   help="feature kind: 'target' (one layer, the target's last) or 'token:DIR' (start from a "
                        "trained token-level drafter: its layers, norm, head and vocabulary)")
    p.add_argument("--reg-weight", type=float, default=None,
                   help="feature kind: feature regression weight (default 0.2 for --init target, 0 for token:DIR)")
    p.add_argument("--draft-vocab", type=int, default=8192, help="tokens the drafter's head scores")
    p.add_argument("--minutes", type=float, default=30.0, help="training time budget")
    p.add_argument("--lr", type=float, default=None, help="default 2e-3 (feature), 1e-3 (token)")
    p.add_argument("--batch-tokens", type=int, default=4096)
    p.add_argument("--gen-batch", type=int, default=16,
                   help="prompts generated at once (16: every decode step stays in the small-M CPU kernel)")
    p.add_argument("--chat-batches", type=int, default=0,
                   help="generate only this many batches of training prompts, shortest first (0 = all)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specmesh.distill import data, prompts, train
    from specmesh.loader import _sha256, bundled_target_path, load_model, resolve_folder

    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = Path(args.target) if args.target else bundled_target_path()
    out = Path(args.out)
    work = Path(args.work) if args.work else out / "work"
    t0 = time.perf_counter()
    folder = resolve_folder(target)
    tok = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(device)
    print(f"target {target} on {device}, {torch.get_num_threads()} thread(s)", file=sys.stderr)

    # 1. data
    train_prompts = prompts.prompts("train")[: args.prompts]
    held_prompts = prompts.prompts("heldout")[: args.heldout_prompts]
    if args.kind == "feature" and target.suffix != ".gguf":  # before the data stage, not after it
        raise ValueError("target: a feature drafter shares the target's embeddings, which needs a .gguf target")
    runtime = load_model(target).to(device)  # generates the chat data; a feature drafter's training reuses it
    eos = {t for x in (tok.eos_token_id, hf.config.eos_token_id) for t in (x if isinstance(x, list) else [x])
           if t is not None}
    feats = args.kind == "feature"
    n_chat = data.generate_chat(runtime, tok, train_prompts, work / "train", args.max_new_tokens, eos,
                                args.gen_batch, args.chat_batches, feats)
    data.teacher_force_corpus(hf, tok, data.corpus_texts(args.corpus_chars, args.seed), work / "train")
    data.generate_chat(runtime, tok, held_prompts, work / "heldout", min(args.max_new_tokens, 128), eos,
                       args.gen_batch, 0, feats)
    t_data = time.perf_counter() - t0
    train_ex = data.load_examples(work / "train")
    held_ex = data.load_examples(work / "heldout")
    n_tokens = sum(len(e["topk_ids"]) for e in train_ex)
    print(f"data: {len(train_ex)} examples, {n_tokens} supervised tokens; held-out {len(held_ex)}", file=sys.stderr)

    # 2. student + training
    vocab_map = train.choose_vocab(train_ex, args.draft_vocab, hf.config.vocab_size, sorted(eos))
    embed = {"sha256": _sha256(target), "path": str(target)} if target.suffix == ".gguf" else None
    base_recipe = {
        "command": "specmesh train-drafter " + " ".join(shlex.quote(a) for a in sys.argv[2:]),
        "target": target.name,
        "target_sha256": embed["sha256"] if embed else None,
        "data": {
            "chat": f"{n_chat} built-in chat prompts (the shortest of the first {len(train_prompts)}) (specmesh.distill.prompts, train split: topics "
                    f"disjoint from the held-out split), the target's greedy responses via its chat template, "
                    f"max {args.max_new_tokens} new tokens, top-{data.TOPK} teacher probabilities per position",
            "corpus": f"{args.corpus_chars} characters of Python standard-library sources and /usr/share/doc "
                      f"text, teacher-forced in 256-token chunks",
            "supervised_tokens": n_tokens,
            "examples": len(train_ex),
        },
    }
    if args.kind == "feature":
        del hf
        return _train_feature(args, runtime.cpu(), folder, train_ex, held_ex, vocab_map, work, embed,
                              base_recipe, t0, t_data, device, len(held_prompts))
    del runtime
    hf = hf.cpu() if device == "cpu" else hf
    student = train.build_student(hf, args.layers, vocab_map).to(device)
    cfg = train.TrainConfig(layers=args.layers, draft_vocab=args.draft_vocab, lr=args.lr or 1e-3,
                            batch_tokens=args.batch_tokens, minutes=args.minutes, seed=args.seed)
    local_of = train.local_index(vocab_map, hf.config.vocab_size)
    before = train.evaluate(student.cpu(), held_ex, vocab_map, local_of)
    student.to(device)
    result = train.train(student, train_ex, held_ex, vocab_map, hf.config.vocab_size, cfg, work / "checkpoint.pt")
    student.cpu()

    # 3. export
    recipe = {
        **base_recipe,
        "student": {"layers": args.layers, "init": f"target layers 0..{args.layers - 1}, final norm",
                    "embeddings": "shared with the target, frozen", "draft_vocab": len(vocab_map),
                    "head_init": "target output-embedding rows of the kept tokens"},
        "train": asdict(cfg),
        "heldout": {"prompts": len(held_prompts), "before_training": before, "after_training": result},
        "seconds": {"data": round(t_data, 1), "total": round(time.perf_counter() - t0, 1)},
        "threads": torch.get_num_threads(),
        "device": device,
    }
    train.export(student, vocab_map, hf, out, embed, recipe)
    print(json.dumps({"out": str(out), "heldout": result}, indent=1))
    return 0


def _train_feature(args, model, folder: Path, train_ex: list[dict], held_ex: list[dict],
                   vocab_map: torch.Tensor, work: Path, embed: dict, base_recipe: dict, t0: float,
                   t_data: float, device: str, held_prompts: int) -> int:
    """The feature-drafter path (`specmesh.distill.feature`): target features, unrolled training, export.
    `model`: the target on our runtime (on the CPU), the one that generated the data."""
    from transformers import AutoConfig

    from specmesh.distill import feature
    from specmesh.loader import load_model

    log = lambda *a, **k: print(*a, **k, file=sys.stderr, flush=True)  # noqa: E731
    feature.add_features(model, train_ex, work / "features-train.pt", log)
    feature.add_features(model, held_ex, work / "features-heldout.pt", log)
    sigma = feature.feature_std(train_ex)
    if args.init == "target":
        student = feature.FeatureStudent.from_target(model, vocab_map, sigma)
        init = {"from": "target", "layers": 1, "init": "the target's last decoder layer, final norm and head rows; "
                                                        "fc = mean of its two (rescaled) inputs"}
    elif args.init.startswith("token:"):
        token_drafter = load_model(args.init[len("token:"):])
        if token_drafter.vocab_map is None or token_drafter.fc is not None:
            raise ValueError("init: token:DIR must be a token-level drafter with a reduced-vocabulary head")
        vocab_map = token_drafter.vocab_map
        student = feature.FeatureStudent.from_token_drafter(model, token_drafter, sigma)
        init = {"from": args.init, "layers": len(student.layers),
                "init": "the token-level drafter's layers, norm, head and vocabulary; fc = [0 ; I] (starts as it)"}
    else:
        raise ValueError(f"init: expected 'target' or 'token:DIR', got {args.init!r}")
    vocab_size = model.config.vocab_size
    del model
    reg = args.reg_weight if args.reg_weight is not None else (0.2 if args.init == "target" else 0.0)
    cfg = feature.FeatureTrainConfig(draft_vocab=len(vocab_map), depths=args.depths, reg_weight=reg,
                                     lr=args.lr or 2e-3, minutes=args.minutes, seed=args.seed)
    local_of = feature.local_index(vocab_map, vocab_size)
    before = feature.evaluate(student, held_ex, local_of, cfg.depths, sigma)
    student.to(device)
    result = feature.train(student, train_ex, held_ex, vocab_map, vocab_size, cfg,
                           work / "checkpoint-feature.pt", log)
    student.cpu()
    recipe = {
        **base_recipe,
        "student": {"kind": "feature (EAGLE-style)", **init,
                    "input": "fc([target final hidden state; embedding of the next token])",
                    "embeddings": "shared with the target, frozen", "draft_vocab": len(vocab_map)},
        "train": {**asdict(cfg), "level_decay": feature.LEVEL_DECAY, "feature_noise": feature.FEATURE_NOISE},
        "heldout": {"prompts": held_prompts, "before_training": before, "after_training": result},
        "seconds": {"data": round(t_data, 1), "total": round(time.perf_counter() - t0, 1)},
        "threads": torch.get_num_threads(),
        "device": device,
    }
    hf_cfg = AutoConfig.from_pretrained(folder).to_dict()
    feature.export(student, vocab_map, hf_cfg, Path(args.out), embed, recipe)
    print(json.dumps({"out": str(args.out), "heldout": result}, indent=1))
    return 0
