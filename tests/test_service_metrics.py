"""Prometheus metrics of the services: the text format of specmesh.metrics and its HTTP exporter,
the verifier's per-step and per-turn observations (from a scripted turn), and the drafter's
metered sessions (around the real n-gram drafter)."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
import torch

from drafter_service.metrics import DrafterMetrics, MeteredDrafter
from loadtest.scrape import parse_prometheus
from specmesh.drafters import NgramDrafter
from specmesh.metrics import Counter, Gauge, Histogram, Registry, start_exporter
from specmesh.sampling import SamplingParams
from verifier_service.metrics import VerifierMetrics
from verifier_service.turns import Chunk, Outcome


def test_text_format_counters_gauges_histograms():
    r = Registry()
    c = r.add(Counter("x_total", "Xs.", ["kind"]))
    c.inc(2, "a")
    c.inc(1, 'q"b')
    r.add(Gauge("g", "G.", lambda: 3))
    h = r.add(Histogram("h_seconds", "H.", (0.1, 1.0)))
    for v in (0.05, 0.1, 0.5, 7.0):
        h.observe(v)
    text = r.render()
    assert "# TYPE x_total counter" in text and "# TYPE h_seconds histogram" in text
    assert 'x_total{kind="a"} 2' in text and 'x_total{kind="q\\"b"} 1' in text
    samples = parse_prometheus(text)
    assert samples["g"] == 3
    assert [samples[f'h_seconds_bucket{{le="{b}"}}'] for b in ("0.1", "1", "+Inf")] == [2, 3, 4]  # cumulative
    assert samples["h_seconds_count"] == 4 and samples["h_seconds_sum"] == pytest.approx(7.65)
    with pytest.raises(AssertionError):
        r.add(Counter("x_total", "again"))


def test_exporter_serves_metrics_and_only_metrics():
    server = start_exporter("127.0.0.1", 0, lambda: "up 1\n")
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            assert resp.read() == b"up 1\n" and resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(base + "/", timeout=5)
        assert e.value.code == 404
    finally:
        server.shutdown()


def scripted_turn(out: Outcome, steps: list[tuple[int, int, list[int]]]):
    """Chunks as the verifier yields them, updating `out`'s cumulative stats like the engine:
    each step (drafted, accepted, new token ids) adds 0.01 s of drafting and 0.02 s of verifying."""
    s = out.result.stats
    for drafted, accepted, ids in steps:
        s.steps += 1
        s.drafted_tokens += drafted
        s.accepted_tokens += accepted
        s.draft_s += 0.01
        s.verify_s += 0.02
        out.result.token_ids += ids
        yield Chunk(ids, "x")
    yield Chunk([], "tail")  # the final text flush carries no tokens
    out.finish_reason = "length"


def test_verifier_metrics_per_step_and_per_turn():
    m = VerifierMetrics(lambda: 5)
    out = Outcome(prompt_tokens=10, cached_prompt_tokens=4, timeouts=1, predraft_hits=2, plain_steps=5)
    chunks = list(m.observe(scripted_turn(out, [(8, 3, [1, 2, 3, 4]), (8, 0, [5]), (4, 2, [6, 7, 8])]), out))
    assert len(chunks) == 4
    s = parse_prometheus(m.render())
    p = "specmesh_verifier_"
    assert s[p + 'turns_total{finish="length"}'] == 1 and s[p + "tokens_generated_total"] == 8
    assert s[p + "steps_total"] == 3 and s[p + "drafted_tokens_total"] == 20 and s[p + "accepted_tokens_total"] == 5
    assert s[p + "prompt_tokens_total"] == 10 and s[p + "cached_prompt_tokens_total"] == 4
    assert s[p + "drafter_timeouts_total"] == 1 and s[p + "predraft_hits_total"] == 2 and s[p + "plain_steps_total"] == 5
    # accepted length per step: 3, 0, 2
    assert [s[p + f'accepted_length_bucket{{le="{b}"}}'] for b in (0, 1, 2, 3)] == [1, 1, 2, 3]
    assert s[p + 'tree_size_bucket{le="4"}'] == 1 and s[p + 'tree_size_bucket{le="8"}'] == 3
    assert s[p + "draft_wait_seconds_count"] == 3 and s[p + "draft_wait_seconds_sum"] == pytest.approx(0.03)
    assert s[p + "verify_step_seconds_sum"] == pytest.approx(0.06)
    assert s[p + "acceptance_rate_count"] == 1 and s[p + "acceptance_rate_sum"] == pytest.approx(0.25)
    assert s[p + "ttft_seconds_count"] == 1 and s[p + "tpot_seconds_count"] == 1
    assert s[p + "sessions"] == 5 and s[p + "turns_in_flight"] == 0


def test_verifier_metrics_count_a_cancelled_turn():
    m = VerifierMetrics(lambda: 0)
    out = Outcome()
    stream = m.observe(scripted_turn(out, [(4, 1, [1, 2])] * 5), out)
    next(stream)
    assert parse_prometheus(m.render())["specmesh_verifier_turns_in_flight"] == 1
    stream.close()  # the client went away
    s = parse_prometheus(m.render())
    assert s['specmesh_verifier_turns_total{finish="cancelled"}'] == 1 and s["specmesh_verifier_turns_in_flight"] == 0


def test_metered_drafter_counts_trees_and_sessions():
    m = DrafterMetrics(lambda: 1)
    drafter = MeteredDrafter(NgramDrafter(), m)
    session = drafter.open([5, 6, 7, 5, 6, 7, 5, 6])
    tree = session.draft(4, 4, SamplingParams(), torch.Generator().manual_seed(0))
    assert len(tree) > 0  # the repeated n-gram proposes a continuation
    session.commit([7])
    session.close()
    session.close()
    s = parse_prometheus(m.render())
    p = "specmesh_drafter_"
    assert s[p + "trees_total"] == 1 and s[p + "tree_nodes_total"] == len(tree)
    assert s[p + "sessions_opened_total"] == 1 and s[p + "sessions_closed_total"] == 1
    assert s[p + "draft_seconds_count"] == 1 and s[p + "sessions"] == 1
    assert not hasattr(session, "draft_many"), "the n-gram drafter drafts one tree at a time"


def test_metered_drafter_counts_every_tree_drafted_together():
    from specmesh.drafters import OracleDrafter

    m = DrafterMetrics(lambda: 1)
    session = MeteredDrafter(OracleDrafter(list(range(50)), 1.0, 100), m).open(list(range(20)))
    trees = session.draft_many([20, 18, 17], 4, 4, SamplingParams(), torch.Generator().manual_seed(0), [(), (), ()])
    assert [t.tokens for t in trees] == [list(range(20, 24)), list(range(18, 22)), list(range(17, 21))]
    s = parse_prometheus(m.render())
    p = "specmesh_drafter_"
    assert s[p + "trees_total"] == 3 and s[p + "tree_nodes_total"] == 12 and s[p + "draft_seconds_count"] == 3


def test_drafter_exports_what_its_planner_weighs():
    """The costs the drafter measured (calibration and live calls, verifications reported with
    commits) and its recent sessions' acceptance, as the planner sees them."""
    from specmesh.costs import Costs
    from specmesh.drafters.predraft import DraftAhead, calibrate, main_path
    from specmesh.planner import Acceptance

    m, process, recent = DrafterMetrics(lambda: 1), Costs(), Acceptance()
    m.watch_planner(process, recent)
    ctx = [5, 6, 7, 5, 6, 7, 5, 6]
    calibrate(NgramDrafter().open(ctx), ctx, process)
    costs = process.of_verifier("v1")  # a session of the verifier "v1", as the service opens it
    ahead = DraftAhead(NgramDrafter().open(ctx), len(ctx), SamplingParams(), pipelined=False, costs=costs,
                       recent=recent)
    points = {1: 0.10, 2: 0.11, 3: 0.12, 5: 0.14, 9: 0.30}  # as a verifier sends them
    costs.set_verify_cost(points.items())
    st = ahead.first(4, 4)
    h = [st.tree.tokens[i] for i in main_path(st.tree)]
    ahead.commit(0, h[:1], 99, 4, 4, verify_s=0.25, arrived_at=1.0)
    ahead.commit(1, [], 98, 4, 4, arrived_at=3.0)  # a step that took 2 s: far over its plan
    s = parse_prometheus(m.render())
    p = "specmesh_drafter_"
    assert s[p + 'draft_cost_seconds{call="draft",term="level"}'] == costs.draft.coef[0]
    rows = 1 + len(st.tree)  # the pending token and the nodes of the tree verified in 0.25 s
    # the verifier's points are the shape, the step verified in 0.25 s its scale
    verified = {r: s[p + f'verify_cost_seconds{{verifier="v1",when="alone",rows="{r}"}}'] for r in points}
    assert verified[9] / verified[1] == pytest.approx(points[9] / points[1])
    assert verified[5] / verified[3] == pytest.approx(points[5] / points[3])
    assert verified[1] > points[1] and costs.verify(1.0, rows) < 0.25
    assert s[p + 'step_period_ratio{verifier="v1",kind="speculative"}'] == pytest.approx(costs.period_ratio("speculative"))
    assert costs.period_ratio("speculative") > 2
    assert s[p + 'step_period_ratio{verifier="v1",kind="overlapped"}'] == 1.0
    assert s[p + 'step_period_ratio{verifier="v1",kind="plain"}'] == 1.0
    assert s[p + 'link_seconds{verifier="v1"}'] == costs.link_s
    assert not any('verifier=""' in k for k in s)  # no session named no verifier
    assert s[p + 'acceptance{depth="1",rank="0"}'] == pytest.approx(recent.rate(1, 0))
    assert s[p + 'acceptance{depth="2",rank="0"}'] == pytest.approx(recent.rate(2, 0))


def test_verifier_exports_batching_only_when_batched():
    from types import SimpleNamespace

    from specmesh.batching import BatchingTarget
    from specmesh.model import ModelConfig, Transformer
    from verifier_service.config import VerifierConfig
    from verifier_service.metrics import MeteredVerifier

    cfg = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                      num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=True,
                      attention_bias=False, max_position_embeddings=64)
    model = Transformer(cfg, torch.ones(4)).eval()
    tokenizer = SimpleNamespace(eos_token_id=None)
    plain = parse_prometheus(MeteredVerifier(VerifierConfig(), model, tokenizer).metrics.render())
    assert not any("batch" in k for k in plain)
    batched = BatchingTarget(model)
    v = MeteredVerifier(VerifierConfig(), batched, tokenizer)
    for _ in range(2):
        cache = batched.new_cache(8)
        batched(torch.tensor([1, 2]), torch.arange(2), cache, 0)
    s = parse_prometheus(v.metrics.render())
    assert s["specmesh_verifier_batch_forwards"] == 2 and s["specmesh_verifier_batch_sessions_per_forward"] == 1
