"""Drafter benchmark: how well and how cheaply each drafter predicts a target, and what that buys.

On held-out chat prompts (`specmesh.distill.prompts`, split "heldout": topics the trained drafter
never saw), for every drafter:
1. **greedy per-token acceptance a**, teacher-forced on the target's own greedy continuation: the
   fraction of continuation positions where the drafter's argmax given the same prefix is the
   target's token (model drafters: one forward over prompt + continuation on our runtime). The
   ngram drafter has no argmax to ask, so its a is accepted / drafted of its engine chain run.
2. **tokens per verification step E** (accepted + the bonus token) through the in-process engine
   with a chain of `--depth` (4) and trees of budget 1/4/8/16 at depth clamp(budget // 2, 1, 6):
   a tree is wider than the chain of the same budget (budget 4 at depth 4 would be the chain again;
   budget 1 can only be a chain of one).
3. **draft cost c** = one drafter forward of one token on its own KV cache / one target forward of
   one token, both at the end of each prompt, timed interleaved (medians; same run, same threads).
4. **end-to-end tokens/s** vs `none` (plain decoding on the same runtime): every configuration on
   every prompt, round robin as in bench_engine.py, greedy outputs checked identical, generation
   stopping at EOS (all configurations produce the same tokens, so tokens/s compare like for like);
   against DESIGN.md's sequential bound E / (1 + g c), g = depth (a depth-D tree costs D draft
   forwards), and the hardware-aware one E / (v + g c), v = verify step time / decode step time
   (a step costs one verification, v decode steps, plus g drafter forwards, c each; with c = 0 it
   is bench_engine.py's E / (v (1 + g c)), which scales the draft cost by v as well).

Pair `qwen2.5-coder` (0.5B drafting for 1.5B) also runs transformers `generate` plain and with
`assistant_model=` (its own speculative decoding, default schedule) as the peer, in the same
round robin; our runtime shares the weights of those transformers models (no second copy).

Usage: python -m loadtest.bench_drafters [--pair smollm2|qwen2.5-coder] [--quick] [--out FILE]
       python -m loadtest.bench_drafters --markdown loadtest/results/bench_drafters.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loadtest.bench_engine import Row, add_markdown_flag, add_stats, base_meta, expected_tokens_per_step, print_saved
from specmesh.drafters.base import Drafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams

PAIRS = ("smollm2", "qwen2.5-coder")
RESULTS = Path(__file__).parent / "results"
MAX_TREE_DEPTH = 6


@dataclass(frozen=True)
class BenchConfig:
    max_tokens: int = 64
    depth: int = 4  # of the chain
    tree_budgets: tuple[int, ...] = (1, 4, 8, 16)
    cost_reps: int = 8  # timed one-token forwards per model and prompt
    stop_ids: frozenset[int] = frozenset()  # EOS; empty = always max_tokens
    warmup: bool = True


@dataclass
class Candidate:
    """A drafter under test; `model` is its network (None for ngram: no forward, no argmax)."""

    name: str
    drafter: Drafter
    model: Transformer | None = None


@dataclass
class Peer:
    """transformers models for the same pair: plain `generate`, and assisted by `draft`."""

    target: object
    draft: object | None = None


@dataclass
class ConfigRow(Row):
    depth: int = 0
    shape: str = ""
    identical_to_hf_plain: bool = True


@dataclass
class DrafterStats:
    matches: int = 0  # teacher-forced argmax hits
    positions: int = 0
    step_s: list[float] = field(default_factory=list)  # one-token forwards


def tree_depth(budget: int) -> int:
    return max(1, min(MAX_TREE_DEPTH, budget // 2))


def shapes(cfg: BenchConfig) -> list[tuple[str, SpecConfig]]:
    out = [("chain", SpecConfig(cfg.depth, cfg.depth, fixed=True))]
    return out + [(f"tree b{b}", SpecConfig(b, tree_depth(b), fixed=True)) for b in cfg.tree_budgets]


def teacher_forced_matches(draft: Transformer, prompt_ids: list[int], continuation: list[int],
                           target: Transformer) -> int:
    """Continuation positions where the drafter's argmax given the same prefix is the target's token.
    A feature drafter gets the target's features of that prefix (its first draft level: every
    earlier token's feature is the target's)."""
    if not continuation:
        return 0
    seq = list(prompt_ids) + list(continuation[:-1])
    n = len(seq)
    if draft.fc is None:
        logits = draft(torch.tensor(seq), torch.arange(n), draft.new_cache(n), 0,
                       logits_rows=slice(len(prompt_ids) - 1, None))  # [len(continuation), vocab]
    else:  # rows j = (f_j, seq[j + 1]) predict seq[j + 2]; the first wanted is the prompt's last row - 1
        _, feats = target(torch.tensor(seq), torch.arange(n), target.new_cache(n), 0, logits_rows=None, hidden=True)
        logits = draft(torch.tensor(seq[1:]), torch.arange(1, n), draft.new_cache(n), 0,
                       logits_rows=slice(len(prompt_ids) - 2, None), features=feats[:-1])
    return int((logits.argmax(-1) == torch.tensor(continuation)).sum())


def forward_step_seconds(models: list[Transformer], context: list[int], reps: int) -> list[list[float]]:
    """Seconds of a one-token forward (with its logits) at the end of `context`, per model and rep;
    models alternate rep by rep so that machine noise hits all of them alike."""
    prefix, at = context[:-1], len(context) - 1

    def feats(m: Transformer, rows: int) -> dict:  # a feature drafter's input (values do not matter here)
        return {} if m.fc is None else {"features": torch.randn(rows, m.config.hidden_size)}

    caches = []
    for m in models:
        cache = m.new_cache(len(context))
        if prefix:
            m(torch.tensor(prefix), torch.arange(at), cache, 0, logits_rows=None, **feats(m, at))
            cache.commit(list(range(at)))
        caches.append(cache)
    tok, pos = torch.tensor(context[-1:]), torch.tensor([at])
    times: list[list[float]] = [[] for _ in models]
    for _ in range(reps):
        for m, cache, ts in zip(models, caches, times):
            f = feats(m, 1)
            t = time.perf_counter()
            m(tok, pos, cache, at, logits_rows=slice(-1, None), **f)  # the same scratch slot each rep
            ts.append(time.perf_counter() - t)
    return times


def hf_generate(model, ids: list[int], max_tokens: int, stop_ids: frozenset[int],
                assistant=None) -> tuple[list[int], float]:
    """transformers greedy `generate` (assisted when `assistant` is given): new ids and seconds."""
    x = torch.tensor([ids])
    eos = sorted(stop_ids)
    kw = dict(do_sample=False, max_new_tokens=max_tokens, attention_mask=torch.ones_like(x),
              eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, **kw)[0, len(ids):].tolist()
    return out, time.perf_counter() - t


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def bench(target: Transformer, prompts: list[list[int]], candidates: list[Candidate], cfg: BenchConfig,
          peer: Peer | None = None, log: Callable[[str], None] = _log) -> dict:
    """Run every configuration on every prompt (round robin); return {"drafters", "results"}."""
    greedy = SamplingParams()
    by_name = {c.name: c for c in candidates}
    none = ConfigRow("specmesh none", "specmesh")
    rows = [none]
    if peer is not None:
        rows.append(ConfigRow("transformers generate", "hf"))
        if peer.draft is not None:
            rows.append(ConfigRow("transformers assisted", "hf", "assisted"))
    for c in candidates:
        for label, spec in shapes(cfg):
            rows.append(ConfigRow(f"specmesh {c.name} {label}", "specmesh", c.name, spec.budget,
                                  depth=spec.depth, shape=label))
    stats = {c.name: DrafterStats() for c in candidates}
    target_step_s: list[float] = []

    def run(row: ConfigRow, ids: list[int], max_tokens: int) -> list[int]:
        if row.kind == "hf":
            assistant = peer.draft if row.drafter == "assisted" else None
            out, secs = hf_generate(peer.target, ids, max_tokens, cfg.stop_ids, assistant)
            row.tokens, row.seconds = row.tokens + len(out), row.seconds + secs
            return out
        drafter = by_name[row.drafter].drafter if row.drafter != "none" else None
        res = generate(target, ids, greedy, StopConditions(max_tokens, cfg.stop_ids), drafter,
                       SpecConfig(row.budget or 1, row.depth or 1, fixed=True))
        add_stats(row, res.stats)
        return res.token_ids

    if cfg.warmup:  # first calls allocate and initialise kernels: keep that out of the timings
        for row in rows:
            run(ConfigRow(row.name, row.kind, row.drafter, row.budget, depth=row.depth), prompts[0], 4)
    for pi, ids in enumerate(prompts):
        # 1. end to end, round robin; `none` first: its output is the reference continuation
        ref = run(none, ids, cfg.max_tokens)
        hf_plain: list[int] | None = None
        for row in rows[1:]:
            out = run(row, ids, cfg.max_tokens)
            row.identical &= out == ref
            if row.kind == "hf":
                if row.drafter == "none":
                    hf_plain = out
                row.identical_to_hf_plain &= out == hf_plain
        # 2. teacher-forced acceptance on the reference, 3. one-token forward times at this prompt
        nets = [c for c in candidates if c.model is not None]
        for c in nets:
            stats[c.name].matches += teacher_forced_matches(c.model, ids, ref, target)
            stats[c.name].positions += len(ref)
        times = forward_step_seconds([target] + [c.model for c in nets], ids, cfg.cost_reps)
        target_step_s += times[0]
        for c, ts in zip(nets, times[1:]):
            stats[c.name].step_s += ts
        log(f"prompt {pi + 1}/{len(prompts)} done ({len(ids)} prompt tokens, {len(ref)} generated)")
    return summarize(rows, candidates, stats, target_step_s, cfg)


def summarize(rows: list[ConfigRow], candidates: list[Candidate], stats: dict[str, DrafterStats],
              target_step_s: list[float], cfg: BenchConfig) -> dict:
    none = rows[0]
    decode_s = none.verify_s / none.steps  # one plain decoding step in the engine
    target_fwd = statistics.median(target_step_s)
    hf_plain = next((r for r in rows if r.kind == "hf" and r.drafter == "none"), None)

    def tps(r: Row) -> float:
        return r.tokens / r.seconds

    drafters = []
    for c in candidates:
        st = stats[c.name]
        chain = next(r for r in rows if r.drafter == c.name and r.shape == "chain")
        d: dict = {"name": c.name}
        if c.model is not None:
            a = st.matches / max(st.positions, 1)
            draft_fwd = statistics.median(st.step_s)
            how = "teacher-forced argmax on the target's greedy continuation"
            if c.model.fc is not None:
                how += " (feature drafter: the target's features of every earlier token, i.e. its first draft level)"
            d |= {"greedy_acceptance": round(a, 4), "acceptance_method": how, "positions": st.positions, "draft_cost_c": round(draft_fwd / target_fwd, 4),
                  "c_method": "median one-token forward, drafter / target, interleaved",
                  "draft_step_ms": round(1e3 * draft_fwd, 3), "target_step_ms": round(1e3 * target_fwd, 3)}
        else:
            a = chain.accepted / max(chain.drafted, 1)
            d |= {"greedy_acceptance": round(a, 4), "acceptance_method": "engine chain run: accepted / drafted",
                  "positions": chain.drafted,
                  "draft_cost_c": round((chain.draft_s / max(chain.drafted, 1)) / decode_s, 4),
                  "c_method": "engine chain run: draft time per drafted token / plain decoding step"}
        d["E_chain_from_acceptance"] = round(expected_tokens_per_step(a, cfg.depth), 3)
        d["engine_chain_E"] = round(chain.tokens / max(chain.steps, 1), 3)  # measured, not modelled
        drafters.append(d)
    c_of = {d["name"]: d["draft_cost_c"] for d in drafters}

    results = []
    for r in rows:
        d = {"name": r.name, "kind": r.kind, "drafter": r.drafter, "tokens": r.tokens,
             "seconds": round(r.seconds, 3), "tokens_per_s": round(tps(r), 2),
             "speedup_vs_specmesh_none": round(tps(r) / tps(none), 3), "identical_to_none": r.identical}
        if hf_plain is not None:
            d["speedup_vs_hf_plain"] = round(tps(r) / tps(hf_plain), 3)
        if r.kind == "hf":
            d["identical_to_hf_plain"] = r.identical_to_hf_plain
        if r.kind == "specmesh" and r.drafter != "none":
            e = r.tokens / r.steps
            c = c_of[r.drafter]
            v = (r.verify_s / r.steps) / decode_s
            seq = e / (1 + r.depth * c)
            hw = e / (v + r.depth * c)
            d |= {"shape": r.shape, "budget": r.budget, "depth": r.depth, "steps": r.steps,
                  "tokens_per_step": round(e, 3), "acceptance_in_engine": round(r.accepted / max(r.drafted, 1), 3),
                  "draft_cost_c": c, "draft_per_step_over_decode": round((r.draft_s / r.steps) / decode_s, 3),
                  "verify_cost_v": round(v, 3), "sequential_bound": round(seq, 3),
                  "hardware_bound": round(hw, 3),
                  "fraction_of_bound": round(d["speedup_vs_specmesh_none"] / seq, 3),
                  "fraction_of_hardware_bound": round(d["speedup_vs_specmesh_none"] / hw, 3)}
        results.append(d)
    return {"drafters": drafters, "results": results}


def format_table(report: dict) -> str:
    """README-ready markdown: one line of meta, a drafter table and a configuration table."""
    meta = report["meta"]
    has_hf = any(d["kind"] == "hf" for d in report["results"])
    lines = [f"commit {meta['commit']} · pair {meta['pair']} · {meta['num_prompts']} held-out chat prompts x "
             f"{meta['max_tokens']} tokens (stop at EOS) · {meta['torch_threads']} torch threads · chain depth "
             f"{meta['depth']}, trees depth clamp(budget // 2, 1, {MAX_TREE_DEPTH})", "",
             "| drafter | greedy acceptance a | measured on | E chain from a | E chain measured | draft cost c |",
             "|---|---|---|---|---|---|"]
    for d in report["drafters"]:
        how = "teacher-forced" if d["acceptance_method"].startswith("teacher") else "engine chain"
        if "feature drafter" in d["acceptance_method"]:
            how += ", first level"
        measured = f"{d['engine_chain_E']:.2f}" if "engine_chain_E" in d else "–"
        lines.append(f"| {d['name']} | {d['greedy_acceptance']:.3f} | {how} ({d['positions']} tokens) | "
                     f"{d['E_chain_from_acceptance']:.2f} | {measured} | {d['draft_cost_c']:.3f} |")
    hf_col = " vs transformers |" if has_hf else ""
    lines += ["", f"| configuration | tok/s | vs specmesh none |{hf_col} tokens/step E | accept rate | seq. bound | "
              "hw bound | of hw bound | verify cost v | identical |",
              "|---|---|---|" + ("---|" if has_hf else "") + "---|---|---|---|---|---|---|"]
    for d in report["results"]:
        def g(k: str, fmt: str = "{:.2f}", d: dict = d) -> str:
            return fmt.format(d[k]) if k in d else "–"
        hf = f" {g('speedup_vs_hf_plain')}x |" if has_hf else ""
        ident = d["identical_to_none"] if d["kind"] == "specmesh" else \
            f"{d['identical_to_hf_plain']} (vs none {d['identical_to_none']})"
        lines.append(f"| {d['name']} | {g('tokens_per_s', '{:.1f}')} | {g('speedup_vs_specmesh_none')}x |{hf} "
                     f"{g('tokens_per_step')} | {g('acceptance_in_engine')} | {g('sequential_bound')} | "
                     f"{g('hardware_bound')} | {g('fraction_of_hardware_bound', '{:.0%}')} | {g('verify_cost_v')} | "
                     f"{ident} |")
    return "\n".join(lines)


def pick_prompts(pair: str, count: int) -> list[str]:
    """Held-out chat prompts; for the coder pair two code prompts, then one prose prompt, and so on."""
    from specmesh.distill.prompts import CODE_TEMPLATES, prompts

    held = prompts("heldout")
    if pair != "qwen2.5-coder":
        return held[:count]
    starts = tuple(t.split("{t}")[0] for t in CODE_TEMPLATES)
    code = iter([p for p in held if p.startswith(starts)])
    prose = iter([p for p in held if not p.startswith(starts)])
    return [next(prose if i % 3 == 2 else code) for i in range(count)]


def _load_shared(path: str):
    """(our Transformer, transformers model) over one set of fp32 weights."""
    from transformers import AutoModelForCausalLM

    from specmesh.loader import model_from_hf, resolve_folder

    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(path), dtype=torch.float32).eval()
    return model_from_hf(hf.config, hf.state_dict()), hf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", choices=PAIRS, default="smollm2")
    ap.add_argument("--drafters", default="ngram,model", help="comma list of: ngram, model")
    ap.add_argument("--drafter-dir", "--drafter-path", dest="drafter_path", default=None,
                    help="the model drafter (default: the pair's, specmesh.modelsets.model_path)")
    ap.add_argument("--extra-drafter", action="append", default=[], metavar="DIR",
                    help="another model drafter to compare in the same run (repeatable)")
    ap.add_argument("--target", default=None, help="the target (default: the pair's)")
    ap.add_argument("--prompts", type=int, default=None, help="held-out prompts (default 8; coder pair 3)")
    ap.add_argument("--max-tokens", type=int, default=None, help="per generation (default 64; coder pair 48)")
    ap.add_argument("--depth", type=int, default=4, help="chain depth")
    ap.add_argument("--tree-budgets", default=None, help="default 1,4,8,16 (coder pair: 8)")
    ap.add_argument("--cost-reps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    ap.add_argument("--no-hf", action="store_true", help="coder pair: skip the transformers peer")
    ap.add_argument("--quick", action="store_true", help="1 prompt x 16 tokens, chain and tree b8 only")
    ap.add_argument("--out", default=None)
    add_markdown_flag(ap)
    args = ap.parse_args(argv)
    if print_saved(args.markdown, format_table):
        return 0
    if args.cost_reps < 1 or args.depth < 1:
        ap.error("--cost-reps and --depth must be >= 1")
    torch.set_num_threads(args.threads)
    coder = args.pair == "qwen2.5-coder"
    kinds = [k.strip() for k in args.drafters.split(",") if k.strip()]
    if unknown := set(kinds) - {"ngram", "model"}:
        ap.error(f"--drafters: unknown {sorted(unknown)}")

    from specmesh.drafters.model import ModelDrafter
    from specmesh.drafters.ngram import NgramDrafter
    from specmesh.loader import load_model, load_tokenizer
    from specmesh.modelsets import model_path
    from specmesh.runtime import encode_prompt, make_drafter

    # 1. models: on the coder pair ours share their weights with the transformers peer
    try:
        target_path = args.target or str(model_path(args.pair, "target"))
        draft_path = (args.drafter_path or str(model_path(args.pair, "drafter"))) if "model" in kinds else None
    except FileNotFoundError as e:
        ap.error(f"{e} (or pass --target / --drafter-dir, or --drafters ngram)")
    tok = load_tokenizer(target_path)
    candidates = [Candidate("ngram", NgramDrafter())] if "ngram" in kinds else []
    paths = {"ngram": "ngram (prompt/suffix lookup)"}
    peer = None
    if coder and not args.no_hf:
        target, hf_target = _load_shared(target_path)
        draft = hf_draft = None
        if draft_path:
            draft, hf_draft = _load_shared(draft_path)
            if draft.config.vocab_size != target.config.vocab_size:
                raise ValueError(f"drafter: vocabulary {draft.config.vocab_size} != {target.config.vocab_size}")
            candidates.append(Candidate(f"model:{Path(draft_path).name}", ModelDrafter(draft), draft))
            paths[candidates[-1].name] = draft_path
        peer = Peer(hf_target, hf_draft)
    else:
        target = load_model(target_path)
        for path in ([draft_path] if draft_path else []) + args.extra_drafter:
            drafter = make_drafter("model", path, target)
            candidates.append(Candidate(f"model:{Path(path).name}", drafter, drafter.model))
            paths[candidates[-1].name] = path
    n_prompts = 1 if args.quick else args.prompts or (3 if coder else 8)
    budgets = "8" if args.quick or (coder and args.tree_budgets is None) else args.tree_budgets or "1,4,8,16"
    eos = tok.eos_token_id
    cfg = BenchConfig(max_tokens=16 if args.quick else args.max_tokens or (48 if coder else 64), depth=args.depth,
                      tree_budgets=tuple(int(b) for b in budgets.split(",") if b),
                      cost_reps=3 if args.quick else args.cost_reps,
                      stop_ids=frozenset([eos] if eos is not None else []))

    # 2. run
    texts = pick_prompts(args.pair, n_prompts)
    report = bench(target, [encode_prompt(tok, t, chat=True) for t in texts], candidates, cfg, peer)
    report["meta"] = base_meta() | {
        "pair": args.pair, "target": Path(target_path).name,
        "drafters": {c.name: paths[c.name] for c in candidates},
        "num_prompts": len(texts), "prompts": texts, "prompt_split": "heldout (specmesh.distill.prompts)",
        "max_tokens": cfg.max_tokens, "stop_at_eos": eos, "depth": cfg.depth, "tree_budgets": list(cfg.tree_budgets),
        "tree_depth": f"clamp(budget // 2, 1, {MAX_TREE_DEPTH})", "cost_reps_per_prompt": cfg.cost_reps,
        "compared": "specmesh engine with each drafter (chain, trees) vs specmesh none (plain decoding, same "
                    "runtime)" + ("; transformers generate plain and assisted (assistant_model=drafter) as the "
                                  "peer, same weights" if peer else ""),
        "note": "ratios from one run, configurations interleaved per prompt; greedy",
    }
    report = {"meta": report.pop("meta"), **report}
    out = Path(args.out) if args.out else RESULTS / ("bench_drafters.json" if not coder
                                                       else f"bench_drafters_{args.pair}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(format_table(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
