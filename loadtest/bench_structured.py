"""Constrained decoding with speculation vs without (issue 18): the bundled SmolLM2 and its shipped
feature drafter in this process (the engine the verifier runs), greedy, one torch thread.

Rows per grammar (a JSON schema, any JSON object, a regex): plain decoding and speculation, each
unconstrained and under the grammar, interleaved prompt by prompt after one untimed warm-up.
Columns: tok/s (decode, prefill excluded), tokens per step, the grammar's cost per step (llguidance
masks of every reachable tree row plus advancing the matcher: `grammar.Constraint.seconds`) and
as a share of the step, and whether the constrained speculative output equals constrained plain
decoding (it must). Speculation under a grammar runs twice: with the drafter guided by the grammar
(the default: it grows only allowed nodes, `grammar.Guide`; its masks count in the grammar's cost)
and unguided (its nodes the grammar forbids are drafted and then refused at verification).

`--services`: the same through the services instead (a verifier and the feature drafter as
processes on 127.0.0.1, one thread each, gRPC requests, the verifier's defaults: the drafter's
planner picks each step's shape, pipelining as the verifier decides): speculation disabled,
speculation with the drafter following the grammar (started with the target's tokenizer, as
`specmesh up` starts it), and speculation with the same drafter started with `--tokenizer none`
(unguided). `--pair qwen2.5-coder`: that installed pair instead of the bundled SmolLM2 (services only).

Usage: python -m loadtest.bench_structured [--max-tokens N] [--services] [--out FILE] [--markdown JSON]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

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


class Metered:
    """A grammar.Constraint whose drafter guide can be turned off, counting the guide's mask time."""

    def __init__(self, constraint, guided: bool) -> None:
        self.constraint, self.guided, self.guides = constraint, guided, []

    def __call__(self, logits, parents, tokens):
        return self.constraint(logits, parents, tokens)

    def add(self, tokens):
        self.constraint.add(tokens)

    def guide(self):
        if not self.guided:
            return None
        self.guides.append(self.constraint.guide())
        return self.guides[-1]

    @property
    def seconds(self) -> float:
        return self.constraint.seconds + sum(g.seconds for g in self.guides)


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
    where = ("through the services (verifier + drafter processes, 1 thread each)" if m.get("services")
             else f"in process, {m['torch_threads']} torch thread")
    pair = ("SmolLM2-135M + shipped feature drafter" if m.get("pair", "smollm2") == "smollm2"
            else f"{m['pair']} ({Path(m['target']).name} + {Path(m['drafter']).name})")
    lines = [f"commit {m['commit']} · {m['cpu_model']} · {pair} ({m['dtype']}), "
             f"{where} · {m['prompts_per_grammar']} prompts per grammar x {m['max_tokens']} tokens, greedy",
             "", "| grammar | configuration | decode tok/s | tokens/step | grammar ms/step | grammar share of step "
                 "| vs plain unconstrained | identical to constrained plain |",
             "|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        ms, share = r["grammar_ms_per_step"], r["grammar_share"]
        ms, share = ("–", "–") if ms != ms else (f"{ms:.2f}", f"{share:.1%}")  # NaN: not measured (services)
        lines.append(f"| {r['grammar']} | {r['config']} | {r['tok_s']:.1f} | {r['tokens_per_step']:.2f} | "
                     f"{ms} | {share} | {r['vs_plain']:.2f}x | {r['identical']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="loadtest/results/bench_structured.json")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--services", action="store_true", help="through a verifier and drafter services")
    ap.add_argument("--pair", default="smollm2", help="with --services: smollm2 | an installed model set")
    add_markdown_flag(ap)
    args = ap.parse_args(argv)
    if print_saved(args.markdown, table):
        return 0
    torch.set_num_threads(1)
    if args.services:
        return services(args)
    model, tok = load_target(None) if args.dtype == "float32" else _target(args.dtype)
    drafter = load_model_drafter(str(bundled_drafter_path()), dtype=args.dtype)
    grammars = Grammars(tok, model.config.vocab_size)
    stop = StopConditions(args.max_tokens, frozenset([tok.eos_token_id]))
    configs = [("plain", False, None), ("plain, constrained", False, True),
               ("speculative", True, None), ("speculative, constrained", True, True),
               ("speculative, constrained, unguided drafter", True, False)]
    results = []
    for name, spec in GRAMMARS.items():
        sums = {c[0]: {"decode_s": 0.0, "decoded": 0, "steps": 0, "new": 0, "grammar_s": 0.0} for c in configs}
        identical = True
        warm = encode_prompt(tok, PROMPTS[name][0], chat=True)
        run(model, warm, stop, drafter, Metered(grammars.constraint(spec), True))  # untimed: warms the caches
        for text in PROMPTS[name]:
            ids = encode_prompt(tok, text, chat=True)
            outs = {}
            for cname, speculative, guided in configs:
                o = run(model, ids, stop, drafter if speculative else None,
                        None if guided is None else Metered(grammars.constraint(spec), guided))
                outs[cname] = o["tokens"]
                for k in sums[cname]:
                    sums[cname][k] += o[k]
            identical &= (outs["speculative, constrained"] == outs["plain, constrained"]
                          == outs["speculative, constrained, unguided drafter"])
        base = sums["plain"]["decoded"] / sums["plain"]["decode_s"]
        for cname, _, _ in configs:
            s = sums[cname]
            tok_s = s["decoded"] / s["decode_s"]
            per_step = s["grammar_s"] / max(s["steps"], 1)
            step_s = (s["decode_s"] / max(s["steps"] - len(PROMPTS[name]), 1))
            results.append({"grammar": name, "config": cname, "tok_s": tok_s, "tokens_per_step": s["new"] / s["steps"],
                            "grammar_ms_per_step": per_step * 1e3, "grammar_share": per_step / step_s if step_s else 0.0,
                            "vs_plain": tok_s / base,
                            "identical": identical if cname.startswith("speculative, constrained") else "–"})
    meta = {**base_meta(), "cpu_model": cpu_model(), "dtype": args.dtype, "max_tokens": args.max_tokens,
            "prompts_per_grammar": len(next(iter(PROMPTS.values()))), "grammars": {k: v.source for k, v in GRAMMARS.items()}}
    save(args.out, meta, results, table({"meta": meta, "results": results}))
    return 0


SERVICE_CONFIGS = [("plain", None, False), ("plain, constrained", None, True),
                   ("speculative", "guided", False), ("speculative, constrained", "guided", True),
                   ("speculative, constrained, unguided drafter", "unguided", True)]


def services(args) -> int:
    """The table through a verifier and two feature-drafter services (guided and unguided)."""
    from specmesh.convert import structured_to_pb
    from specmesh.launch import start
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc
    import grpc

    if args.pair == "smollm2":
        target, draft = str(bundled_target_path()), str(bundled_drafter_path())
    else:
        from specmesh.modelsets import model_path

        target, draft = str(model_path(args.pair, "target")), str(model_path(args.pair, "drafter"))
    tok = load_tokenizer(target)
    common = ["--threads", "1", "--dtype", args.dtype]
    target_args = [] if args.pair == "smollm2" else ["--target", target]
    procs = {"verifier": start("verifier_service", *common, *target_args, "--drafter-allow", "127.0.0.1:*"),
             "guided": start("drafter_service", "--drafter", f"model:{draft}", *common, "--tokenizer", target),
             "unguided": start("drafter_service", "--drafter", f"model:{draft}", *common, "--tokenizer", "none")}
    try:
        stub = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(procs["verifier"].address))

        def remote(ids, which, spec) -> dict:
            req = verifier_pb2.GenerateRequest(max_tokens=args.max_tokens, token_ids=verifier_pb2.TokenIds(ids=ids))
            if which is None:
                req.speculation.disabled = True
            else:
                req.drafter_address = procs[which].address
            if spec is not None:
                req.structured.CopyFrom(structured_to_pb(spec))
            out, first, done = [], None, None
            for r in stub.Generate(req, timeout=600):
                if r.HasField("chunk") and r.chunk.token_ids:
                    first = first or time.perf_counter()
                    out.extend(r.chunk.token_ids)
                elif r.HasField("complete"):
                    done = r.complete
            end = time.perf_counter()
            sp = done.speculation
            return {"tokens": out, "decode_s": end - (first or end), "decoded": max(len(out) - 1, 0),
                    "steps": sp.steps or len(out), "new": len(out), "grammar_s": 0.0}

        results = []
        for name, spec in GRAMMARS.items():
            sums = {c[0]: {"decode_s": 0.0, "decoded": 0, "steps": 0, "new": 0} for c in SERVICE_CONFIGS}
            outs: dict[str, list] = {c[0]: [] for c in SERVICE_CONFIGS}
            warm = encode_prompt(tok, PROMPTS[name][0], chat=True)
            for _, which, _ in SERVICE_CONFIGS[1:3] + SERVICE_CONFIGS[4:]:
                remote(warm, which, spec)  # untimed: compiles the grammar, warms both drafters
            for text in PROMPTS[name]:
                ids = encode_prompt(tok, text, chat=True)
                for cname, which, constrained in SERVICE_CONFIGS:
                    o = remote(ids, which, spec if constrained else None)
                    outs[cname].append(o["tokens"])
                    for k in sums[cname]:
                        sums[cname][k] += o[k]
            identical = (outs["speculative, constrained"] == outs["plain, constrained"]
                         == outs["speculative, constrained, unguided drafter"])
            base = sums["plain"]["decoded"] / sums["plain"]["decode_s"]
            for cname, _, _ in SERVICE_CONFIGS:
                s = sums[cname]
                tok_s = s["decoded"] / s["decode_s"]
                results.append({"grammar": name, "config": cname, "tok_s": tok_s,
                                "tokens_per_step": s["new"] / s["steps"], "grammar_ms_per_step": float("nan"),
                                "grammar_share": float("nan"), "vs_plain": tok_s / base,
                                "identical": identical if cname.startswith("speculative, constrained") else "–"})
    finally:
        for proc in procs.values():
            proc.stop()
    meta = {**base_meta(), "cpu_model": cpu_model(), "dtype": args.dtype, "max_tokens": args.max_tokens,
            "services": True, "pair": args.pair, "target": target, "drafter": draft, "service_threads": 1,
            "prompts_per_grammar": len(next(iter(PROMPTS.values()))),
            "grammars": {k: v.source for k, v in GRAMMARS.items()}}
    save(args.out, meta, results, table({"meta": meta, "results": results}))
    return 0


def _target(dtype: str):
    from specmesh.loader import bundled_target_path, load_model, load_tokenizer

    return load_model(bundled_target_path(), dtype=dtype), load_tokenizer(bundled_target_path())


if __name__ == "__main__":
    raise SystemExit(main())
