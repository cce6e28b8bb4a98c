"""The engine on the bundled SmolLM2: greedy output token-identical to transformers' own
`generate(do_sample=False)` with every drafter, adversarial ones included; sampling reproducible."""

from __future__ import annotations

import json
import random
import subprocess
import time
import sys

import pytest
import torch

from specmesh.drafters import NgramDrafter, OracleDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES
from specmesh.loader import bundled_target_path, model_from_hf, resolve_folder
from specmesh.runtime import encode_prompt, load_target
from specmesh.sampling import SamplingParams
from specmesh.tree import DraftTree

PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that adds two numbers.",
    "Repeat exactly: red green blue, red green blue, red green blue.",
]
NEW_TOKENS = 24


class AdversarialDrafter:
    """Drafts garbage on purpose: random tokens in maximal trees, duplicate siblings, or trees
    that are invalid (out-of-vocabulary ids, parents after children)."""

    name = "adversarial"
    needs_features = False

    def __init__(self, vocab_size: int, mode: str, seed: int = 0) -> None:
        self.vocab, self.mode, self.rng = vocab_size, mode, random.Random(seed)

    def open(self, context, features=None):
        return self

    def commit(self, tokens, features=None):
        pass

    def close(self):
        pass

    def draft(self, budget, depth, params, generator):
        r = self.rng
        if self.mode == "invalid":
            bad = r.choice([DraftTree([self.vocab + 5], [-1]), DraftTree([1, 2], [1, -1]),
                            DraftTree([1] * (MAX_TREE_NODES + 1), [-1] * (MAX_TREE_NODES + 1))])
            return bad
        tokens, parents = [], []
        for i in range(MAX_TREE_NODES):
            parent = -1 if i < 4 else r.randrange(-1, i)
            while parent != -1 and _depth(parents, parent) >= MAX_DEPTH:
                parent = parents[parent]
            if self.mode == "duplicates" and i > 0:
                tokens.append(tokens[0])
            else:
                tokens.append(r.randrange(self.vocab))
            parents.append(parent)
        kids: dict[int, set[int]] = {}
        for t, p in zip(tokens, parents):
            kids.setdefault(p, set()).add(t)
        q_nodes = sorted(kids)
        q_ids = [sorted(kids[n]) for n in q_nodes]
        q_probs = [[1.0 / len(ids)] * len(ids) for ids in q_ids]
        return DraftTree(tokens, parents, q_nodes, q_ids, q_probs)


def _depth(parents, node):
    d = 1
    while parents[node] != -1:
        node, d = parents[node], d + 1
    return d


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(2)
    from transformers import AutoModelForCausalLM

    model, tok = load_target(None)
    hf = AutoModelForCausalLM.from_pretrained(resolve_folder(bundled_target_path()), dtype=torch.float32).eval()
    cases = []
    for text in PROMPTS:
        ids = encode_prompt(tok, text, chat=True)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=tok.eos_token_id)
        cases.append((ids, out[0, len(ids):].tolist()))
    return model, tok, hf, cases


def _tiny_random_drafter(model):
    """A random-initialised 2-layer Llama with the target's vocabulary: a real but bad drafter."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return ModelDrafter(model_from_hf(cfg, LlamaForCausalLM(cfg).state_dict()))


# (drafter, tree budget at depth 4: 4 = chain), drafted as that fixed shape (planned shapes:
# test_planned_generation_identical_to_plain); adversarial drafters send maximal trees anyway.
DRAFTERS = [("none", 4), ("ngram", 12), ("self-model", 4), ("self-model", 12), ("random-model", 8),
            ("oracle-0.7", 4), ("oracle-0.7", 12), ("adv-random", 8), ("adv-duplicates", 8), ("adv-invalid", 8)]


@pytest.mark.slow
@pytest.mark.parametrize("drafter, budget", DRAFTERS)
def test_greedy_identical_to_transformers(bundle, drafter, budget):
    model, tok, _hf, cases = bundle
    vocab = model.config.vocab_size
    for i, (ids, expected) in enumerate(cases[:1] if drafter.startswith("adv") else cases):
        d = {
            "none": None, "ngram": NgramDrafter(), "self-model": ModelDrafter(model),
            "random-model": _tiny_random_drafter(model) if drafter == "random-model" else None,
            "oracle-0.7": OracleDrafter(ids + expected, 0.7, vocab, seed=i),
            "adv-random": AdversarialDrafter(vocab, "random", i),
            "adv-duplicates": AdversarialDrafter(vocab, "duplicates", i),
            "adv-invalid": AdversarialDrafter(vocab, "invalid", i),
        }[drafter]
        stop = StopConditions(NEW_TOKENS, frozenset([tok.eos_token_id]))
        res = generate(model, ids, SamplingParams(), stop, d, SpecConfig(budget, 4, fixed=True))
        assert res.token_ids == expected, f"prompt {i} with {drafter}"
        assert res.stats.new_tokens == len(expected)
        if drafter == "self-model":  # the target drafting for itself is always right
            assert res.stats.tokens_per_step >= 3
        if drafter == "adv-invalid":
            assert res.stats.rejected_trees == res.stats.steps and res.stats.accepted_tokens == 0


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["ngram", "self-model", "random-model", "oracle-0.7"])
def test_planned_generation_identical_to_plain(bundle, drafter):
    """Without `fixed`, the engine plans each step's shape within the caps, as a drafter service
    does (`PlannedDrafts`), from costs measured once per process and pair: greedy output is the
    target's whatever it picks, runs of plain steps included (a random drafter's trees are soon
    not worth drafting: it drafts fewer nodes than its fixed shape would)."""
    from specmesh.engine import GenerationResult, generate_stream, planning_for

    model, tok, _hf, cases = bundle
    vocab = model.config.vocab_size
    d = {"ngram": NgramDrafter(), "self-model": ModelDrafter(model),
         "random-model": _tiny_random_drafter(model) if drafter == "random-model" else None,
         "oracle-0.7": OracleDrafter(cases[0][0] + cases[0][1], 0.7, vocab, seed=0)}[drafter]
    planning = planning_for(model, d)
    assert planning_for(model, d) is planning  # measured once per pair
    assert [r for r, _ in planning.steps.points()][:3] == [1, 2, 3]  # the target's step by rows, measured
    for ids, expected in cases[:1] if drafter == "oracle-0.7" else cases:
        res = GenerationResult()
        stop = StopConditions(NEW_TOKENS, frozenset([tok.eos_token_id]))
        out = [t for ids_ in generate_stream(model, ids, SamplingParams(), stop, d, SpecConfig(8, 4), result=res)
               for t in ids_]
        assert out == res.token_ids == expected, f"{drafter}"
        if drafter == "self-model":
            assert res.stats.accepted_tokens > 0
        if drafter == "random-model":
            assert res.stats.drafted_tokens < 8 * res.stats.steps
    assert sum(planning.recent.tried[0]) > 0  # the sessions' acceptance is the next ones' prior


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "self-model", "adv-duplicates"])
def test_sampling_reproducible_with_seed(bundle, drafter):
    model, _tok, _hf, cases = bundle
    ids = cases[0][0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(seed_params):
        d = {"none": None, "self-model": ModelDrafter(model),
             "adv-duplicates": AdversarialDrafter(model.config.vocab_size, "duplicates")}[drafter]
        return generate(model, ids, seed_params, StopConditions(16), d, SpecConfig(8, 4)).token_ids

    a, b = run(params), run(params)
    assert a == b and len(a) == 16
    other = run(SamplingParams(temperature=0.9, top_p=0.95, seed=99))
    assert other != a  # a different seed gives a different sample (fails with prob ~0 for 16 tokens)


def test_stop_conditions(bundle):
    model, tok, _hf, cases = bundle
    ids, expected = cases[0]
    eos = frozenset([tok.eos_token_id])
    res = generate(model, ids, SamplingParams(), StopConditions(200, eos), NgramDrafter(), SpecConfig(8, 4))
    assert res.finish_reason == "stop" and res.token_ids[-1] == tok.eos_token_id
    assert res.token_ids[:NEW_TOKENS] == expected
    res = generate(model, ids, SamplingParams(), StopConditions(3, eos), NgramDrafter(), SpecConfig(8, 4))
    assert res.finish_reason == "length" and res.token_ids == expected[:3]
    # EOS right after max_tokens (here as the bonus of a fully accepted chain) is never reached
    n = len(expected) - 1
    assert expected[-1] == tok.eos_token_id
    oracle = OracleDrafter(ids + expected, 1.0, model.config.vocab_size)
    res = generate(model, ids, SamplingParams(), StopConditions(n, eos), oracle, SpecConfig(n, n, fixed=True))
    assert res.finish_reason == "length" and res.token_ids == expected[:n]
    # stop string: generation ends at the token that completes it
    text = tok.decode(expected)
    word = text.split()[2]
    decode = lambda t: tok.decode(t, skip_special_tokens=True)  # noqa: E731
    res = generate(model, ids, SamplingParams(), StopConditions(NEW_TOKENS, stop_strings=(word,)), None,
                   decode=decode)
    assert res.finish_reason == "stop" and word in decode(res.token_ids)
    assert word not in decode(res.token_ids[:-1])


@pytest.mark.parametrize("bad, field", [
    (SamplingParams(temperature=-0.5), "temperature"), (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(top_k=-3), "top_k"), (SamplingParams(seed=-1), "seed"),
])
def test_bad_sampling_params_rejected(bundle, bad, field):
    model, _tok, _hf, cases = bundle
    with pytest.raises(ValueError, match=field):
        generate(model, cases[0][0], bad, StopConditions(4))


@pytest.mark.parametrize("spec, stop, field", [
    (SpecConfig(0, 4), StopConditions(4), "tree_budget"), (SpecConfig(8, 0), StopConditions(4), "depth"),
    (SpecConfig(8, 4), StopConditions(0), "max_tokens"),
])
def test_bad_generation_settings_rejected(bundle, spec, stop, field):
    model, _tok, _hf, cases = bundle
    with pytest.raises(ValueError, match=field):
        generate(model, cases[0][0], SamplingParams(), stop, None, spec)


def test_bad_prompt_ids_rejected(bundle):
    model = bundle[0]
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [1, model.config.vocab_size + 3], SamplingParams(), StopConditions(4))
    with pytest.raises(ValueError, match="prompt"):
        generate(model, [], SamplingParams(), StopConditions(4))


@pytest.mark.slow
def test_cli_json(bundle):
    _model, tok, _hf, cases = bundle
    out = subprocess.run(
        [sys.executable, "-m", "specmesh.cli", "generate", "--prompt", PROMPTS[0], "--chat", "--max-tokens", "12",
         "--drafter", "ngram", "--json", "--threads", "1", "--dtype", "float32"],  # the fp32 engine's tokens
        capture_output=True, text=True, timeout=300, check=True,
    )
    obj = json.loads(out.stdout)
    expected = cases[0][1]
    n = len(obj["token_ids"])
    assert obj["token_ids"] == expected[:n] and n >= 1
    assert obj["text"] == tok.decode(obj["token_ids"], skip_special_tokens=True)
    assert {"steps", "drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_s", "draft_s",
            "verify_s"} <= set(obj["stats"])


def test_cli_bad_flag_is_a_clear_error():
    out = subprocess.run([sys.executable, "-m", "specmesh.cli", "generate", "--prompt", "hi", "--top-p", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "top_p" in out.stderr


def test_measure_steps_times_each_row_count() -> None:
    from specmesh.engine import STEP_ROWS, measure_steps

    points = measure_steps(_tiny_target(), rounds=2)
    assert [r for r, _ in points] == list(STEP_ROWS)
    assert all(0 < s < 5 for _, s in points)


def test_a_pairs_costs_are_measured_once_per_machine(tmp_path, monkeypatch) -> None:
    """`pair_costs` keeps the target's step table and the drafter's calls on disk, each by its own
    model's layout (the verifier and the drafter service read the same through `target_steps` and
    `drafter_calls`): a later process (here: a new model object of the same layout) reads them back
    instead of measuring; another layout, an n-gram drafter, a target that is not one module here
    (a TP group) or SPECMESH_COST_CACHE=0 measures."""
    import specmesh.engine as engine
    import specmesh.drafters.predraft as predraft
    from specmesh.model import ModelConfig, Transformer

    def tiny(hidden: int) -> Transformer:
        cfg = ModelConfig(vocab_size=64, hidden_size=hidden, intermediate_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          attention_bias=False, max_position_embeddings=256)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
        return Transformer(cfg, inv_freq).eval()

    steps, calls = [], []
    measure_steps, samples = engine.measure_steps, predraft.drafter_samples
    monkeypatch.setattr(engine, "measure_steps", lambda m: steps.append(m) or measure_steps(m, rounds=1))
    monkeypatch.setattr(predraft, "drafter_samples", lambda d, v: calls.append(d) or samples(d, v))
    monkeypatch.setenv("SPECMESH_CACHE", str(tmp_path))
    monkeypatch.setenv(engine.COST_CACHE_ENV, "1")
    first = engine.pair_costs(tiny(32), ModelDrafter(tiny(32)))
    assert (len(steps), len(calls)) == (1, 1) and [r for r, _ in first["steps"]] == list(engine.STEP_ROWS)
    assert first["draft"] and first["draft_many"]
    again = engine.pair_costs(tiny(32), ModelDrafter(tiny(32)))
    assert (len(steps), len(calls)) == (1, 1) and again == json.loads(json.dumps(first))  # as JSON holds it
    planning = engine.planning_for(tiny(32), ModelDrafter(tiny(32)))
    assert (len(steps), len(calls)) == (1, 1) and planning.costs.draft.calibrated and planning.steps.start
    assert engine.target_steps(tiny(32)) == again["steps"] and len(steps) == 1  # the verifier's start
    engine.pair_costs(tiny(32), ModelDrafter(tiny(64)))  # another drafter layout: its calls only
    assert (len(steps), len(calls)) == (1, 2)
    engine.pair_costs(tiny(64), NgramDrafter())  # another target; no drafter model: never kept
    engine.pair_costs(tiny(64), NgramDrafter())
    assert (len(steps), len(calls)) == (2, 4)

    class Group:  # a TP group's handle (verifier_service.tp_group.TPModel): the model's interface, no module
        def __init__(self, model: Transformer) -> None:
            self.model = model

        def __call__(self, *args, **kwargs):
            return self.model(*args, **kwargs)

        def __getattr__(self, name: str):
            return getattr(self.model, name)

    engine.target_steps(Group(tiny(32)))
    assert len(steps) == 3
    monkeypatch.setenv(engine.COST_CACHE_ENV, "0")
    engine.pair_costs(tiny(32), ModelDrafter(tiny(32)))
    assert (len(steps), len(calls)) == (4, 5)
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "costs").glob("*.json"))
    assert kept == ["drafter", "drafter", "steps", "steps"]
    # another version of specmesh's code (`kernels.code_key`): its own costs, measured again
    from specmesh import kernels

    monkeypatch.setenv(engine.COST_CACHE_ENV, "1")
    monkeypatch.setattr(kernels, "code_key", lambda: "another version")
    engine.pair_costs(tiny(32), ModelDrafter(tiny(32)))
    assert (len(steps), len(calls)) == (5, 6)


def test_the_code_key_follows_the_sources_only(tmp_path):
    """Kept costs are keyed by a hash of specmesh's Python and C++ sources: any change to one
    (a faster forward) measures afresh; other files (weights, data) do not count."""
    from specmesh import kernels

    (tmp_path / "kernels").mkdir()
    for name, text in (("model.py", "a = 1"), ("kernels/glue.cpp", "int f();"), ("kernels/pool.h", "#pragma once"),
                       ("weights.bin", "w")):
        (tmp_path / name).write_text(text)
    first = kernels.source_hash(tmp_path)
    (tmp_path / "weights.bin").write_text("other weights")
    assert kernels.source_hash(tmp_path) == first
    for name in ("model.py", "kernels/glue.cpp", "kernels/pool.h"):
        before = kernels.source_hash(tmp_path)
        (tmp_path / name).write_text((tmp_path / name).read_text() + " ")
        assert kernels.source_hash(tmp_path) != before, name
    assert len(kernels.code_key()) == 16 and kernels.code_key() == kernels.code_key()


def test_rollback_to_a_prefix_continues_as_a_session_started_there() -> None:
    """`TargetSession.rollback` (the verifier keeps a shared prefix's KV for a regenerated answer or
    the next of n samples): extending the rolled-back session gives the logits, next tokens and
    kept target features of a session prefilled from that prefix."""
    from specmesh.engine import TargetSession
    from specmesh.sampling import make_generator

    torch.manual_seed(3)
    model = _tiny_target()
    prompt, params = [5, 9, 2, 7, 1, 3], SamplingParams()
    held = TargetSession(model, prompt, features=True)
    for _ in range(4):
        held.step(DraftTree.empty(), params, make_generator(params))
    held.rollback(len(prompt) - 1)
    fresh = TargetSession(model, prompt[:-1], features=True)
    assert held.tokens == fresh.tokens and torch.equal(held.features, fresh.features)  # nothing new yet
    for t in (held, fresh):
        t.extend(prompt[-1:])
    assert held.tokens == fresh.tokens and torch.equal(held.features, fresh.features)
    for _ in range(3):
        a, b = (t.step(DraftTree.empty(), params, make_generator(params))[1] for t in (held, fresh))
        assert a == b
    assert torch.equal(held.features, fresh.features)


def test_measure_steps_prices_a_row_count_as_a_run_of_its_steps(monkeypatch) -> None:
    """A plan runs its steps back to back (a plain run: one-row steps; speculation: steps of a few
    rows). The first step after a change of rows may cost more (caches hold the last shape's
    weights): measured in turn, every row count was priced at that cost, one row most of all."""
    import specmesh.engine as engine

    step, last = engine.TargetSession.step, []

    def slow_after_a_change(self, tree, *args, **kwargs):
        if last and last[-1] != len(tree):
            time.sleep(0.05)  # the first step of a new shape
        last.append(len(tree))
        return step(self, tree, *args, **kwargs)

    monkeypatch.setattr(engine.TargetSession, "step", slow_after_a_change)
    points = dict(engine.measure_steps(_tiny_target(), rows=(1, 2, 3), rounds=2))
    assert max(points.values()) < 0.04, points


def test_measure_steps_never_prices_a_row_count_above_a_larger_one(monkeypatch) -> None:
    """Noise comes in spells: one row count's run timed during one (here: every step of 2 rows in
    the first pass) is priced at its second pass, and a row count is never priced above a larger
    one, which does more of the same work."""
    import specmesh.engine as engine

    step, seen = engine.TargetSession.step, []

    def spells(self, tree, *args, **kwargs):
        seen.append(len(tree) + 1)
        if seen.count(len(tree) + 1) <= 4 and len(tree) + 1 == 2:
            time.sleep(0.05)  # the first pass's run of 2-row steps, in a spell of noise
        if len(tree) + 1 == 3:
            time.sleep(0.03)  # 3 rows: always slower than 4 here, as no kernel is
        return step(self, tree, *args, **kwargs)

    monkeypatch.setattr(engine.TargetSession, "step", spells)
    points = dict(engine.measure_steps(_tiny_target(), rows=(1, 2, 3, 4), rounds=2))
    assert points[2] < 0.03 and points[3] <= points[4] < 0.03, points


def _tiny_target():
    """A 2-layer target of random weights (seeded by the caller where its output matters)."""
    from specmesh.model import ModelConfig, Transformer

    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      attention_bias=False, max_position_embeddings=256)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float) / cfg.head_dim))
    return Transformer(cfg, inv_freq).eval()
