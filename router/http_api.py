"""OpenAI-compatible HTTP API of the router (aiohttp): /v1/completions, /v1/chat/completions (JSON or
SSE streaming), /v1/models, /health, /metrics.

The official `openai` client works against it unchanged (base_url = http://HOST:PORT/v1). The
OpenAI API is stateless: a request carries the whole context (prompt, or all messages rendered
with the tokenizer's chat template); with a session id (header `X-Session-ID`, else the `user`
field) the router keeps the session on the verifier holding its KV cache and sends only the part
past what the session already holds (see router.turns, `full_context`). Extensions: `top_k`,
`ignore_eos`, `stop_token_ids` and `speculation` in requests (`{"disabled": true}` = plain decoding
for this request, `budget`, `depth`: tree shape; the gRPC SpeculationOptions, for A/B tests over
HTTP; openai clients pass it with `extra_body=`); `specmesh.speculation` stats in responses.
Errors are OpenAI-style JSON ({"error": {"message", "type", "param", "code"}}) with 400 / 401 /
404 / 409 / 429 / 503; an error after a stream started is sent as an SSE `error` event.
Every request field is checked at this edge: unknown fields, wrong types, integers past what the
field carries, strings that are not valid Unicode, unknown message roles or message fields and JSON
nested too deep each get a 400 naming the field. OpenAI fields specmesh does not implement (suffix,
tools, functions, tool_choice, parallel_tool_calls) are accepted only at the value that changes
nothing (suffix "", ...), refused otherwise; `top_p: 0` is refused (a nucleus of mass 0 holds no
token; the verifier refuses an explicit 0 as well).

Several samples (`n`, and completions' `best_of`, up to MAX_N): independent samples of the same
request, one after another in one session, so the verifier prefills the prompt once and each next
sample keeps its KV (router.turns: the shared prefix is kept). With a `seed`, sample i uses seed + i
(mod 2^64); without one each is seeded at random. The request's session (X-Session-ID / `user`)
is that session, holding the last sample afterwards; without one a private session is opened and
closed. `best_of` > n returns the n samples with the highest mean log-probability per token (the
target's raw logprobs, OpenAI's rule), best first, and cannot be streamed; a stream sends each
sample's chunks under its `index`, sample after sample. Usage counts the prompt once and every
sampled token (best_of's too).

Penalties (specmesh.sampling.Penalizer; part of the target distribution, so output stays lossless
under speculation): OpenAI's `presence_penalty`, `frequency_penalty` (over this request's output)
and `logit_bias`, vLLM's `repetition_penalty` (over prompt and output) and `min_tokens`.

Structured outputs (specmesh.grammar, llguidance): OpenAI's `response_format` (json_object,
json_schema) on chat, vLLM's `structured_outputs` ({"json" | "regex" | "choice" | "grammar"}, the
spelling of vLLM >= 0.10; "grammar" is Lark) on both endpoints.

Log-probabilities, in OpenAI's shapes, streaming and not: chat `logprobs: true` + `top_logprobs`
(0..20) -> `choices[].logprobs.content`; completions `logprobs: N` (0..20 alternatives; OpenAI caps
it at 5, vLLM at 20) -> `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`, and with `echo:
true` the prompt's text and its tokens' logprobs first (the first prompt token's are null). The
values are the target's raw log-probabilities (log_softmax of its logits, before temperature,
top-k and top-p: vLLM's default), from the verification forward that produced each token. A
request with echo and logprobs prefills its whole prompt (no KV reuse of a session's prefix).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from contextlib import aclosing

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from router.errors import Kind, RouterError, invalid
from router.turns import Delta, Done, Router, TurnRequest
from specmesh.limits import MAX_DEPTH, MAX_TREE_NODES
from specmesh.logprobs import MAX_TOP_LOGPROBS
from specmesh.v1 import common_pb2, verifier_pb2

ROUTER_KEY = web.AppKey("router", Router)
OUTCOME = "specmesh_outcome"  # request-scoped: how a stream that had started ended
API = "http"


INT32_MAX = 2**31 - 1  # token ids and top_k travel as int32, seeds as uint64
UINT64_MAX = 2**64 - 1
ROLES = ("system", "user", "assistant")
MESSAGE_FIELDS = ("role", "content")

# Every field each endpoint honours; any other is refused with a 400 naming it, never ignored.
# OpenAI fields specmesh does not implement are accepted only at the value that changes nothing.
HONOURED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
            "ignore_eos", "speculation", "user", "stream", "stream_options", "presence_penalty",
            "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n"}
ENDPOINT_FIELDS = {"completions": HONOURED | {"prompt", "logprobs", "echo", "structured_outputs", "best_of"},
                   "chat": HONOURED | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                       "response_format", "structured_outputs"}}
LOGPROB_FLOOR = -9999.0  # a probability that underflowed to 0: JSON has no -Infinity (vLLM's choice too)
MAX_N = 16  # samples per request (n, best_of); OpenAI allows 128, vLLM sets no bound

NEUTRAL_ONLY = {  # field -> (endpoints, the value accepted as said in the 400, whether a value is it)
    "suffix": (("completions",), '""', lambda v: v is None or v == ""),
    "tools": (("chat",), "[]", lambda v: v is None or v == []),
    "functions": (("chat",), "[]", lambda v: v is None or v == []),
    "tool_choice": (("chat",), '"none"', lambda v: v is None or v == "none"),
    "parallel_tool_calls": (("chat",), "null", lambda v: v is None),
}


def _check_fields(body: dict, endpoint: str) -> None:
    """Unknown fields and unimplemented ones at a value that would change the output: a 400 naming
    the field (a field silently ignored would give a result the caller did not ask for)."""
    allowed = ENDPOINT_FIELDS[endpoint]
    for name, value in body.items():
        if name in allowed:
            continue
        endpoints, accepted, neutral = NEUTRAL_ONLY.get(name, ((), "", None))
        if endpoint not in endpoints:
            raise invalid(name, f"unknown field for /v1/{'chat/' if endpoint == 'chat' else ''}completions")
        if not neutral(value):
            raise invalid(name, f"not supported (only {accepted} is accepted)")


def _text(value: str, name: str) -> str:
    """A string that can travel (UTF-8): a lone surrogate such as "\\ud800" is refused."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(name, f"not valid Unicode ({e.reason} at character {e.start})") from e
    return value


def _field(body: dict, name: str, types: type | tuple[type, ...], default=None):
    value = body.get(name)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise invalid(name, f"wrong type {type(value).__name__}")
    return _text(value, name) if isinstance(value, str) else value


def _int(body: dict, name: str, low: int, high: int, default: int | None) -> int | None:
    value = _field(body, name, int, None)
    if value is None:
        return default
    if not low <= value <= high:
        raise invalid(name, f"must be in [{low}, {high}], got {value}")
    return value


def _number(body: dict, name: str, default: float) -> float:
    value = _field(body, name, (int, float), None)
    if value is None:
        return default
    try:
        out = float(value)
    except OverflowError as e:
        raise invalid(name, "too large") from e
    if not math.isfinite(out):
        raise invalid(name, "must be finite")
    return out


SPECULATION_FIELDS = {"disabled": bool, "budget": int, "depth": int}
SPECULATION_LIMITS = {"budget": MAX_TREE_NODES, "depth": MAX_DEPTH}  # the core's, 0 = the server's default


def _speculation(body: dict) -> verifier_pb2.SpeculationOptions:
    spec = _field(body, "speculation", dict, {})
    for name, value in spec.items():
        kind = SPECULATION_FIELDS.get(name)
        if kind is None:
            raise invalid(f"speculation.{name}", f"unknown; expected one of {sorted(SPECULATION_FIELDS)}")
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise invalid(f"speculation.{name}", f"wrong type {type(value).__name__}")
        top = SPECULATION_LIMITS.get(name)
        if top is not None and not 0 <= value <= top:
            raise invalid(f"speculation.{name}", f"must be in [0, {top}] (0 = the server's default)")
    return verifier_pb2.SpeculationOptions(**spec)


def _logit_bias(body: dict) -> dict[int, float]:
    """OpenAI's `logit_bias`: {"token id": bias}; the ids as strings (JSON keys) or ints."""
    bias = _field(body, "logit_bias", dict, {})
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise invalid("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= token <= INT32_MAX:
            raise invalid("logit_bias", f"token id {token} outside [0, {INT32_MAX}]")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise invalid("logit_bias", f"token {token}: bias must be a finite number, got {value!r}")
        out[token] = float(value)
    return out


STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "lark"}


def _structured(body: dict) -> common_pb2.StructuredOutput | None:
    """The output grammar: OpenAI's `response_format` ({"type": "json_object"} or {"type":
    "json_schema", "json_schema": {"name", "schema", "strict", "description"}}) or vLLM's
    `structured_outputs` (exactly one of "json": a schema, "regex", "choice": a list of strings,
    "grammar": a Lark grammar); not both."""
    fmt = _field(body, "response_format", dict, None)
    so = _field(body, "structured_outputs", dict, None)
    if fmt is not None and so is not None:
        raise invalid("structured_outputs", "give response_format or structured_outputs, not both")
    out = common_pb2.StructuredOutput()
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "text" and set(fmt) == {"type"}:
            return None
        if kind == "json_object" and set(fmt) == {"type"}:
            out.json_object = True
            return out
        if kind != "json_schema":
            raise invalid("response_format.type", f'one of "text", "json_object", "json_schema", got {kind!r}')
        extra = next((k for k in fmt if k not in ("type", "json_schema")), None)
        if extra is not None:
            raise invalid(f"response_format.{extra}", "unknown field")
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format.json_schema.schema", "a JSON schema object is required")
        extra = next((k for k in spec if k not in ("name", "schema", "strict", "description")), None)
        if extra is not None:
            raise invalid(f"response_format.json_schema.{extra}", "unknown field")
        out.json_schema = json.dumps(spec["schema"])
        return out
    if so is None:
        return None
    given = [k for k in so if so[k] is not None]
    if len(given) != 1 or given[0] not in STRUCTURED_KEYS:
        raise invalid("structured_outputs", f"exactly one of {sorted(STRUCTURED_KEYS)}, got {sorted(so)}")
    key = given[0]
    value = so[key]
    where = f"structured_outputs.{key}"
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise invalid(where, f"not JSON ({e})") from e
        if not isinstance(value, dict):
            raise invalid(where, "a JSON schema object")
        out.json_schema = json.dumps(value)
    elif key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise invalid(where, "a non-empty list of non-empty strings")
        out.choice.choices.extend(_text(c, where) for c in value)
    else:
        if not isinstance(value, str) or not value:
            raise invalid(where, "a non-empty string")
        setattr(out, STRUCTURED_KEYS[key], _text(value, where))
    return out


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (_text(stop, "stop"),)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(_text(s, "stop") for s in stop)
    raise invalid("stop", "a string or a list of strings")


def _token_list(value, name: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise invalid(name, "a list of token ids")
    bad = next((t for t in value if not 0 <= t <= INT32_MAX), None)
    if bad is not None:
        raise invalid(name, f"token id {bad} outside [0, {INT32_MAX}]")
    return value


def _samples(body: dict, stream: bool) -> tuple[int, int]:
    """(n, best_of): the samples returned and the samples drawn."""
    n = _int(body, "n", 1, MAX_N, 1)
    best_of = _int(body, "best_of", 1, MAX_N, n)
    if best_of < n:
        raise invalid("best_of", f"must be >= n ({n}), got {best_of}")
    if stream and best_of > n:
        raise invalid("best_of", "a stream sends every sample: best_of must equal n when streaming")
    return n, best_of


def _mean_logprob(lps: list[verifier_pb2.TokenLogprob], done: Done) -> float:
    """Of the sampled tokens only (an echoed prompt's logprobs come first)."""
    known = [lp.logprob for lp in lps[len(lps) - done.completion_tokens:] if lp.HasField("logprob")]
    return sum(known) / len(known) if known else 0.0


def _message(m, i: int) -> dict:
    """One chat message, {role, content}: roles the template renders, text content only."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, "a {role, content} object")
    extra = next((k for k in m if k not in MESSAGE_FIELDS), None)
    if extra is not None:
        raise invalid(f"{where}.{extra}", f"unknown message field; expected {list(MESSAGE_FIELDS)}")
    role = m.get("role")
    if role not in ROLES:
        raise invalid(f"{where}.role", f"one of {list(ROLES)}, got {role!r}")
    content = m.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                           and set(p) <= {"type", "text"} and isinstance(p.get("text", ""), str)
                                           for p in content):
        text = "".join(p.get("text", "") for p in content)
    else:
        raise invalid(f"{where}.content", "a string or a list of {type: text, text} parts")
    return {"role": role, "content": _text(text, f"{where}.content")}


class OpenAIApi:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _body(self, request: web.Request, endpoint: str) -> tuple[dict, str]:
        """The request's JSON body, checked (`endpoint`: completions | chat), and the caller's API key id."""
        key = self.router.auth.authenticate(request.headers.get("Authorization"))
        limit = self.router.cfg.max_request_bytes
        if (request.content_length or 0) > limit:
            raise invalid("request_bytes", f"{request.content_length} bytes exceed max_request_bytes {limit}")
        timeout = self.router.cfg.body_timeout_s
        try:  # bounded in size by client_max_size = the limit, and in time
            raw = await asyncio.wait_for(request.read(), timeout)
        except web.HTTPRequestEntityTooLarge as e:
            raise invalid("request_bytes", f"more than max_request_bytes {limit}") from e
        except asyncio.TimeoutError as e:
            raise RouterError(Kind.TIMEOUT, f"body: not received within {timeout:g} s", code="body") from e
        try:
            body = json.loads(raw)
        except RecursionError as e:
            raise invalid("body", "JSON nested too deep") from e
        except ValueError as e:
            raise invalid("body", f"not JSON ({e})") from e
        if not isinstance(body, dict):
            raise invalid("body", "a JSON object")
        _check_fields(body, endpoint)
        model = _field(body, "model", str, "")
        if model and model != self.router.model_name:
            raise RouterError(Kind.NOT_FOUND, f"model: {model!r} does not exist; this router serves "
                                              f"{self.router.model_name!r}", code="model_not_found", param="model")
        return body, key

    def _turn(self, request: web.Request, body: dict, key: str, ids: list[int], default_max_tokens: int,
              max_tokens_field: str = "max_tokens", logprobs: int | None = None,
              prompt_logprobs: bool = False) -> TurnRequest:
        r = self.router
        field = max_tokens_field if body.get(max_tokens_field) is not None else "max_tokens"
        max_tokens = _field(body, field, int, None)
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        session_id = request.headers.get("X-Session-ID") or _field(body, "user", str, "")
        stops = _stops(body)
        stop_ids = tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids"))
        ignore_eos = bool(_field(body, "ignore_eos", bool, False))
        r.check_request(request.content_length or 0, max_tokens, session_id, len(stops), field)
        top_p = _number(body, "top_p", 1.0)
        if not 0 < top_p <= 1:  # checked here too, to answer with the HTTP field's name
            raise invalid("top_p", f"must be in (0, 1], got {top_p}")
        sampling = common_pb2.SamplingParams(temperature=_number(body, "temperature", 1.0), top_p=top_p,
                                             top_k=_int(body, "top_k", 0, INT32_MAX, 0))
        seed = _int(body, "seed", 0, UINT64_MAX, None)
        if seed is not None:
            sampling.seed = seed
        # penalties: types here, ranges by the verifier (its 400 names the field too)
        sampling.presence_penalty = _number(body, "presence_penalty", 0.0)
        sampling.frequency_penalty = _number(body, "frequency_penalty", 0.0)
        repetition = _number(body, "repetition_penalty", 1.0)
        if repetition <= 0:  # 0 would read as unset (1.0) on the wire
            raise invalid("repetition_penalty", f"must be > 0, got {repetition}")
        sampling.repetition_penalty = repetition
        sampling.logit_bias.update(_logit_bias(body))
        sampling.min_tokens = _int(body, "min_tokens", 0, max_tokens, 0)
        template = verifier_pb2.GenerateRequest(sampling=sampling, stop=stops, stop_token_ids=stop_ids,
                                                ignore_eos=ignore_eos, speculation=_speculation(body),
                                                prompt_logprobs=prompt_logprobs)
        if logprobs is not None:
            template.logprobs = logprobs
        structured = _structured(body)
        if structured is not None:
            template.structured.CopyFrom(structured)
        return TurnRequest(session_id=session_id, ids=ids,
                           stop=r.stop_conditions(max_tokens, stops, stop_ids, ignore_eos), template=template,
                           full_context=True, key_id=key)

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, key = await self._body(request, "completions")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = await self.router.encode(_text(prompt, "prompt"))
        else:
            ids = _token_list(prompt, "prompt")
        logprobs = _int(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
        echo = bool(_field(body, "echo", bool, False))
        turn = self._turn(request, body, key, ids, self.router.cfg.default_max_tokens_http, logprobs=logprobs,
                          prompt_logprobs=echo and logprobs is not None)
        echoed = None
        if echo:
            echoed = prompt if isinstance(prompt, str) else self.router.decode(ids)
        return await self._respond(request, body, turn, chat=False, echo=echoed)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, key = await self._body(request, "chat")
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages):
            raise invalid("messages", "a non-empty list of {role, content}")
        ids = await self.router.encode_chat([_message(m, i) for i, m in enumerate(messages)])
        wanted = bool(_field(body, "logprobs", bool, False))
        top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, None)
        if top is not None and not wanted:
            raise invalid("top_logprobs", "needs logprobs: true")
        turn = self._turn(request, body, key, ids, self.router.cfg.max_tokens, "max_completion_tokens",
                          logprobs=(top or 0) if wanted else None)
        return await self._respond(request, body, turn, chat=True)

    async def _respond(self, request: web.Request, body: dict, turn: TurnRequest, chat: bool,
                       echo: str | None = None) -> web.StreamResponse:
        """The turn's answer, JSON or SSE; `echo`: completions' echoed prompt text (shown first)."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.router.model_name}
        stream = bool(_field(body, "stream", bool, False))
        options = _field(body, "stream_options", dict, {})
        extra = next((k for k in options if k != "include_usage"), None)
        if extra is not None:
            raise invalid(f"stream_options.{extra}", "unknown; expected include_usage")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise invalid("stream_options.include_usage", f"wrong type {type(include_usage).__name__}")
        n, best_of = _samples(body, stream)
        wanted = turn.template.HasField("logprobs")
        if best_of > n and not wanted:
            turn.template.logprobs = 0  # ranked by the sampled tokens' logprobs, not shown
        private = best_of > 1 and not turn.session_id  # the samples share a session: one prefill
        turns = _sample_turns(turn, best_of, f"samples-{rid}" if private else turn.session_id)
        try:
            if not stream:
                samples = [await self._collect(t, chat, echo) for t in turns]
                order = sorted(range(best_of), key=lambda i: -_mean_logprob(samples[i][1], samples[i][2]))[:n] \
                    if best_of > n else list(range(n))
                choices = []
                for index, i in enumerate(order):
                    text, lps, done = samples[i]
                    choice = {"index": index, "finish_reason": done.finish_reason,
                              "logprobs": _Logprobs(self.router.pieces, chat).render(lps) if wanted else None}
                    choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
                    choices.append(choice)
                dones = [d for _, _, d in samples]
                return web.json_response({**head, "choices": choices, "usage": _usage(dones),
                                          "specmesh": _extras(dones)})
            return await self._stream(request, head, turns, chat, echo, wanted, include_usage)
        finally:
            if private:
                await self.router.close_session(turns[0].session_id, turn.key_id)

    async def _first(self, events, chat: bool):
        """A turn's first event; its errors as the HTTP layer names them."""
        try:
            return await anext(events)
        except RouterError as e:
            if e.code == "token_ids":  # the verifier's name for what this request sent as
                e.code = "messages" if chat else "prompt"
            raise

    async def _collect(self, turn: TurnRequest, chat: bool, echo: str | None) -> tuple[str, list, Done]:
        """One whole sample: (text, logprobs: the echoed prompt's first, Done)."""
        async with aclosing(self.router.run(turn)) as events:
            text, lps, ev = [echo or ""], [], await self._first(events, chat)
            while isinstance(ev, Delta):
                lps += ev.prompt_logprobs or []
                lps += ev.logprobs
                text.append(ev.text)
                ev = await anext(events)
            return "".join(text), lps, ev

    async def _stream(self, request: web.Request, head: dict, turns: list[TurnRequest], chat: bool,
                      echo: str | None, wanted: bool, include_usage: bool) -> web.StreamResponse:
        """SSE: each sample's chunks under its index, one sample after another. Errors before the
        first event are plain HTTP errors; later ones an SSE `error` event."""
        head["object"] = "chat.completion.chunk" if chat else "text_completion"
        resp, dones = None, []
        try:
            for index, turn in enumerate(turns):
                async with aclosing(self.router.run(turn)) as events:
                    ev = await self._first(events, chat)
                    if resp is None:
                        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                        await resp.prepare(request)
                    if chat:
                        await _sse(resp, {**head, "choices": [{"index": index, "finish_reason": None, "logprobs": None,
                                                                "delta": {"role": "assistant", "content": ""}}]})
                    shown, shown_echo = _Logprobs(self.router.pieces, chat), echo
                    while not isinstance(ev, Done):
                        text, lps = ev.text, ev.logprobs
                        if shown_echo is not None:  # the echoed prompt (with its logprobs, the first event's) first
                            text, shown_echo = shown_echo + text, None
                            lps = (ev.prompt_logprobs or []) + lps
                        if text or lps:
                            piece = {"delta": {"content": text}} if chat else {"text": text}
                            await _sse(resp, {**head, "choices": [{"index": index, "finish_reason": None, **piece,
                                                                    "logprobs": shown.render(lps) if wanted else None}]})
                        ev = await anext(events)
                    last = {"index": index, "logprobs": None, "finish_reason": ev.finish_reason}
                    last.update({"delta": {}} if chat else {"text": ""})
                    await _sse(resp, {**head, "choices": [last], "specmesh": _extras([ev])})
                    dones.append(ev)
            if include_usage:
                await _sse(resp, {**head, "choices": [], "usage": _usage(dones)})
        except RouterError as e:
            if resp is None:
                raise
            request[OUTCOME] = e.kind.value
            await _sse(resp, e.openai_body())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        self.router.auth.authenticate(request.headers.get("Authorization"))
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "specmesh", "verifiers": v, "drafters": d}
                for m, v, d in await self.router.models()]
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        try:
            await self.router.state.ping()
            (_, verifiers, _), = await self.router.models()
        except RouterError as e:
            return web.json_response({"status": "unavailable", "reason": e.message}, status=503)
        if not verifiers:
            return web.json_response({"status": "unavailable", "reason": "no live verifier"}, status=503)
        return web.json_response({"status": "ok", "verifiers": verifiers})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.router.metrics.render(), content_type="text/plain", charset="utf-8")


class _Logprobs:
    """TokenLogprobs in OpenAI's shapes: chat's `{"content": [...]}`, completions' parallel lists
    (`text_offset` counts characters of the tokens' texts from the choice's start, across the
    chunks of a stream)."""

    def __init__(self, pieces, chat: bool) -> None:
        self.pieces, self.chat, self.offset = pieces, chat, 0

    def render(self, lps: list[verifier_pb2.TokenLogprob]) -> dict:
        if self.chat:
            return {"content": [self._entry(lp.token_id, lp.logprob) | {"top_logprobs": [
                self._entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]} for lp in lps], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            text = self.pieces(lp.token_id)[0]
            known = lp.HasField("logprob")
            out["tokens"].append(text)
            out["token_logprobs"].append(_floor(lp.logprob) if known else None)
            out["top_logprobs"].append({self.pieces(i)[0]: _floor(v) for i, v in zip(lp.top_ids, lp.top_logprobs)}
                                       if known else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out

    def _entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.pieces(token_id)
        return {"token": text, "logprob": _floor(logprob), "bytes": raw}


def _floor(logprob: float) -> float:
    return max(float(logprob), LOGPROB_FLOOR)


def _usage(dones: list[Done]) -> dict:
    """The prompt once (the first sample's, as cached then), every sample's tokens."""
    prompt, completion = dones[0].prompt_tokens, sum(d.completion_tokens for d in dones)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": dones[0].cached_prompt_tokens}}


def _extras(dones: list[Done]) -> dict:
    """The speculation stats: one sample's, or a list, one per sample drawn in order."""
    stats = [MessageToDict(d.speculation, always_print_fields_with_no_presence=True, preserving_proto_field_name=True)
             for d in dones]
    return {"speculation": stats[0] if len(stats) == 1 else stats}


def _sample_turns(turn: TurnRequest, count: int, session_id: str) -> list[TurnRequest]:
    """`count` copies of `turn` in session `session_id`, sample i seeded with seed + i when seeded."""
    if count == 1:
        return [turn]
    out = []
    for i in range(count):
        template = verifier_pb2.GenerateRequest()
        template.CopyFrom(turn.template)
        if template.sampling.HasField("seed"):
            template.sampling.seed = (template.sampling.seed + i) % (UINT64_MAX + 1)
        out.append(dataclasses.replace(turn, session_id=session_id, template=template))
    return out


async def _sse(resp: web.StreamResponse, obj: dict) -> None:
    await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    """RouterErrors -> OpenAI-style JSON with their HTTP status; one place for the counters."""
    outcome = "ok"
    try:
        return await handler(request)
    except RouterError as e:
        outcome = e.kind.value
        return web.json_response(e.openai_body(), status=e.http_status, headers=dict(e.headers))
    except web.HTTPException:
        raise
    except Exception:
        outcome = "internal"  # a bug: aiohttp answers 500; counted as what it is, not "ok"
        raise
    finally:
        if request.path.startswith("/v1/") and request.method == "POST":
            request.app[ROUTER_KEY].metrics.requests[(API, request.get(OUTCOME, outcome))] += 1


def build_app(router: Router) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=router.cfg.max_request_bytes)
    app[ROUTER_KEY] = router
    api = OpenAIApi(router)
    app.router.add_post("/v1/completions", api.completions)
    app.router.add_post("/v1/chat/completions", api.chat_completions)
    app.router.add_get("/v1/models", api.models)
    app.router.add_get("/health", api.health)
    app.router.add_get("/metrics", api.metrics)
    return app
