"""`specmesh loadtest` against a real `specmesh up` cluster (bundled SmolLM2, one thread per
service): closed loop over gRPC with speculation on and off interleaved, and a multi-round
session run over the OpenAI HTTP API with the router's /metrics scraped."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from tests.up_proc import UpProcess, in_groups

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VLLM_FIELDS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
               "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
               "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
               "request_goodput", "ttfts", "itls", "input_lens", "output_lens", "errors")


@pytest.fixture(scope="module")
def cluster():
    up = UpProcess()
    try:
        yield (*up.wait_ready(), up.metrics_urls())
        up.signal(signal.SIGTERM)
        assert up.wait(timeout=120) == 0, up.output()
    finally:
        up.kill()
    assert not in_groups(set(up.pids().values()))


def loadtest(tmp_path, *argv: str) -> dict:
    out = tmp_path / "result.json"
    p = subprocess.run([sys.executable, "-m", "specmesh.cli", "loadtest", *argv, "--out", str(out), "--no-plots",
                        "--max-duration-s", "150"], check=False, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Mean TPOT (ms)" in p.stdout  # the table
    return json.loads(out.read_text())


def speculated(arm: dict) -> bool:
    """Whether the drafter planned the arm's steps: it sent trees, or, where its planner measured
    that speculation does not pay on this machine, plain runs (a loaded machine can tip it)."""
    return arm["speculation"]["drafted_tokens"] > 0 or arm["speculation"]["plain_steps"] > 0


def test_grpc_closed_loop_ab_on_and_off(cluster, tmp_path):
    grpc_address, _, metrics = cluster
    assert set(metrics) == {"verifier", "drafter-0"}
    r = loadtest(tmp_path, "--grpc", grpc_address, "--ab", "--num-prompts", "2", "--max-concurrency", "2",
                 "--max-tokens", "12", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
                 "--scrape", metrics["verifier"], "--scrape", metrics["drafter-0"])
    (run,) = r["runs"]
    assert r["backend"] == "grpc" and run["level"] == {"max_concurrency": 2, "request_rate": "inf", "burstiness": 1.0}
    spec, nospec = run["arms"]["spec"], run["arms"]["nospec"]
    for arm in (spec, nospec):
        assert all(k in arm for k in VLLM_FIELDS)
        assert arm["completed"] == 2 and arm["failed"] == 0 and 2 <= arm["total_output_tokens"] <= 24
        assert arm["mean_ttft_ms"] > 0 and arm["request_goodput"] == arm["request_throughput"]
    # the server's speculation stats: the drafter planned only the A arm's steps
    assert spec["speculation"]["steps"] > 0 and speculated(spec)
    assert nospec["speculation"]["drafted_tokens"] == 0 and not speculated(nospec)
    assert nospec["speculation"]["tokens_per_step"] == pytest.approx(1.0)
    # lossless: greedy output is the same with and without speculation
    assert run["ab"]["identical_outputs"] == {"same": 2, "pairs": 2, "checked": True}
    assert run["ab"]["speedup_mean_tpot"] > 0
    # the services' own Prometheus metrics moved with the run
    verifier, drafter = (s["delta"] for s in r["server_metrics"])
    assert verifier['specmesh_verifier_turns_total{finish="length"}'] + \
        verifier.get('specmesh_verifier_turns_total{finish="stop"}', 0) == 4
    assert verifier["specmesh_verifier_steps_total"] == spec["speculation"]["steps"] + nospec["speculation"]["steps"]
    assert verifier["specmesh_verifier_accepted_length_count"] == verifier["specmesh_verifier_steps_total"]
    assert drafter["specmesh_drafter_trees_total"] > 0


def test_http_sessions_reuse_the_kv_cache_ab_and_scrape_metrics(cluster, tmp_path):
    _, http_address, _ = cluster
    r = loadtest(tmp_path, "--target-url", f"http://{http_address}", "--num-prompts", "1", "--rounds", "2",
                 "--max-tokens", "8", "--ab")
    (run,) = r["runs"]
    for name in ("spec", "nospec"):
        arm = run["arms"][name]
        assert arm["completed"] == 2 and arm["failed"] == 0
        first, second = arm["input_lens"]
        assert second > first + 8  # the context grew by the reply and a new question
        assert arm["cached_prompt_tokens"] >= first  # the second turn reused the first turn's KV cache
    # the router's `speculation` extension switched the B arm to plain decoding
    assert speculated(run["arms"]["spec"])
    assert run["arms"]["nospec"]["speculation"]["drafted_tokens"] == 0 and not speculated(run["arms"]["nospec"])
    assert run["ab"]["identical_outputs"]["same"] == run["ab"]["identical_outputs"]["pairs"] == 2
    (scraped,) = r["server_metrics"]
    assert scraped["delta"]['specmesh_router_requests_total{api="http",outcome="ok"}'] == 4
