"""bench_pairs: its arithmetic on synthetic rows (γc from the pipelining-off twin, the bounds, the
in-process rows' own unit), and its quick mode end to end: real verifier and drafter services with
the bundled SmolLM2 and its shipped drafter, the JSON's shape, greedy outputs identical."""

from __future__ import annotations

import json

import pytest

from loadtest.bench_pairs import AR, Row, checks, format_table, main, summarise


def _rows() -> list[Row]:
    # the verifier's AR decode step: 0.1 s (10 tokens after the first in 1 s)
    return [
        Row(AR, "tp1", tokens=11, seconds=1.2, decode_tokens=10, decode_s=1.0, steps=11, verify_s=1.1),
        # off: 0.1 s per decode step (10 after the first in 1 s), of which 0.06 s verifying (v = 0.6), so
        # γc = 0.4; its summed wait (0.5 s: the first one held the drafter's prefill) is not used; E = 2
        Row("services default pipelining off", "tp1", "drafter", False, budget=0, depth=0, tokens=22, seconds=1.2,
            decode_tokens=18, decode_s=1.0, steps=11, idle_s=0.5, verify_s=0.66, shape="default", plain_steps=3),
        Row("services default pipelining on", "tp1", "drafter", True, budget=0, depth=0, tokens=20, seconds=1.0,
            decode_tokens=18, decode_s=0.9, steps=8, idle_s=0.1, verify_s=0.96, hits=4, shape="default"),
        Row("in-process none (2 threads)", "inproc", tokens=11, seconds=0.6, decode_tokens=10, decode_s=0.5,
            steps=11, verify_s=0.55, threads=2),
        Row("in-process speculative (2 threads)", "inproc", "drafter", tokens=20, seconds=0.5, decode_tokens=18,
            decode_s=0.45, steps=8, idle_s=0.08, verify_s=0.32, threads=2, shape="default"),
        Row("transformers generate (2 threads)", "hf", tokens=11, seconds=0.8, decode_tokens=10, decode_s=0.7,
            threads=2, agree_prompts=1, agree_tokens=11, ref_tokens=11),
        Row("llama.cpp plain (1 thread)", "llama", status="not installed (llama-cpp-python: no module)"),
    ]


def test_bounds_take_gamma_c_from_the_pipelining_off_twin_and_each_runtimes_own_step() -> None:
    rows = {d["name"]: d for d in summarise(_rows(), 1)}
    off, on = rows["services default pipelining off"], rows["services default pipelining on"]
    assert off["gamma_c"] == pytest.approx(0.4) and on["gamma_c"] == pytest.approx(0.4)
    assert on["gamma_c_from"] == "services default pipelining off"
    assert off["verify_cost_v"] == pytest.approx(0.6) and off["tokens_per_step"] == pytest.approx(2.0)
    assert off["pipelined_bound"] == pytest.approx(2.0 / 0.6, abs=1e-3)
    assert off["bound"] == "sequential" and off["sequential_bound"] == pytest.approx(2.0)
    assert off["of_bound"] == pytest.approx(1.8 / 2.0)
    assert on["bound"] == "pipelined" and on["verify_cost_v"] == pytest.approx(1.2)
    assert on["decode_speedup_vs_autoregressive"] == pytest.approx(2.0)  # 20 tok/s decode vs 10
    assert on["of_bound"] == pytest.approx(2.0 / (2.5 / 1.2), abs=1e-3)
    assert on["predraft_hit_rate"] == pytest.approx(0.5)
    assert (off["plain_steps"], on["plain_steps"]) == (3, 0)
    spec = rows["in-process speculative (2 threads)"]  # unit: the in-process plain step, 0.05 s
    assert spec["verify_cost_v"] == pytest.approx(0.8) and spec["gamma_c"] == pytest.approx(0.2)
    assert spec["of_bound"] == pytest.approx((40 / 20) / (2.5 / 1.0), abs=1e-3)
    assert rows["transformers generate (2 threads)"]["greedy_identical_prompts"] == "1/1"
    assert rows["llama.cpp plain (1 thread)"] == {"name": "llama.cpp plain (1 thread)", "kind": "llama.cpp",
                                                 "threads": 1, "status": "not installed (llama-cpp-python: no module)"}
    c = checks(list(rows.values()), "services default pipelining on")
    assert c["default_vs_autoregressive"] == pytest.approx((20 / 1.0) / (11 / 1.2), abs=1e-2)
    assert c["pipelining_on_vs_off"] == {"services default pipelining on": pytest.approx(20.0 / 18.33, abs=1e-3)}


def test_each_prompts_share_of_a_row_is_reported_apart() -> None:
    r = Row("services default pipelining on", "tp1", "drafter", True, tokens=30, seconds=2.0, steps=12, hits=5,
            per_prompt=[{"tokens": 20, "seconds": 1.0, "steps": 5, "hits": 4, "plain_steps": 0, "decode_tokens": 18,
                         "decode_s": 0.9},
                        {"tokens": 10, "seconds": 1.0, "steps": 7, "hits": 1, "plain_steps": 2, "decode_tokens": 9,
                         "decode_s": 0.0}])
    (d,) = [x for x in summarise([_rows()[0], r], 2) if x["name"] == r.name]
    assert d["per_prompt"] == [
        {"tokens": 20, "tokens_per_s": 20.0, "decode_tokens_per_s": 20.0, "steps": 5, "tokens_per_step": 4.0,
         "predraft_hits": 4, "plain_steps": 0},
        {"tokens": 10, "tokens_per_s": 10.0, "decode_tokens_per_s": None, "steps": 7, "tokens_per_step": 1.429,
         "predraft_hits": 1, "plain_steps": 2}]


def test_the_chain_ceiling_is_the_best_depth_at_free_verification() -> None:
    """From a chain-4 row: the per-token acceptance that gives its tokens per step, a quarter of
    its γc a level; the best chain depth when verification costs one row's step, drafting and
    verification in turn (sequential) or beside each other (pipelined)."""
    from loadtest.bench_pairs import chain_ceiling

    a, c = 0.8, 0.25
    e4 = sum(a ** k for k in range(5))
    got = chain_ceiling({"name": "services chain 4 pipelining off", "tokens_per_step": e4, "gamma_c": 4 * c})
    assert got["acceptance_per_token"] == pytest.approx(a, abs=1e-3) and got["draft_level_cost"] == c
    best = max(sum(a ** k for k in range(d + 1)) / (1 + c * d) for d in range(1, 17))
    assert got["sequential_free_verification"] == pytest.approx(best, abs=1e-3)
    assert got["sequential_depth"] == 3  # 2.95 / 1.75 beats depth 4's 3.36 / 2.0
    # pipelined: drafting is free up to one step's time (d <= 4), then it bounds the step
    assert got["pipelined_depth"] == 4 and got["pipelined_free_verification"] == pytest.approx(e4, abs=1e-3)
    assert chain_ceiling({"name": "x", "tokens_per_step": 5.0, "gamma_c": 1.0}) is None  # nothing to fit
    rows = {d["name"]: d for d in summarise(_rows(), 1)}
    assert "chain_ceiling" not in checks(list(rows.values()), "services default pipelining on")  # no chain row


def test_checks_hold_the_verifier_against_llama_cpp_at_one_thread() -> None:
    rows = _rows()
    rows[-1] = Row("llama.cpp plain (1 thread)", "llama", tokens=11, seconds=2.4, decode_tokens=10, decode_s=2.0,
                   threads=1, agree_prompts=1, agree_tokens=11, ref_tokens=11)
    c = checks(summarise(rows, 1), "services default pipelining on")
    assert c["verifier_decode_vs_llama_1_thread"] == pytest.approx(10 / 5)  # 10 vs 5 tok/s in decode
    assert c["greedy_identical"] is True


def test_a_second_service_set_is_measured_against_its_own_autoregressive_row() -> None:
    rows = _rows()
    one = "services 1+1"  # its verifier at half the first's speed: 0.2 s a decode step
    rows[3:3] = [
        Row(f"{one} autoregressive", "tp1", tokens=11, seconds=2.4, decode_tokens=10, decode_s=2.0, steps=11,
            verify_s=2.2, group=one),
        Row(f"{one} default pipelining on", "tp1", "drafter", True, budget=0, depth=0, tokens=22, seconds=1.2,
            decode_tokens=18, decode_s=1.0, steps=11, idle_s=0.1, verify_s=1.1, hits=8, shape="default", group=one),
    ]
    by = {d["name"]: d for d in summarise(rows, 1)}
    on = by[f"{one} default pipelining on"]
    assert on["service_set"] == one and by["services default pipelining on"]["service_set"] == "services"
    assert on["decode_speedup_vs_autoregressive"] == pytest.approx(18 / 5)  # 18 tok/s in decode against 5
    assert on["verify_cost_v"] == pytest.approx(0.5)  # 0.1 s a step against its own verifier's 0.2 s
    assert "gamma_c" not in on  # no pipelining-off twin in its set
    # the first set's ratios are unchanged by the second set's rows
    assert by["services default pipelining on"]["decode_speedup_vs_autoregressive"] == pytest.approx(2.0)
    first = checks(list(by.values()), "services default pipelining on")
    second = checks(list(by.values()), f"{one} default pipelining on", one)
    assert first["default_vs_autoregressive"] == pytest.approx((20 / 1.0) / (11 / 1.2), abs=1e-2)
    assert second["default_vs_autoregressive"] == pytest.approx((22 / 1.2) / (11 / 2.4), abs=1e-2)
    assert list(first["pipelining_on_vs_off"]) == ["services default pipelining on"]
    assert second["pipelining_on_vs_off"] == {}  # its off row is not in this run
    assert second["default_vs_faster_transformers"] == pytest.approx((22 / 1.2) / (11 / 0.8), abs=1e-2)


def test_spinning_twins_repeat_each_set_with_its_default_rows_and_are_compared_to_it(monkeypatch) -> None:
    from loadtest import bench_pairs
    from loadtest.bench_pairs import passive_vs_spinning, service_rows, service_sets

    monkeypatch.setattr(bench_pairs, "service_threads", lambda asked: (asked or 2, asked or 2))
    sets = service_sets([0, 1], spinning=True)
    assert [(s.prefix, s.env, s.full) for s in sets] == [
        ("services", (), True), ("services 1+1", (), True),
        ("services spinning", (("OMP_WAIT_POLICY", None),), False),
        ("services 1+1 spinning", (("OMP_WAIT_POLICY", None),), False)]
    assert [r.name for r in service_rows("x", "services spinning", full=False)] == [
        "services spinning autoregressive", "services spinning default pipelining off",
        "services spinning default pipelining on"]
    assert [s.prefix for s in service_sets([0, 1])] == ["services", "services 1+1"]
    rows = _rows()
    rows[1:1] = [Row("services spinning autoregressive", "tp1", tokens=11, seconds=1.6, decode_tokens=10,
                     decode_s=1.4, steps=11, verify_s=1.5, group="services spinning"),
                 Row("services spinning default pipelining on", "tp1", "drafter", True, budget=0, depth=0, tokens=20,
                     seconds=1.25, decode_tokens=18, decode_s=1.1, steps=8, verify_s=1.0, shape="default",
                     group="services spinning")]
    results = summarise(rows, 1)
    got = passive_vs_spinning(results, [{"prefix": "services"}, {"prefix": "services 1+1"}])
    assert got == {"services": {"autoregressive": pytest.approx(1.6 / 1.2, abs=1e-3),
                                "default pipelining on": pytest.approx(1.25 / 1.0, abs=1e-3)}}
    # each twin's own checks against its own autoregressive row, the first set's untouched
    first = checks(results, "services default pipelining on")
    assert first["default_vs_autoregressive"] == pytest.approx((20 / 1.0) / (11 / 1.2), abs=1e-2)


@pytest.mark.e2e
@pytest.mark.slow
def test_quick_mode_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "bench_pairs.json"
    assert main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    meta = report["meta"]
    for key in ("cpu_model", "avx2", "avx512", "machine_threads", "commit_full", "torch", "transformers",
                "llama_cpp_python", "service_threads", "fixed_shapes_sent_as", "prompts"):
        assert key in meta, key
    assert meta["service_threads"].startswith("specmesh up's default")  # said in the output, as run
    assert meta["service_env"] == {"OMP_WAIT_POLICY": "PASSIVE"}  # what the service children ran with
    (pair,) = report["pairs"]
    assert pair["pair"] == "smollm2"
    from specmesh.cluster import ClusterSpec
    from verifier_service.config import VerifierConfig

    drafter_threads, verifier_threads = ClusterSpec().service_threads()
    assert pair["service_threads"] == {"drafter": drafter_threads, "verifier": verifier_threads}
    takes_turns = not VerifierConfig(threads=verifier_threads).pipelines("127.0.0.1:1")
    assert pair["defaults_row"] == f"services default pipelining {'off' if takes_turns else 'on'}"
    assert pair["checks"]["defaults_row"] == pair["defaults_row"]
    rows = {d["name"]: d for d in pair["results"]}
    for name in (AR, "services default pipelining off", "services default pipelining on",
                 "services chain 4 pipelining off", "services chain 4 pipelining on",
                 "services tree 8/4 pipelining off", "services tree 8/4 pipelining on"):
        d = rows[name]
        assert d["status"] == "ok" and d["tokens"] > 0 and d["tokens_per_s"] > 0, d
        assert d["identical_to_autoregressive"] is True, name
        if name != AR:
            assert {"gamma_c", "verify_cost_v", "pipelined_bound", "of_bound", "predraft_hit_rate"} <= d.keys()
    sampled = next(d for d in pair["results"] if d["status"] == "ok" and d["sampled"])
    assert "identical_to_autoregressive" not in sampled
    inproc = [d for d in pair["results"] if d["kind"] == "in-process"]
    # fp32 plain and speculative, and the same two in the services' format (--dtype auto, the default)
    assert len(inproc) == 4 and all("identical_to_autoregressive" not in d for d in inproc)
    assert pair["services_dtype"] == "auto"
    spec = next(d for d in inproc if "speculative" in d["name"])
    assert spec["identical_to_own_plain"] is True and "greedy_token_agreement" in spec
    hf = rows[next(n for n in rows if n.startswith("transformers generate"))]
    assert hf["status"] == "ok" and "greedy_token_agreement" in hf
    llama = [d for d in pair["results"] if d["kind"] == "llama.cpp"]
    assert len(llama) == 4 and all(d["status"] == "ok" or d["status"].startswith(("not installed", "not offered"))
                                   for d in llama)
    assert pair["checks"]["greedy_identical"] is True
    # each row's prompts apart, in prompt order, adding up to the row
    for d in (d for d in pair["results"] if d["status"] == "ok"):
        assert len(d["per_prompt"]) == len(meta["prompts"]), d["name"]
        assert sum(q["tokens"] for q in d["per_prompt"]) == d["tokens"], d["name"]
        if "steps" in d:
            assert sum(q["steps"] for q in d["per_prompt"]) == d["steps"], d["name"]
    # a second set with a core per service, measured beside the first (where the machine has 2 cores)
    sets = pair["service_sets"]
    assert sets[0]["prefix"] == "services" and sets[0]["defaults_row"] == pair["defaults_row"]
    if ClusterSpec(threads=1).service_threads() != (drafter_threads, verifier_threads):
        assert [s["prefix"] for s in sets] == ["services", "services 1+1"]
        assert sets[1]["service_threads"] == {"drafter": 1, "verifier": 1}
        assert set(pair["checks_by_service_set"]) == {"services", "services 1+1"}
        own = {name: d for name, d in rows.items() if d.get("service_set") == "services 1+1"}
        assert len(own) == 8 and all(d["status"] == "ok" for d in own.values())
        assert all(d["identical_to_autoregressive"] is True for d in own.values() if not d["sampled"])
    table = format_table(report)
    assert all(name in table for name in rows)
