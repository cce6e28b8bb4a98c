"""The verifier's request handling and turn loop in process, on the bundled SmolLM2: `to_turn`
turns a GenerateRequest into a Turn (fields, defaults, the seeded-request rules, errors naming the
field), and `Verifier.run` streams what the engine generates, keeps a session's KV cache for its
next turn, rebuilds from a history, and resumes a turn mid-output."""

from __future__ import annotations

import pytest
import torch

from specmesh.engine import StopConditions, generate
from specmesh.grammar import GrammarSpec
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, verifier_pb2
from verifier_service.config import VerifierConfig
from verifier_service.servicer import VerifierServicer
from verifier_service.turns import Outcome, Verifier

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(1)
    model, tok = load_target(None)
    verifier = Verifier(VerifierConfig(drafter="127.0.0.1:9", max_new_tokens=64), model, tok)
    return model, tok, verifier, VerifierServicer(verifier)


def request(**kw) -> verifier_pb2.GenerateRequest:
    kw.setdefault("max_tokens", 8)
    return verifier_pb2.GenerateRequest(**kw)


def test_to_turn_maps_the_request(bundle):
    _m, tok, verifier, servicer = bundle
    t = servicer.to_turn(request(session_id="s", text="Hello there", stop=["."], stop_token_ids=[5]))
    assert t.session_id == "s" and t.new_ids == tok.encode("Hello there", add_special_tokens=False)
    assert t.stop == StopConditions(8, frozenset({5, tok.eos_token_id}), (".",))
    assert t.drafter == "127.0.0.1:9" and t.spec is not None and not t.spec.fixed and t.derive_deadline
    assert t.history is None and t.structured is None and t.logprobs is None
    t = servicer.to_turn(request(token_ids=verifier_pb2.TokenIds(ids=[1, 2]), ignore_eos=True,
                                 speculation=verifier_pb2.SpeculationOptions(disabled=True)))
    assert t.new_ids == [1, 2] and t.stop.stop_ids == frozenset() and t.spec is None
    # a seeded request does not depend on timing: fixed shape, drafted in turn, the deadline as set
    t = servicer.to_turn(request(sampling=common_pb2.SamplingParams(temperature=0.7, seed=3),
                                 speculation=verifier_pb2.SpeculationOptions(budget=4, depth=2)))
    assert (t.spec.budget, t.spec.depth, t.spec.fixed) == (4, 2, True)
    assert not t.pipelined and not t.derive_deadline and t.params.seed == 3
    t = servicer.to_turn(request(history=verifier_pb2.TokenIds(ids=[1, 2, 3]), resumed_output_tokens=1,
                                 structured=common_pb2.StructuredOutput(regex="a+"), logprobs=2))
    assert t.history == [1, 2, 3] and t.resumed_output == 1 and t.logprobs == 2
    assert t.structured == GrammarSpec("regex", "a+")


@pytest.mark.parametrize("fields, field", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 65}, "max_tokens"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"session_id": "s" * 321}, "session_id"),
    ({"speculation": verifier_pb2.SpeculationOptions(depth=17)}, "speculation.depth"),
    ({"speculation": verifier_pb2.SpeculationOptions(draft_deadline_s=61)}, "speculation.draft_deadline_s"),
    ({"prompt_logprobs": True}, "prompt_logprobs"),
    ({"sampling": common_pb2.SamplingParams(top_p=0)}, "top_p"),
])
def test_to_turn_refuses_bad_fields_naming_them(bundle, fields, field):
    _m, _t, _v, servicer = bundle
    with pytest.raises(ValueError, match=f"^{field}"):
        servicer.to_turn(request(**fields))


def run(verifier: Verifier, servicer: VerifierServicer, **kw) -> tuple[list[int], Outcome]:
    out = Outcome()
    ids = [t for c in verifier.run(servicer.to_turn(request(**kw)), lambda: True, out) for t in c.token_ids]
    return ids, out


def test_the_turn_loop_streams_the_engines_output_and_keeps_the_session(bundle):
    model, tok, verifier, servicer = bundle
    prompt = encode_prompt(tok, "Name three colours.", chat=True)
    stop = StopConditions(12, frozenset([tok.eos_token_id]))
    ref = generate(model, prompt, SamplingParams(), stop).token_ids
    no_spec = verifier_pb2.SpeculationOptions(disabled=True)
    ids, out = run(verifier, servicer, token_ids=verifier_pb2.TokenIds(ids=prompt), max_tokens=12,
                   speculation=no_spec)
    assert ids == ref and out.result.token_ids == ref and out.prompt_tokens == len(prompt)
    # a session's second turn extends its KV cache: only the new tokens are prefilled
    follow = tok.encode(" And two more?", add_special_tokens=False)
    run(verifier, servicer, session_id="chat", token_ids=verifier_pb2.TokenIds(ids=prompt), max_tokens=12,
        speculation=no_spec)
    ids2, out2 = run(verifier, servicer, session_id="chat", token_ids=verifier_pb2.TokenIds(ids=follow),
                     max_tokens=6, speculation=no_spec)
    assert out2.cached_prompt_tokens == len(prompt) + len(ref)
    whole = generate(model, prompt + ref + follow, SamplingParams(), StopConditions(6, stop.stop_ids)).token_ids
    assert ids2 == whole
    # a turn resumed mid-output from a history (another verifier's failover) goes on where it was
    k = len(ref) // 2
    ids3, out3 = run(verifier, servicer, history=verifier_pb2.TokenIds(ids=prompt + ref[:k]),
                     token_ids=verifier_pb2.TokenIds(), resumed_output_tokens=k, max_tokens=12 - k,
                     speculation=no_spec)
    assert ids3 == ref[k:] and out3.cached_prompt_tokens == 0


def test_a_turn_does_not_wait_for_a_session_whose_turn_ended(bundle):
    """With batching, a step waits (up to `gather_s`) for the other recently active sessions to
    join its forward; a session whose turn is over is not coming, so the next session's turn, right
    after, must not wait for it (it did, at every step of its first half second)."""
    import threading

    from specmesh.batching import BatchingTarget

    model, tok, _v, _s = bundle
    slow = BatchingTarget(model, gather_s=60.0)  # a wait for a gone session would take a minute a step
    verifier = Verifier(VerifierConfig(drafter="127.0.0.1:9", max_new_tokens=64), slow, tok)
    servicer = VerifierServicer(verifier)
    prompt = tok.encode("Count to three:", add_special_tokens=False)
    no_spec = verifier_pb2.SpeculationOptions(disabled=True)
    outs: list = []

    def two_turns() -> None:
        for _ in range(2):
            outs.append(run(verifier, servicer, token_ids=verifier_pb2.TokenIds(ids=prompt), max_tokens=4,
                            speculation=no_spec)[0])

    t = threading.Thread(target=two_turns, daemon=True)
    t.start()
    t.join(30)
    assert len(outs) == 2, "the second turn waited for the first one's session"
    assert outs[0] == outs[1] == generate(model, prompt, SamplingParams(), StopConditions(4)).token_ids[:4]
