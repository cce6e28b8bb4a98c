"""Log-probabilities of the target on the bundled SmolLM2: the verification forward's values for
every emitted token equal transformers' fp32 forward on the same tokens, are the same with
speculation on and off, stay aligned with the tokens through stops, and are raw (temperature does
not change them). The prompt's come from the prefill."""

from __future__ import annotations

import pytest
import torch

from specmesh.drafters import bundled_drafter_path
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, TargetSession, generate
from specmesh.loader import bundled_target_path, resolve_folder
from specmesh.logprobs import TokenLogprob
from specmesh.runtime import encode_prompt, load_model_drafter, load_target
from specmesh.sampling import SamplingParams
from specmesh.text import TokenPieces

pytestmark = pytest.mark.slow

PROMPT = "Write a haiku about the sea, then explain it in two sentences."
NEW = 24
TOP = 5
TOL = 1e-4  # fp32, two implementations of the same forward


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    model, tok = load_target(None)
    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(bundled_target_path()), dtype=torch.float32).eval()
    return model, tok, hf, encode_prompt(tok, PROMPT, chat=True)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax at every position: row i is the distribution of ids[i + 1]."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(lps: list[TokenLogprob], ref: torch.Tensor, tokens: list[int]) -> None:
    """Each TokenLogprob against the reference row that predicts its token."""
    assert [lp.token for lp in lps] == tokens
    for i, lp in enumerate(lps):
        row = ref[i]
        assert abs(lp.logprob - float(row[lp.token])) < TOL, (i, lp.logprob, float(row[lp.token]))
        assert len(lp.top) == TOP
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        for tid, v in lp.top:
            assert abs(v - float(row[tid])) < TOL
        # the alternatives are the reference's top ones (up to ties at the last place)
        assert abs(lp.top[-1][1] - float(row.topk(TOP).values[-1])) < TOL


def test_generated_tokens_logprobs_equal_transformers_with_speculation_on_and_off(bundle):
    model, tok, hf, ids = bundle
    stop = StopConditions(NEW, frozenset([tok.eos_token_id]))
    plain = generate(model, ids, SamplingParams(), stop, logprobs=TOP)
    assert len(plain.logprobs) == len(plain.token_ids) == NEW
    ref = hf_logprobs(hf, ids + plain.token_ids)[len(ids) - 1:-1]
    assert_matches(plain.logprobs, ref, plain.token_ids)
    # speculation: the same tokens come from forwards over trees; their logprobs are the same values
    for drafter, spec in ((ModelDrafter(model), SpecConfig(8, 4)),
                          (load_model_drafter(str(bundled_drafter_path())), SpecConfig(4, 4))):
        res = generate(model, ids, SamplingParams(), stop, drafter, spec, logprobs=TOP)
        assert res.stats.accepted_tokens > 0, "the drafter never drafted: speculation untested"
        assert res.token_ids == plain.token_ids
        for a, b in zip(res.logprobs, plain.logprobs):
            assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-5
            assert [i for i, _ in a.top] == [i for i, _ in b.top] or abs(a.top[-1][1] - a.top[-2][1]) < 1e-5


def test_logprobs_are_raw_and_stay_aligned_through_a_stop(bundle):
    model, tok, hf, ids = bundle
    params = SamplingParams(temperature=1.3, top_k=20, seed=7)
    res = generate(model, ids, params, StopConditions(NEW), ModelDrafter(model), SpecConfig(6, 3), logprobs=TOP)
    ref = hf_logprobs(hf, ids + res.token_ids)[len(ids) - 1:-1]
    assert_matches(res.logprobs, ref, res.token_ids)  # not the tempered, top-k'd distribution
    # a stop id inside a step cuts the logprobs where it cuts the tokens
    stop_id = res.token_ids[5]
    cut = generate(model, ids, params, StopConditions(NEW, frozenset([stop_id])), ModelDrafter(model),
                   SpecConfig(6, 3), logprobs=0)
    assert cut.finish_reason == "stop" and cut.token_ids[-1] == stop_id
    assert [lp.token for lp in cut.logprobs] == cut.token_ids and all(lp.top == () for lp in cut.logprobs)


def test_prompt_logprobs_come_from_the_prefill(bundle):
    model, _tok, hf, ids = bundle
    ref = hf_logprobs(hf, ids)
    fresh = TargetSession(model, ids, prompt_logprobs=TOP)
    try:
        first, rest = fresh.prompt_logprobs[0], fresh.prompt_logprobs[1:]
        assert first == TokenLogprob(ids[0], None)  # nothing predicts a context's first token
        assert_matches(rest, ref[:-1], ids[1:])
    finally:
        fresh.close()
    # a follow-up turn's tokens: each one's predecessor is already in the cache
    split = len(ids) // 2
    held = TargetSession(model, ids[:split])
    try:
        assert held.prompt_logprobs is None
        assert_matches(held.extend(ids[split:], TOP), ref[split - 1:-1], ids[split:])
    finally:
        held.close()


def test_token_pieces_give_each_tokens_exact_bytes(bundle):
    _model, tok, _hf, _ids = bundle
    pieces = TokenPieces(tok)
    text = "naïve café – ‘quoted’ 漢字 <|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    raw = b"".join(bytes(pieces(i)[1]) for i in ids)
    assert raw.decode("utf-8") == text
    # a token holding part of a UTF-8 character reads as its bytes, OpenAI's way
    partial = [i for i in ids if pieces(i)[0].startswith("bytes:")]
    assert partial, "expected a token that splits a character"
    for i in partial:
        assert pieces(i)[0] == "bytes:" + "".join(f"\\x{b:02x}" for b in pieces(i)[1])
