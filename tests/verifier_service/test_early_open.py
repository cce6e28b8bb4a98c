"""A pipelined turn with a drafter on cores of its own opens its drafter session before the
target's prefill, so that the drafter's prefill and first tree run beside it (time to first token);
a turn whose drafter shares the verifier's cores, and a feature drafter (it needs the prefill's
features), open it after. A first tree that was ready before it was asked for does not set the
wait a derived deadline allows, and a wait that times out lengthens the next one. Through a real
drafter service and the verifier's real link, on the bundled SmolLM2 with a model drafter of the
same weights; output identical to plain decoding."""

from __future__ import annotations

import pytest
import torch

import verifier_service.turns as turns
from drafter_service.config import DrafterServiceConfig
from drafter_service.server import start_server
from drafter_service.sessions import SessionStore
from specmesh.costs import Costs
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.planner import Acceptance
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams
from tests.slow_drafter import SlowDrafter
from verifier_service.config import VerifierConfig

pytestmark = pytest.mark.slow

SLOW_S = 0.08  # a slow drafter's every draft call takes this much longer: far more than a target step


@pytest.fixture(scope="module", params=["quick", "slow"])
def served(request):
    torch.set_num_threads(1)
    model, tok = load_target(None)
    drafter = ModelDrafter(model) if request.param == "quick" else SlowDrafter(ModelDrafter(model), SLOW_S)
    server, _health, port = start_server(DrafterServiceConfig(port=0), drafter, model.config.vocab_size,
                                         SessionStore(8, 600.0), Costs(), Acceptance())
    address = f"127.0.0.1:{port}"
    verifier = turns.Verifier(VerifierConfig(drafter=address, max_new_tokens=64), model, tok)
    yield model, tok, verifier, address, request.param
    verifier.shutdown()
    server.stop(0)


@pytest.mark.parametrize("pipelined, shares_cores, early", [(True, False, True), (True, True, False),
                                                            (False, False, False)])
def test_the_drafter_session_opens_before_the_prefill_only_beside_it(served, monkeypatch, pipelined, shares_cores,
                                                                     early) -> None:
    model, tok, verifier, address, kind = served
    sid = f"s-{pipelined}-{shares_cores}"
    seen = []

    class Recorded(turns.TargetSession):
        def __init__(self, *args, **kwargs) -> None:
            seen.append(verifier.sessions._sessions[sid].drafts is not None)  # at the prefill's start
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(turns, "TargetSession", Recorded)
    ids = encode_prompt(tok, "Name three colours.", chat=True)
    stop = StopConditions(24, frozenset())
    # a tree every step: for a drafter as big as its target the planner may rightly plan one-row steps
    spec = SpecConfig(fixed=True)
    turn = turns.Turn(sid, ids, SamplingParams(), stop, address, spec, pipelined, 5.0,
                      derive_deadline=True, shares_cores=shares_cores)
    out = turns.Outcome()
    got = [t for c in verifier.run(turn, lambda: True, out) for t in c.token_ids]
    assert seen == [early]
    assert got == generate(model, ids, SamplingParams(), stop).token_ids
    assert out.result.stats.accepted_tokens > 0  # the drafter's trees were verified (its own model: all taken)
    if kind == "slow" and early:  # its first tree, ready at the first step, set no wait (it left them
        assert out.timeouts <= 1, out.timeouts  # all at the deadline's floor, below a slow drafter's trees)
    # the next turn of the session extends the same drafter session
    drafts = verifier.sessions._sessions[sid].drafts
    more = [t for c in verifier.run(turns.Turn(sid, [tok.eos_token_id], SamplingParams(), StopConditions(8, frozenset()),
                                               address, spec, pipelined, 5.0, shares_cores=shares_cores),
                                    lambda: True, turns.Outcome()) for t in c.token_ids]
    assert len(more) == 8 and verifier.sessions._sessions[sid].drafts is drafts and seen == [early]


def test_a_wait_that_timed_out_lengthens_the_next(served) -> None:
    model, tok, verifier, address, kind = served
    sid = f"backoff-{kind}"
    ids = encode_prompt(tok, "Name three colours.", chat=True)

    def turn(new_ids, n):
        out = turns.Outcome()
        t = turns.Turn(sid, new_ids, SamplingParams(), StopConditions(n, frozenset()), address,
                       SpecConfig(4, 2, fixed=True), False, 5.0, derive_deadline=True)
        got = [t for c in verifier.run(t, lambda: True, out) for t in c.token_ids]
        return got, out

    first, _ = turn(ids, 4)
    drafts = verifier.sessions._sessions[sid].drafts
    drafts.slowest_s = 0.0  # as though every tree so far had been ready at once: the floor's wait
    got, out = turn([first[-1]], 24)
    steps = out.result.stats.steps
    assert out.result.stats.accepted_tokens > 0
    # the floor (20 ms), then 3x each wait that timed out: a slow drafter's trees come after a few
    assert verifier.sessions._sessions[sid].drafts is drafts and out.timeouts <= 3, (out.timeouts, steps)
