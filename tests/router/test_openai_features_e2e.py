"""OpenAI features through the whole cluster (router, verifier, the bundled feature drafter, Redis)
with the official `openai` client, streaming and not, speculation on and off: log-probabilities
(chat and completions shapes, echo, the SDK's `Completion.logprobs`) and penalties; the 400s
naming the field."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import openai
import pytest
import torch

from specmesh.client import Client
from specmesh.cluster import Cluster, ClusterSpec
from specmesh.drafters import bundled_drafter_path
from specmesh.loader import bundled_target_path, load_tokenizer, resolve_folder

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TOL = 1e-4


@pytest.fixture(scope="module")
def cluster(redis_server):
    # float32: the log-probabilities are held against transformers' fp32 forward (TOL)
    c = Cluster(ClusterSpec(drafter=f"model:{bundled_drafter_path()}", redis_url=redis_server.url, metrics=False,
                            dtype="float32"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oa(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(resolve_folder(bundled_target_path()), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(bundled_target_path())


@pytest.fixture(scope="module")
def model(oa):
    return oa.models.list().data[0].id


@pytest.fixture(scope="module")
def sdk(cluster):
    with Client(cluster.grpc_address, timeout=120) as c:
        yield c


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


QUESTION = [{"role": "user", "content": "List three facts about the moon."}]


def chat(oa, model: str, spec: dict, stream: bool, **kw):
    body = dict(model=model, messages=QUESTION, max_tokens=20, temperature=0, logprobs=True, top_logprobs=3,
                extra_body={"speculation": spec}, **kw)
    if not stream:
        r = oa.chat.completions.create(**body)
        return r.choices[0].message.content, r.choices[0].logprobs.content, r.model_extra["specmesh"]
    parts = list(oa.chat.completions.create(stream=True, **body))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    content = [c for p in parts if p.choices and p.choices[0].logprobs for c in p.choices[0].logprobs.content]
    return text, content, parts[-1].model_extra["specmesh"]


def test_chat_logprobs_are_the_targets_with_speculation_on_and_off_streaming_or_not(oa, model, sdk, hf, tok):
    runs = {(spec_on, stream): chat(oa, model, {} if spec_on else {"disabled": True}, stream)
            for spec_on in (True, False) for stream in (False, True)}
    assert runs[(True, False)][2]["speculation"]["accepted_tokens"] > 0, "speculation never accepted a draft"
    text, ref, _ = runs[(False, False)]
    for key, (t, content, _) in runs.items():
        assert t == text, key
        assert [c.token for c in content] == [c.token for c in ref], key
        for a, b in zip(content, ref):
            assert abs(a.logprob - b.logprob) < 1e-5 and len(a.top_logprobs) == 3, key
    assert b"".join(bytes(c.bytes) for c in ref).decode("utf-8") == text
    # the same turn through the SDK (token ids), and transformers' fp32 forward on those tokens
    ids = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    done = sdk.complete(ids, max_tokens=20, logprobs=3)
    out = done.token_ids
    assert done.text == text and [lp.token for lp in done.logprobs] == out
    rows = hf_logprobs(hf, ids + out)[len(ids) - 1:]
    for i, c in enumerate(ref):
        assert abs(c.logprob - done.logprobs[i].logprob) < 1e-5
        assert abs(c.logprob - float(rows[i, out[i]])) < TOL
        assert abs(c.top_logprobs[0].logprob - float(rows[i].max())) < TOL
        assert c.top_logprobs[0].logprob >= c.logprob - 1e-6  # greedy: the chosen token is the top one


def test_completions_logprobs_and_echo(oa, model, sdk, hf, tok):
    prompt = "The capital of France is"
    r = oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2, echo=True)
    choice = r.choices[0]
    lp = choice.logprobs
    ids = tok.encode(prompt, add_special_tokens=False)
    n = len(ids)
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 8
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    out = sdk.complete(ids, max_tokens=8).token_ids
    rows = hf_logprobs(hf, ids + out)
    for i in range(1, n + 8):
        assert abs(lp.token_logprobs[i] - float(rows[i - 1, (ids + out)[i]])) < TOL, i
        assert len(lp.top_logprobs[i]) <= 2 and max(lp.top_logprobs[i].values()) == pytest.approx(
            float(rows[i - 1].max()), abs=TOL)
    # streamed: the echoed prompt and its logprobs first, offsets running on across the chunks
    parts = list(oa.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2,
                                       echo=True, stream=True))
    assert "".join(p.choices[0].text for p in parts) == choice.text
    streamed = [p.choices[0].logprobs for p in parts if p.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset
    # echo alone shows the prompt; no logprobs asked, none given
    plain = oa.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_sdk_completion_logprobs_and_sampling_keeps_them_raw(sdk, hf, tok):
    ids = tok.encode("Once upon a time", add_special_tokens=False)
    out = sdk.complete(ids, max_tokens=12, temperature=0.8, seed=3, logprobs=1, prompt_logprobs=True)
    assert [lp.token for lp in out.logprobs] == out.token_ids
    assert [lp.token for lp in out.prompt_logprobs] == ids and out.prompt_logprobs[0].logprob is None
    rows = hf_logprobs(hf, ids + out.token_ids)
    for i, lp in enumerate(out.prompt_logprobs[1:] + out.logprobs, start=1):
        assert abs(lp.logprob - float(rows[i - 1, lp.token])) < TOL, i
        assert len(lp.top) == 1 and abs(lp.top[0][1] - float(rows[i - 1].max())) < TOL
    assert all(math.isfinite(lp.logprob) for lp in out.logprobs)


def _chat_text(oa, model: str, spec: dict, stream: bool, **kw) -> str:
    body = dict(model=model, messages=QUESTION, max_tokens=24, temperature=0, **kw)
    body["extra_body"] = {"speculation": spec, **body.pop("extra_body", {})}
    if not stream:
        return oa.chat.completions.create(**body).choices[0].message.content
    return "".join(p.choices[0].delta.content or "" for p in oa.chat.completions.create(stream=True, **body)
                   if p.choices)


def test_penalties_change_the_output_and_speculation_keeps_it(oa, model, tok):
    plain = _chat_text(oa, model, {}, False)
    dog = tok.encode(" dog", add_special_tokens=False)[0]
    cases = [dict(presence_penalty=1.5, frequency_penalty=1.0),
             dict(logit_bias={str(dog): 30.0}),
             dict(extra_body={"repetition_penalty": 1.5, "min_tokens": 24})]
    for kw in cases:
        runs = {(on, stream): _chat_text(oa, model, {} if on else {"disabled": True}, stream, **kw)
                for on in (True, False) for stream in (False, True)}
        assert len(set(runs.values())) == 1, (kw, runs)
        assert runs[(True, False)] != plain, f"{kw} changed nothing"
    assert " dog" in _chat_text(oa, model, {}, False, logit_bias={str(dog): 30.0})


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
STRUCTURED = [  # (request fields, check of the output text)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
     lambda t: jsonschema.validate(json.loads(t), PERSON)),
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict) or 1 / 0),
    ({"extra_body": {"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} is [1-9][0-9]? years old\."}}},
     lambda t: re.fullmatch(r"[A-Z][a-z]{2,8} is [1-9][0-9]? years old\.", t) or 1 / 0),
    ({"extra_body": {"structured_outputs": {"choice": ["yes", "no", "it depends"]}}},
     lambda t: t in ("yes", "no", "it depends") or 1 / 0),
]


@pytest.mark.parametrize("fields, check", STRUCTURED, ids=["json_schema", "json_object", "regex", "choice"])
def test_structured_outputs_match_their_grammar_with_speculation_on_and_off(oa, model, fields, check):
    question = [{"role": "user", "content": "Ann is 31. Describe her as JSON, or say how old she is."}]
    texts = set()
    for on in (True, False):
        for stream in (False, True):
            kw = {**fields, "extra_body": {**fields.get("extra_body", {}),
                                           "speculation": {} if on else {"disabled": True}}}
            body = dict(model=model, messages=question, max_tokens=48, temperature=0, **kw)
            if stream:
                text = "".join(p.choices[0].delta.content or "" for p in
                               oa.chat.completions.create(stream=True, **body) if p.choices)
            else:
                r = oa.chat.completions.create(**body)
                assert r.choices[0].finish_reason == "stop"
                text = r.choices[0].message.content
            check(text)
            texts.add(text)
    assert len(texts) == 1, texts  # greedy: the same constrained output every way
    # sampled output matches too
    sampled = oa.chat.completions.create(model=model, messages=question, max_tokens=48, temperature=1.0, seed=5,
                                         **fields)
    if sampled.choices[0].finish_reason == "stop":
        check(sampled.choices[0].message.content)


def test_completions_and_the_sdk_take_structured_outputs(oa, model, sdk):
    r = oa.completions.create(model=model, prompt="The answer (yes or no):", max_tokens=8, temperature=0,
                              extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    done = sdk.complete("Ann's age as JSON:", max_tokens=48, structured={"json": PERSON})
    jsonschema.validate(json.loads(done.text), PERSON)


@pytest.mark.parametrize("endpoint, body, param", [
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"logprobs": 3}, "logprobs"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": "1"}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"logit_bias": {"x": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"1": 101}}, "logit_bias"),
    ("chat", {"logit_bias": {"999999": 1}}, "logit_bias"),
    ("completions", {"min_tokens": -1}, "min_tokens"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ("chat", {"structured_outputs": {"regex": "([a-z"}}, "structured.regex"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("completions", {"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ("completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("chat", {"n": 17}, "n"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"best_of": 2}, "best_of"),
    ("completions", {"n": 3, "best_of": 2}, "best_of"),
    ("completions", {"best_of": 3, "stream": True}, "best_of"),
])
def test_bad_logprobs_fields_are_400_naming_the_field(oa, model, endpoint, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            oa.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, extra_body=body)
        else:
            oa.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body=body)
    assert e.value.body["param"] == param, e.value.body


def test_n_samples_derive_their_seeds_and_share_the_prompt(oa, model):
    """n samples, streaming or not: sample i is the one-sample answer seeded seed + i (speculation
    off: a seeded sample is then a function of the target's logits alone), usage counts the prompt
    once and every sample's tokens; the samples run in one session, so its KV holds the prompt."""
    body = dict(model=model, messages=QUESTION, max_tokens=12, temperature=1.0, seed=11,
                extra_body={"speculation": {"disabled": True}})
    r = oa.chat.completions.create(n=3, **body)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) > 1, texts
    singles = [oa.chat.completions.create(**{**body, "seed": 11 + i}) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert len(r.model_extra["specmesh"]["speculation"]) == 3  # one entry per sample
    parts = list(oa.chat.completions.create(n=3, stream=True, **body))
    assert ["".join(p.choices[0].delta.content or "" for p in parts if p.choices and p.choices[0].index == i)
            for i in range(3)] == texts
    # greedy with speculation: n identical answers, each the one-sample answer
    greedy = oa.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0, n=2)
    one = oa.chat.completions.create(model=model, messages=QUESTION, max_tokens=12, temperature=0)
    assert [c.message.content for c in greedy.choices] == [one.choices[0].message.content] * 2


def test_a_regenerated_answer_keeps_the_prompts_kv(oa, model):
    """The same messages again in one session (a regenerated answer): the verifier keeps the KV of
    the prompt both turns share (all but its last token) instead of prefilling it again, and the
    greedy answer is the same."""
    body = dict(model=model, messages=QUESTION, max_tokens=10, temperature=0,
                extra_headers={"X-Session-ID": "regenerate-kv"})
    first, again = oa.chat.completions.create(**body), oa.chat.completions.create(**body)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1


def test_best_of_returns_the_samples_with_the_highest_mean_logprob(oa, model):
    """best_of 4, n 2: the two of the four seeded samples (seed + i) with the highest mean
    log-probability per token, best first; the logprobs used to rank are not shown unless asked."""
    body = dict(model=model, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5,
                extra_body={"speculation": {"disabled": True}})
    r = oa.completions.create(n=2, best_of=4, **body)
    assert all(c.logprobs is None for c in r.choices)
    singles = [oa.completions.create(**{**body, "seed": 5 + i}, logprobs=0).choices[0] for i in range(4)]
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in singles]
    ranked = sorted(range(4), key=lambda i: -mean[i])[:2]
    assert [c.text for c in r.choices] == [singles[i].text for i in ranked]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in singles)
    # echoed with logprobs: the prompt's logprobs come first and do not take part in the ranking
    echoed = oa.completions.create(n=2, best_of=4, echo=True, logprobs=0, **body)
    assert [c.text for c in echoed.choices] == [body["prompt"] + singles[i].text for i in ranked]
