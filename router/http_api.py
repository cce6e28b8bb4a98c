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
Not supported (400 naming the field): n > 1, best_of > 1, echo, logprobs, tools.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from router.errors import Kind, RouterError, invalid
from router.turns import Delta, Done, Router, TurnRequest
from specmesh.v1 import common_pb2, verifier_pb2

ROUTER_KEY = web.AppKey("router", Router)
OUTCOME = "specmesh_outcome"  # request-scoped: how a stream that had started ended
API = "http"


def _field(body: dict, name: str, types: type | tuple[type, ...], default=None):
    value = body.get(name)
    if value is None:
        return default
    types = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise invalid(name, f"wrong type {type(value).__name__}")
    return value


SPECULATION_FIELDS = {"disabled": bool, "budget": int, "depth": int}


def _speculation(body: dict) -> verifier_pb2.SpeculationOptions:
    spec = _field(body, "speculation", dict, {})
    for name, value in spec.items():
        kind = SPECULATION_FIELDS.get(name)
        if kind is None:
            raise invalid(f"speculation.{name}", f"unknown; expected one of {sorted(SPECULATION_FIELDS)}")
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise invalid(f"speculation.{name}", f"wrong type {type(value).__name__}")
        if kind is int and not 0 <= value <= 64:
            raise invalid(f"speculation.{name}", "must be in [0, 64] (0 = the server's default)")
    return verifier_pb2.SpeculationOptions(**spec)


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise invalid("stop", "a string or a list of strings")


def _token_list(value, name: str) -> list[int]:
    if not (isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
        raise invalid(name, "a list of token ids")
    return value


def _message_text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise invalid("messages", "content must be a string or a list of text parts")


class OpenAIApi:
    def __init__(self, router: Router) -> None:
        self.router = router

    async def _body(self, request: web.Request) -> tuple[dict, str]:
        """The request's JSON body, checked, and the caller's API key id."""
        key = self.router.authenticate(request.headers.get("Authorization"))
        limit = self.router.cfg.max_request_bytes
        if (request.content_length or 0) > limit:
            raise invalid("request_bytes", f"{request.content_length} bytes exceed max_request_bytes {limit}")
        try:
            raw = await request.read()  # bounded by client_max_size = the limit
        except web.HTTPRequestEntityTooLarge as e:
            raise invalid("request_bytes", f"more than max_request_bytes {limit}") from e
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise invalid("body", f"not JSON ({e})") from e
        if not isinstance(body, dict):
            raise invalid("body", "a JSON object")
        model = _field(body, "model", str, "")
        if model and model != self.router.model_name:
            raise RouterError(Kind.NOT_FOUND, f"model: {model!r} does not exist; this router serves "
                                              f"{self.router.model_name!r}", code="model_not_found")
        for name, ok in (("n", lambda v: v == 1), ("best_of", lambda v: v == 1), ("echo", lambda v: not v),
                         ("logprobs", lambda v: not v), ("tools", lambda v: not v)):
            if body.get(name) is not None and not ok(body[name]):
                raise invalid(name, "not supported")
        return body, key

    def _turn(self, request: web.Request, body: dict, key: str, ids: list[int], default_max_tokens: int,
              max_tokens_field: str = "max_tokens") -> TurnRequest:
        r = self.router
        max_tokens = _field(body, max_tokens_field, int, None)
        if max_tokens is None and max_tokens_field != "max_tokens":
            max_tokens = _field(body, "max_tokens", int, None)
        max_tokens = default_max_tokens if max_tokens is None else max_tokens
        session_id = request.headers.get("X-Session-ID") or _field(body, "user", str, "")
        stops = _stops(body)
        stop_ids = tuple(_token_list(body.get("stop_token_ids") or [], "stop_token_ids"))
        ignore_eos = bool(_field(body, "ignore_eos", bool, False))
        r.check_request(request.content_length or 0, max_tokens, session_id, len(stops))
        sampling = common_pb2.SamplingParams(
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)), top_k=int(_field(body, "top_k", int, 0)))
        seed = _field(body, "seed", int, None)
        if seed is not None:
            if seed < 0:
                raise invalid("seed", "must be >= 0")
            sampling.seed = seed
        template = verifier_pb2.GenerateRequest(sampling=sampling, stop=stops, stop_token_ids=stop_ids,
                                                ignore_eos=ignore_eos, speculation=_speculation(body))
        return TurnRequest(session_id=session_id, ids=ids, max_tokens=max_tokens,
                           stops=r.stops(stops, stop_ids, ignore_eos), template=template, full_context=True,
                           key_id=key)

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, key = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = await self.router.encode(prompt)
        else:
            ids = _token_list(prompt, "prompt")
        turn = self._turn(request, body, key, ids, self.router.cfg.default_max_tokens_http)
        return await self._respond(request, body, turn, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body, key = await self._body(request)
        messages = body.get("messages")
        if not (isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                                 for m in messages)):
            raise invalid("messages", "a non-empty list of {role, content}")
        ids = await self.router.encode_chat([{"role": m["role"], "content": _message_text(m.get("content", ""))}
                                             for m in messages])
        turn = self._turn(request, body, key, ids, self.router.cfg.max_tokens, "max_completion_tokens")
        return await self._respond(request, body, turn, chat=True)

    async def _respond(self, request: web.Request, body: dict, turn: TurnRequest, chat: bool) -> web.StreamResponse:
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.router.model_name}
        stream = bool(_field(body, "stream", bool, False))
        options = _field(body, "stream_options", dict, {})
        include_usage = bool(options.get("include_usage"))
        async with aclosing(self.router.run(turn)) as events:
            first = await anext(events)  # errors before the first event are plain HTTP errors
            if not stream:
                text, done = [], first
                while isinstance(done, Delta):
                    text.append(done.text)
                    done = await anext(events)
                choice = {"index": 0, "finish_reason": done.finish_reason, "logprobs": None}
                choice.update({"message": {"role": "assistant", "content": "".join(text)}} if chat
                              else {"text": "".join(text)})
                return web.json_response({**head, "choices": [choice], "usage": _usage(done),
                                          "specmesh": _extras(done)})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await resp.prepare(request)
            head["object"] = "chat.completion.chunk" if chat else "text_completion"
            if chat:
                await _sse(resp, {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}]})
            ev = first
            try:
                while True:
                    if isinstance(ev, Done):
                        last = {"index": 0, "logprobs": None, "finish_reason": ev.finish_reason}
                        last.update({"delta": {}} if chat else {"text": ""})
                        await _sse(resp, {**head, "choices": [last], "specmesh": _extras(ev)})
                        if include_usage:
                            await _sse(resp, {**head, "choices": [], "usage": _usage(ev)})
                        break
                    if ev.text:
                        piece = {"delta": {"content": ev.text}} if chat else {"text": ev.text}
                        await _sse(resp, {**head, "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                                                                **piece}]})
                    ev = await anext(events)
            except RouterError as e:
                request[OUTCOME] = e.kind.value
                await _sse(resp, e.openai_body())
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp

    async def models(self, request: web.Request) -> web.Response:
        self.router.authenticate(request.headers.get("Authorization"))
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


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": done.cached_prompt_tokens}}


def _extras(done: Done) -> dict:
    return {"speculation": MessageToDict(done.speculation, always_print_fields_with_no_presence=True,
                                         preserving_proto_field_name=True)}


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
