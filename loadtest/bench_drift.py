"""How far each weight format's greedy output drifts from transformers' fp32 reference (issue 20).

specmesh is lossless against the target *as served*: speculation reproduces plain decoding in the
same format token for token (the tests). A quantized format serves other numerics than the fp32
checkpoint, so its greedy text may part from transformers' fp32 `generate` after some tokens. This
measures by how much, per format, on the same held-out chat prompts (`specmesh.distill.prompts`):

- identical: prompts whose N greedy tokens equal the reference's exactly;
- agreement: the tokens before the first difference, summed over prompts, over the reference's
  tokens (1.0 = identical everywhere);
- first difference: the median position of the first differing token among prompts that differ.

Formats: `float32` (specmesh's fp32 runtime on the dequantized weights), `int8`, `int4`, `gguf`
(the file's own blocks; only for a GGUF), and llama.cpp on the same GGUF (when llama-cpp-python
is installed) as the peer that serves these files. specmesh's rows run at 1 torch thread (as the
services do); transformers at the machine's threads.

    python -m loadtest.bench_drift                         # the bundled SmolLM2 (Q4_1 GGUF)
    python -m loadtest.bench_drift --pair qwen2.5-coder    # after `specmesh models install qwen2.5-coder`

Writes `loadtest/results/bench_drift[_<pair>].json`; `--markdown JSON` prints its table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from loadtest.bench_drafters import _load_shared, hf_generate, pick_prompts
from loadtest.bench_engine import add_markdown_flag, print_saved
from loadtest.bench_pairs import PAIRS, RESULTS, llama_binding, llama_chunks, machine_info

FORMATS = ("float32", "int8", "int4", "gguf")


def compare(ref: list[list[int]], got: list[list[int]]) -> dict:
    """identical prompts, common-prefix agreement and the first differing positions of `got` vs `ref`."""
    prefix, firsts = 0, []
    for r, g in zip(ref, got):
        n = next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), min(len(r), len(g)))
        prefix += n
        if r != g:
            firsts.append(n)
    total = sum(map(len, ref))
    return {"identical_prompts": len(ref) - len(firsts), "prompts": len(ref),
            "agreement": round(prefix / max(1, total), 3), "agree_tokens": prefix, "ref_tokens": total,
            "first_difference_median": statistics.median(firsts) if firsts else None}


def specmesh_greedy(model, prompts: list[list[int]], n: int, stop: frozenset[int]) -> tuple[list[list[int]], float]:
    from specmesh.engine import StopConditions, generate
    from specmesh.sampling import SamplingParams

    outs, t = [], time.perf_counter()
    for ids in prompts:
        outs.append(generate(model, ids, SamplingParams(), StopConditions(n, stop)).token_ids)
    return outs, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest.bench_drift", description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=PAIRS, default="smollm2", help="whose target: the bundled SmolLM2 or the Qwen 1.5B")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=None)
    add_markdown_flag(ap)
    args = ap.parse_args(argv)
    if print_saved(args.markdown, format_table):
        return 0
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    if bad := set(formats) - set(FORMATS):
        ap.error(f"--formats: unknown {sorted(bad)}")
    from specmesh.device import DTYPES
    from specmesh.loader import bundled_target_path, load_model, load_tokenizer
    from specmesh.modelsets import model_path
    from specmesh.runtime import encode_prompt

    path = str(bundled_target_path() if args.pair == "smollm2" else model_path(args.pair, "target"))
    tok = load_tokenizer(path)
    prompts = [encode_prompt(tok, t, chat=True) for t in pick_prompts(args.pair, args.prompts)]
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    _, hf = _load_shared(path)
    eos = hf.generation_config.eos_token_id
    stop = frozenset([tok.eos_token_id] + (eos if isinstance(eos, list) else [eos])) - {None}
    t = time.perf_counter()
    ref = [hf_generate(hf, ids, args.max_tokens, stop)[0] for ids in prompts]
    rows = [{"runtime": f"transformers fp32 generate ({threads} threads): the reference", "seconds": round(time.perf_counter() - t, 1),
             **compare(ref, ref)}]
    del hf
    torch.set_num_threads(1)
    for fmt in formats:
        if fmt == "gguf" and not path.endswith(".gguf"):
            continue
        model = load_model(path, DTYPES[fmt])
        card = model.weight_format.describe() if getattr(model, "weight_format", None) else fmt
        outs, secs = specmesh_greedy(model, prompts, args.max_tokens, stop)
        rows.append({"runtime": f"specmesh {card} (1 thread)", "format": fmt, "seconds": round(secs, 1), **compare(ref, outs)})
        print(f"bench_drift: {rows[-1]}", file=sys.stderr, flush=True)
        del model
    binding, why = llama_binding()
    if binding is None or not path.endswith(".gguf"):
        rows.append({"runtime": "llama.cpp", "status": why or "not a GGUF"})
    else:
        llm = binding(path, 1, False, max(map(len, prompts)) + args.max_tokens + 64)
        t = time.perf_counter()
        outs = [[i for chunk in llama_chunks(llm, ids, args.max_tokens, stop) for i in chunk] for ids in prompts]
        rows.append({"runtime": "llama.cpp, the same GGUF (1 thread)", "seconds": round(time.perf_counter() - t, 1),
                     **compare(ref, outs)})
    report = {"meta": {**machine_info(), "commit": machine_info()["commit_full"][:7], "pair": args.pair,
                       "target": Path(path).name, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                       "compared": "each runtime's greedy tokens against transformers fp32 generate on the same prompts"},
              "rows": rows}
    out = Path(args.out or RESULTS / f"bench_drift{'' if args.pair == 'smollm2' else '_' + args.pair}.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    return 0


def format_table(report: dict) -> str:
    m = report["meta"]
    lines = [f"commit {m['commit']} · {m['cpu_model']} · {m['target']} · {m['num_prompts']} held-out chat prompts x "
             f"{m['max_tokens']} greedy tokens, against transformers fp32 `generate`",
             "",
             "| runtime | identical prompts | token agreement (common prefix) | median first difference |",
             "|---|---|---|---|"]
    for r in report["rows"]:
        if "status" in r:
            lines.append(f"| {r['runtime']} | {r['status']} | | |")
            continue
        first = "–" if r["first_difference_median"] is None else f"token {r['first_difference_median']:g}"
        lines.append(f"| {r['runtime']} | {r['identical_prompts']}/{r['prompts']} | {r['agreement']:.0%} "
                     f"({r['agree_tokens']}/{r['ref_tokens']}) | {first} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
