"""bench_drift: its comparison arithmetic, and a short run end to end on the bundled SmolLM2 GGUF:
the fp32 runtime reproduces transformers' fp32 greedy tokens, every format gets a row."""

from __future__ import annotations

import json

from loadtest.bench_drift import compare, format_table, main


def test_agreement_counts_the_common_prefix_and_first_differences() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    got = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9]]
    c = compare(ref, got)
    assert c["identical_prompts"] == 1 and c["prompts"] == 3
    assert c["agree_tokens"] == 4 + 2 + 0 and c["ref_tokens"] == 10 and c["agreement"] == 0.6
    assert c["first_difference_median"] == 1  # positions 2 and 0
    short = compare([[1, 2, 3]], [[1, 2]])  # a run that stopped early differs at its end
    assert short["identical_prompts"] == 0 and short["agree_tokens"] == 2


def test_short_run_end_to_end(tmp_path) -> None:
    out = tmp_path / "drift.json"
    assert main(["--prompts", "2", "--max-tokens", "12", "--formats", "float32,gguf", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["rows"][0]["identical_prompts"] == 2  # the reference against itself
    fp32 = next(r for r in report["rows"] if r.get("format") == "float32")
    assert fp32["identical_prompts"] == 2 and fp32["agreement"] == 1.0  # same weights, fp32 both sides
    gguf = next(r for r in report["rows"] if r.get("format") == "gguf")
    assert gguf["runtime"].startswith("specmesh gguf (specmesh-qdot") and 0 <= gguf["agreement"] <= 1
    assert report["meta"]["cpu_model"] and report["rows"][-1]["runtime"].startswith("llama.cpp")
    assert "| runtime |" in format_table(report)
