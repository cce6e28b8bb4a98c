"""Structured outputs on the bundled SmolLM2 (llguidance): greedy output under a grammar is token
for token target-only constrained decoding with every drafter, the output matches the grammar
(JSON that validates against its schema, regex, choice), and sampled output matches too. The
drafters' guide (`grammar.Guide`) answers as a fresh matcher would, and their trees under it hold
only nodes the grammar allows."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from specmesh.drafters import bundled_drafter_path
from specmesh.drafters.base import turn_guide
from specmesh.drafters.model import ModelDrafter
from specmesh.engine import SpecConfig, StopConditions, generate
from specmesh.grammar import Grammars, GrammarSpec
from specmesh.runtime import encode_prompt, load_model_drafter, load_target
from specmesh.sampling import SamplingParams, make_generator
from specmesh.tree import ROOT

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{2,8} is [1-9][0-9]? years old\."
CHOICES = ["yes", "no", "it depends"]
CASES = [("json_schema", json.dumps(SCHEMA), "Describe a person named Ann aged 31 as JSON."),
         ("json_object", "", "Give me a JSON object with your favourite colour."),
         ("regex", REGEX, "How old is Ann? She is 31."),
         ("choice", json.dumps(CHOICES), "Is the sky blue?")]


@pytest.fixture(scope="module")
def bundle():
    torch.set_num_threads(2)
    model, tok = load_target(None)
    drafters = [ModelDrafter(model), load_model_drafter(str(bundled_drafter_path()))]
    return model, tok, Grammars(tok, model.config.vocab_size), drafters


def check(kind: str, text: str) -> None:
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


@pytest.mark.parametrize("kind, source, question", CASES, ids=[c[0] for c in CASES])
def test_greedy_constrained_output_is_target_only_constrained_decoding(bundle, kind, source, question):
    model, tok, grammars, drafters = bundle
    ids = encode_prompt(tok, question, chat=True)
    stop = StopConditions(48, frozenset([tok.eos_token_id]))
    spec = GrammarSpec(kind, source)
    ref = generate(model, ids, SamplingParams(), stop, constraint=grammars.constraint(spec))
    assert ref.finish_reason == "stop", "the grammar should end within the budget (EOS once complete)"
    check(kind, tok.decode(ref.token_ids, skip_special_tokens=True))
    for drafter, shape in zip(drafters, (SpecConfig(8, 4), SpecConfig(4, 4))):
        res = generate(model, ids, SamplingParams(), stop, drafter, shape, constraint=grammars.constraint(spec))
        assert res.token_ids == ref.token_ids, (kind, type(drafter).__name__)
        if kind != "choice":  # a one-word answer leaves an unconstrained drafter little to get right
            assert res.stats.accepted_tokens > 0, "no draft was accepted: speculation untested"


def test_sampled_constrained_output_matches_the_grammar(bundle):
    model, tok, grammars, drafters = bundle
    stop = StopConditions(48, frozenset([tok.eos_token_id]))
    for kind, source, question in CASES:
        ids = encode_prompt(tok, question, chat=True)
        for seed in range(3):
            res = generate(model, ids, SamplingParams(temperature=1.0, seed=seed), stop, drafters[0],
                           SpecConfig(6, 3), constraint=grammars.constraint(GrammarSpec(kind, source)))
            if res.finish_reason == "stop":
                check(kind, tok.decode(res.token_ids, skip_special_tokens=True))


def test_a_bad_grammar_is_refused_naming_it(bundle):
    _model, _tok, grammars, _drafters = bundle
    with pytest.raises(ValueError, match="^structured.regex"):
        grammars.constraint(GrammarSpec("regex", "([a-z"))
    with pytest.raises(ValueError, match="^structured.json_schema"):
        grammars.constraint(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(ValueError, match="^structured.choice"):
        grammars.constraint(GrammarSpec("choice", "[]"))


def test_the_guide_answers_as_a_fresh_matcher_whatever_it_was_asked_before(bundle):
    _model, tok, grammars, _drafters = bundle
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    context = [1, 2, 3]
    ctx = context + tok.encode('{"name": "Ann", "age": 31}', add_special_tokens=False)
    guide = grammars.guide(spec)
    rng = random.Random(0)
    for _ in range(40):  # roots and paths in any order: the guide rolls back and consumes as needed
        root = rng.randint(len(context), len(ctx))
        path = tuple(ctx[root:root + rng.randint(0, len(ctx) - root)])
        fresh = grammars.constraint(spec)
        fresh.add(ctx[len(context):root + len(path)])
        assert torch.equal(guide.allowed(ctx[len(context):root] + list(path)), fresh.allowed()), (root, path)
    assert guide.allowed(tok.encode("hello", add_special_tokens=False)) is None
    assert not guide.allowed(ctx[len(context):] + [tok.eos_token_id]).any(), "nothing follows the end of the turn"


@pytest.mark.parametrize("kind, source, question", CASES[:3], ids=[c[0] for c in CASES[:3]])
def test_guided_trees_hold_only_nodes_the_grammar_allows(bundle, kind, source, question):
    model, tok, grammars, drafters = bundle
    ids = encode_prompt(tok, question, chat=True)
    spec = GrammarSpec(kind, source)
    for drafter in drafters:
        for params in (SamplingParams(), SamplingParams(temperature=1.0, seed=1)):
            session = drafter.open(ids, None if not drafter.needs_features else _features(model, ids))
            guide = turn_guide(params, len(ids), grammars.guide(spec))
            tree = session.draft(8, 4, params, make_generator(params), guide=guide)
            assert tree.tokens, (kind, type(drafter).__name__)
            for node, tok_id in enumerate(tree.tokens):
                path, at = [tok_id], tree.parents[node]
                while at != ROOT:
                    path.insert(0, tree.tokens[at])
                    at = tree.parents[at]
                fresh = grammars.constraint(spec)
                fresh.add(path[:-1])
                assert fresh.allowed()[tok_id], (kind, type(drafter).__name__, path)
            for ids_, probs in zip(tree.q_ids, tree.q_probs):  # sampling: q over allowed tokens, summing to 1
                assert sum(probs) == pytest.approx(1.0)


def _features(model, ids):
    from specmesh.engine import TargetSession

    return TargetSession(model, ids, features=True).features
