"""Real pairs through real services: the headline benchmark (`specmesh bench pairs`).

Pairs: the bundled SmolLM2-135M target with its shipped feature drafter (what `--drafter auto`
picks), and Qwen2.5-Coder 0.5B drafting for 1.5B (GGUF files of `specmesh models install
qwen2.5-coder`; opt-in: when not installed its entry says so). Per pair, two service sets on
127.0.0.1 (`--service-threads`, default 0,1), each one drafter service and its verifier: first with
the threads `specmesh up` gives them by default (the machine's cores each, drafting and verifying
taking turns: one machine serving alone), then with a core each (`services 1+1 ...` rows: the
drafter's core stands for its own hardware, the design's separate drafter pods, as issue 15 asks
its benchmark to run). Requests with token ids, and per set these rows:
- autoregressive through the verifier (speculation disabled): the unit of every ratio;
- speculation with the server's default settings, pipelining off and on, greedy, plus one sampled
  run (temperature 0.7, seeded) with the defaults. The defaults row (`defaults_row`) is what a
  request without options gets: with `--pipelining auto`, a verifier whose threads take every core
  and a drafter on the same machine take turns, so it is pipelining off; the pipelining-on rows
  then run on a second verifier started with `--pipelining on`;
- fixed shapes for reference, chain 4 (budget 4, depth 4) and tree 8/4, pipelining off and on
  (`SpeculationOptions.fixed` when the proto has it, else the shape is sent as plain caps: see
  meta "fixed_shapes_sent_as");
- the in-process engine (`specmesh.engine`) at the whole machine's threads, `none` and with the
  pair's drafter (the engine's default caps, each step's shape planned within them: `PlannedDrafts`);
- transformers `generate` and assisted generation (`assistant_model=`, the pair's drafter as a
  causal LM; a feature drafter is not one, so that row says why it is absent) at the whole
  machine's threads, fp32, from the same GGUF files (specmesh.loader's cached conversion);
- llama.cpp (`llama-cpp-python`, when importable; rows say "not installed" otherwise) on the same
  GGUF files, plain decoding at 1 thread and at the machine's threads, and the binding's own
  speculative decoding (prompt lookup: the binding offers no model-draft path, see meta).

Prompts: held-out chat-templated code and prose prompts (`specmesh.distill.prompts` split
"heldout", topics the shipped drafter never saw), every row on every prompt, interleaved prompt by
prompt after an untimed warm-up on one more held-out prompt that is not measured: first the
services' defaults row for the whole length, then every row (first calls allocate and initialise
kernels) for 4 tokens, the defaults row again for the whole length, so that the drafter has served one request before the measured ones, as a running
service has (its planner starts a session from its recent sessions' acceptance; 4-token sessions
alone, a chat answer's first tokens, left the first measured session planned from 8 unrepresentative
trials: 0.93 depth-1 acceptance on one pair, 0.52 on the other). Generation stops at the tokenizer's EOS ids (as users run it),
so every greedy row makes the same tokens; outputs of the greedy services rows must equal the
autoregressive verifier's ("identical"), those of an in-process speculative row its own plain
(`none`) row's in the same format and threads ("own plain": another thread count than the
verifier's rounds torch's reductions otherwise, so only agreement is reported against the
verifier); transformers' and llama.cpp's are reported as agreement.

Columns, as in bench_services.py: tok/s end to end and in decode (first streamed token to last);
decode speedup vs autoregressive through the verifier; tokens per step E; verifier idle fraction;
predraft hits; v = verification time per step / that verifier's autoregressive decode step; γc =
the verifier's wait for a tree per step with pipelining off (drafting plus the link), in the same
unit, for the same shape (pipelining-on rows take their off twin's; from its decode phase, see
`_gamma_c`); bounds E/max(v, γc) (pipelined) and E/(v + γc) (sequential), and the decode speedup
as a fraction of the row's own. A pipelining-off row's γc is derived from its own step time, so
its sequential "of bound" is near 1 by construction; the pipelined rows' is the one that tells.
The JSON also has each row's `per_prompt`: every timed prompt's share of it (tokens/s, decode
tokens/s, tokens a step, predraft hits, plain steps), where a ratio over all prompts hides one.

Usage: python -m loadtest.bench_pairs [--pairs smollm2,qwen2.5-coder] [--prompts N] [--max-tokens N]
       [--quick] [--skip-peers] [--out FILE]        (also: specmesh bench pairs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loadtest.bench_drafters import _load_shared, pick_prompts
from loadtest.bench_engine import add_markdown_flag, base_meta, print_saved
from loadtest.bench_services import Config, _timed, add_timed, generate_inproc, run_remote
from specmesh.launch import SERVICE_ENV, service_env, start
from specmesh.service import DEFAULT_DTYPE

PAIRS = ("smollm2", "qwen2.5-coder")
RESULTS = Path(__file__).parent / "results"
TEMPERATURE, SEED = 0.7, 1234
AR = "services autoregressive"


@dataclass
class Row(Config):
    """One configuration; `where`: tp1 (the services) | inproc | hf | llama."""
    shape: str = ""            # default | chain 4 | tree 8/4
    sampled: bool = False
    threads: int = 1
    split: str = ""            # in-process: how `fit_threads` split the threads, e.g. "2 (kernels 2, torch ops 1)"
    status: str = "ok"         # else why the row has no numbers
    agree_prompts: int = 0     # peers: prompts whose greedy output equals the verifier's ...
    agree_tokens: int = 0      # ... and tokens of the common prefix, of ...
    ref_tokens: int = 0        # ... the verifier's tokens
    runner: object = field(default=None, repr=False)  # the model, drafter or binding it runs
    group: str = "services"    # services rows: the name prefix of their service set (`ServiceSet.prefix`)
    per_prompt: list = field(default_factory=list)  # `PROMPT_FIELDS` of each timed prompt's run, in prompt order


PROMPT_FIELDS = ("tokens", "seconds", "steps", "hits", "plain_steps", "decode_tokens", "decode_s")


def run_prompt(r: Row, *args) -> list[int]:
    """`run_row` for one timed prompt, its own share of the row's sums kept in `r.per_prompt`: a
    row's ratio over all prompts can hide one prompt where a plan lost (prose against code)."""
    before = [getattr(r, f) for f in PROMPT_FIELDS]
    out = run_row(r, *args)
    r.per_prompt.append({f: getattr(r, f) - b for f, b in zip(PROMPT_FIELDS, before)})
    return out


SHAPES = (("default", 0, 0, False), ("chain 4", 4, 4, True), ("tree 8/4", 8, 4, True))


def service_rows(threads: str, prefix: str = "services", full: bool = True) -> list[Row]:
    """The rows of one service set, named `{prefix} ...`; not `full`: autoregressive and the
    default shape only (a set that repeats another under another environment)."""
    rows = [Row(f"{prefix} autoregressive", "tp1", threads=threads, group=prefix)]
    for shape, budget, depth, fixed in SHAPES if full else SHAPES[:1]:
        for pipe in (False, True):
            rows.append(Row(f"{prefix} {shape} pipelining {'on' if pipe else 'off'}", "tp1", "drafter", pipe,
                            budget=budget, depth=depth, fixed=fixed, shape=shape, threads=threads, group=prefix))
    if full:
        rows.append(Row(f"{prefix} defaults, sampled T={TEMPERATURE}", "tp1", "drafter", True, budget=0, depth=0,
                        shape="default", sampled=True, threads=threads, group=prefix))
    return rows


def service_threads(asked: int) -> tuple[int, int]:
    """(drafter threads, verifier threads): as asked, or with 0 what `specmesh up` gives each
    service by default (`ClusterSpec.service_threads`)."""
    from specmesh.cluster import ClusterSpec

    return ClusterSpec(threads=asked).service_threads()


@dataclass(frozen=True)
class ServiceSet:
    """One drafter service and its verifier(s), each with `drafter`/`verifier` threads; its rows are
    named `{prefix} ...`: `services` for the first set, `services D+V` for the others."""
    drafter: int
    verifier: int
    prefix: str
    env: tuple[tuple[str, str | None], ...] = ()  # over `specmesh.launch.service_env` (None: unset), both processes
    full: bool = True                      # every row (`service_rows`)


SPINNING = (("OMP_WAIT_POLICY", None),)  # unset: libgomp's default, its threads spin a while before they sleep


def service_sets(asked: list[int], spinning: bool = False) -> list[ServiceSet]:
    """A set per `--service-threads` entry (0: `specmesh up`'s default threads), in that order; an
    entry that comes to the same threads as an earlier one (on a one-core machine) is left out.
    `spinning`: then each again with SPINNING (`{prefix} spinning ...`, autoregressive and default rows)."""
    sets: list[ServiceSet] = []
    for a in asked:
        dt, vt = service_threads(a)
        if all((s.drafter, s.verifier) != (dt, vt) for s in sets):
            sets.append(ServiceSet(dt, vt, "services" if not sets else f"services {dt}+{vt}"))
    return sets + [ServiceSet(s.drafter, s.verifier, f"{s.prefix} spinning", SPINNING, full=False)
                   for s in sets if spinning]


@dataclass
class LoadedPair:
    target: str      # paths
    drafter: str
    tokenizer: object
    stop: frozenset[int]
    rows: list[Row]  # in-process and peer rows, their models loaded


def load_pair(pair: str, threads: int, peers: bool, n_ctx: int) -> LoadedPair:
    """The pair's files, tokenizer and stop ids, and its in-process and peer rows with their models
    (llama.cpp with a context of `n_ctx` tokens: its prompt lookup keeps logits for every position)."""
    from specmesh.drafters import bundled_drafter_path
    from specmesh.drafters.model import ModelDrafter
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.modelsets import model_path
    from specmesh.runtime import make_drafter

    if pair == "smollm2":
        target_path, draft_path = str(bundled_target_path()), str(bundled_drafter_path())
    else:
        target_path, draft_path = str(model_path(pair, "target")), str(model_path(pair, "drafter"))
    target, hf = _load_shared(target_path)
    if pair == "smollm2":  # the shipped feature drafter: not a causal LM transformers could run
        drafter, hf_draft = make_drafter("model", draft_path, target), None
    else:
        draft, hf_draft = _load_shared(draft_path)
        drafter = ModelDrafter(draft)
    tok = load_tokenizer(target_path)
    eos = hf.generation_config.eos_token_id
    stop = frozenset([tok.eos_token_id] + (eos if isinstance(eos, list) else [eos])) - {None}
    rows = [Row(f"in-process none ({threads} threads)", "inproc", threads=threads, runner=(target, None)),
            Row(f"in-process speculative ({threads} threads)", "inproc", "drafter", shape="default",
                threads=threads, runner=(target, drafter))]
    hf_rows = [Row(f"transformers generate ({threads} threads)", "hf", threads=threads, runner=(hf, None)),
               Row(f"transformers assisted ({threads} threads)", "hf", "drafter", threads=threads,
                   runner=(hf, hf_draft))]
    if hf_draft is None:
        hf_rows[1].status = "n/a: the shipped drafter is a feature drafter (EAGLE-style), not a causal LM"
    binding, why = llama_binding()
    llama_rows = [Row("llama.cpp plain (1 thread)", "llama", threads=1),
                  Row(f"llama.cpp plain ({threads} threads)", "llama", threads=threads),
                  Row(f"llama.cpp prompt-lookup speculative ({threads} threads)", "llama", "pld", threads=threads),
                  Row(f"llama.cpp speculative, {Path(draft_path).name} draft", "llama", "model",
                      status="not offered by llama-cpp-python: its draft_model hook has only prompt lookup "
                             "(LlamaPromptLookupDecoding)")]
    for r in hf_rows + llama_rows:
        if not peers:
            r.status, r.runner = "skipped (--skip-peers)", None
        elif r.where == "llama" and r.status == "ok":
            if binding is None:
                r.status = why
            else:
                r.runner = binding(target_path, r.threads, r.drafter == "pld", n_ctx)
    return LoadedPair(target_path, draft_path, tok, stop, rows + hf_rows + llama_rows)


def load_tokenizer_of(pair: str):
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.modelsets import model_path

    return load_tokenizer(bundled_target_path() if pair == "smollm2" else model_path(pair, "target"))


def run_row(r: Row, address: dict[str, dict[str, str]], ids: list[int], n: int, stop: frozenset[int], spec) -> list[int]:
    from specmesh import kernels
    from specmesh.runtime import fit_threads
    from specmesh.sampling import SamplingParams

    params = SamplingParams(TEMPERATURE, seed=SEED) if r.sampled else None
    if r.where == "tp1":  # pipelining asked for where the defaults take turns: the verifier told to pipeline
        addr = address[r.group]  # its service set's drafter and verifiers
        pipe = r.pipelined and not r.sampled and "tp1-pipe" in addr
        return run_remote(r, addr | {"tp1": addr["tp1-pipe"]} if pipe else addr, ids, None, n, params, stop)
    kernels.set_threads(r.threads)  # peers: torch at the whole budget
    if r.where == "inproc":
        model, drafter = r.runner
        r.split = fit_threads(model, drafter)
        return generate_inproc(r, model, ids, None, n, drafter, spec, params, stop)
    if r.where == "hf":
        return hf_timed(r, r.runner[0], ids, n, stop, r.runner[1])
    return _timed(llama_chunks(r.runner, ids, n, stop), r)


def format_rows(pair: LoadedPair, dtype: str, threads: int) -> list[Row]:
    """In-process rows in the services' weight format `dtype` (beside the fp32 ones), when it is not fp32."""
    from specmesh.drafters.feature import FeatureDrafter
    from specmesh.drafters.model import ModelDrafter
    from specmesh.loader import load_drafter_weights, load_model

    target = load_model(pair.target, dtype)
    draft = load_drafter_weights(pair.drafter, dtype)
    drafter = FeatureDrafter(draft) if draft.fc is not None else ModelDrafter(draft)
    fmt = target.weight_format.describe() if getattr(target, "weight_format", None) else dtype
    return [Row(f"in-process none, {fmt} ({threads} threads)", "inproc", threads=threads, runner=(target, None)),
            Row(f"in-process speculative, {fmt} ({threads} threads)", "inproc", "drafter", shape="default",
                threads=threads, runner=(target, drafter))]


def bench_pair(pair: str, texts: list[str], n: int, threads: int, peers: bool, log=print,
               dtype: str = DEFAULT_DTYPE, services_only: bool = False, service_threads_asked: tuple[int, ...] | list[int] = (0,),
               warm_text: str | None = None, spinning: bool = False) -> dict:
    """Start the pair's services (weights as `dtype`), a service set per entry of
    `service_threads_asked` (`service_sets`), warm them up on `warm_text` (default: the first
    prompt), run every row on every prompt (interleaved), stop them; the pair's report. Greedy
    identity is asserted for the rows in the services' own weight format, each services row against
    its own set's autoregressive row, that row against the first set's (the in-process fp32 rows
    beside another format report agreement only)."""
    from specmesh.runtime import encode_prompt

    from specmesh.engine import SpecConfig

    tok = load_tokenizer_of(pair)
    prompts = [encode_prompt(tok, t, chat=True) for t in texts]
    warm = encode_prompt(tok, warm_text, chat=True) if warm_text is not None else prompts[0]
    loaded = load_pair(pair, threads, peers, n_ctx=max(map(len, prompts)) + n + 64)
    if dtype != "float32":
        loaded.rows[2:2] = format_rows(loaded, dtype, threads)
    from verifier_service.config import VerifierConfig

    sets = service_sets(list(service_threads_asked), spinning)
    rows = [r for s in sets for r in service_rows(f"drafter {s.drafter}, verifier {s.verifier}", s.prefix, s.full)]
    rows += [] if services_only else loaded.rows
    live = [r for r in rows if r.status == "ok"]
    stop, spec = loaded.stop, SpecConfig()  # in-process: the engine's default caps, planned within
    procs: dict[str, dict] = {}
    described = []
    try:
        for s in sets:
            ps = procs[s.prefix] = {}
            env = dict(s.env)
            ps["drafter"] = start("drafter_service", "--drafter", f"model:{loaded.drafter}", "--threads",
                                  str(s.drafter), "--dtype", dtype, env=env)
            verifier = ("verifier_service", "--threads", str(s.verifier), "--target", loaded.target, "--dtype", dtype,
                        "--drafter-allow", ps["drafter"].address)  # requests name it (drafter_address)
            ps["tp1"] = start(*verifier, env=env)  # the defaults: --pipelining auto
            pipelines = VerifierConfig(threads=s.verifier).pipelines(ps["drafter"].address)
            if not pipelines:  # the defaults take turns: the pipelining-on rows need a verifier told to pipeline
                ps["tp1-pipe"] = start(*verifier, "--pipelining", "on", env=env)
            described.append({
                "prefix": s.prefix, "service_threads": {"drafter": s.drafter, "verifier": s.verifier},
                "service_env": described_env(env),
                "defaults_row": f"{s.prefix} default pipelining {'on' if pipelines else 'off'}",
                "defaults_row_why": f"what a request without speculation options gets from a verifier with --threads "
                                    f"{s.verifier} and --pipelining auto, its drafter on 127.0.0.1 "
                                    f"(verifier_service.config.pipelines)" + (
                                        "; pipelining-on rows then ran on a second verifier started with "
                                        "--pipelining on" if not pipelines else ""),
                "verifier_banner": next((line.strip() for line in ps["tp1"].lines if "listening on" in line), "")})
        address = {g: {k: p.address for k, p in ps.items()} for g, ps in procs.items()}
        defaults = {d["defaults_row"] for d in described}
        # warm-up, untimed: each set's defaults serve one whole request (the drafter's recent sessions,
        # which a session's planning starts from), then every row's first calls allocate and initialise
        # kernels (4 tokens; a defaults row, met again, serves a whole request once more)
        for r in [r for r in live if r.name in defaults] + live:
            run_row(Row(r.name, r.where, r.drafter, r.pipelined, budget=r.budget, depth=r.depth, fixed=r.fixed,
                        sampled=r.sampled, runner=r.runner, group=r.group), address, warm,
                    n if r.name in defaults else 4, stop, spec)
        first_ar = live[0]
        for pi, ids in enumerate(prompts):
            ref = run_prompt(first_ar, address, ids, n, stop, spec)
            own_ref = {first_ar.group: ref}  # each service set's autoregressive output
            outs: dict[str, list[int]] = {}  # this prompt's outputs (an in-process none row precedes its twin)
            for r in live[1:]:
                out = outs[r.name] = run_prompt(r, address, ids, n, stop, spec)
                if r.sampled:
                    continue
                if r.where == "tp1" and r.drafter == "none":  # another set's autoregressive row (first in its set)
                    own_ref[r.group] = out
                    r.identical &= out == ref
                elif r.where == "tp1":
                    r.identical &= out == own_ref[r.group]
                elif r.where == "inproc" and r.drafter != "none":
                    r.identical &= out == outs.get(r.name.replace("speculative", "none"))
                common = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
                r.agree_prompts += out == ref
                r.agree_tokens += common
                r.ref_tokens += len(ref)
            log(f"{pair}: prompt {pi + 1}/{len(prompts)} done ({len(ids)} prompt tokens, {len(ref)} generated)")
    finally:
        for ps in procs.values():
            for p in ps.values():
                p.stop()
    first = described[0]
    return {"pair": pair, "target": loaded.target, "drafter": loaded.drafter, "stop_ids": sorted(stop),
            "services_dtype": dtype, "verifier_banner": first["verifier_banner"],
            "service_threads": first["service_threads"], "defaults_row": first["defaults_row"],
            "defaults_row_why": first["defaults_row_why"], "service_sets": described,
            "default_shape": f"services: the verifier's defaults (no budget/depth sent); in-process: "
                             f"caps budget {spec.budget}, depth {spec.depth} (specmesh.engine.SpecConfig), each "
                             f"step's shape planned within them (specmesh.engine.PlannedDrafts)",
            "results": summarise(rows, len(prompts))}


def summarise(rows: list[Row], n_prompts: int) -> list[dict]:
    """Each row's numbers; ratios against the autoregressive row of the first service set (services
    rows: of their own set; in-process rows: their own plain row)."""
    by = {r.name: r for r in rows}
    ars = {r.group: r for r in rows if r.where == "tp1" and r.drafter == "none"}
    first_ar = next(iter(ars.values()))
    inproc_none = next((r for r in rows if r.where == "inproc" and r.drafter == "none"), None)
    out = []
    for r in rows:
        kind = {"tp1": "services", "inproc": "in-process", "hf": "transformers", "llama": "llama.cpp"}[r.where]
        threads = r.threads if r.where == "tp1" else r.split or r.threads
        d: dict = {"name": r.name, "kind": kind, "threads": threads, "status": r.status}
        if r.status != "ok":
            out.append(d)
            continue
        dt, ds = r.decode_rate()
        ar = ars[r.group] if r.where == "tp1" else first_ar
        ar_dt, ar_ds = ar.decode_rate()
        ar_tps = ar.tokens / ar.seconds
        if r.where == "tp1":
            d["service_set"] = r.group
        d |= {"shape": r.shape or None, "pipelining": r.pipelined if r.where == "tp1" and r.drafter != "none" else None,
              "sampled": r.sampled, "tokens": r.tokens, "seconds": round(r.seconds, 3),
              "tokens_per_s": round(r.tokens / r.seconds, 2), "decode_tokens_per_s": round(dt / ds, 2),
              "speedup_vs_autoregressive": round(r.tokens / r.seconds / ar_tps, 3),
              "decode_speedup_vs_autoregressive": round((dt / ds) / (ar_dt / ar_ds), 3)}
        if not r.sampled:
            d["greedy_identical_prompts"] = f"{r.agree_prompts}/{n_prompts}" if r is not ar else f"{n_prompts}/{n_prompts}"
            d["greedy_token_agreement"] = round(r.agree_tokens / r.ref_tokens, 4) if r.ref_tokens else 1.0
            if r.where == "tp1":
                d["identical_to_autoregressive"] = r.identical
            elif r.where == "inproc" and r.drafter != "none":
                d["identical_to_own_plain"] = r.identical
        if r.where in ("tp1", "inproc") and r.steps:
            # each runtime's own plain decode step (in its own weight format) is its unit
            base = ar if r.where == "tp1" else by.get(r.name.replace("speculative", "none"), inproc_none)
            bt, bs = base.decode_rate()
            unit, speedup = bs / bt, (dt / ds) / (bt / bs)
            e, v = r.tokens / r.steps, r.verify_s / r.steps / unit
            d |= {"steps": r.steps, "tokens_per_step": round(e, 3),
                  "verify_idle_fraction": round(r.idle_s / r.seconds, 3), "verify_cost_v": round(v, 3)}
            if r.where == "tp1":
                d["predraft_hit_rate"] = round(r.hits / r.steps, 3)
                d["plain_steps"] = r.plain_steps  # one token each: the planner's runs without speculation
            twin = r if r.where == "inproc" or not r.pipelined else by.get(_off_twin(r.name))
            if r.drafter != "none" and twin is not None and twin.steps:
                gc = _gamma_c(twin, unit)
                pipe, seq = e / max(v, gc), e / (v + gc)
                own = pipe if r.where == "tp1" and r.pipelined else seq
                d |= {"gamma_c": round(gc, 3), "gamma_c_from": twin.name, "pipelined_bound": round(pipe, 3),
                      "sequential_bound": round(seq, 3), "bound": "pipelined" if own is pipe else "sequential",
                      "of_bound": round(speedup / own, 3)}
        d["per_prompt"] = [{"tokens": q["tokens"], "tokens_per_s": round(q["tokens"] / q["seconds"], 2),
                            "decode_tokens_per_s": round(q["decode_tokens"] / q["decode_s"], 2) if q["decode_s"] > 0 else None,
                            **({"steps": q["steps"], "tokens_per_step": round(q["tokens"] / q["steps"], 3),
                                "predraft_hits": q["hits"], "plain_steps": q["plain_steps"]} if q["steps"] else {})}
                           for q in r.per_prompt if q["seconds"] > 0]
        out.append(d)
    return out


def _gamma_c(twin: Row, unit: float) -> float:
    """Draft cost per step in `unit`s, from a row that waits for every tree. Services: a decode-phase
    step's time less its verification (the first step, before the first chunk, also waits for the
    drafter's prefill of the prompt, so the verifier's summed wait would overstate it); in-process:
    the engine's draft time per step (its drafter's prefill is not in it)."""
    if twin.where != "tp1":
        return twin.idle_s / twin.steps / unit
    per_step = twin.decode_s / max(twin.steps - 1, 1)
    return max(0.0, (per_step - twin.verify_s / twin.steps) / unit)


def _off_twin(name: str) -> str:
    return name.replace("pipelining on", "pipelining off")


def hf_timed(r: Row, model, ids: list[int], max_tokens: int, stop: frozenset[int], assistant=None) -> list[int]:
    """transformers greedy `generate` (assisted when `assistant`), its new ids timed into `r` as they
    arrive at its streamer, so that the decode phase is timed as for the services. In this thread:
    a second thread would start a second OpenMP team that spins against the first."""
    x = torch.tensor([ids])  # [1, prompt]
    arrivals: list[tuple[float, list[int]]] = []

    class Streamer:  # transformers' streamer protocol: put(the prompt, then new ids), end()
        prompt_seen = False

        def put(self, value: torch.Tensor) -> None:
            if self.prompt_seen:
                arrivals.append((time.perf_counter(), value.reshape(-1).tolist()))
            self.prompt_seen = True

        def end(self) -> None:
            pass

    kw = dict(do_sample=False, max_new_tokens=max_tokens, attention_mask=torch.ones_like(x),
              eos_token_id=sorted(stop), pad_token_id=min(stop), streamer=Streamer())
    if assistant is not None:
        kw["assistant_model"] = assistant
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(x, **kw)
    return add_timed(r, t0, arrivals, time.perf_counter())


def llama_binding():
    """(a factory of llama.cpp runners, None) when llama-cpp-python imports, else (None, why)."""
    try:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError as e:
        return None, f"not installed (llama-cpp-python: {e})"

    def make(gguf: str, threads: int, prompt_lookup: bool, n_ctx: int):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=4) if prompt_lookup else None
        return llama_cpp.Llama(model_path=gguf, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                               draft_model=draft, verbose=False)
    return make, ""


def llama_chunks(llm, ids: list[int], max_tokens: int, stop: frozenset[int]):
    """llama.cpp greedy decoding (top_k 1, no penalties), one token id per yield; the KV cache is
    reset first so no prompt prefix is reused across rows."""
    llm.reset()
    n = 0
    for t in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        yield [int(t)]
        n += 1
        if t in stop or n >= max_tokens:
            break


def machine_info() -> dict:
    """CPU model and vector flags (as the kernel dispatch keys them), threads, library versions, HEAD."""
    import transformers

    from specmesh.kernels import attention, glue, qdot
    from specmesh.kernels.dispatch import cpu_flags, cpu_model

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    flags = cpu_flags()
    try:
        import llama_cpp
        llama = llama_cpp.__version__
        # the peer's build: which SIMD paths ggml was compiled with (AVX512, VNNI, ...) on this host
        llama_build = llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    except ImportError:
        llama, llama_build = "not installed", ""
    return {"cpu_model": cpu_model(), "avx2": "avx2" in flags, "avx512": [f for f in flags if f.startswith("avx512")],
            "amx": [f for f in flags if f.startswith("amx")], "machine_threads": os.cpu_count(),
            "commit_full": commit, "torch": torch.__version__, "transformers": transformers.__version__,
            "llama_cpp_python": llama, "llama_cpp_system_info": llama_build,
            "integer_kernel": qdot.describe(),  # this process's thread count; each service names its own at start
            "row_attention": "specmesh kernel" if attention.available() else f"SDPA per row ({attention.reason()})",
            "glue": "specmesh kernels" if glue.available() else f"torch ops ({glue.reason()})",
            "service_env": described_env()}  # what the service children ran with


def described_env(extra: dict | None = None) -> dict:
    """SERVICE_ENV's variables, and `extra`'s, as a service child started with `extra` has them."""
    child = service_env(extra)
    return {k: child.get(k, "unset") for k in (*SERVICE_ENV, *(extra or {}))}


def passive_vs_spinning(results: list[dict], sets: list[dict]) -> dict:
    """Per service set run again spinning (`--spinning`): its rows' tok/s over its spinning twin's."""
    by = {d["name"]: d for d in results if d["status"] == "ok"}
    out = {}
    for s in sets:
        twin = f"{s['prefix']} spinning"
        ratios = {}
        for row in ("autoregressive", "default pipelining off", "default pipelining on"):
            a, b = by.get(f"{s['prefix']} {row}"), by.get(f"{twin} {row}")
            if a and b:
                ratios[row] = round(a["tokens_per_s"] / b["tokens_per_s"], 3)
        if ratios:
            out[s["prefix"]] = ratios
    return out


def checks(results: list[dict], defaults: str, prefix: str = "services") -> dict:
    """The issue's criteria that this one run can decide, from the rows above, for the service set
    whose rows are named `{prefix} ...`; `defaults`: its row that is what a request without
    speculation options gets."""
    by = {d["name"]: d for d in results if d["status"] == "ok" and d.get("service_set", prefix) == prefix}
    ar_name = f"{prefix} autoregressive"

    def tps(name: str) -> float | None:
        return by[name]["tokens_per_s"] if name in by else None
    ar, dflt = tps(ar_name), tps(defaults)
    hf = [v for k, v in ((k, d["tokens_per_s"]) for k, d in by.items()) if k.startswith("transformers")]
    fixed = [d["tokens_per_s"] for k, d in by.items() if k.startswith((f"{prefix} chain", f"{prefix} tree"))]
    out: dict = {}
    if ar and dflt:
        out["default_vs_autoregressive"] = round(dflt / ar, 3)
    if dflt and hf:
        out["default_vs_faster_transformers"] = round(dflt / max(hf), 3)
    if dflt and fixed:
        out["default_vs_best_fixed_shape"] = round(dflt / max(fixed), 3)
    pairs = [(k, _off_twin(k)) for k in by if k.startswith(prefix) and k.endswith("pipelining on")]
    out["pipelining_on_vs_off"] = {k: round(by[k]["tokens_per_s"] / by[o]["tokens_per_s"], 3)
                                   for k, o in pairs if o in by}
    out["defaults_row"] = defaults
    if "of_bound" in by.get(defaults, {}):
        out["default_of_bound"] = by[defaults]["of_bound"]
    if ceiling := chain_ceiling(by.get(f"{prefix} chain 4 pipelining off", {})):
        out["chain_ceiling"] = ceiling
    nones = [d for k, d in by.items() if k.startswith("in-process none")]  # fp32 first, then the services' format
    hf_plain = next((d for k, d in by.items() if k.startswith("transformers generate")), None)
    if nones and hf_plain:  # fp32 on both sides
        out["in_process_none_vs_transformers_generate"] = round(nones[0]["tokens_per_s"] / hf_plain["tokens_per_s"], 3)
    llama = next((d for k, d in by.items() if k.startswith("llama.cpp plain") and d["threads"] != 1), None)
    llama1 = next((d for k, d in by.items() if k.startswith("llama.cpp plain") and d["threads"] == 1), None)
    if llama and nones:  # issue 20: the same machine threads on both sides, the served format
        out["in_process_none_vs_llama_plain"] = round(nones[-1]["tokens_per_s"] / llama["tokens_per_s"], 3)
    if llama1 and ar_name in by:  # issue 20: one thread each, decode phase
        out["verifier_decode_vs_llama_1_thread"] = round(by[ar_name]["decode_tokens_per_s"] /
                                                         llama1["decode_tokens_per_s"], 3)
    if llama and dflt:
        out["default_vs_llama_plain"] = round(dflt / llama["tokens_per_s"], 3)
    out["greedy_identical"] = all(d.get("identical_to_autoregressive", True) and d.get("identical_to_own_plain", True)
                                  for d in by.values())
    return out


def chain_ceiling(chain4: dict, depths: int = 16) -> dict | None:
    """What a chain of any depth (1..`depths`) could reach against autoregressive decoding if
    verifying its rows cost what one row's step costs, from a run's chain-4 row (pipelining off):
    the drafted tokens' acceptance as one rate a token, fitted to its tokens per step (E = 1 + a +
    ... + a^4), and a level of drafting at a quarter of its γc. Sequential (drafting and
    verification taking turns, as on shared cores): max E_d / (1 + c d); pipelined: max E_d /
    max(1, c d). No planner beats these on that machine with that drafter unless verification of
    several rows gets cheaper than one row's step, or drafting or acceptance change; a chain is what
    trees reduce to where rows cost time, which they do on a CPU."""
    e4, gc = chain4.get("tokens_per_step"), chain4.get("gamma_c")
    if not e4 or gc is None or not 1.0 <= e4 < 5.0:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):  # E(a) = 1 + a + ... + a^4 grows with a: bisection
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid ** k for k in range(5)) < e4 else (lo, mid)
    a, c = lo, gc / 4

    def tokens(d: int) -> float:
        return sum(a ** k for k in range(d + 1))
    seq = max(range(1, depths + 1), key=lambda d: tokens(d) / (1 + c * d))
    pipe = max(range(1, depths + 1), key=lambda d: tokens(d) / max(1.0, c * d))
    return {"from": chain4["name"], "acceptance_per_token": round(a, 3), "draft_level_cost": round(c, 3),
            "sequential_free_verification": round(tokens(seq) / (1 + c * seq), 3), "sequential_depth": seq,
            "pipelined_free_verification": round(tokens(pipe) / max(1.0, c * pipe), 3), "pipelined_depth": pipe}


def format_table(report: dict) -> str:
    """README-ready markdown: a line of meta, then per pair one table."""
    m = report["meta"]
    lines = [f"commit {m['commit']} · {m['cpu_model']} (AVX2 {m['avx2']}, AVX-512 {bool(m['avx512'])}) · "
             f"{m['num_prompts']} held-out chat prompts (code and prose) x {m['max_tokens']} tokens, stop at EOS · "
             f"services: {m['service_threads']}, "
             f"{' '.join(f'{k}={v}' for k, v in m.get('service_env', {}).items())} · "
             f"in-process, transformers: {m['machine_threads']} threads"]
    for p in report["pairs"]:
        lines += ["", f"**{p['pair']}**" + (f": {p['status']}" if "results" not in p else
                                             f" ({Path(p['target']).name}, drafter {Path(p['drafter']).name})")]
        if "results" not in p:
            continue
        lines += ["| configuration | threads | tok/s | decode tok/s | decode vs AR | tokens/step | idle | "
                  "predraft hits | γc | v | bound E/max(v,γc) | of bound | greedy identical |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for d in p["results"]:
            if d["status"] != "ok":
                lines.append(f"| {d['name']} | {d['threads']} | {d['status']} |" + " |" * 10)
                continue

            def g(k: str, fmt: str = "{:.2f}", d: dict = d) -> str:
                return "–" if d.get(k) is None else fmt.format(d[k])
            bound = "–" if "pipelined_bound" not in d else (
                f"{d['pipelined_bound']:.2f}" + ("" if d["bound"] == "pipelined" else
                                                 f" (seq. {d['sequential_bound']:.2f})"))
            agree = "" if d["sampled"] else f"{d['greedy_identical_prompts']} prompts, {d['greedy_token_agreement']:.0%} tokens"
            ident = "– (sampled)" if d["sampled"] else (
                str(d["identical_to_autoregressive"]) if "identical_to_autoregressive" in d else
                f"{d['identical_to_own_plain']} (own plain); AR: {agree}" if "identical_to_own_plain" in d else agree)
            lines.append(f"| {d['name']} | {d['threads']} | {g('tokens_per_s', '{:.1f}')} | "
                         f"{g('decode_tokens_per_s', '{:.1f}')} | {g('decode_speedup_vs_autoregressive')}x | "
                         f"{g('tokens_per_step')} | {g('verify_idle_fraction', '{:.0%}')} | "
                         f"{g('predraft_hit_rate', '{:.0%}')} | {g('gamma_c')} | {g('verify_cost_v')} | {bound} | "
                         f"{g('of_bound', '{:.0%}')} | {ident} |")
        for name, c in (p.get("checks_by_service_set") or {}).items():
            if ceiling := c.get("chain_ceiling"):
                lines.append(f"\n{name}: a chain's ceiling if verifying its rows cost one row's step (`chain_ceiling`, "
                             f"acceptance {ceiling['acceptance_per_token']:.2f} a token, a drafting level "
                             f"{ceiling['draft_level_cost']:.2f} steps): {ceiling['sequential_free_verification']:.2f}x "
                             f"taking turns (depth {ceiling['sequential_depth']}), "
                             f"{ceiling['pipelined_free_verification']:.2f}x pipelined (depth {ceiling['pipelined_depth']})")
        for name, ratios in (p.get("passive_vs_spinning") or {}).items():
            lines.append(f"\n{name}: waiting passively (the default) over spinning (OMP_WAIT_POLICY unset), tok/s: " +
                         ", ".join(f"{row} {r:.2f}x" for row, r in ratios.items()))
    return "\n".join(lines)


def _thread_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected a comma list of thread counts >= 0, got {text!r}")
    return out


def _describe_threads(asked: int) -> str:
    if asked:
        return f"--threads {asked} per service process (verifier, drafter)"
    return "specmesh up's default (ClusterSpec.service_threads): the machine's cores for each service, which take turns"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specmesh bench pairs", description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", default=",".join(PAIRS), help="comma list of: " + ", ".join(PAIRS))
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=str(RESULTS / "bench_pairs.json"))
    ap.add_argument("--quick", action="store_true", help="SmolLM2 only, 2 prompts x 12 tokens")
    ap.add_argument("--skip-peers", action="store_true", help="no transformers or llama.cpp rows")
    ap.add_argument("--services-only", action="store_true", help="only the services' rows (a quick probe)")
    ap.add_argument("--service-threads", default="0,1", type=_thread_list,
                    help="a service set (a drafter and its verifier) per entry, N: --threads N for each of "
                         "its processes, 0: what `specmesh up` gives them (the machine's cores each, taking "
                         "turns); default 0,1: that, and a core each (the drafter's own core standing for "
                         "its own hardware, as in the design's separate drafter pods)")
    ap.add_argument("--spinning", action="store_true",
                    help="also run each service set with OMP_WAIT_POLICY unset (libgomp's default: its threads "
                         "spin a while after each parallel region, as before the services waited passively): "
                         "its autoregressive and default rows, interleaved with the rest")
    ap.add_argument("--dtype", default=DEFAULT_DTYPE,
                    help="the services' weights (verifier and drafter --dtype; default auto, the services' own "
                         "default: measured here), and in-process rows in that format beside the fp32 ones")
    add_markdown_flag(ap)
    args = ap.parse_args(argv)
    if print_saved(args.markdown, format_table):
        return 0
    pairs = ["smollm2"] if args.quick else [p.strip() for p in args.pairs.split(",") if p.strip()]
    if unknown := set(pairs) - set(PAIRS):
        ap.error(f"--pairs: unknown {sorted(unknown)}")
    n_prompts, n = (2, 12) if args.quick else (args.prompts, args.max_tokens)
    if n_prompts < 1 or n < 1:
        ap.error("--prompts and --max-tokens must be >= 1")
    threads = os.cpu_count() or 1
    from specmesh import kernels

    kernels.set_threads(threads)  # this process runs the in-process and peer rows at the machine's threads
    from specmesh.modelsets import model_path
    from specmesh.v1 import verifier_pb2

    *texts, warm_text = pick_prompts("qwen2.5-coder", n_prompts + 1)  # code, code, prose, ...: held out for both
    report_pairs = []
    for pair in pairs:
        try:
            model_path(pair, "target"), model_path(pair, "drafter")
        except FileNotFoundError as e:
            report_pairs.append({"pair": pair, "status": f"not installed: {e}"})
            continue
        report = bench_pair(pair, texts, n, threads, not (args.skip_peers or args.services_only),
                            log=lambda line: print(line, file=sys.stderr, flush=True), dtype=args.dtype,
                            services_only=args.services_only, service_threads_asked=args.service_threads,
                            warm_text=warm_text, spinning=args.spinning)
        report["checks"] = checks(report["results"], report["defaults_row"])  # the first set's
        report["checks_by_service_set"] = {s["prefix"]: checks(report["results"], s["defaults_row"], s["prefix"])
                                           for s in report["service_sets"]}
        if args.spinning:
            report["passive_vs_spinning"] = passive_vs_spinning(report["results"], report["service_sets"])
        report_pairs.append(report)
    has_fixed = "fixed" in verifier_pb2.SpeculationOptions.DESCRIPTOR.fields_by_name
    meta = base_meta() | machine_info() | {
        "service_threads": "; ".join(_describe_threads(a) for a in args.service_threads),
        "in_process_threads": threads, "num_prompts": len(texts), "prompts": texts, "warm_up_prompt": warm_text,
        "prompt_split": "heldout (specmesh.distill.prompts), chat template", "max_tokens": n,
        "stop": "the tokenizer's and generation config's EOS ids", "sampled_run": {"temperature": TEMPERATURE,
                                                                                   "seed": SEED},
        "fixed_shapes_sent_as": "SpeculationOptions.fixed = true" if has_fixed else
        "budget/depth only (this proto has no SpeculationOptions.fixed yet)",
        "llama_cpp_model_draft": "not offered by llama-cpp-python: Llama(draft_model=) takes a LlamaDraftModel, "
                                 "and the binding ships only LlamaPromptLookupDecoding",
        "note": "ratios from one run, every row on every prompt, interleaved prompt by prompt, after an "
                "untimed warm-up on warm_up_prompt (the services' defaults for max_tokens, then every row for "
                "4 tokens, the defaults again for max_tokens); the machine may be shared"}
    out = {"meta": meta, "pairs": report_pairs}
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(format_table(out))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
