"""Tests for specmesh.model and specmesh.loader, and the target side of specmesh.engine.

- Parity: our Transformer's logits equal transformers' own forward (fp32, max abs diff 1e-4) for
  tiny random models of every supported family, for prefill, chunked prefill and token-by-token
  decode over our KV cache, after loading from an HF folder or a .safetensors file, and for the
  bundled SmolLM2.
- Tree verification: the logits `TargetSession.step` computes for each tree node equal those of
  decoding that node's path token by token on a fresh cache.
- Commit: after a step, the cache holds exactly prompt + accepted path, and the next step's logits
  are those of a fresh cache fed the same tokens; greedy generation is identical with any drafter.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from specmesh.drafters import NgramDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, TargetSession, generate
from specmesh.loader import bundled_target_path, load_model, load_tokenizer, model_from_hf, resolve_folder
from specmesh.model import Transformer
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import DraftTree, depths, path_to, tree_attention_mask
from tests.tiny_models import random_hf_model

TOL = 1e-4
VOCAB = 96
SEQ_LEN = 32

_SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per K/V head
    max_position_embeddings=256,
)
# Llama 3.1 style scaling; original_max_position_embeddings small enough that, with head_dim 16,
# some frequencies are kept, some interpolated and some divided by `factor`.
_LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0,
    low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32,
)
FAMILIES = {
    "llama": lambda: LlamaConfig(**_SMALL, tie_word_embeddings=False),
    "llama-tied": lambda: LlamaConfig(**_SMALL, tie_word_embeddings=True),
    "llama3-rope": lambda: LlamaConfig(**_SMALL, rope_parameters=dict(_LLAMA3_ROPE)),
    "mistral": lambda: MistralConfig(**_SMALL),
    "qwen2": lambda: Qwen2Config(**_SMALL),  # q/k/v biases
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _hf_model(family: str, seed: int = 0):
    """A seeded random transformers model whose every parameter (norms and biases included) is
    far from its default init, so logits are O(1) and a wrong weight or missing bias shows."""
    cfg = FAMILIES[family]()
    return random_hf_model(cfg, seed)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0].float()  # [T, V]


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert want.std() > 0.3, "reference logits too flat for the tolerance to mean anything"
    diff = (got - want).abs().max().item()
    assert diff <= TOL, f"max abs diff {diff:.3g} > {TOL}"


def _random_ids(n: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _tiny(family: str = "llama", seed: int = 0) -> Transformer:
    hf = _hf_model(family, seed)
    return model_from_hf(hf.config, hf.state_dict())


# --- parity with transformers -------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(family):
    hf = _hf_model(family)
    ours = model_from_hf(hf.config, hf.state_dict())
    ids = _random_ids(SEQ_LEN, seed=1)
    got = ours(ids, torch.arange(SEQ_LEN), ours.new_cache(), 0)  # [T, V]
    _assert_close(got, _hf_logits(hf, ids))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "chunks",
    [[8] + [1] * (SEQ_LEN - 8), [5, 7, 1, 1, 11, 7]],
    ids=["prefill-then-decode", "chunked"],
)
def test_cached_decode_matches_full_forward(family, chunks):
    """Feeding the sequence in pieces over our cache gives the full forward's logits per position."""
    assert sum(chunks) == SEQ_LEN
    hf = _hf_model(family)
    ours = model_from_hf(hf.config, hf.state_dict())
    ids = _random_ids(SEQ_LEN, seed=2)
    cache = ours.new_cache(capacity=4)  # small: the forward must grow it as it goes
    rows, start = [], 0
    for n in chunks:
        rows.append(ours(ids[start:start + n], torch.arange(start, start + n), cache, start))
        cache.commit(list(range(start, start + n)))
        start += n
    assert cache.length == SEQ_LEN
    _assert_close(torch.cat(rows), _hf_logits(hf, ids))


def test_qwen2_biases_are_loaded():
    """The Qwen2 parity cases are only meaningful if the q/k/v biases exist and are non-zero."""
    hf = _hf_model("qwen2")
    attn = model_from_hf(hf.config, hf.state_dict()).model.layers[0].self_attn
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.bias is not None and proj.bias.abs().min() > 0
    assert attn.o_proj.bias is None


@pytest.mark.parametrize("family,tied", [("llama", False), ("llama-tied", True)])
def test_tied_embeddings_share_one_tensor(family, tied):
    ours = _tiny(family)
    same = ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert same == tied


def test_llama3_rope_scaling_changes_frequencies():
    """Guards the llama3 parity case: its frequencies must differ from the default rope's."""
    plain, scaled = _tiny("llama"), _tiny("llama3-rope")
    assert not torch.allclose(plain.inv_freq, scaled.inv_freq)
    assert torch.equal(plain.inv_freq[0], scaled.inv_freq[0])  # the highest frequency is kept


@pytest.mark.parametrize("family", ["llama", "llama-tied", "qwen2"])
def test_load_model_from_saved_folder_and_safetensors_file(family, tmp_path):
    hf = _hf_model(family)
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    assert weights.is_file()
    ids = _random_ids(SEQ_LEN, seed=3)
    want = _hf_logits(hf, ids)
    for path in (tmp_path, weights):
        ours = load_model(path)
        _assert_close(ours(ids, torch.arange(SEQ_LEN), ours.new_cache(), 0), want)


def test_load_model_rejects_unknown_paths(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .gguf"):
        load_model(tmp_path / "weights.bin")


@pytest.mark.slow  # ~3 s with the converted model cached; ~40 s when the GGUF is converted first
def test_bundled_smollm2_prefill_matches_transformers():
    path = bundled_target_path()
    ours = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(path), dtype=torch.float32).eval()
    tok = load_tokenizer(path)
    messages = [{"role": "user", "content": "Name three primary colours and say why they are primary."}]
    ids = torch.tensor(tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])
    assert ids.shape[0] > 20
    got = ours(ids, torch.arange(ids.shape[0]), ours.new_cache(), 0)
    _assert_close(got, _hf_logits(hf, ids))


# --- tree verification and commit through TargetSession -----------------------------------------

#            root (pending)
#        /       |        \
#      0         1          2
#      |       /   \
#      3      4     5      node 5 repeats node 4's token: duplicate siblings are allowed
#      |      |     |
#      6      7     8
TREE_PARENTS = [-1, -1, -1, 0, 1, 1, 3, 4, 5]
ACCEPT_PATH = [1, 4, 7]  # the path test_commit_keeps_exactly_the_accepted_path steers greedy along
TREES = {
    "tree": DraftTree(tokens=[11, 12, 13, 14, 15, 15, 16, 17, 18], parents=TREE_PARENTS),
    "chain": DraftTree.chain([21, 22, 23, 24]),
    "empty": DraftTree.empty(),
}


def _sequential_logits(model: Transformer, prefix: list[int], path: list[int]) -> torch.Tensor:
    """[len(path) + 1, V]: logits after `prefix`, then after each path token fed one at a time,
    on a fresh cache."""
    cache = model.new_cache()
    n = len(prefix)
    rows = [model(torch.tensor(prefix), torch.arange(n), cache, 0, logits_rows=slice(-1, None))]
    cache.commit(list(range(n)))
    for tok in path:
        rows.append(model(torch.tensor([tok]), torch.tensor([cache.length]), cache, cache.length))
        cache.commit([cache.length])
    return torch.cat(rows)


def _step_recording_logits(session: TargetSession, tree: DraftTree):
    """Run one TargetSession.step and return (result, new tokens, the forward's logits [1+N, V])."""
    seen: list[torch.Tensor] = []
    hook = session.model.register_forward_hook(lambda _m, _args, out: seen.append(out))
    try:
        result, new = session.step(tree, SamplingParams(), make_generator(SamplingParams(seed=0)))
    finally:
        hook.remove()
    assert len(seen) == 1, "a step is one forward"
    return result, new, seen[0]


def _assert_rows_match_paths(model, prefix: list[int], tree: DraftTree, logits: torch.Tensor) -> None:
    assert logits.shape == (len(tree) + 1, VOCAB)
    _assert_close(logits[0], _sequential_logits(model, prefix, [])[0])
    for i in range(len(tree)):
        path = [tree.tokens[j] for j in path_to(tree.parents, i)]
        want = _sequential_logits(model, prefix, path)[-1]
        diff = (logits[i + 1] - want).abs().max().item()
        assert diff <= TOL, f"node {i} (path {path}): max abs diff {diff:.3g}"


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tree_name", TREES)
def test_tree_rows_equal_sequential_decoding(family, tree_name):
    model = _tiny(family)
    prompt = _random_ids(12, seed=4).tolist()
    session = TargetSession(model, prompt)
    _, _, logits = _step_recording_logits(session, TREES[tree_name])
    _assert_rows_match_paths(model, prompt, TREES[tree_name], logits)


def test_inexact_rows_attend_row_by_row_where_the_kernel_runs():
    """A drafter's forward (`exact=False`, a tree mask over scratch slots) takes the row kernel on a
    CPU in fp32, faster there than batched SDPA: its rows then equal the exact forward's to the
    bit. Where the kernel cannot run (head dim 16 here), batched SDPA agrees up to rounding."""
    from specmesh.kernels import attention
    from specmesh.model import causal_mask

    for heads, kernel in ((2, attention.available()), (4, False)):  # head dim 32, then 16
        hf = random_hf_model(LlamaConfig(**{**_SMALL, "num_attention_heads": heads, "num_key_value_heads": 1}), 0)
        model = model_from_hf(hf.config, hf.state_dict())
        prompt = _random_ids(12, seed=5)
        tree = TREES["tree"]
        node_depth = depths(tree.parents)
        mask = torch.ones(len(tree), 12 + len(tree), dtype=torch.bool)
        mask[:, 12:] = tree_attention_mask(tree.parents)
        out = {}
        for exact in (True, False):
            cache = model.new_cache()
            model(prompt, torch.arange(12), cache, 0, causal_mask(0, 12), logits_rows=None)
            cache.commit(list(range(12)))
            out[exact] = model(torch.tensor(tree.tokens), torch.tensor([11 + d for d in node_depth]), cache, 12, mask,
                               exact=exact)
        if kernel:
            assert torch.equal(out[False], out[True])
        else:
            _assert_close(out[False], out[True])


def _steered_tree(greedy: list[int], accept: int) -> DraftTree:
    """TREE_PARENTS with tokens chosen so greedy verification accepts ACCEPT_PATH[:accept]:
    the path's nodes carry the target's greedy tokens up to `accept`, then a wrong one; every
    sibling of a path node carries a wrong token."""
    tokens = []
    for i, depth in enumerate(depths(TREE_PARENTS)):
        d = depth - 1  # index into `greedy`
        if i in ACCEPT_PATH:
            tokens.append(greedy[d] if d < accept else (greedy[d] + 1) % VOCAB)
        else:
            tokens.append((greedy[d] + 2 + i) % VOCAB)
    return DraftTree(tokens=tokens, parents=TREE_PARENTS)


@pytest.mark.parametrize("accept", [0, 1, 2, 3])
def test_commit_keeps_exactly_the_accepted_path(accept):
    model = _tiny("llama")
    prompt = _random_ids(10, seed=5).tolist()
    # The target's own greedy continuation decides what a tree may get accepted.
    greedy: list[int] = []
    for _ in range(4):
        greedy.append(int(_sequential_logits(model, prompt, greedy)[-1].argmax()))
    tree = _steered_tree(greedy, accept)

    session = TargetSession(model, prompt)
    result, new, _ = _step_recording_logits(session, tree)
    assert result.accepted == ACCEPT_PATH[:accept]
    expected_new = greedy[:accept] + [greedy[accept]]  # accepted tokens, then the bonus
    assert new == expected_new
    assert session.tokens == prompt + expected_new
    assert session.pending == greedy[accept]

    # 1. the cache holds exactly prompt + accepted tokens (the bonus is the new pending token)
    kept = prompt + greedy[:accept]
    assert session.cache.length == len(kept)
    fresh = model.new_cache()
    model(torch.tensor(kept), torch.arange(len(kept)), fresh, 0, logits_rows=None)
    for got, want in ((session.cache.k, fresh.k), (session.cache.v, fresh.v)):
        diff = (got[:, :, :len(kept)] - want[:, :, :len(kept)]).abs().max().item()
        assert diff <= TOL, f"cache differs from a fresh prefill by {diff:.3g}"

    # 2. the next step (another tree, on top of the stale scratch slots) sees just that context
    second = TREES["tree"]
    _, _, logits = _step_recording_logits(session, second)
    _assert_rows_match_paths(model, prompt + expected_new, second, logits)


def test_rollback_then_step_matches_fresh_context():
    model = _tiny("llama")
    prompt = _random_ids(10, seed=6).tolist()
    session = TargetSession(model, prompt)
    _, first, _ = _step_recording_logits(session, TREES["chain"])
    _step_recording_logits(session, TREES["tree"])
    session.rollback(len(prompt) + 1)
    kept = prompt + first[:1]
    assert session.tokens == kept and session.pending == first[0]
    _, _, logits = _step_recording_logits(session, TREES["chain"])
    _assert_rows_match_paths(model, kept, TREES["chain"], logits)


@pytest.mark.parametrize("spec", [SpecConfig(budget=6, depth=3), SpecConfig(budget=4, depth=4)],
                         ids=["tree", "chain"])
@pytest.mark.parametrize("drafter_name", ["ngram", "self"])
def test_greedy_generation_is_identical_with_any_drafter(drafter_name, spec):
    model = _tiny("llama")
    prompt = _random_ids(16, seed=7).tolist()
    stop = StopConditions(max_new_tokens=40)
    plain = generate(model, prompt, SamplingParams(), stop)
    drafter = NgramDrafter() if drafter_name == "ngram" else ModelDrafter(model)
    spec_out = generate(model, prompt, SamplingParams(), stop, drafter, spec)
    assert len(plain.token_ids) == 40
    assert spec_out.token_ids == plain.token_ids
    assert spec_out.stats.accepted_tokens > 0, "speculation never accepted: the comparison is vacuous"
    assert spec_out.stats.steps < plain.stats.steps
