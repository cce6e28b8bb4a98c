"""A drafter's head cut to its frequent tokens plus each session's context (specmesh.drafters.head_cut),
on the bundled SmolLM2 GGUF (a 49,152-token vocabulary) loaded as a drafter."""

from __future__ import annotations

import pytest
import torch

from specmesh import loader
from specmesh.drafters.head_cut import ContextVocab, kept_ids
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.sampling import SamplingParams

CUT = 2048
CONTEXT = [1, 504, 3458, 282, 260, 1345, 314, 253, 2630, 30, 198, 41000, 23456, 9000]  # the last three beyond CUT


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> tuple:
    """(the whole head, the head cut to CUT tokens), both requantized to 4 bits as `auto` loads a GGUF drafter."""
    mp = pytest.MonkeyPatch()
    mp.setattr(loader, "cache_root", lambda: tmp_path_factory.mktemp("cache"))
    mp.setattr(loader, "auto_format", lambda path: "gguf")
    path = loader.bundled_target_path()
    try:
        yield loader.load_drafter_weights(path, "auto", head=0), loader.load_drafter_weights(path, "auto", head=CUT)
    finally:
        mp.undo()


def _logits(model, context: list[int]) -> torch.Tensor:
    vocab = ContextVocab(model.head_cut) if model.head_cut is not None else None
    if vocab is not None:
        vocab.add(context)
    tokens = torch.tensor(context)
    return model(tokens, torch.arange(len(tokens)), model.new_cache(32), 0, exact=False,
                 extra_vocab=vocab.value if vocab is not None else None)


def test_a_cut_head_scores_its_tokens_and_the_context_as_the_whole_head_does(drafters):
    whole, cut = drafters
    added = list(loader.load_tokenizer(loader.bundled_target_path()).added_tokens_decoder)
    keep = kept_ids(whole.config.vocab_size, CUT, added)
    assert torch.equal(cut.vocab_map, keep) and len(keep) == CUT + sum(t >= CUT for t in added)
    assert "head: %d of 49152 tokens, and each session's context" % len(keep) in cut.weight_format.describe()
    got, want = _logits(cut, CONTEXT), _logits(whole, CONTEXT)
    # the kept rows are the whole head's rows, requantized alike: the same logits to the bit
    assert torch.equal(got[:, keep], want[:, keep])
    # a context token beyond the cut is scored from its row as the whole head holds it (fp32
    # activations here, the kernel's 8-bit ones there)
    extra = torch.tensor([t for t in CONTEXT if t >= CUT])
    torch.testing.assert_close(got[:, extra], want[:, extra], atol=0.03 * float(want.std()), rtol=0.02)
    # every other token: probability 0 from the drafter
    scored = torch.zeros(whole.config.vocab_size, dtype=torch.bool)
    scored[keep] = True
    scored[extra] = True
    assert torch.isinf(got[:, ~scored]).all() and torch.isfinite(got[:, scored]).all()


def test_context_vocab_grows_with_commits_and_skips_the_heads_own_tokens(drafters):
    _, cut = drafters
    v = ContextVocab(cut.head_cut)
    assert v.value is None
    v.add([5, 7, 40000])
    v.add([40000, 41000, 6])
    ids, rows = v.value
    assert ids.tolist() == [40000, 41000] and rows.shape == (2, cut.config.hidden_size)
    assert torch.equal(rows, cut.head_cut.rows(ids))


def test_speculation_with_a_cut_head_drafter_is_lossless(drafters):
    """Greedy through trees of the cut drafter equals plain decoding; its trees' q put mass only on
    tokens it can score (what the verifier's residual rule takes as the drafter's distribution)."""
    _, cut = drafters
    target = loader.load_model(loader.bundled_target_path(), "gguf")
    prompt = CONTEXT[:11]
    plain = generate(target, prompt, SamplingParams(), StopConditions(32)).token_ids
    drafter = ModelDrafter(cut)
    for spec in (SpecConfig(4, 4, fixed=True), SpecConfig(8, 3, fixed=True)):  # trees every step
        out = generate(target, prompt, SamplingParams(), StopConditions(32), drafter, spec)
        assert out.token_ids == plain, spec
        assert out.stats.accepted_tokens > 0
    session = drafter.open(CONTEXT)
    tree = session.draft(8, 3, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    allowed = set(cut.vocab_map.tolist()) | set(CONTEXT)
    assert set(tree.tokens) <= allowed
    for ids, probs in zip(tree.q_ids, tree.q_probs):
        assert {i for i, q in zip(ids, probs) if q > 0} <= allowed


def test_a_cut_is_refused_where_it_cannot_be_made():
    from specmesh.drafters import bundled_drafter_path

    with pytest.raises(ValueError, match="draft_vocab"):
        loader.load_drafter_weights(bundled_drafter_path(), torch.float32, head=1024)
    with pytest.raises(ValueError, match="draft_vocab"):
        loader.load_drafter_weights(loader.bundled_target_path(), "gguf", head=1024)
