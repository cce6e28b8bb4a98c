"""loadtest.gpu_check end to end on the CPU (`--device cpu --preset tiny`): the script the GPU
check runs, with the same services, flags and summary; only the device and the model size differ."""

from __future__ import annotations

import json

from loadtest import gpu_check


def test_gpu_check_runs_every_configuration_and_reproduces_the_target(tmp_path) -> None:
    out = tmp_path / "gc.json"
    rc = gpu_check.main(["--device", "cpu", "--preset", "tiny", "--prompts", "1", "--prompt-len", "16",
                         "--max-tokens", "12", "--sessions", "1,3", "--out", str(out), "--commit", "test"])
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["results"]}
    assert rc == 0 and all(r.get("identical_to_target", True) for r in rows.values())
    meta = data["meta"]
    assert meta["commit"] == "test" and meta["device"] == "cpu" and meta["dtype"] == "float32"
    assert "(tp=1, cpu, float32, process group none" in meta["verifier"]
    assert "static shapes: buckets [16], CUDA graphs captured []" in meta["static_verifier"]
    assert meta["weight_bytes"] > 0 and meta["weight_read_limit_tok_s"] is None  # no bandwidth known for a CPU
    for name in ("tp1 autoregressive", "tp1 o8 pipelining off", "tp1 o8 pipelining on",
                 "tp1 model drafter (random, same device) pipelining on", "static autoregressive",
                 "static o8 pipelining off", "static o8 pipelining on"):
        assert rows[name]["tokens_per_s"] > 0
    # the oracle at 0.8 verifies more than one token per step; the overhead row compares like with like
    assert rows["tp1 oracle 0.8 cost-free pipelining off"]["tokens_per_step"] > 1
    assert rows["static o8 pipelining off"]["tokens_per_step"] > 1
    assert rows["per-step gRPC overhead (s)"]["same_steps"] is True
    assert rows["tp1 o8 pipelining on"]["gamma_c"] > 0 and rows["tp1 o8 pipelining on"]["draft_cost_s_per_level"] > 0
    concurrent = {(r["verifier"], r["sessions"]): r for r in data["concurrent"]}
    assert set(concurrent) == {("tp1", 1), ("tp1", 3), ("static", 1), ("static", 3)}
    for r in concurrent.values():
        assert r["identical_to_target"] and not r["errors"] and r["tokens"] == r["sessions"] * 12
    peer = data["peer"]
    assert peer["name"] == "transformers generate, static cache" and not peer["compiled"]
    assert peer["tokens"] == 12 and peer["tokens_per_s"] > 0 and peer["token_agreement"] > 0.5
