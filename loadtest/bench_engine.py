"""In-process engine benchmark: specmesh vs transformers on the same model, prompts and machine.

Every configuration runs on every prompt, interleaved prompt by prompt (round robin), so that the
noise of a shared machine hits all of them alike; results are ratios measured in this one run.
Compared: transformers `generate` (plain greedy) and its prompt-lookup assisted generation;
specmesh `none` (plain decoding on our runtime), `ngram`, and `oracle` at alpha 0.6/0.8/0.9 with
a chain (budget = depth) and trees (budget 8 and 16). Every run generates exactly `max_tokens`
tokens (end-of-sequence ignored) so tokens/s compare like for like; greedy outputs of all specmesh
configurations are checked identical to `none`.

Theory (DESIGN.md): E = (1 - a^(g+1)) / (1 - a) tokens per step for a chain of g tokens at
per-token acceptance a; sequential speedup bound E / (1 + g c), c = draft/target cost per token.
We also report v = (time of one verification step) / (time of one plain decoding step): on a
CPU, verifying g+1 tokens is not free, so E / (v (1 + g c)) is the bound this hardware allows.

Usage: python -m loadtest.bench_engine [--quick] [--out FILE]   (also: specmesh bench engine)
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from specmesh import kernels
from specmesh.kernels import dispatch as _dispatch

PROMPTS = [
    "Explain in three sentences why the sky is blue.",
    "Write a Python function that checks whether a string is a palindrome, with a docstring.",
    "List the planets of the solar system in order, one line each, with one short fact.",
    "Repeat the following sentence exactly three times: The quick brown fox jumps over the lazy dog.",
    "Rewrite this code with descriptive variable names: def f(a, b):\n    c = a + b\n    d = c * 2\n    return d",
]
ALPHAS = (0.6, 0.8, 0.9)
DEPTH = 4


@dataclass
class Row:
    name: str
    kind: str  # hf | specmesh
    drafter: str = "none"
    budget: int = 0
    alpha: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    identical: bool = True


def add_stats(row: Row, s) -> None:
    """Accumulate one specmesh generation's `GenerationStats` into a configuration's row."""
    row.tokens += s.new_tokens
    row.seconds += s.total_s
    row.steps += s.steps
    row.drafted += s.drafted_tokens
    row.accepted += s.accepted_tokens
    row.draft_s += s.draft_s
    row.verify_s += s.verify_s


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    if alpha >= 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def _commit() -> str:
    """HEAD's short hash, with "+dirty" when tracked files differ from it (the code measured is not
    exactly that commit's)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], capture_output=True).returncode != 0
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def base_meta() -> dict:
    """What every benchmark records about its run: the code, when, the machine, threads, the kernel."""
    return {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "machine": platform.processor() or platform.machine(), "cpu": _dispatch.cpu_model(),
            "torch_threads": torch.get_num_threads(),
            "small_m_kernel": kernels.active() or kernels.reason(),
            "kernel_dispatch": kernels.describe()}  # per weight shape: kernel or torch, and the times (call after loading)


def add_markdown_flag(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--markdown", metavar="JSON", default=None, help="print the table of a saved result and exit")


def print_saved(path: str | None, format_table) -> bool:
    """--markdown: print the table of the result saved at `path` (True), or nothing when not given."""
    if not path:
        return False
    with open(path) as f:
        print(format_table(json.load(f)))
    return True


def run_concurrently(n: int, fn) -> float:
    """fn(0) .. fn(n - 1), each in a thread of its own (as a server runs sessions), all started
    together; the wall seconds until the last one ends."""
    import threading

    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def save(path: str, meta: dict, results: list[dict], table: str) -> None:
    """The JSON result file, then the README-ready table on stdout."""
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_engine.json")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the built-in prompts")
    ap.add_argument("--target", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: robust on shared machines)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from specmesh.engine import SpecConfig, StopConditions, generate
    from specmesh.loader import bundled_target_path, resolve_folder
    from specmesh.runtime import encode_prompt, load_target, make_drafter
    from specmesh.sampling import SamplingParams

    target_path = args.target or str(bundled_target_path())
    model, tok = load_target(target_path)
    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(target_path), dtype=torch.float32).eval()
    prompts = PROMPTS[:2] if args.quick else PROMPTS[: args.prompts]
    alphas = (0.8,) if args.quick else ALPHAS
    n = args.max_tokens
    stop = StopConditions(n)  # no stop ids: every run yields exactly n tokens
    greedy = SamplingParams()

    configs: list[Row] = [Row("transformers generate", "hf"), Row("transformers prompt-lookup", "hf", "pld", 4)]
    configs += [Row("specmesh none", "specmesh"), Row(f"specmesh ngram b{8}", "specmesh", "ngram", 8)]
    for a in alphas:
        for b in (DEPTH, 8, 16):
            shape = "chain" if b == DEPTH else f"tree b{b}"
            configs.append(Row(f"specmesh oracle a={a} {shape}", "specmesh", "oracle", b, a))

    def run_hf(row: Row, ids: list[int]) -> list[int]:
        x = torch.tensor([ids])
        kw = dict(do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=tok.eos_token_id)
        if row.drafter == "pld":
            kw["prompt_lookup_num_tokens"] = row.budget
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, **kw)[0, len(ids):].tolist()
        row.seconds += time.perf_counter() - t
        row.tokens += len(out)
        return out

    for pi, text in enumerate(prompts):
        ids = encode_prompt(tok, text, chat=True)
        base = generate(model, ids, greedy, stop)  # warm-up and the oracle's reference
        reference = ids + base.token_ids
        for row in configs:
            if row.kind == "hf":
                out = run_hf(row, ids)
                # HF masks EOS (min_new_tokens): compare up to where ours emits its first EOS
                b = base.token_ids
                cut = b.index(tok.eos_token_id) if tok.eos_token_id in b else len(b)
                row.identical &= out[:cut] == b[:cut]
                continue
            drafter = make_drafter(row.drafter, str(row.alpha), model, reference, seed=pi)
            spec = SpecConfig(row.budget or DEPTH, DEPTH, fixed=True)  # the row's shape, not planned
            res = generate(model, ids, greedy, stop, drafter, spec)
            add_stats(row, res.stats)
            row.identical &= res.token_ids == base.token_ids
        print(f"prompt {pi + 1}/{len(prompts)} done", file=sys.stderr)

    none = next(r for r in configs if r.name == "specmesh none")
    hf_plain = configs[0]
    step_s = none.verify_s / none.steps  # one plain decoding step on our runtime
    results = []
    for r in configs:
        tps = r.tokens / r.seconds
        d = {"name": r.name, "tokens": r.tokens, "seconds": round(r.seconds, 3), "tokens_per_s": round(tps, 2),
             "speedup_vs_specmesh_none": round(tps / (none.tokens / none.seconds), 3),
             "speedup_vs_transformers": round(tps / (hf_plain.tokens / hf_plain.seconds), 3)}
        d["identical_to_none"] = r.identical
        if r.kind == "specmesh" and r.drafter != "none":
            v = (r.verify_s / r.steps) / step_s
            c = (r.draft_s / max(r.drafted, 1)) / step_s
            d |= {"steps": r.steps,
                  "acceptance_rate": round(r.accepted / max(r.drafted, 1), 3),
                  "tokens_per_step": round(r.tokens / r.steps, 3), "verify_cost_v": round(v, 3),
                  "draft_cost_c": round(c, 4)}
            if r.alpha is not None:
                e = expected_tokens_per_step(r.alpha, DEPTH)
                seq = e / (1 + DEPTH * c)
                d |= {"alpha": r.alpha, "E_chain": round(e, 3), "sequential_bound": round(seq, 3),
                      "fraction_of_bound": round(d["speedup_vs_specmesh_none"] / seq, 3),
                      "hardware_bound": round(seq / v, 3)}
        results.append(d)

    meta = base_meta() | {"max_tokens": n, "depth": DEPTH, "prompts": len(prompts),
                          "target": target_path.split("/")[-1],
                          "note": "ratios from one run, configurations interleaved per prompt; EOS ignored"}
    save(args.out, meta, results, format_table(meta, results))
    return 0


def format_table(meta: dict, results: list[dict]) -> str:
    lines = [f"commit {meta['commit']} · {meta['prompts']} chat prompts x {meta['max_tokens']} tokens · "
             f"{meta['torch_threads']} torch threads · depth {meta['depth']}",
             "| configuration | tok/s | vs specmesh none | vs transformers | accept rate | tokens/step | "
             "seq. bound | of bound | verify cost v | identical |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for d in results:
        def g(k, fmt="{:.2f}"):
            return fmt.format(d[k]) if k in d else "–"
        lines.append(f"| {d['name']} | {g('tokens_per_s', '{:.1f}')} | {g('speedup_vs_specmesh_none')}x | "
                     f"{g('speedup_vs_transformers')}x | {g('acceptance_rate')} | {g('tokens_per_step')} | "
                     f"{g('sequential_bound')} | {g('fraction_of_bound', '{:.0%}')} | {g('verify_cost_v')} | "
                     f"{d.get('identical_to_none', '–')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
