"""Distributed benchmark: in-process engine vs drafter + verifier services (TP=1, TP=2), with
pipelining on and off, oracle drafters at alpha 0.6 / 0.8 with a configurable draft cost, and ngram.

One run, same prompts, every configuration interleaved prompt by prompt. Each service process gets
one torch thread (say so in the output: on 2 cores several processes with 2 threads each spin).
Reported per configuration: tokens/s, speedup over autoregressive decoding on the same verifier,
verifier idle fraction (time waiting for a tree / turn time), predraft hit rate, and, for the
oracles, the bounds of DESIGN.md for the measured acceptance: E' = measured tokens per step
(= (1 - a^(g+1)) / (1 - a) at the measured a; the oracle's nominal a gives E, reported as
`nominal_pipelined_bound`: a few dozen steps per configuration leave E' some way from E either
side), the draft cost ratio c (the oracle's draft cost per level / that verifier's
autoregressive step): sequential E' / (1 + g c), pipelined E' / max(1, g c); and the same with
the verification's measured cost ("hw"): v = verification time per step / that verifier's
autoregressive step, sequential E' / (v + g c), pipelined E' / max(v, g c). "of bound" =
decode speedup / bound: the bounds are per decoding step, so they are held against the decode
phase, from the first streamed token to the last (the prefill, the same work in every
configuration, is left out; "speedup vs AR" is end to end, prefill included). The autoregressive
step that is the unit of c and v is a decode step too. Oracle drafters run at two draft costs: about a target step per chain
(--draft-cost-s) and well below it (--low-draft-cost-s).

The in-process oracle uses the drafter service's seed (0), so with pipelining off the in-process
engine and the services see the same draws, the same trees and the same number of steps: their
throughput ratio is the system's overhead, not the oracle's luck. The per-step gRPC overhead is
(distributed time - in-process time) / steps for that cost-free oracle, pipelining off.

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
    drafter: str = "none"      # none | ngram | o6 | o8 | o8l | o8w (row cost too) | o8c (oracle 0.8, cost-free)
    pipelined: bool = True
    alpha: float | None = None
    cost_s: float = 0.0        # the oracle's draft cost per tree level ...
    row_cost_s: float = 0.0    # ... and per row of a level, on top (a CPU-like drafter)
    budget: int = DEPTH        # the request's SpeculationOptions (0 = the server's default)
    depth: int = DEPTH
    fixed: bool = False        # the shape as given, not as a cap for the verifier's planner
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    idle_s: float = 0.0
    verify_s: float = 0.0
    hits: int = 0
    plain_steps: int = 0       # steps of plain runs the drafter's planner asked for (no tree)
    identical: bool = True
    decode_tokens: int = 0     # tokens after the first chunk ...
    decode_s: float = 0.0      # ... and the time from the first chunk to the last (no prefill)
    extra: dict = field(default_factory=dict)

    def decode_rate(self) -> tuple[int, float]:
        """(tokens, seconds) of the decode phase; the whole run where it was not timed apart."""
        return (self.decode_tokens, self.decode_s) if self.decode_s > 0 else (self.tokens, self.seconds)


def _timed(chunks, c: Config) -> list[int]:
    """Consume a stream of token-id chunks into `c`: all tokens and the whole time, and the decode
    phase apart (tokens after the first chunk, from its arrival to the last chunk's)."""
    t0 = time.perf_counter()
    arrivals = [(time.perf_counter(), ids) for ids in chunks if ids]
    return add_timed(c, t0, arrivals, time.perf_counter())


def add_timed(c: Config, t0: float, arrivals: list[tuple[float, list[int]]], end: float) -> list[int]:
    """Add one generation to `c` from when it started, its chunks' (arrival time, token ids) and when
    it ended (as `_timed` does, for callers that get chunks by callback); its token ids."""
    out = [t for _, ids in arrivals for t in ids]
    c.seconds += end - t0
    c.tokens += len(out)
    if arrivals and arrivals[-1][0] > arrivals[0][0]:
        c.decode_tokens += len(out) - len(arrivals[0][1])
        c.decode_s += arrivals[-1][0] - arrivals[0][0]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_services.json")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--draft-cost-s", type=float, default=0.025, help="oracle sleep per tree level")
    ap.add_argument("--low-draft-cost-s", type=float, default=0.01,
                    help="the second oracle draft cost (a chain well below a target step)")
    ap.add_argument("--row-draft-cost-s", type=float, default=0.004,
                    help="o8w: the low draft cost per level plus this per row of a level (width costs, as on a CPU)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)

    from specmesh.engine import StopConditions
    from specmesh.runtime import encode_prompt, load_target

    n = args.max_tokens
    model, tok = load_target(None)
    prompts = PROMPTS[:1] if args.quick else PROMPTS
    stop = StopConditions(n)
    cases = reference_cases(model, [encode_prompt(tok, text, chat=True) for text in prompts], stop)
    ref = write_reference(cases)

    cost, low = str(args.draft_cost_s), str(args.low_draft_cost_s)
    procs = {
        "ngram": start("drafter_service", "--drafter", "ngram", "--threads", "1"),
        "o6": start("drafter_service", "--drafter", "oracle:0.6", "--oracle-reference", ref, "--draft-cost-s", cost),
        "o8": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref, "--draft-cost-s", cost),
        "o8l": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref, "--draft-cost-s", low),
        "o8w": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref, "--draft-cost-s", low,
                     "--draft-row-cost-s", str(args.row_draft_cost_s)),
        "o8c": start("drafter_service", "--drafter", "oracle:0.8", "--oracle-reference", ref),
    }
    # requests name their drafter (drafter_address): the verifiers may dial these, nothing else
    allow = ("--drafter-allow", ",".join(p.address for p in procs.values()))
    procs["tp1"] = start("verifier_service", "--threads", "1", "--draft-deadline-s", "10", *allow)
    if not args.quick:
        procs["tp2"] = start("verifier_service", "--tp", "2", "--threads", "1", "--draft-deadline-s", "10", *allow)
    try:
        configs = [Config("in-process none", "inproc"), Config("in-process oracle 0.8 cost-free", "inproc", "o8c"),
                   Config("in-process oracle 0.8 with draft cost", "inproc", "o8", alpha=0.8, cost_s=args.draft_cost_s)]
        costs = {"o6": args.draft_cost_s, "o8": args.draft_cost_s, "o8l": args.low_draft_cost_s,
                 "o8w": args.low_draft_cost_s}
        rows = {"o8w": args.row_draft_cost_s}
        for where in [w for w in ("tp1", "tp2") if w in procs]:
            configs.append(Config(f"{where} autoregressive", where))
            drafters = ([("ngram", None), ("o6", 0.6), ("o8", 0.8), ("o8l", 0.8), ("o8w", 0.8)] if where == "tp1"
                        else [("o8", 0.8)])
            for d, a in drafters:
                for pipe in (False, True):  # chains of DEPTH (the bounds' shape); the predrafts planned
                    configs.append(Config(f"{where} {d} pipelining {'on' if pipe else 'off'}", where, d, pipe, a,
                                          costs.get(d, 0.0), rows.get(d, 0.0), fixed=True))
            if where == "tp1":
                for pipe in (False, True):  # the planner's own shapes within 8 nodes / depth 4: no chain bound
                    configs.append(Config(f"tp1 o8w planned pipelining {'on' if pipe else 'off'}", "tp1", "o8w", pipe,
                                          budget=8, depth=DEPTH))
                configs.append(Config("tp1 oracle 0.8 cost-free pipelining off", "tp1", "o8c", False, fixed=True))
        run_all(configs, cases, model, {k: p.address for k, p in procs.items()}, n)
    finally:
        for p in procs.values():
            p.stop()

    results = summarise(configs)
    meta = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "max_tokens": n, "depth": DEPTH,
            "prompts": len(cases), "draft_cost_s_per_level": args.draft_cost_s,
            "low_draft_cost_s_per_level": args.low_draft_cost_s, "row_draft_cost_s_per_row": args.row_draft_cost_s,
            "threads": "1 torch thread per process (verifier rank, drafter, in-process engine)",
            "note": "chains (budget = depth = 4); EOS ignored; ratios from one run, interleaved per prompt"}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(format_table(meta, results))
    return 0


def reference_cases(model, prompts: list[list[int]], stop) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, the target's greedy continuation) per prompt: what every configuration must
    reproduce, and what the oracle drafters replay."""
    from specmesh.engine import generate
    from specmesh.sampling import SamplingParams

    return [(ids, generate(model, ids, SamplingParams(), stop).token_ids) for ids in prompts]


def write_reference(cases: list[tuple[list[int], list[int]]]) -> str:
    """The oracle drafter service's --oracle-reference file (prompt + continuation per case)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as ref:
        json.dump([ids + out for ids, out in cases], ref)
    return ref.name


def run_all(configs: list[Config], cases: list[tuple[list[int], list[int]]], model, address: dict[str, str],
            max_tokens: int) -> None:
    """Every configuration on every case, interleaved case by case. `model`: the in-process
    engine's target; `address`: service name (a Config's `where` or `drafter`) -> host:port."""
    for pi, (ids, expected) in enumerate(cases):
        for c in configs:
            if c.where == "inproc":
                run_inproc(c, model, ids, expected, max_tokens)
            else:
                run_remote(c, address, ids, expected, max_tokens)
        print(f"prompt {pi + 1}/{len(cases)} done", file=sys.stderr)


def run_inproc(c: Config, model, ids: list[int], expected: list[int], max_tokens: int) -> None:
    """One generation on the in-process engine, added to `c`. The oracle uses seed 0, the drafter
    service's, so it draws what the service's oracle draws."""
    from specmesh.drafters import OracleDrafter
    from specmesh.engine import SpecConfig

    drafter = None
    if c.drafter != "none":
        drafter = OracleDrafter(ids + expected, 0.8, model.config.vocab_size, seed=0, draft_cost_s=c.cost_s)
    generate_inproc(c, model, ids, expected, max_tokens, drafter, SpecConfig(DEPTH, DEPTH, fixed=True))


def generate_inproc(c: Config, model, ids: list[int], expected: list[int] | None, max_tokens: int, drafter,
                    spec, params=None, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """One streamed generation on the in-process engine (greedy unless `params`), timed and added
    to `c` (the engine's draft time counts as idle); its new token ids. `expected` None: no check."""
    from specmesh.engine import GenerationResult, StopConditions, generate_stream
    from specmesh.sampling import SamplingParams

    res = GenerationResult()
    out = _timed(generate_stream(model, ids, params or SamplingParams(), StopConditions(max_tokens, stop_ids),
                                 drafter, spec, result=res), c)
    s = res.stats
    c.steps += s.steps
    c.idle_s += s.draft_s
    c.verify_s += s.verify_s
    if expected is not None:
        c.identical &= out == expected == res.token_ids
    return out


def run_remote(c: Config, address: dict[str, str], ids: list[int], expected: list[int] | None, max_tokens: int,
               params=None, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """One Generate on the verifier `c.where` with drafter `c.drafter` (the shape `c` asks for:
    chains of DEPTH by default), greedy unless `params`, stopping at `stop_ids` only (the server's
    EOS ignored); added to `c`; its new token ids. `expected` None: no identity check."""
    from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

    with grpc.insecure_channel(address[c.where]) as channel:
        stub = verifier_pb2_grpc.VerifierStub(channel)
        spec = verifier_pb2.SpeculationOptions(disabled=c.drafter == "none", budget=c.budget, depth=c.depth,
                                               no_pipelining=not c.pipelined)
        if c.fixed:
            spec.fixed = True
        req = verifier_pb2.GenerateRequest(max_tokens=max_tokens, ignore_eos=True, speculation=spec,
                                           drafter_address=address[c.drafter] if c.drafter != "none" else "")
        req.token_ids.ids.extend(ids)
        req.stop_token_ids.extend(sorted(stop_ids))
        if params is not None:
            req.sampling.temperature, req.sampling.top_p, req.sampling.top_k = (params.temperature, params.top_p,
                                                                                params.top_k)
            if params.seed is not None:
                req.sampling.seed = params.seed
        done = []

        def chunks():
            for r in stub.Generate(req, timeout=600):
                if r.HasField("chunk"):
                    yield list(r.chunk.token_ids)
                else:
                    done.append(r.complete.speculation)

        out = _timed(chunks(), c)
    sp = done[0]
    c.steps += sp.steps
    c.idle_s += sp.draft_s
    c.verify_s += sp.verify_s
    c.hits += sp.predraft_hits
    c.plain_steps += sp.plain_steps
    if expected is not None:
        c.identical &= out == expected
    return out


def summarise(configs: list[Config]) -> list[dict]:
    """Per-configuration results (see the module docstring for the bounds), then the per-step
    gRPC overhead. Each verifier's own autoregressive step is its unit: a TP=2 step over gloo on
    one machine is slower than an in-process one, so the same oracle costs less of it."""
    by = {c.name: c for c in configs}
    out = []
    for c in configs:
        tps = c.tokens / c.seconds
        base = by["in-process none"] if c.where == "inproc" else by[f"{c.where} autoregressive"]
        (dt, ds), (bt, bs) = c.decode_rate(), base.decode_rate()
        step_s = bs / bt  # one autoregressive decode step of this verifier
        speedup = tps / (base.tokens / base.seconds)
        decode_speedup = (dt / ds) / (bt / bs)
        d = {"name": c.name, "tokens_per_s": round(tps, 2), "speedup_vs_autoregressive": round(speedup, 3),
             "decode_speedup_vs_autoregressive": round(decode_speedup, 3),
             "identical_to_target": c.identical, "steps": c.steps, "tokens_per_step": round(c.tokens / c.steps, 3),
             "verify_idle_fraction": round(c.idle_s / c.seconds, 3),
             "verify_cost": round(c.verify_s / c.steps / step_s, 3),
             "predraft_hit_rate": round(c.hits / c.steps, 3) if c.where != "inproc" else None}
        if c.alpha is not None:
            e, e_run, v = expected_tokens_per_step(c.alpha, DEPTH), c.tokens / c.steps, c.verify_s / c.steps / step_s
            gc = DEPTH * (c.cost_s + c.row_cost_s) / step_s  # draft cost of a chain relative to one target step
            bounds = {"sequential_bound": e_run / (1 + gc), "pipelined_bound": e_run / max(1.0, gc),
                      "nominal_pipelined_bound": e / max(1.0, gc),
                      "hw_sequential_bound": e_run / (v + gc), "hw_pipelined_bound": e_run / max(v, gc)}
            d |= {"E": round(e, 3), "E_measured": round(e_run, 3), "draft_cost_s_per_level": c.cost_s,
                  "gamma_c": round(gc, 3)}
            for k, b in bounds.items():  # per-step bounds: against the decode phase's speedup
                d[k] = round(b, 3)
                d["of_" + k] = round(decode_speedup / b, 3)
        out.append(d)
    free_in, free_remote = by["in-process oracle 0.8 cost-free"], by.get("tp1 oracle 0.8 cost-free pipelining off")
    if free_remote is not None:
        step_s = by["in-process none"].seconds / by["in-process none"].steps
        overhead = (free_remote.seconds / free_remote.steps) - (free_in.seconds / free_in.steps)
        out.append({"name": "per-step gRPC overhead (s)", "value": round(overhead, 4),
                    "relative_to_target_step": round(overhead / step_s, 3),
                    "tp1_vs_in_process_throughput": round((free_remote.tokens / free_remote.seconds)
                                                          / (free_in.tokens / free_in.seconds), 3),
                    "same_steps": free_remote.steps == free_in.steps})
    return out


def format_table(meta: dict, results: list[dict]) -> str:
    low = meta.get("low_draft_cost_s_per_level")
    row = meta.get("row_draft_cost_s_per_row")
    costs = (f"{meta['draft_cost_s_per_level']}s/level (o6, o8) and {low}s/level (o8l)"
             if isinstance(low, (int, float)) else f"{meta['draft_cost_s_per_level']}s/level (o8)")
    if isinstance(row, (int, float)):
        costs += f", {low}s/level + {row}s/row (o8w)"
    lines = [f"commit {meta['commit']} · {meta['prompts']} prompts x {meta['max_tokens']} tokens · chains of "
             f"{meta['depth']} · oracle draft cost {costs} · {meta['threads']}",
             "| configuration | tok/s | speedup vs AR | decode speedup | tokens/step E' | verify cost v | idle fraction "
             "| predraft hits | γc | seq. bound E'/(1+γc) | pipelined bound E'/max(1,γc) (of) "
             "| hw pipelined bound E'/max(v,γc) (of) | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for d in results:
        if "value" in d:
            lines.append(f"| {d['name']} | {d['value']} ({d['relative_to_target_step']:.0%} of a target step; "
                         f"TP=1 / in-process throughput {d['tp1_vs_in_process_throughput']:.2f}, same steps: "
                         f"{d['same_steps']}) | | | | | | | | | | | |")
            continue
        hit = "–" if d["predraft_hit_rate"] is None else f"{d['predraft_hit_rate']:.0%}"
        if "E" in d:
            bounds = (f"{d['gamma_c']:.2f} | {d['sequential_bound']:.2f} | {d['pipelined_bound']:.2f} "
                      f"({d['of_pipelined_bound']:.0%}) | {d['hw_pipelined_bound']:.2f} ({d['of_hw_pipelined_bound']:.0%})")
        else:
            bounds = "– | – | – | –"
        dec = d.get("decode_speedup_vs_autoregressive")
        lines.append(f"| {d['name']} | {d['tokens_per_s']:.1f} | {d['speedup_vs_autoregressive']:.2f}x | "
                     f"{'–' if dec is None else f'{dec:.2f}x'} | {d['tokens_per_step']:.2f} | {d['verify_cost']:.2f} | {d['verify_idle_fraction']:.0%} | {hit} | "
                     f"{bounds} | {d['identical_to_target']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
