"""The constrained-decoding benchmark runs end to end and its constrained speculative output, with
the drafter guided by the grammar and unguided, equals constrained plain decoding for every grammar."""

from __future__ import annotations

import json

import pytest

from loadtest import bench_structured

pytestmark = pytest.mark.slow


def test_bench_structured_runs_and_speculation_keeps_the_constrained_output(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert bench_structured.main(["--max-tokens", "12", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert {r["grammar"] for r in rows} == set(bench_structured.GRAMMARS)
    spec = [r for r in rows if r["config"].startswith("speculative, constrained")]
    assert len(spec) == 2 * len(bench_structured.GRAMMARS) and all(r["identical"] is True for r in spec)
    assert all(r["grammar_ms_per_step"] > 0 for r in rows if "constrained" in r["config"])
    assert data["meta"]["cpu_model"] and "| grammar |" in capsys.readouterr().out


def test_bench_structured_through_the_services(tmp_path):
    out = tmp_path / "s.json"
    assert bench_structured.main(["--services", "--max-tokens", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["results"]
    assert data["meta"]["services"] and {r["grammar"] for r in rows} == set(bench_structured.GRAMMARS)
    spec = [r for r in rows if r["config"].startswith("speculative, constrained")]
    assert len(spec) == 2 * len(bench_structured.GRAMMARS) and all(r["identical"] is True for r in spec)
