"""Batched verification across sessions (specmesh.batching) vs one forward per session.

What the verifier does at --tp 1, in one process: N sessions, each in its own thread (as the gRPC
server runs them), generate with speculation (oracle drafter, alpha 0.8, chains of 4, cost-free,
so the comparison is about verification) against (a) the plain model — concurrent forwards, one
per session, the verifier with --no-batching — and (b) `BatchingTarget` — the default. For N = 1,
2, 4 sessions; every (N, mode) pair runs back to back, repeated `--reps` times interleaved, so
a shared machine's noise hits both alike. Reported: aggregate tokens/s, the ratio batched /
unbatched, rows per forward, and whether every session's greedy output equals its sequential
reference (it must). torch uses `--threads` intra-op threads (default 1, as the verifier).
`--tp N`: the target is a TP group of N ranks (verifier_service.tp_group, gloo on 127.0.0.1,
`--threads` per rank) and the batches are its BATCH ops; the references are the group's own.

Usage: python -m loadtest.bench_batching [--sessions 1,2,4] [--max-tokens 32] [--tp N] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

from loadtest.bench_engine import PROMPTS, base_meta, run_concurrently, save

ALPHA, DEPTH = 0.8, 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="1,2,4")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default="bench_batching.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specmesh.batching import BatchingTarget
    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.runtime import encode_prompt, load_target, make_drafter
    from specmesh.sampling import SamplingParams

    model, tok = load_target(None)
    group = None
    if args.tp > 1:
        from specmesh.loader import bundled_target_path
        from verifier_service.tp_group import start_tp

        group = start_tp(bundled_target_path(), args.tp, threads_per_rank=args.threads)
    target_model = group or model
    levels = [int(x) for x in args.sessions.split(",")]
    prompts = [encode_prompt(tok, PROMPTS[i % len(PROMPTS)], chat=True) for i in range(max(levels))]
    stop, greedy, spec = StopConditions(args.max_tokens), SamplingParams(), SpecConfig(budget=DEPTH, depth=DEPTH, fixed=True)
    refs = [generate(target_model, p, greedy, stop).token_ids for p in prompts]  # warm-up and references

    def run(target, n: int) -> tuple[float, int, bool]:
        outs: list = [None] * n

        def one(i: int) -> None:
            drafter = make_drafter("oracle", str(ALPHA), model, prompts[i] + refs[i], seed=i)
            outs[i] = generate(target, prompts[i], greedy, stop, drafter=drafter, spec=spec).token_ids

        seconds = run_concurrently(n, one)
        return seconds, sum(len(o) for o in outs), all(o == refs[i] for i, o in enumerate(outs))

    rows: dict[tuple[int, str], dict] = {}
    for _ in range(args.reps):
        for n in levels:
            for mode in ("unbatched", "batched"):
                target = BatchingTarget(target_model) if mode == "batched" else target_model
                seconds, tokens, same = run(target, n)
                r = rows.setdefault((n, mode), {"sessions": n, "mode": mode, "seconds": 0.0, "tokens": 0,
                                                "identical": True, "forwards": 0, "segments": 0})
                r["seconds"] += seconds
                r["tokens"] += tokens
                r["identical"] &= same
                if mode == "batched":
                    r["forwards"] += target.stats.forwards
                    r["segments"] += target.stats.segments
    if group is not None:
        group.shutdown()
    results = []
    for (n, mode), r in rows.items():
        r["tokens_per_s"] = round(r["tokens"] / r["seconds"], 2)
        if mode == "batched":
            r["sessions_per_forward"] = round(r["segments"] / max(r["forwards"], 1), 2)
            r["speedup_vs_unbatched"] = round(r["tokens_per_s"] / rows[(n, "unbatched")]["tokens_per_s"], 3)
        r["seconds"] = round(r["seconds"], 3)
        results.append(r)
    meta = base_meta() | {"max_tokens": args.max_tokens, "reps": args.reps, "tp": args.tp,
                          "drafter": f"oracle alpha {ALPHA}, chains of {DEPTH}, cost-free",
                          "compared": "N sessions in N threads: BatchingTarget vs one forward per session "
                                      "(same process)"}
    save(args.out, meta, results, format_table(meta, results))
    return 0


def format_table(meta: dict, results: list[dict]) -> str:
    lines = [f"commit {meta['commit']} · {meta.get('cpu', '?')} · {meta['max_tokens']} tokens per session x "
             f"{meta['reps']} reps · TP {meta.get('tp', 1)} · {meta['torch_threads']} torch thread(s) per rank · "
             f"{meta['drafter']}", "",
             "| sessions | mode | tok/s (all sessions) | vs unbatched | sessions per forward | identical |",
             "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['sessions']} | {r['mode']} | {r['tokens_per_s']} | "
                     f"{r.get('speedup_vs_unbatched', 1.0):.2f}x | {r.get('sessions_per_forward', '–')} | "
                     f"{r['identical']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
