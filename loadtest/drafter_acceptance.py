"""Held-out greedy per-token acceptance of drafters for the bundled target, on more prompts than
`bench_drafters` runs at speed: for each held-out chat prompt (topics no training prompt has), the
target's greedy answer (up to --max-tokens, stopping at EOS), then for every answer position
whether the drafter's argmax given the same prefix is the target's token (teacher-forced: a
feature drafter gets the target's states of that prefix; `bench_drafters.teacher_forced_matches`).
Reported per drafter: matches / positions, and the standard error over prompts. Same prompts,
same answers, every drafter in one run.

Usage: python -m loadtest.drafter_acceptance [--prompts 48] [--max-tokens 64]
           [--drafter NAME=DIR ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from loadtest.bench_drafters import pick_prompts, teacher_forced_matches
from loadtest.bench_engine import base_meta

SHIPPED = Path(__file__).resolve().parent.parent / "specmesh" / "drafters" / "smollm2_135m"


def acceptance(target, tok, drafters: dict, prompts: list[str], max_tokens: int) -> dict:
    """{name: {"acceptance", "std_err", "positions"}} over `prompts` (teacher-forced, greedy)."""
    from specmesh.engine import StopConditions, generate
    from specmesh.runtime import encode_prompt
    from specmesh.sampling import SamplingParams

    stop = StopConditions(max_tokens, frozenset([tok.eos_token_id]) if tok.eos_token_id is not None else frozenset())
    per: dict[str, list[float]] = {name: [] for name in drafters}
    hits = dict.fromkeys(drafters, 0)
    positions = 0
    for text in prompts:
        ids = encode_prompt(tok, text, chat=True)
        out = generate(target, ids, SamplingParams(), stop).token_ids
        positions += len(out)
        for name, d in drafters.items():
            m = teacher_forced_matches(d, ids, out, target)
            hits[name] += m
            per[name].append(m / max(len(out), 1))
    return {name: {"acceptance": round(hits[name] / max(positions, 1), 4),
                   "std_err": round(float(torch.tensor(per[name]).std() / len(per[name]) ** 0.5), 4)
                   if len(per[name]) > 1 else None,
                   "positions": positions} for name in drafters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR",
                    help=f"default: shipped={SHIPPED}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="JSON results (default: print only)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specmesh.loader import load_model
    from specmesh.runtime import load_target

    target, tok = load_target(None)
    named = dict(d.split("=", 1) for d in args.drafter) if args.drafter else {"shipped": str(SHIPPED)}
    drafters = {name: load_model(path) for name, path in named.items()}
    prompts = pick_prompts("smollm2", args.prompts)
    results = acceptance(target, tok, drafters, prompts, args.max_tokens)
    report = {"meta": base_meta() | {"prompts": len(prompts), "prompt_split": "heldout (specmesh.distill.prompts)",
                                      "max_tokens": args.max_tokens, "drafters": named,
                                      "measure": "teacher-forced first-level greedy acceptance"},
              "results": results}
    print(json.dumps(report["results"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
