"""Constrained decoding with speculation vs without (issue 18): the bundled SmolLM2 and its shipped
feature drafter in this process (the engine the verifier runs), greedy, one torch thread.

Rows per grammar (a JSON schema, any JSON object, a regex): plain decoding and speculation, each
unconstrained and under the grammar, interleaved prompt by prompt after one untimed warm-up.
Columns: tok/s (decode, prefill excluded), tokens per step, the grammar's cost per step (llguidance
masks of every reachable tree row plus advancing the matcher: `grammar.Constraint.seconds`) and
as a share of the step, and whether the constrained speculative output equals constrained plain
decoding (it must). The drafter is not constrained: its nodes the grammar forbids are rejected.

Usage: python -m loadtest.bench_structured [--max-tokens N] [--out FILE] [--markdown JSON]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from loadtest.bench_engine import add_markdown_flag, base_meta, print_saved, save
from specmesh.drafters import bundled_drafter_path
from specmesh.engine import SpecConfig, StopConditions, generate_stream
from specmesh.engine import GenerationResult
from specmesh.grammar import Grammars, GrammarSpec
from specmesh.kernels.dispatch import cpu_model
from specmesh.runtime import encode_prompt, load_model_drafter, load_target
from specmesh.sampling import SamplingParams

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "hobbies": {"type": "array",
                                                                                   "items": {"type": "string"}}},
          "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
GRAMMARS = {"json_schema": GrammarSpec("json_schema", json.dumps(PERSON)),
            "json_object": GrammarSpec("json_object", ""),
            "regex": GrammarSpec("regex", r"([A-Z][a-z]+, ){3,6}and [A-Z][a-z]+\.")}
PROMPTS = {"json_schema": ["Describe a person named Ann, 31, from Oslo, who likes chess and hiking, as JSON.",
                           "Give me a JSON record for Bob, 45, a painter in Lyon with three hobbies."],
           "json_object": ["Return a JSON object describing a small red car.",
                           "Return a JSON object with the planets of the solar system and their order."],
           "regex": ["Name some European capital cities.", "Name some colours of the rainbow."]}


def run(model, ids, stop, drafter, constraint) -> dict:
    res = GenerationResult()
    first = None
    t0 = time.perf_counter()
    for _ in generate_stream(model, ids, SamplingParams(), stop, drafter, SpecConfig(), result=res,
                             constraint=constraint):
        if first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    decoded = max(len(res.token_ids) - 1, 0)
    return {"tokens": res.token_ids, "decode_s": end - (first or end), "decoded": decoded,
            "steps": res.stats.steps, "new": res.stats.new_tokens,
            "grammar_s": constraint.seconds if constraint is not None else 0.0, "total_s": end - t0}


def table(data: dict) -> str:
    m = data["meta"]
    lines = [f"commit {m['commit']} · {m['cpu_model']} · SmolLM2-135M ({m['dtype']}) + shipped feature drafter, "
             f"in process, {m['torch_threads']} torch thread · {m['prompts_per_grammar']} prompts per grammar x "
             f"{m['max_tokens']} tokens, greedy",
             "", "| grammar | configuration | decode tok/s | tokens/step | grammar ms/step | grammar share of step "
                 "| vs plain unconstrained | identical to constrained plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        lines.append(f"| {r['grammar']} | {r['config']} | {r['tok_s']:.1f} | {r['tokens_per_step']:.2f} | "
                     f"{r['grammar_ms_per_step']:.2f} | {r['grammar_share']:.1%} | {r['vs_plain']:.2f}x | "
                     f"{r['identical']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="loadtest/results/bench_structured.json")
    ap.add_argument("--dtype", default="auto")
    add_markdown_flag(ap)
    args = ap.parse_args(argv)
    if print_saved(args.markdown, table):
        return 0
    torch.set_num_threads(1)
    model, tok = load_target(None) if args.dtype == "float32" else _target(args.dtype)
    drafter = load_model_drafter(str(bundled_drafter_path()), dtype=args.dtype)
    grammars = Grammars(tok, model.config.vocab_size)
    stop = StopConditions(args.max_tokens, frozenset([tok.eos_token_id]))
    configs = [("plain", False, False), ("plain, constrained", False, True),
               ("speculative", True, False), ("speculative, constrained", True, True)]
    results = []
    for name, spec in GRAMMARS.items():
        sums = {c[0]: {"decode_s": 0.0, "decoded": 0, "steps": 0, "new": 0, "grammar_s": 0.0} for c in configs}
        identical = True
        warm = encode_prompt(tok, PROMPTS[name][0], chat=True)
        run(model, warm, stop, drafter, grammars.constraint(spec))  # untimed: compiles, warms the caches
        for text in PROMPTS[name]:
            ids = encode_prompt(tok, text, chat=True)
            outs = {}
            for cname, speculative, constrained in configs:
                o = run(model, ids, stop, drafter if speculative else None,
                        grammars.constraint(spec) if constrained else None)
                outs[cname] = o["tokens"]
                for k in sums[cname]:
                    sums[cname][k] += o[k]
            identical &= outs["speculative, constrained"] == outs["plain, constrained"]
        base = sums["plain"]["decoded"] / sums["plain"]["decode_s"]
        for cname, _, _ in configs:
            s = sums[cname]
            tok_s = s["decoded"] / s["decode_s"]
            per_step = s["grammar_s"] / max(s["steps"], 1)
            step_s = (s["decode_s"] / max(s["steps"] - len(PROMPTS[name]), 1))
            results.append({"grammar": name, "config": cname, "tok_s": tok_s, "tokens_per_step": s["new"] / s["steps"],
                            "grammar_ms_per_step": per_step * 1e3, "grammar_share": per_step / step_s if step_s else 0.0,
                            "vs_plain": tok_s / base,
                            "identical": identical if cname == "speculative, constrained" else "–"})
    meta = {**base_meta(), "cpu_model": cpu_model(), "dtype": args.dtype, "max_tokens": args.max_tokens,
            "prompts_per_grammar": len(next(iter(PROMPTS.values()))), "grammars": {k: v.source for k, v in GRAMMARS.items()}}
    save(args.out, meta, results, table({"meta": meta, "results": results}))
    return 0


def _target(dtype: str):
    from specmesh.loader import bundled_target_path, load_model, load_tokenizer

    return load_model(bundled_target_path(), dtype=dtype), load_tokenizer(bundled_target_path())


if __name__ == "__main__":
    raise SystemExit(main())
