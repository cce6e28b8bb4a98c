"""The drafter benchmark's core on a tiny random model pair (real engine, real transformers peer):
a drafter identical to the target is accepted everywhere (a = 1, E = depth + 1 on a chain), a
different drafter is not, outputs stay identical, and the JSON and the table have their shape."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from loadtest.bench_drafters import BenchConfig, Candidate, Peer, bench, format_table, shapes, tree_depth
from specmesh.drafters import NgramDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.loader import model_from_hf
from tests.tiny_models import random_hf_model

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
DEPTH = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _pair(seed: int):
    hf = random_hf_model(LlamaConfig(**SMALL), seed)
    hf.generation_config.eos_token_id = None  # run to max_new_tokens, as the engine does here
    hf.generation_config.pad_token_id = None
    return model_from_hf(hf.config, hf.state_dict()), hf


def test_identical_drafter_is_always_accepted_and_the_report_has_its_shape():
    target, hf_target = _pair(0)
    other, _ = _pair(1)
    cfg = BenchConfig(max_tokens=15, depth=DEPTH, tree_budgets=(4,), cost_reps=2, warmup=False)
    prompt = [5, 17, 42, 8, 5, 17, 42, 8, 5, 17]  # repeats, so that ngram has something to look up
    cands = [Candidate("ngram", NgramDrafter()), Candidate("same", ModelDrafter(target), target),
             Candidate("other", ModelDrafter(other), other)]
    report = bench(target, [prompt], cands, cfg, Peer(hf_target, hf_target), log=lambda _: None)
    json.dumps(report)  # plain data only

    drafters = {d["name"]: d for d in report["drafters"]}
    assert set(drafters) == {"ngram", "same", "other"}
    assert drafters["same"]["greedy_acceptance"] == 1.0 and drafters["same"]["positions"] == 15
    assert drafters["same"]["E_chain_from_acceptance"] == DEPTH + 1
    assert drafters["other"]["greedy_acceptance"] < 0.9  # a random model is no oracle
    assert drafters["ngram"]["acceptance_method"].startswith("engine")
    for d in drafters.values():
        assert d["draft_cost_c"] >= 0

    rows = {r["name"]: r for r in report["results"]}
    want = {"specmesh none", "transformers generate", "transformers assisted"}
    want |= {f"specmesh {c} {label}" for c in drafters for label in ("chain", "tree b4")}
    assert set(rows) == want
    assert all(r["tokens"] == 15 and r["identical_to_none"] for r in rows.values())
    assert rows["transformers assisted"]["identical_to_hf_plain"]
    chain = rows["specmesh same chain"]
    assert chain["tokens_per_step"] == DEPTH + 1 and chain["steps"] == 3 and chain["acceptance_in_engine"] == 1.0
    c, v = chain["draft_cost_c"], chain["verify_cost_v"]
    assert chain["sequential_bound"] == pytest.approx((DEPTH + 1) / (1 + DEPTH * c), rel=1e-2)
    assert chain["hardware_bound"] == pytest.approx((DEPTH + 1) / (v + DEPTH * c), rel=1e-2)
    tree = rows["specmesh same tree b4"]
    assert (tree["budget"], tree["depth"]) == (4, tree_depth(4)) == (4, 2)
    assert tree["tokens_per_step"] == tree_depth(4) + 1  # the greedy path is always among the children
    for r in rows.values():
        assert r["tokens_per_s"] > 0 and "speedup_vs_hf_plain" in r

    report["meta"] = {"commit": "x", "pair": "tiny", "num_prompts": 1, "max_tokens": 15, "torch_threads": 1,
                      "depth": DEPTH}
    table = format_table(report)
    assert table.count("\n| specmesh ") == 7 and "| same | 1.000 | teacher-forced (15 tokens) | 5.00 |" in table


def test_tree_shapes_are_wider_than_the_chain():
    got = [(label, s.budget, s.depth) for label, s in shapes(BenchConfig())]
    assert got == [("chain", 4, 4), ("tree b1", 1, 1), ("tree b4", 4, 2), ("tree b8", 8, 4), ("tree b16", 16, 6)]
