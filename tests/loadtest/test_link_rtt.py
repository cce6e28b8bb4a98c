"""loadtest.link_rtt against a real drafter service: both round trips measured, in JSON."""

from __future__ import annotations

import json

from loadtest import link_rtt


def test_link_rtt_measures_the_drafter_link_and_a_unary_call(tmp_path) -> None:
    out = tmp_path / "rtt.json"
    assert link_rtt.main(["--n", "20", "--gap-s", "0", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["round_trips"] == 20
    for key in ("commit_to_tree", "unary_health_check"):
        assert 0 < res[key]["median_ms"] <= res[key]["p90_ms"] < 10_000
