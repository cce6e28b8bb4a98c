"""GPU check of the services: verifier (TP=1, NCCL group of one rank) and drafters on a GPU, serving
a randomly initialised Llama (1B shapes by default), with the oracle drafter at alpha 0.8.

Builds the model folder (random weights, seed 0; a tokenizer copied from --tokenizer, only so the
verifier loads as it always does: the prompts are random token ids), computes the target's greedy
continuation of each prompt on the in-process engine (the reference every configuration must
reproduce, and what the oracle replays), measures its autoregressive step, then starts
`python -m verifier_service --device D --dtype T` and the drafter services and runs, interleaved
prompt by prompt (bench_services' runner): in-process and distributed autoregressive decoding;
oracle 0.8 cost-free and with a draft cost of `--cost-frac` target steps per level (chains of 4,
so a chain costs 4 x cost-frac of a target step: below verify cost), pipelining off and on; and a
model drafter (a random 2-layer Llama on the same device, `--drafter model:PATH --device D`): its
drafts are almost never accepted, so it checks that a GPU drafter's trees verify to the same
output, not speed. A second verifier runs with `--static-shapes on` (specmesh.static_steps: fixed
row buckets, CUDA graphs on a GPU) and its rows sit beside the dynamic verifier's; then both serve
1, 8 and 32 concurrent sessions (`--sessions`; oracle 0.8 cost-free; the static one batches them).
Output: JSON (bench_services' summary: tokens/s, speedup over the verifier's own autoregressive
decoding, idle fraction, predraft hits, DESIGN.md's bounds at the measured acceptance; the weight
bytes and, for a GPU of known bandwidth, each autoregressive row's share of the weight-read limit;
the concurrent rows) and markdown tables.

Runs on the CPU too (`--device cpu --preset tiny`: the test's configuration).

Usage: python -m loadtest.gpu_check [--device cuda] [--dtype float32] [--preset 1b] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from loadtest.bench_engine import _commit, run_concurrently
from loadtest.bench_services import (DEPTH, Config, format_table, reference_cases, run_all, run_remote, summarise,
                                     write_reference)
from specmesh.launch import start

# nominal HBM bandwidth (GB/s) of the GPUs this check is lent, by a part of their CUDA name
BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0}
# Llama 3.2 1B's shapes with SmolLM2's vocabulary (the tokenizer we carry): 1.07B parameters.
PRESETS = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
DRAFTER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def random_llama(folder: Path, shapes: dict, vocab_size: int, tokenizer: Path, seed: int, device: torch.device) -> int:
    """Write a Llama with random N(0, 0.02) weights (unit norms, tied embeddings) as an HF folder
    (bfloat16 safetensors, exact in every --dtype); returns its parameter count."""
    from safetensors.torch import save_file

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size, rms_norm_eps=1e-5,
               max_position_embeddings=4096, rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu",
               torch_dtype="bfloat16", **shapes)
    h, f, kv = shapes["hidden_size"], shapes["intermediate_size"], shapes["num_key_value_heads"]
    d = h // shapes["num_attention_heads"]
    gen = torch.Generator(device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()

    state = {"model.embed_tokens.weight": rand(vocab_size, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shapes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state |= {p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
                  p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, h),
                  p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
                  p + "mlp.down_proj.weight": rand(h, f),
                  p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                  p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for name in TOKENIZER_FILES:
        if (tokenizer / name).is_file():
            shutil.copy(tokenizer / name, folder / name)
    return sum(t.numel() for t in state.values())


def default_tokenizer() -> Path:
    """The bundled SmolLM2's tokenizer (its converted HF folder)."""
    from specmesh.loader import bundled_target_path, resolve_folder

    return resolve_folder(bundled_target_path())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--preset", default="1b", choices=tuple(PRESETS))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cost-frac", type=float, default=0.125,
                    help="oracle draft cost per tree level, in target autoregressive steps")
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.json (default: the bundled SmolLM2's)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--commit", default=None, help="the commit measured (default: git's, where there is one)")
    ap.add_argument("--work", default=None, help="folder for the model files (default: a temporary one)")
    ap.add_argument("--static-buckets", default="16",
                    help="row buckets of the static-shape verifier (verifier_service --static-shapes on)")
    ap.add_argument("--sessions", default="1,8,32",
                    help="concurrent sessions of the throughput rows (each a thread with its own Generate)")
    ap.add_argument("--compile", default="auto", choices=("auto", "on", "off"),
                    help="torch.compile the transformers peer's forward (auto: on a GPU, mode reduce-overhead)")
    ap.add_argument("--bandwidth-gbs", type=float, default=None,
                    help="the device's nominal memory bandwidth in GB/s, for the weight-read limit (default: "
                         "known GPUs by name, see BANDWIDTH_GBS)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from specmesh.device import parse_dtype, place, resolve_device
    from specmesh.engine import StopConditions
    from specmesh.loader import load_model

    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    levels = [int(n) for n in args.sessions.split(",")]
    tok = Path(args.tokenizer) if args.tokenizer else default_tokenizer()
    vocab = len(json.loads((tok / "tokenizer.json").read_text())["model"]["vocab"])
    work = Path(args.work or tempfile.mkdtemp(prefix="specmesh-gpu-check-"))
    t0 = time.perf_counter()
    params = random_llama(work / "target", PRESETS[args.preset], vocab, tok, 0, device)
    random_llama(work / "drafter", DRAFTER, vocab, tok, 1, device)
    print(f"random target ({params / 1e9:.2f}B parameters) and drafter written in {time.perf_counter() - t0:.0f} s",
          file=sys.stderr)

    model = place(load_model(work / "target", dtype), device)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())  # a tied head counted once
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    bandwidth = args.bandwidth_gbs or next((bw for key, bw in BANDWIDTH_GBS.items() if key in name), None)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    stop = StopConditions(args.max_tokens)
    reference_cases(model, prompts[:1], StopConditions(8))  # warm-up (CUDA context, kernels, allocator)
    t = time.perf_counter()
    cases = reference_cases(model, prompts, stop)
    step_s = (time.perf_counter() - t) / (len(cases) * args.max_tokens)  # with each prompt's prefill: an upper bound
    cost_s = args.cost_frac * step_s
    ref = write_reference(cases)
    print(f"reference: {len(cases)} x {args.max_tokens} tokens, {step_s * 1e3:.2f} ms per token; oracle draft cost "
          f"{cost_s * 1e3:.2f} ms per level", file=sys.stderr)

    dev_flags = ("--device", str(device), "--dtype", args.dtype, "--threads", str(args.threads))
    oracle = ("--oracle-reference", ref, "--vocab-size", str(vocab))
    procs = {}
    try:
        procs["o8c"] = start("drafter_service", "--drafter", "oracle:0.8", *oracle)
        procs["o8"] = start("drafter_service", "--drafter", "oracle:0.8", *oracle, "--draft-cost-s", str(cost_s))
        procs["model"] = start("drafter_service", "--drafter", f"model:{work / 'drafter'}", *dev_flags, timeout=600)
        drafters = ",".join(p.address for p in procs.values())
        procs["tp1"] = start("verifier_service", "--target", str(work / "target"), *dev_flags,
                             "--draft-deadline-s", "10", "--drafter-allow", drafters, timeout=600)
        procs["static"] = start("verifier_service", "--target", str(work / "target"), *dev_flags,
                                "--draft-deadline-s", "10", "--drafter-allow", drafters, "--static-shapes", "on",
                                "--static-buckets", args.static_buckets, "--max-sessions", str(max(levels)),
                                "--max-context-tokens", str(args.prompt_len + args.max_tokens + 16), timeout=600)
        configs = [Config("in-process none", "inproc"),
                   Config("in-process oracle 0.8 cost-free", "inproc", "o8c"),
                   Config("in-process oracle 0.8 with draft cost", "inproc", "o8", alpha=0.8, cost_s=cost_s),
                   Config("tp1 autoregressive", "tp1"),
                   # chains of DEPTH, the bounds' shape (only the predrafts are planned)
                   Config("tp1 oracle 0.8 cost-free pipelining off", "tp1", "o8c", False, 0.8, fixed=True),
                   Config("tp1 oracle 0.8 cost-free pipelining on", "tp1", "o8c", True, 0.8, fixed=True),
                   Config("tp1 o8 pipelining off", "tp1", "o8", False, 0.8, cost_s, fixed=True),
                   Config("tp1 o8 pipelining on", "tp1", "o8", True, 0.8, cost_s, fixed=True),
                   Config("tp1 model drafter (random, same device) pipelining on", "tp1", "model", True),
                   # the same verifier with fixed-shape steps (CUDA graphs on a GPU: specmesh.static_steps)
                   Config("static autoregressive", "static"),
                   Config("static o8 pipelining off", "static", "o8", False, 0.8, cost_s, fixed=True),
                   Config("static o8 pipelining on", "static", "o8", True, 0.8, cost_s, fixed=True)]
        addresses = {k: p.address for k, p in procs.items()}
        run_all(configs, cases, model, addresses, args.max_tokens)
        concurrent = [concurrent_row(where, n, cases, addresses, args.max_tokens)
                      for where in ("tp1", "static") for n in levels]
        compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
        peer = transformers_peer(work / "target", cases, device, dtype, args.max_tokens, compiled)
        verifier_line = next(line.strip() for line in procs["tp1"].lines if "listening on" in line)
        static_line = next(line.strip() for line in procs["static"].lines if "static shapes:" in line)
    finally:
        for p in procs.values():
            p.stop()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)

    results = summarise(configs)
    # batch-1 decoding reads every weight once a token: bytes / bandwidth bounds its rate
    limit = None if bandwidth is None else bandwidth * 1e9 / weight_bytes
    decode = {c.name: c.decode_rate() for c in configs}
    for r in results:
        if limit is not None and r["name"] in ("in-process none", "tp1 autoregressive", "static autoregressive"):
            tokens, seconds = decode[r["name"]]
            r["of_weight_read_limit"] = round(tokens / seconds / limit, 3)
    meta = {"commit": args.commit or _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": str(device),
            "device_name": name, "dtype": args.dtype, "torch": torch.__version__, "weight_bytes": weight_bytes,
            "bandwidth_gbs": bandwidth, "weight_read_limit_tok_s": None if limit is None else round(limit, 1),
            "static_verifier": static_line,
            "target": f"random Llama ({args.preset}: {PRESETS[args.preset]}, vocab {vocab}), {params / 1e9:.2f}B",
            "verifier": verifier_line, "prompts": len(cases), "prompt_len": args.prompt_len,
            "max_tokens": args.max_tokens, "depth": DEPTH, "draft_cost_s_per_level": round(cost_s, 5),
            "reference_step_s": round(step_s, 5),
            "threads": f"{args.threads} torch thread(s) per process",
            "note": "chains (budget = depth = 4); EOS ignored; random prompts; ratios from one run, interleaved per "
                    "prompt; o8 = oracle 0.8 with draft cost"}
    for r in concurrent:
        one = next(c for c in concurrent if c["verifier"] == r["verifier"] and c["sessions"] == min(levels))
        r["vs_fewest_sessions"] = round(r["tokens_per_s"] / one["tokens_per_s"], 2)
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results, "concurrent": concurrent, "peer": peer}, f, indent=1)
    print(format_table(meta, results))
    print("| verifier | sessions | tok/s (all sessions) | vs fewest sessions | identical |\n|---|---|---|---|---|\n"
          + "\n".join(f"| {r['verifier']} | {r['sessions']} | {r['tokens_per_s']:.1f} | {r['vs_fewest_sessions']:.2f}x "
                      f"| {r['identical_to_target']} |" for r in concurrent))
    print(f"{peer['name']}: {peer['tokens_per_s']:.1f} tok/s, token agreement with the references "
          f"{peer['token_agreement']:.3f}")
    ok = all(d.get("identical_to_target", True) for d in results + concurrent)
    return 0 if ok else 1


def transformers_peer(folder: Path, cases: list, device: torch.device, dtype, max_tokens: int,
                      compiled: bool) -> dict:
    """transformers' greedy `generate` of the same weights on the same device and dtype, with its
    static KV cache and, where `compiled`, its forward under `torch.compile(mode="reduce-overhead")`
    (CUDA graphs on a GPU): tokens/s over the cases after one warm-up generation (which compiles),
    and the share of tokens equal to the references (another runtime's kernels: near-ties may part)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    if compiled:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    kw = dict(do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, cache_implementation="static",
              pad_token_id=0)

    def run(ids: list[int]) -> list[int]:
        x = torch.tensor([ids], device=device)
        with torch.inference_mode():
            return hf.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(ids):].tolist()

    run(cases[0][0])
    t0 = time.perf_counter()
    outs = [run(ids) for ids, _ in cases]
    seconds = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    same = sum(a == b for o, (_, ref) in zip(outs, cases) for a, b in zip(o, ref))
    name = "transformers generate, static cache" + (", torch.compile reduce-overhead" if compiled else "")
    return {"name": name, "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
            "token_agreement": round(same / tokens, 4), "compiled": compiled}


def concurrent_row(where: str, n: int, cases: list, addresses: dict[str, str], max_tokens: int) -> dict:
    """Throughput of `n` sessions at once on verifier `where`, each a thread with one Generate of
    case i % len(cases) (oracle 0.8, cost-free, chains of DEPTH, pipelining off): all sessions'
    tokens over the wall time, and whether every output is its case's reference."""
    rows = [Config(f"{where} x{n}", where, "o8c", False, 0.8, fixed=True) for _ in range(n)]
    errors: list[str] = []

    def one(i: int) -> None:
        ids, expected = cases[i % len(cases)]
        try:
            run_remote(rows[i], addresses, ids, expected, max_tokens)
        except Exception as e:  # noqa: BLE001 - reported in the row, and the row fails
            rows[i].identical = False
            errors.append(repr(e))

    seconds = run_concurrently(n, one)
    tokens = sum(c.tokens for c in rows)
    return {"verifier": where, "sessions": n, "tokens": tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2), "identical_to_target": all(c.identical for c in rows),
            "errors": errors[:3]}


if __name__ == "__main__":
    sys.exit(main())
