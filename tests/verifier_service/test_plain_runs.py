"""Plain runs through a real drafter service and the verifier's real link: when the drafter's
planner predicts that not speculating is faster, the verifier takes a run of one-row steps
without asking for trees and sends their tokens (with the target's features, for a feature
drafter) in one extension. Output identical to plain decoding; the drafter's session holds
exactly the target's features afterwards; a second turn resumes mid-run."""

from __future__ import annotations

import time

import pytest
import torch

from drafter_service.config import DrafterServiceConfig
from drafter_service.server import start_server
from drafter_service.sessions import SessionStore
from specmesh.costs import Costs
from specmesh.drafters import bundled_drafter_path
from specmesh.drafters.feature import FeatureDrafter
from specmesh.drafters.predraft import PROBE_EVERY
from specmesh.engine import SpecConfig, StopConditions, TargetSession, run_turn
from specmesh.loader import load_drafter_weights
from specmesh.planner import Acceptance
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams, make_generator
from tests.slow_drafter import SlowDrafter
from verifier_service.drafter_link import DrafterLink, RemoteDrafts

# the shipped feature drafter with every draft call this much slower (a drafter on a slow device): far
# more than the target's one-row step, so the planner measures that and stops asking for trees
DRAFT_SLEEP_S = 0.2


@pytest.fixture(scope="module")
def served():
    torch.set_num_threads(1)
    model, tok = load_target(None)
    drafter = SlowDrafter(FeatureDrafter(load_drafter_weights(str(bundled_drafter_path()), torch.float32)),
                          DRAFT_SLEEP_S)
    store = SessionStore(8, 600.0)
    recent = Acceptance()  # evidence enough that no first trees are probes
    recent.tried[0][0], recent.accepted[0][0] = 64.0, 32.0
    server, _health, port = start_server(DrafterServiceConfig(port=0), drafter, model.config.vocab_size, store,
                                         Costs(), recent)
    link = DrafterLink(f"127.0.0.1:{port}", 64 << 20)
    yield model, tok, store, link
    link.shutdown()
    server.stop(0)


def test_a_plain_run_is_one_extension_with_the_targets_features(served) -> None:
    model, tok, store, link = served
    ids = encode_prompt(tok, "Write a short story about a lighthouse keeper.", chat=True)
    n = 3 * (PROBE_EVERY + 1)
    stop = StopConditions(n, frozenset())
    params = SamplingParams()
    plain = list(run_turn(TargetSession(model, ids), None, params, make_generator(params), stop))

    target = TargetSession(model, ids, features=True)
    source = RemoteDrafts(link, "plain", target, params, SpecConfig(budget=4, depth=2), False, deadline_s=30.0)
    got = list(run_turn(target, source, params, make_generator(params), stop))
    assert sum(got, []) == sum(plain, [])
    # the planner chose no tree for most steps: each run of PROBE_EVERY steps went out at once
    assert source.plain_steps >= PROBE_EVERY
    held = store.get(source.sid)
    assert held is not None
    # a second turn cut the last run short: its tokens travel with the turn's extension
    more = [int(t) for t in tok.encode(" Go on.")]
    target.extend(more)
    assert source.resume(link, target, params, source.spec, False, 30.0)
    list(run_turn(target, source, params, make_generator(params), StopConditions(PROBE_EVERY // 2, frozenset())))
    time.sleep(0.5)  # the last extension reaches the drafter
    session = held.session.inner
    drafted_to = len(session.context)
    assert session.context == target.tokens[:drafted_to] and drafted_to >= len(target.tokens) - PROBE_EVERY
    # row j of the drafter's features is the target's state at token j: fp16 on the wire
    torch.testing.assert_close(session.features.view()[:drafted_to - 1].float(),
                               target.features[:drafted_to - 1].float(), rtol=1e-2, atol=1e-2)


def test_the_verifiers_live_steps_reach_the_next_sessions_points(served) -> None:
    """A verifier's start-up points, far off (every row count 10x too cheap): the steps of a
    session taken alone, plain-run steps included, are what the next session's open sends the
    drafter, and the drafter's planner takes that shape."""
    from specmesh.costs import StepTable

    model, tok, store, link = served
    ids = encode_prompt(tok, "Name three rivers.", chat=True)
    table = StepTable([(1, 1e-5), (2, 1.1e-5), (3, 1.2e-5), (5, 1.4e-5)])
    params = SamplingParams()
    target = TargetSession(model, ids, features=True)
    source = RemoteDrafts(link, "live-a", target, params, SpecConfig(budget=4, depth=2), False, deadline_s=30.0,
                          steps=table)
    list(run_turn(target, source, params, make_generator(params), StopConditions(2 * PROBE_EVERY, frozenset())))
    assert len(table.live[1]) >= StepTable.MIN_LIVE  # the plain runs' one-row steps
    points = dict(table.points())
    assert points[1] > 1e-3 and points[5] > 1e-3  # measured, or scaled by what was measured
    second = RemoteDrafts(link, "live-b", TargetSession(model, ids, features=True), params,
                          SpecConfig(budget=4, depth=2), False, deadline_s=30.0, steps=table)
    try:
        time.sleep(0.5)  # the open reaches the drafter
        costs = store.get(second.sid).costs
        assert dict(costs.verify_points)[1] == pytest.approx(points[1], rel=1e-6)
    finally:
        second.close()
