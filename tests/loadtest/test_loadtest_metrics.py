"""Load-test arithmetic on literal data: percentiles, TTFT/TPOT/ITL, goodput, speculation totals,
A/B ratios and output identity; workload shapes and arrivals; Prometheus parsing; the report;
and the guards (loopback only, bounded, no A/B over HTTP)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import math
import statistics
import time

import pytest

from loadtest import plots
from loadtest.metrics import (
    RequestRecord,
    Slo,
    ab_comparison,
    distribution,
    identical_outputs,
    meets_slo,
    percentile_key,
    speculation_totals,
    summarize,
)
from loadtest.progress import Progress
from loadtest.report import markdown, table
from loadtest.run import Level, LoadtestConfig, add_arguments, check_loopback, config_from_args, run_level, run_result
from loadtest.scrape import delta, parse_prometheus
from loadtest.workload import (
    SPEC_OFF,
    SPEC_ON,
    SYSTEM_PROMPT,
    WorkloadSpec,
    ab_jobs,
    arrival_offsets,
    build_units,
    messages_for,
)


def rec(arm="spec", unit=0, start=10.0, chunks=(10.2, 10.3, 10.5), tokens=4, end=10.5, ok=True, **kw):
    return RequestRecord(arm, unit, start=start, chunk_times=list(chunks), chunk_tokens=[1] * len(chunks),
                         output_tokens=tokens, end=end, success=ok, **kw)


def test_ttft_tpot_itl_of_one_request():
    r = rec()
    assert r.ttft == pytest.approx(0.2)
    assert r.tpot == pytest.approx((0.5 - 0.2) / 3)  # (latency - ttft) / (tokens - 1)
    assert r.itls == pytest.approx([0.1, 0.2])
    assert rec(tokens=1, chunks=(10.2,)).tpot is None  # one token: no TPOT (vLLM)
    assert rec(ok=False).tpot is None


def test_distribution_matches_numpy_linear_percentiles():
    d = distribution("ttft", [0.1, 0.2, 0.3, 0.4], (50, 90, 99.9))
    assert d["mean_ttft_ms"] == pytest.approx(250.0)
    assert d["median_ttft_ms"] == pytest.approx(250.0)
    assert d["p90_ttft_ms"] == pytest.approx(370.0)           # 100 + 0.9 * 3 * 100
    assert d["p99.9_ttft_ms"] == pytest.approx(399.7)
    assert d["std_ttft_ms"] == pytest.approx(statistics.pstdev([100, 200, 300, 400]))
    assert distribution("tpot", [])["p99_tpot_ms"] == 0.0      # empty -> 0, as vLLM
    assert percentile_key(99) == "p99" and percentile_key(99.9) == "p99.9"


def test_summary_fields_throughput_and_goodput():
    records = [rec(unit=0, prompt_len=10),                                          # ttft 200 ms, tpot 100 ms
               rec(unit=1, start=11.0, chunks=(11.8, 12.0), tokens=3, end=12.0, prompt_len=20),  # ttft 800
               rec(unit=2, ok=False, error="UNAVAILABLE: x", tokens=0, chunks=())]
    s = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=500, tpot_ms=150))
    assert (s["completed"], s["failed"], s["duration"]) == (2, 1, 2.0)
    assert s["total_input_tokens"] == 30 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(1.0) and s["output_throughput"] == pytest.approx(3.5)
    assert s["total_token_throughput"] == pytest.approx(18.5)
    assert s["good_requests"] == 1 and s["request_goodput"] == pytest.approx(0.5)
    assert s["mean_ttft_ms"] == pytest.approx(500.0) and s["median_ttft_ms"] == pytest.approx(500.0)
    assert s["mean_tpot_ms"] == pytest.approx((100.0 + 100.0) / 2)
    assert s["mean_itl_ms"] == pytest.approx((100 + 200 + 200) / 3)
    assert s["mean_e2el_ms"] == pytest.approx(750.0)
    assert s["mean_tokens_per_chunk"] == pytest.approx(7 / 5)
    assert s["errors"] == ["", "", "UNAVAILABLE: x"] and s["output_lens"] == [4, 3, 0]
    for key in ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p90_e2el_ms",
                "request_throughput", "output_throughput", "completed", "duration"):
        assert key in s
    assert summarize(records, 2.0)["request_goodput"] is None  # no SLO given


@pytest.mark.parametrize("slo, good", [
    (Slo(), True), (Slo(ttft_ms=200), True), (Slo(ttft_ms=199), False), (Slo(tpot_ms=100.001), True),
    (Slo(tpot_ms=99), False), (Slo(e2el_ms=500), True), (Slo(e2el_ms=499), False),
])
def test_slo_checks_every_objective(slo, good):
    assert meets_slo(rec(), slo) is good


def test_speculation_totals_recompute_ratios_from_sums():
    a = rec(tokens=10, speculation={"steps": 4, "drafted_tokens": 16, "accepted_tokens": 6, "predraft_hits": 2})
    b = rec(tokens=5, speculation={"steps": 5, "drafted_tokens": 4, "accepted_tokens": 0, "predraft_hits": 0})
    t = speculation_totals([a, b, rec(ok=False, speculation={"steps": 99})])
    assert t["steps"] == 9 and t["drafted_tokens"] == 20 and t["accepted_tokens"] == 6
    assert t["acceptance_rate"] == pytest.approx(6 / 20)        # not the mean of 6/16 and 0/4
    assert t["tokens_per_step"] == pytest.approx(15 / 9)
    assert t["predraft_hit_rate"] == pytest.approx(2 / 9)


def test_ab_ratios_and_identical_outputs():
    spec = {"mean_tpot_ms": 50.0, "median_tpot_ms": 40.0, "mean_e2el_ms": 900.0, "mean_ttft_ms": 100.0,
            "output_throughput": 30.0}
    nospec = {"mean_tpot_ms": 100.0, "median_tpot_ms": 100.0, "mean_e2el_ms": 1800.0, "mean_ttft_ms": 100.0,
              "output_throughput": 20.0}
    ab = ab_comparison(spec, nospec)
    assert ab["speedup_mean_tpot"] == 2.0 and ab["speedup_median_tpot"] == 2.5 and ab["speedup_mean_e2el"] == 2.0
    assert ab["output_throughput_ratio"] == 1.5
    assert ab_comparison(spec, {**nospec, "mean_tpot_ms": 0.0})["speedup_mean_tpot"] is None
    records = [rec(SPEC_ON, 0, token_ids=[1, 2]), rec(SPEC_OFF, 0, token_ids=[1, 2]),
               rec(SPEC_ON, 1, token_ids=[3]), rec(SPEC_OFF, 1, token_ids=[3, 4]), rec(SPEC_ON, 2, token_ids=[5])]
    assert identical_outputs(records) == (1, 2)


def test_workload_sessions_share_the_system_prompt_and_grow():
    units = build_units(WorkloadSpec(units=8, rounds=3, long_fraction=0.25, long_words=200, seed=1))
    assert len(units) == 8 and all(u.rounds == 3 and u.system == SYSTEM_PROMPT for u in units)
    longs = [u for u in units if u.long_context]
    assert len(longs) == 2 and all(len(u.user_turns[0].split()) >= 200 for u in longs)
    assert build_units(WorkloadSpec(units=8, rounds=3, long_fraction=0.25, seed=1)) == \
        build_units(WorkloadSpec(units=8, rounds=3, long_fraction=0.25, seed=1))  # deterministic
    m = messages_for(units[0], ["first reply", "second reply"])
    assert [x["role"] for x in m] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert m[2]["content"] == "first reply" and m[-1]["content"] == units[0].user_turns[2]
    with pytest.raises(AssertionError):
        messages_for(units[0], ["a", "b", "c"])


def test_ab_jobs_interleave_and_alternate_the_first_arm():
    units = build_units(WorkloadSpec(units=3))
    jobs = [(u.index, a) for u, a in ab_jobs(units, (SPEC_ON, SPEC_OFF))]
    assert jobs == [(0, SPEC_ON), (0, SPEC_OFF), (1, SPEC_OFF), (1, SPEC_ON), (2, SPEC_ON), (2, SPEC_OFF)]


def test_arrivals_closed_loop_poisson_and_gamma():
    assert arrival_offsets(3, math.inf) == [0.0, 0.0, 0.0]
    poisson = arrival_offsets(4000, rate=4.0, burstiness=1.0, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(poisson)]
    assert poisson[0] == 0.0 and all(g > 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.25, rel=0.06)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)   # exponential: CV 1
    bursty = arrival_offsets(4000, rate=4.0, burstiness=0.25, seed=3)
    bgaps = [b - a for a, b in itertools.pairwise(bursty)]
    assert statistics.mean(bgaps) == pytest.approx(0.25, rel=0.12)                       # same mean rate
    assert statistics.stdev(bgaps) / statistics.mean(bgaps) == pytest.approx(2.0, rel=0.12)  # CV = 1/sqrt(shape)
    with pytest.raises(ValueError):
        arrival_offsets(2, 0.0)


def test_prometheus_parse_and_delta():
    text = ('# HELP x_total X.\n# TYPE x_total counter\nx_total 3\n'
            'req_total{api="http",outcome="ok"} 5\nh_bucket{le="+Inf"} 7 1712345678\nbad line here\n')
    samples = parse_prometheus(text)
    assert samples == {"x_total": 3.0, 'req_total{api="http",outcome="ok"}': 5.0, 'h_bucket{le="+Inf"}': 7.0}
    assert delta({"x_total": 1.0, "gone": 2.0}, samples) == {"x_total": 2.0, 'req_total{api="http",outcome="ok"}': 5.0,
                                                            'h_bucket{le="+Inf"}': 7.0}


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True),
                                      ("10.0.0.1", False), ("8.8.8.8", False), ("192.168.1.5", False)])
def test_only_loopback_targets_unless_allowed(host, ok):
    if ok:
        check_loopback(host, allow_remote=False)
    else:
        with pytest.raises(ValueError, match="not a loopback"):
            check_loopback(host, allow_remote=False)
        check_loopback(host, allow_remote=True)


def parse(*argv: str) -> LoadtestConfig:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flags_levels_and_guards():
    cfg = parse("--grpc", "127.0.0.1:5", "--ab", "--max-concurrency", "1,2,4", "--slo-ttft-ms", "300")
    cfg.validate()
    assert [lv.max_concurrency for lv in cfg.levels] == [1, 2, 4] and cfg.arms == (SPEC_ON, SPEC_OFF)
    assert cfg.slo == Slo(ttft_ms=300.0) and cfg.total_requests() == 3 * 2 * 8
    rates = parse("--target-url", "http://localhost:8000", "--request-rate", "0.5,2", "--burstiness", "0.5")
    rates.validate()
    assert rates.levels == (Level(4, 0.5, 0.5), Level(4, 2.0, 0.5))
    assert rates.scrape_urls == ("http://localhost:8000/metrics",)
    parse("--target-url", "http://127.0.0.1:1", "--ab").validate()  # A/B over HTTP: the speculation extension
    for argv, msg in [(("--grpc", "10.1.2.3:50050"), "loopback"),
                      (("--target-url", "http://127.0.0.1:1", "--scrape", "http://1.2.3.4/metrics"), "loopback"),
                      ((), "exactly one"),
                      (("--grpc", "127.0.0.1:5", "--num-prompts", "3000", "--ab"), "at most"),
                      (("--grpc", "127.0.0.1:5", "--max-concurrency", "1,2", "--request-rate", "1,2"), "not both")]:
        with pytest.raises(ValueError, match=msg):
            parse(*argv).validate()


def literal_result() -> dict:
    records = [rec(SPEC_ON, 0, token_ids=[1]), rec(SPEC_OFF, 0, start=10.0, end=11.0, token_ids=[1])]
    arms = {a: summarize([r for r in records if r.arm == a], 2.0) for a in (SPEC_ON, SPEC_OFF)}
    run = {"level": Level(2, math.inf).to_dict(), "duration": 2.0, "session_rebuilds": 0, "arms": arms,
           "output_throughput": 4.0, "request_throughput": 1.0,
           "ab": {**ab_comparison(arms[SPEC_ON], arms[SPEC_OFF]),
                  "identical_outputs": {"same": 1, "pairs": 1, "checked": True}}}
    return {"backend": "grpc", "runs": [run, {**run, "level": Level(4, math.inf).to_dict()}]}


def test_report_table_and_markdown():
    result = literal_result()
    text = table(result)
    assert "Mean TPOT (ms)" in text and "Identical outputs (greedy)" in text and "TPOT speedup" in text
    assert "| Mean TTFT (ms) | 200.0 | 200.0 |" in markdown(result)


@pytest.mark.skipif(not plots.available(), reason="matplotlib not installed")
def test_plots_are_pngs(tmp_path):
    paths = plots.write_plots(literal_result(), tmp_path / "r.json")
    assert [p.name for p in paths] == ["r-cdf.png", "r-throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000 for p in paths)


class FakeBackend:
    """Answers every turn after `delay_s` with `reply`; records how many were in flight."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.in_flight, self.peak, self.sent, self.ended = delay_s, 0, 0, [], []

    async def send(self, state, messages, sampling, speculate, rec) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        self.sent.append((time.perf_counter(), len(messages), speculate, state.session_id))
        rec.start = time.perf_counter()
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        rec.chunk_times, rec.end = [time.perf_counter()], time.perf_counter()
        rec.output_tokens, rec.success = 1, True
        state.replies.append("ok")

    async def end_session(self, state) -> None:
        self.ended.append(state.session_id)


def run_fake(backend: FakeBackend, cfg: LoadtestConfig, level: Level, limit_s: float = 30.0):
    deadline = time.monotonic() + limit_s
    return asyncio.run(run_level(backend, cfg, level, "t", deadline, Progress(0, enabled=False)))


def test_closed_loop_keeps_max_concurrency_in_flight_and_sessions_in_order():
    cfg = LoadtestConfig(grpc="127.0.0.1:1", workload=WorkloadSpec(units=3, rounds=2), ab=True)
    backend = FakeBackend(0.02)
    records, duration, _ = run_fake(backend, cfg, Level(2, math.inf))
    assert backend.peak == 2 and len(records) == 12 and all(r.success for r in records)
    assert sorted((r.arm, r.unit, r.turn) for r in records) == sorted(
        (a, u, t) for a in (SPEC_ON, SPEC_OFF) for u in range(3) for t in range(2))
    turns_of = {}
    for _, n_messages, speculate, sid in backend.sent:  # each session: turn 0 (2 messages), then turn 1 (4)
        turns_of.setdefault(sid, []).append(n_messages)
        assert sid.endswith("-spec") == speculate
    assert len(turns_of) == 6 and all(v == [2, 4] for v in turns_of.values())
    assert sorted(backend.ended) == sorted(turns_of)  # every session closed after its last turn
    assert duration >= 12 * 0.02 / 2


def test_open_loop_sends_on_the_arrival_schedule():
    cfg = LoadtestConfig(grpc="127.0.0.1:1", workload=WorkloadSpec(units=6))
    backend = FakeBackend(0.0)
    run_fake(backend, cfg, Level(None, 20.0))
    times = [t for t, *_ in backend.sent]
    expected = arrival_offsets(6, 20.0, 1.0, 0)
    assert [t - times[0] for t in times] == pytest.approx(expected, abs=0.03)


def test_the_time_limit_cancels_in_flight_requests_and_counts_the_rest():
    cfg = LoadtestConfig(grpc="127.0.0.1:1", workload=WorkloadSpec(units=4))
    t0 = time.monotonic()
    records, _, _ = run_fake(FakeBackend(5.0), cfg, Level(2, math.inf), limit_s=0.3)
    assert time.monotonic() - t0 < 2.0
    assert len(records) == 2 and all(not r.success and "max-duration-s" in r.error for r in records)
    result = {"runs": [run_result(cfg, Level(2, math.inf), records, 0.3, 0)]}
    assert result["runs"][0]["not_sent"] == 2 and result["runs"][0]["arms"]["spec"]["failed"] == 2
