"""The drafter link's round trip: commit of a step -> the tree for the next one, through the
verifier's own `DrafterLink` to a real drafter service, against a unary gRPC call (the health
check) to the same server as the floor of this machine's gRPC.

The drafter is ngram over a random context (it proposes nothing, so the drafting itself costs
microseconds): what is left is the transport and the threads on both sides. Each round trip is
followed by a pause (`--gap-s`) as a verification would be. This is the per-step cost every
speculative step pays when its tree was not sent ahead (bench_services' "per-step gRPC overhead").

Usage: python -m loadtest.link_rtt [--n 300] [--out link_rtt.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest.bench_engine import _commit
from specmesh.convert import sampling_to_pb
from specmesh.launch import start
from specmesh.sampling import SamplingParams
from specmesh.v1 import drafter_pb2 as pb


def _quantiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median_ms": round(xs[len(xs) // 2] * 1e3, 3), "p90_ms": round(xs[int(len(xs) * 0.9)] * 1e3, 3)}


def measure(address: str, n: int, gap_s: float) -> dict:
    from verifier_service.drafter_link import DrafterLink

    health = health_pb2_grpc.HealthStub(grpc.insecure_channel(address))
    unary = []
    for i in range(n + 20):
        t = time.perf_counter()
        health.Check(health_pb2.HealthCheckRequest())
        if i >= 20:  # after a warm-up
            unary.append(time.perf_counter() - t)
    link = DrafterLink(address, 64 << 20)
    rng = random.Random(0)
    context = [rng.randrange(100, 40000) for _ in range(64)]
    link.open("rtt", pb.OpenSession(context=context, sampling=sampling_to_pb(SamplingParams()), budget=4, depth=4))
    if link.wait_tree("rtt", 0, 10) is None:
        raise RuntimeError(f"drafter at {address} did not answer the open")
    stream = []
    for step in range(n + 20):
        t = time.perf_counter()
        link.commit("rtt", pb.CommitStep(step=step, accepted=[], bonus=rng.randrange(100, 40000), budget=4, depth=4))
        resp = link.wait_tree("rtt", step + 1, 10)
        if resp is None or resp.error:
            raise RuntimeError(f"drafter at {address}: no tree for step {step + 1}: {resp}")
        if step >= 20:
            stream.append(time.perf_counter() - t)
        time.sleep(gap_s)
    link.close_session("rtt")
    link.shutdown()
    return {"round_trips": n, "commit_to_tree": _quantiles(stream), "unary_health_check": _quantiles(unary)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--gap-s", type=float, default=0.005, help="pause after each round trip")
    ap.add_argument("--out", default="link_rtt.json")
    args = ap.parse_args(argv)
    drafter = start("drafter_service", "--drafter", "ngram", "--threads", "1")
    try:
        res = measure(drafter.address, args.n, args.gap_s)
    finally:
        drafter.stop()
    res["meta"] = {"commit": _commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
                   "drafter": "ngram (random context: empty trees)",
                   "gap_s": args.gap_s}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    c, u = res["commit_to_tree"], res["unary_health_check"]
    print(f"drafter link commit -> tree: median {c['median_ms']} ms, p90 {c['p90_ms']} ms; "
          f"unary health check: median {u['median_ms']} ms, p90 {u['p90_ms']} ms ({args.n} each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
