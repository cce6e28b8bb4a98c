"""bench_services' arithmetic: the bounds of DESIGN.md and the measured ("hw") ones, each against
the autoregressive step of the verifier it ran on."""

from __future__ import annotations

import pytest

from loadtest.bench_services import DEPTH, Config, format_table, summarise


def configs() -> list[Config]:
    return [
        Config("in-process none", "inproc", tokens=100, seconds=10.0, steps=100, verify_s=10.0),
        Config("in-process oracle 0.8 cost-free", "inproc", "o8c", tokens=100, seconds=4.0, steps=40, verify_s=3.6),
        Config("tp2 autoregressive", "tp2", tokens=100, seconds=20.0, steps=100, verify_s=19.0),
        # TP=2: a step is 0.2 s, a chain of 4 at 0.1 s/level costs 0.4 s = 2 steps
        Config("tp2 o8 pipelining on", "tp2", "o8", True, 0.8, 0.1, tokens=100, seconds=16.0, steps=40,
               idle_s=4.0, verify_s=10.0, hits=10),
        Config("tp1 oracle 0.8 cost-free pipelining off", "tp1", "o8c", False, tokens=100, seconds=4.4, steps=40),
        Config("tp1 autoregressive", "tp1", tokens=100, seconds=10.0, steps=100),
    ]


def test_bounds_use_the_verifiers_own_step_and_the_measured_costs() -> None:
    rows = {r["name"]: r for r in summarise(configs())}
    r = rows["tp2 o8 pipelining on"]
    e = (1 - 0.8 ** (DEPTH + 1)) / 0.2
    assert r["gamma_c"] == pytest.approx(2.0)
    assert r["speedup_vs_autoregressive"] == pytest.approx(1.25)
    assert r["verify_cost"] == pytest.approx(1.25)  # 0.25 s per verification / 0.2 s per AR step
    assert r["E_measured"] == pytest.approx(2.5) and r["E"] == pytest.approx(e, abs=1e-3)
    assert r["sequential_bound"] == pytest.approx(2.5 / 3, abs=1e-3)  # DESIGN.md's, at the measured acceptance
    assert r["pipelined_bound"] == pytest.approx(2.5 / 2)
    assert r["nominal_pipelined_bound"] == pytest.approx(e / 2, abs=1e-3)
    assert r["hw_pipelined_bound"] == pytest.approx(2.5 / 2.0)  # E' = 2.5 tokens/step, max(v, gc) = 2
    assert r["hw_sequential_bound"] == pytest.approx(2.5 / 3.25, abs=1e-3)
    assert r["of_hw_pipelined_bound"] == pytest.approx(1.0)
    assert r["of_pipelined_bound"] == pytest.approx(1.0) and r["of_nominal_pipelined_bound"] == pytest.approx(1.25 / (e / 2), abs=1e-3)
    assert r["predraft_hit_rate"] == pytest.approx(0.25) and r["verify_idle_fraction"] == pytest.approx(0.25)
    over = rows["per-step gRPC overhead (s)"]
    assert over["value"] == pytest.approx(0.01) and over["tp1_vs_in_process_throughput"] == pytest.approx(4 / 4.4, abs=1e-3)
    assert over["same_steps"] is True
    table = format_table({"commit": "x", "prompts": 1, "max_tokens": 100, "depth": DEPTH, "draft_cost_s_per_level": 0.1,
                          "low_draft_cost_s_per_level": 0.01, "threads": "1"}, list(rows.values()))
    assert "| tp2 o8 pipelining on | 6.2 | 1.25x | 1.25x | 2.50 | 1.25 | 25% | 25% | 2.00 |" in table


def test_bounds_are_held_against_the_decode_phase() -> None:
    """With the decode phase timed apart, the prefill (the same work in every configuration) stays
    out of the per-step bounds, of c and of v; the end-to-end speedup keeps it."""
    cs = configs()
    ar, spec = cs[2], cs[3]  # tp2: 100 tokens in 20 s, of which 2 s before the first token
    ar.decode_tokens, ar.decode_s = 99, 18.0
    spec.decode_tokens, spec.decode_s = 97, 12.0
    r = {r["name"]: r for r in summarise(cs)}["tp2 o8 pipelining on"]
    step = 18.0 / 99
    decode = (97 / 12.0) / (99 / 18.0)
    assert r["speedup_vs_autoregressive"] == pytest.approx(1.25)
    assert r["decode_speedup_vs_autoregressive"] == pytest.approx(decode, abs=1e-3)
    assert r["gamma_c"] == pytest.approx(DEPTH * 0.1 / step, abs=1e-3)
    assert r["verify_cost"] == pytest.approx(10.0 / 40 / step, abs=1e-3)
    assert r["of_pipelined_bound"] == pytest.approx(decode / (2.5 / max(1.0, DEPTH * 0.1 / step)), abs=1e-3)
