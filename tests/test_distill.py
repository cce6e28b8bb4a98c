"""Drafter distillation (specmesh/distill) and reduced-vocabulary drafters: the pieces on a tiny
random model (training lowers the loss, checkpoints resume, export loads into our runtime with the
same logits, the drafter stays lossless), the data recorder on the bundled target, and the drafter
shipped for the bundled target (held-out acceptance, default of `specmesh generate`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from specmesh.distill import train
from specmesh.distill.prompts import is_heldout, prompts
from specmesh.drafters import bundled_drafter_path, resolve_auto
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.loader import VOCAB_MAP_KEY, load_model, target_embeddings
from specmesh.sampling import SamplingParams
from tests.tiny_models import tiny_distillation_setup

VOCAB = 96


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return tiny_distillation_setup(VOCAB)


def test_prompt_splits_are_disjoint_by_topic():
    tr, ho = prompts("train"), prompts("heldout")
    assert len(tr) > 1000 and 50 < len(ho) < len(tr) / 4
    assert not set(tr) & set(ho)
    assert prompts("heldout") == ho  # deterministic
    with pytest.raises(ValueError, match="split"):
        prompts("test")
    assert all(is_heldout(t) == is_heldout(t) for t in ("recursion", "bees"))  # a pure function of the topic


def test_distillation_learns_and_export_loads_into_the_runtime(tiny, tmp_path):
    cfg, hf, target, examples = tiny
    vocab_map = train.choose_vocab(examples, 48, VOCAB, always=[1])
    assert len(vocab_map) == 48 and 1 in vocab_map.tolist()
    student = train.build_student(hf, 1, vocab_map)
    local_of = train.local_index(vocab_map, VOCAB)
    before = train.evaluate(student, examples[:6], vocab_map, local_of)
    tc = train.TrainConfig(layers=1, draft_vocab=48, lr=3e-3, batch_tokens=256, minutes=5, max_epochs=6,
                           warmup_steps=3, checkpoint_every=5)
    result = train.train(student, examples, examples[:6], vocab_map, VOCAB, tc, tmp_path / "ckpt.pt",
                         log=lambda *a, **k: None)
    assert result["final_loss"] < 0.9 * result["first_loss"], result  # soft targets: entropy stays
    assert result["greedy_acceptance"] > before["greedy_acceptance"] + 0.2, (before, result)

    # A finished run resumes from its checkpoint without training again.
    steps = result["steps"]
    again = train.train(student, examples, examples[:6], vocab_map, VOCAB, tc, tmp_path / "ckpt.pt",
                        log=lambda *a, **k: None)
    assert again["steps"] == steps

    out = tmp_path / "drafter"
    train.export(student, vocab_map, hf, out, None, {"test": True}, dtype=torch.float32)
    drafter = load_model(out)
    assert drafter.config.draft_vocab_size == 48 and drafter.lm_head.weight.shape == (48, 32)
    ids = examples[0]["tokens"][:20].long()
    with torch.no_grad():
        ref = student(ids[None], torch.ones(1, 20, dtype=torch.long))[0]
    logits = drafter(ids, torch.arange(20), drafter.new_cache(32), 0)
    torch.testing.assert_close(logits[:, vocab_map], ref, atol=1e-4, rtol=1e-4)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[vocab_map] = False
    assert torch.isneginf(logits[:, outside]).all()

    # Lossless with a reduced-vocabulary drafter: greedy and seeded sampling equal target-only runs.
    d = ModelDrafter(drafter)
    for prompt in ([5, 9, 17, 33], [70, 2, 2, 41, 8]):
        stop = StopConditions(20)
        plain = generate(target, prompt, SamplingParams(), stop).token_ids
        res = generate(target, prompt, SamplingParams(), stop, d, SpecConfig(6, 3))
        assert res.token_ids == plain and res.stats.steps < len(plain)


def test_batched_greedy_data_is_each_prompts_own_greedy_decoding(tiny):
    """The data generator (many prompts per forward, each with its own cache) records exactly what
    single-sequence greedy decoding produces, stops each row at its EOS (kept), and its features
    are the teacher-forced ones."""
    from specmesh.distill.data import greedy_batch
    from specmesh.distill.feature import target_features

    _cfg, _hf, target, _ = tiny
    g = torch.Generator().manual_seed(5)
    prompts_ = [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5, 12)]
    ref = [generate(target, p, SamplingParams(), StopConditions(10)).token_ids for p in prompts_]
    eos = {ref[1][3]}  # row 1 must stop at its 4th token; others may too, wherever it appears
    want = []
    for r in ref:
        cut = next((k + 1 for k, t in enumerate(r) if t in eos), len(r))
        want.append(r[:cut])
    assert len(want[1]) <= 4
    for ex, p, w in zip(greedy_batch(target, prompts_, 10, eos, features=True), prompts_, want):
        assert ex["tokens"].tolist() == p + w and ex["start"] == len(p)
        assert ex["topk_ids"][:, 0].tolist() == w  # the recorded top-1 is the token taken
        assert ex["topk_p"].shape == (len(w), 8) and (ex["topk_p"].float().sum(-1) <= 1.001).all()
        assert (ex["topk_p"][:, :-1] >= ex["topk_p"][:, 1:]).all()
        torch.testing.assert_close(ex["feats"].float(), target_features(target, ex["tokens"]).float(),
                                   rtol=2e-3, atol=2e-3)
    plain = greedy_batch(target, prompts_, 10, eos)
    assert [e["tokens"].tolist() for e in plain] == [p + w for p, w in zip(prompts_, want)]
    assert all("feats" not in e for e in plain)


def test_reduced_vocab_weights_must_carry_their_map(tiny, tmp_path):
    cfg, hf, target, examples = tiny
    vocab_map = train.choose_vocab(examples, 40, VOCAB, always=[1])
    out = tmp_path / "d"
    train.export(train.build_student(hf, 1, vocab_map), vocab_map, hf, out, None, {})
    from safetensors.torch import load_file, save_file

    state = load_file(out / "model.safetensors")
    del state[VOCAB_MAP_KEY]
    save_file(state, out / "model.safetensors")
    with pytest.raises(ValueError, match="vocab_map"):
        load_model(out)


def test_shared_embeddings_need_the_target():
    with pytest.raises(FileNotFoundError, match="sha256 0123456789abcdef"):
        target_embeddings("0123456789abcdef" * 4)


# --- the drafter shipped for the bundled target ---------------------------------------------

@pytest.fixture(scope="module")
def bundled():
    from specmesh.runtime import load_target

    torch.set_num_threads(2)
    return load_target(None)


def test_chat_data_goes_through_the_chat_template_in_resumable_shards(bundled, tmp_path):
    from specmesh.distill.data import generate_chat, load_examples
    from specmesh.runtime import encode_prompt

    model, tok = bundled
    texts = ["Name a colour.", "Write one sentence about the history of tea in China.", "Hi."]
    eos = {tok.eos_token_id}
    assert generate_chat(model, tok, texts, tmp_path, 4, eos, batch_size=2, features=True) == 3
    shards = sorted(tmp_path.glob("chat-*.pt"))
    assert len(shards) == 2
    stamp = [s.stat().st_mtime_ns for s in shards]
    examples = load_examples(tmp_path)
    assert [e["prompt"] for e in examples] == ["Hi.", "Name a colour.", texts[1]]  # shortest first
    for e in examples:
        ids = encode_prompt(tok, e["prompt"], chat=True)
        assert e["tokens"][:e["start"]].tolist() == ids and 1 <= len(e["topk_ids"]) <= 4
        assert e["feats"].shape == (len(e["tokens"]), model.config.hidden_size)
    generate_chat(model, tok, texts, tmp_path, 4, eos, batch_size=2, features=True)  # resumes: nothing to do
    assert [s.stat().st_mtime_ns for s in shards] == stamp


def test_shipped_drafter_is_the_default_for_the_bundled_target():
    assert (bundled_drafter_path() / "model.safetensors").is_file()
    recipe = json.loads((bundled_drafter_path() / "recipe.json").read_text())
    assert recipe["command"].startswith("specmesh train-drafter")
    assert resolve_auto("auto", None) == f"model:{bundled_drafter_path()}"
    assert resolve_auto("auto", "/some/other/target.gguf") == "ngram"
    assert resolve_auto("none", None) == "none"


@pytest.mark.slow
@pytest.mark.parametrize("which, floor", [("smollm2_135m", 0.40), ("smollm2_135m_token", 0.30)])
def test_shipped_drafter_heldout_acceptance(bundled, which, floor):
    """Greedy per-token acceptance, teacher-forced on the target's own greedy answers to held-out
    prompts (topics never trained on); the feature drafter gets the target's features of the prefix
    (its first draft level). Deterministic; the benchmark (bench_drafters) measures more."""
    from loadtest.bench_drafters import teacher_forced_matches
    from specmesh.runtime import encode_prompt

    model, tok = bundled
    drafter = load_model(bundled_drafter_path().parent / which)
    hit = total = 0
    for text in prompts("heldout")[:4]:
        ids = encode_prompt(tok, text, chat=True)
        out = generate(model, ids, SamplingParams(), StopConditions(48, frozenset({tok.eos_token_id}))).token_ids
        hit += teacher_forced_matches(drafter, ids, out, model)
        total += len(out)
    # A regression guard, not a goal: README "Drafters" has the measured values (the token
    # drafter: 0.40 on 8 held-out prompts, 0.04 untrained).
    assert hit / total >= floor, f"held-out greedy acceptance {hit / total:.2f}"


@pytest.mark.slow
def test_generate_cli_defaults_to_the_shipped_drafter_and_is_lossless():
    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "specmesh.cli", "generate", "--prompt", "Explain rainbows.",
                            "--chat", "--max-tokens", "24", "--json", "--threads", "1", *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    auto, plain = run(), run("--drafter", "none")
    assert auto["stats"]["drafter"] == f"model:{bundled_drafter_path()}"
    assert auto["token_ids"] == plain["token_ids"]
    assert auto["stats"]["accepted_tokens"] > 0


@pytest.mark.slow
def test_train_drafter_cli_runs_every_stage_on_a_small_target(bundled, tmp_path):
    """`specmesh train-drafter` end to end (data on our runtime, corpus, training, held-out
    evaluation, export) on a tiny random target that uses the bundled tokenizer and chat
    template; the export loads and drafts losslessly for that target."""
    from transformers import LlamaConfig

    from tests.tiny_models import random_hf_model

    _model, tok = bundled
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    target_dir, out = tmp_path / "target", tmp_path / "drafter"
    random_hf_model(cfg, seed=1).save_pretrained(target_dir)
    tok.save_pretrained(target_dir)
    cmd = [sys.executable, "-m", "specmesh.cli", "train-drafter", "--target", str(target_dir), "--out", str(out),
           "--kind", "token", "--layers", "1", "--prompts", "6", "--heldout-prompts", "2", "--max-new-tokens", "8",
           "--corpus-chars", "3000", "--minutes", "0.1", "--gen-batch", "4", "--draft-vocab", "256",
           "--threads", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # A feature drafter needs a GGUF target (it shares its embeddings): refused before any data is made.
    feat = subprocess.run([*cmd[:cmd.index("--out") + 1], str(tmp_path / "feature"), "--kind", "feature"],
                          capture_output=True, text=True, timeout=600)
    assert feat.returncode != 0 and "needs a .gguf target" in feat.stderr, feat.stderr[-2000:]
    assert not (tmp_path / "feature").exists()
    recipe = json.loads((out / "recipe.json").read_text())
    assert recipe["command"].startswith("specmesh train-drafter --target")
    assert recipe["data"]["examples"] > 6 and recipe["heldout"]["prompts"] == 2
    assert len(list((out / "work" / "train").glob("chat-*.pt"))) == 2  # 6 prompts, 4 per batch
    target, drafter = load_model(target_dir), load_model(out)
    assert drafter.vocab_map is not None and len(drafter.vocab_map) == 256
    ids = tok.encode("def add(a, b):", add_special_tokens=False)
    stop = StopConditions(12)
    plain = generate(target, ids, SamplingParams(), stop).token_ids
    spec = generate(target, ids, SamplingParams(), stop, ModelDrafter(drafter), SpecConfig(4, 4)).token_ids
    assert spec == plain
