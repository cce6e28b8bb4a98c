"""Distributed benchmark: in-process engine vs drafter + verifier services (TP=1, TP=2), with
pipelining on and off, oracle drafters at alpha 0.6 / 0.8 with a configurable draft cost, and ngram.

One run, same prompts, every configuration interleaved prompt by prompt. Each service process gets
one torch thread (say so in the output: on 2 cores several processes with 2 threads each spin).
Reported per configuration: tokens/s, speedup over autoregressive decoding on the same verifier,
verifier idle fraction (time waiting for a tree / turn time), predraft hit rate, and, for the
oracles, the bounds of DESIGN.md with E = (1 - a^(g+1)) / (1 - a) and the measured draft cost
ratio c: sequential E / (1 + g c), pipelined E / max(1, g c). The per-step gRPC overhead is
(distributed time - in-process time) / steps for the same cost-free oracle, pipelining off.

Usage: python -m loadtest.bench_services [--quick] [--out FILE] [--draft-cost-s 0.025]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field

import grpc
import torch

from loadtest.bench_engine import _commit, expected_tokens_per_step
from specmesh.launch import start

DEPTH = 4
PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List the planets of the solar system in order, one line each.",
]


@dataclass
class Config:
    name: str
    where: str                 # inproc | tp1 | tp2
    drafter: str = "none"      # none | ngram | o6 | o8 | o8c (oracle 0.8, cost-free)
    pipelined: bool = True
    alpha: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    idle_s: float = 0.0
    hits: int = 0
    identical: bool = True
    extra: dict = field(default_factory=dict)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_services.json")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-cost-s", type=float, default=0.025, help="oracle sleep per tree level")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from specmesh.drafters import OracleDrafter
    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.runtime import encode_prompt, load_target
    from specmesh.sampling import SamplingParams
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

    n = args.max_tokens
    model, tok = load_target(None)
    prompts = PROMPTS[:1] if args.quick else PROMPTS
    stop = StopConditions(n)
    cases = []
    for text in prompts:
        ids = encode_prompt(tok, text, chat=True)
        cases.append((ids, generate(model, ids, SamplingParams(), stop).token_ids))
    ref = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump([ids + out for ids, out in cases], ref)
    ref.close()

    cost = str(args.draft_cost_s)
    procs = {
        "ngram": start("drafter_service", "--drafter", "ngram", "--threads", "1"),
        "o6": start("drafter_service", "--drafter", "oracle:0.6", "--oracle-reference", ref.name, "--draft-cost-s", cost),
        "o8": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref.name, "--draft-cost-s", cost),
        "o8c": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref.name),
        "tp1": start("verifier_service", "--threads", "1", "--draft-deadline-s", "10"),
    }
    if not args.quick:
        procs["tp2"] = start("verifier_service", "--tp", "2", "--threads", "1", "--draft-deadline-s", "10")
    try:
        configs = [Config("in-process none", "inproc"), Config("in-process oracle 0.8 cost-free", "inproc", "o8c"),
                   Config("in-process oracle 0.8 with draft cost", "inproc", "o8", alpha=0.8)]
        for where in [w for w in ("tp1", "tp2") if w in procs]:
            configs.append(Config(f"{where} autoregressive", where))
            drafters = [("ngram", None), ("o6", 0.6), ("o8", 0.8)] if where == "tp1" else [("o8", 0.8)]
            for d, a in drafters:
                for pipe in (False, True):
                    configs.append(Config(f"{where} {d} pipelining {'on' if pipe else 'off'}", where, d, pipe, a))
            if where == "tp1":
                configs.append(Config("tp1 oracle 0.8 cost-free pipelining off", "tp1", "o8c", False))

        def run_inproc(c: Config, ids: list[int], expected: list[int], seed: int) -> None:
            drafter = None
            if c.drafter != "none":
                alpha = 0.8
                drafter = OracleDrafter(ids + expected, alpha, model.config.vocab_size, seed=seed,
                                        draft_cost_s=args.draft_cost_s if c.drafter == "o8" else 0.0)
            res = generate(model, ids, SamplingParams(), stop, drafter, SpecConfig(DEPTH, DEPTH))
            s = res.stats
            c.tokens += s.new_tokens
            c.seconds += s.total_s
            c.steps += s.steps
            c.idle_s += s.draft_s
            c.identical &= res.token_ids == expected

        def run_remote(c: Config, ids: list[int], expected: list[int]) -> None:
            stub = verifier_pb2_grpc.VerifierStub(grpc.insecure_channel(procs[c.where].address))
            spec = verifier_pb2.SpeculationOptions(disabled=c.drafter == "none", budget=DEPTH, depth=DEPTH,
                                                   no_pipelining=not c.pipelined)
            req = verifier_pb2.GenerateRequest(max_tokens=n, ignore_eos=True, speculation=spec,
                                               drafter_address=procs[c.drafter].address if c.drafter != "none" else "")
            req.token_ids.ids.extend(ids)
            out, t = [], time.perf_counter()
            for r in stub.Generate(req, timeout=600):
                if r.HasField("chunk"):
                    out.extend(r.chunk.token_ids)
                else:
                    sp = r.complete.speculation
            c.seconds += time.perf_counter() - t
            c.tokens += len(out)
            c.steps += sp.steps
            c.idle_s += sp.draft_s
            c.hits += sp.predraft_hits
            c.identical &= out == expected

        for pi, (ids, expected) in enumerate(cases):
            for c in configs:
                run_inproc(c, ids, expected, pi) if c.where == "inproc" else run_remote(c, ids, expected)
            print(f"prompt {pi + 1}/{len(cases)} done", file=sys.stderr)
    finally:
        for p in procs.values():
            p.stop()

    results = summarise(configs, args.draft_cost_s)
    meta = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "max_tokens": n, "depth": DEPTH,
            "prompts": len(cases), "draft_cost_s_per_level": args.draft_cost_s,
            "threads": "1 torch thread per process (verifier rank, drafter, in-process engine)",
            "note": "chains (budget = depth = 4); EOS ignored; ratios from one run, interleaved per prompt"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(format_table(meta, results))
    return 0


def summarise(configs: list[Config], cost_s: float) -> list[dict]:
    by = {c.name: c for c in configs}
    step_s = by["in-process none"].seconds / by["in-process none"].steps  # one target step
    out = []
    for c in configs:
        tps = c.tokens / c.seconds
        base = by["in-process none"] if c.where == "inproc" else by[f"{c.where} autoregressive"]
        d = {"name": c.name, "tokens_per_s": round(tps, 2), "speedup_vs_autoregressive":
             round(tps / (base.tokens / base.seconds), 3), "identical_to_target": c.identical,
             "steps": c.steps, "tokens_per_step": round(c.tokens / c.steps, 3),
             "verify_idle_fraction": round(c.idle_s / c.seconds, 3),
             "predraft_hit_rate": round(c.hits / c.steps, 3) if c.where != "inproc" else None}
        if c.alpha is not None:
            e = expected_tokens_per_step(c.alpha, DEPTH)
            gc = DEPTH * cost_s / step_s  # draft cost of a chain relative to one target step
            d |= {"E": round(e, 3), "gamma_c": round(gc, 3), "sequential_bound": round(e / (1 + gc), 3),
                  "pipelined_bound": round(e / max(1.0, gc), 3)}
        out.append(d)
    free_in, free_remote = by["in-process oracle 0.8 cost-free"], by.get("tp1 oracle 0.8 cost-free pipelining off")
    if free_remote is not None:
        overhead = (free_remote.seconds / free_remote.steps) - (free_in.seconds / free_in.steps)
        out.append({"name": "per-step gRPC overhead (s)", "value": round(overhead, 4),
                    "relative_to_target_step": round(overhead / step_s, 3)})
    return out


def format_table(meta: dict, results: list[dict]) -> str:
    lines = [f"commit {meta['commit']} · {meta['prompts']} prompts x {meta['max_tokens']} tokens · chains of "
             f"{meta['depth']} · oracle draft cost {meta['draft_cost_s_per_level']}s/level · {meta['threads']}",
             "| configuration | tok/s | speedup vs AR | tokens/step | idle fraction | predraft hits | seq. bound | "
             "pipelined bound | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for d in results:
        if "value" in d:
            lines.append(f"| {d['name']} | {d['value']} ({d['relative_to_target_step']:.0%} of a target step) "
                         "| | | | | | | |")
            continue
        hit = "–" if d["predraft_hit_rate"] is None else f"{d['predraft_hit_rate']:.0%}"
        lines.append(f"| {d['name']} | {d['tokens_per_s']:.1f} | {d['speedup_vs_autoregressive']:.2f}x | "
                     f"{d['tokens_per_step']:.2f} | {d['verify_idle_fraction']:.0%} | {hit} | "
                     f"{d.get('sequential_bound', '–')} | {d.get('pipelined_bound', '–')} | {d['identical_to_target']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
