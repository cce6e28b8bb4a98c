"""specmesh SDK: `Client` (blocking) and `AsyncClient` (asyncio) for the router's gRPC API
(`specmesh.v1.Router`).

    with Client("127.0.0.1:50050", api_key="...") as c:
        stream = c.generate("Hello", max_tokens=32, session_id="chat-1")
        for chunk in stream:                 # Chunk(token_ids, text)
            print(chunk.text, end="")
        print(stream.result.usage)           # Completion once the stream is exhausted
        out = c.complete([1, 2, 3], max_tokens=8)   # Completion(text, token_ids, finish_reason, usage, speculation)
        c.complete("Hi", logprobs=2).logprobs  # TokenLogprob(token, logprob, top) per token: the target's

- `prompt` is text (tokenized by the router) or token ids; with a `session_id` it is appended to
  the session (one turn), without one the request is one-shot.
- Retries: a failure before the first response (UNAVAILABLE, RESOURCE_EXHAUSTED, ABORTED,
  INTERNAL, UNKNOWN) is retried up to `retries` times with backoff, on the next address when
  several router replicas are given, within `timeout`. Never after the first token: the router
  already fails over between verifiers mid-stream, and a repeat would duplicate output.
- Cancellation: closing the stream (`stream.cancel()`, leaving a `with` block, `break` out of a
  loop over a stream nobody else holds, cancelling the asyncio task) cancels the RPC, and the
  router cancels the verifier's turn.
  A status sent with trailing metadata `x-should-retry: false` (e.g. the router's
  max_sessions_per_key) is never retried.
- Errors: `SpecmeshError` with the gRPC `code` and the server's `details` (which name the field
  or limit at fault).
- TLS: `tls=True` (system roots), `root_ca=PATH` (trust that CA), `client_cert=PATH` +
  `client_key=PATH` (mTLS, for a router started with `--tls-client-ca`); or any
  `credentials=grpc.ChannelCredentials`. Default: plaintext.

Only this module and specmesh.tls of specmesh/ import grpc for clients; they know nothing of
the engine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, fields

import grpc

from specmesh.logprobs import TokenLogprob, logprob_from_pb
from specmesh.tls import channel_credentials
from specmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, verifier_pb2

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
BACKOFF_S = (0.1, 0.3, 1.0, 2.0)
CHANNEL_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
NO_RETRY = ("x-should-retry", "false")  # trailing metadata of an error that a retry cannot cure


class SpecmeshError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    text: str  # text delta
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, with `logprobs=`


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class SpeculationStats:
    steps: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float = 0.0
    tokens_per_step: float = 0.0
    rejected_trees: int = 0
    drafter_timeouts: int = 0
    verify_idle_fraction: float = 0.0
    predraft_hits: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    plain_steps: int = 0


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | cancelled
    usage: Usage = field(default_factory=Usage)
    speculation: SpeculationStats = field(default_factory=SpeculationStats)
    # with `logprobs=`: the target's, one per token id (raw log_softmax of its logits)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # with `prompt_logprobs=True`


@dataclass(frozen=True)
class Model:
    id: str
    verifiers: int
    drafters: int


def build_request(prompt: str | Sequence[int], *, max_tokens: int = 128, temperature: float = 0.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), ignore_eos: bool = False, session_id: str = "",
                  speculate: bool = True, budget: int = 0, depth: int = 0, fixed_shape: bool = False,
                  logprobs: int | None = None,
                  prompt_logprobs: bool = False, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float = 1.0, logit_bias: dict[int, float] | None = None,
                  min_tokens: int = 0, structured: dict | None = None) -> verifier_pb2.GenerateRequest:
    """The GenerateRequest of one turn (budget/depth 0 = the verifier's defaults: caps within which
    the drafter plans each step's shape; `fixed_shape`: exactly that shape). `logprobs`: the
    target's log-probability of each generated token with this many alternatives (0..20; None =
    none); `prompt_logprobs`: also of the prompt's tokens (needs `logprobs`). Penalties: as in
    OpenAI's and vLLM's APIs (common.proto SamplingParams says the order). `structured`: the
    output's grammar, vLLM's `structured_outputs` form: {"json": schema dict}, {"json_object":
    True}, {"regex": str}, {"choice": [str, ...]} or {"grammar": Lark text}."""
    sampling = common_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                         presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                         repetition_penalty=repetition_penalty, logit_bias=logit_bias or {},
                                         min_tokens=min_tokens)
    if seed is not None:
        sampling.seed = seed
    req = verifier_pb2.GenerateRequest(
        session_id=session_id, sampling=sampling, max_tokens=max_tokens, stop=list(stop),
        stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
        speculation=verifier_pb2.SpeculationOptions(disabled=not speculate, budget=budget, depth=depth,
                                                    fixed=fixed_shape),
        prompt_logprobs=prompt_logprobs)
    if logprobs is not None:
        req.logprobs = logprobs
    if structured is not None:
        req.structured.CopyFrom(_structured(structured))
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def _structured(spec: dict) -> common_pb2.StructuredOutput:
    if len(spec) != 1:
        raise ValueError(f"structured: exactly one of json, json_object, regex, choice, grammar; got {sorted(spec)}")
    (key, value), = spec.items()
    out = common_pb2.StructuredOutput()
    if key == "json":
        out.json_schema = value if isinstance(value, str) else json.dumps(value)
    elif key == "json_object":
        out.json_object = True
    elif key == "choice":
        out.choice.choices.extend(value)
    elif key in ("regex", "grammar"):
        setattr(out, "lark" if key == "grammar" else "regex", value)
    else:
        raise ValueError(f"structured: unknown key {key!r}")
    return out


class _Collected:
    """What a stream received so far: the Completion's parts, and each chunk as the SDK's Chunk."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob] = []

    def chunk(self, msg: verifier_pb2.Chunk) -> Chunk | None:
        """The chunk for the caller (None: one carrying only the prompt's logprobs)."""
        self.prompt_logprobs += [logprob_from_pb(lp) for lp in msg.prompt_logprobs]
        if not msg.token_ids and not msg.text:
            return None
        lps = [logprob_from_pb(lp) for lp in msg.logprobs]
        self.ids.extend(msg.token_ids)
        self.texts.append(msg.text)
        self.logprobs += lps
        return Chunk(list(msg.token_ids), msg.text, lps)

    def completion(self, complete: verifier_pb2.Complete) -> Completion:
        u = complete.usage
        spec = SpeculationStats(**{f.name: getattr(complete.speculation, f.name) for f in fields(SpeculationStats)})
        return Completion("".join(self.texts), self.ids, complete.finish_reason,
                          Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens), spec,
                          self.logprobs, self.prompt_logprobs)


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _may_retry(e: grpc.RpcError, attempt: int, retries: int, deadline: float | None) -> float | None:
    """Seconds to wait before retrying, or None to give up."""
    if e.code() not in RETRYABLE or attempt >= retries or NO_RETRY in tuple(e.trailing_metadata() or ()):
        return None
    wait = BACKOFF_S[min(attempt, len(BACKOFF_S) - 1)]
    if deadline is not None and time.monotonic() + wait >= deadline:
        return None
    return wait


def _credentials(credentials: grpc.ChannelCredentials | None, tls: bool, root_ca: str | None,
                 client_cert: str | None, client_key: str | None) -> grpc.ChannelCredentials | None:
    """The channel credentials the options ask for; None = plaintext."""
    if credentials is not None:
        if tls or root_ca or client_cert or client_key:
            raise ValueError("credentials: give either credentials or tls/root_ca/client_cert/client_key")
        return credentials
    if tls or root_ca or client_cert or client_key:
        return channel_credentials(root_ca, client_cert, client_key)
    return None


class _Base:
    def __init__(self, target: str | Sequence[str], api_key: str | None, timeout: float | None, retries: int,
                 credentials: grpc.ChannelCredentials | None) -> None:
        self.addresses = [target] if isinstance(target, str) else list(target)
        if not self.addresses:
            raise ValueError("target: at least one address")
        self.api_key, self.timeout, self.retries, self.credentials = api_key, timeout, retries, credentials
        self._next = 0

    def _pick(self) -> int:
        i = self._next
        self._next = (self._next + 1) % len(self.addresses)
        return i


class Stream:
    """The chunks of one generation; `result` holds the Completion once it is exhausted."""

    def __init__(self, client: Client, request: verifier_pb2.GenerateRequest, timeout: float | None,
                 api_key: str | None) -> None:
        self._box: dict[str, Completion] = {}  # the generator holds the box, not the Stream: no cycle,
        self._gen = client._stream(self._box, request, timeout, api_key)  # so dropping the Stream cancels

    @property
    def result(self) -> Completion | None:
        return self._box.get("result")

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Chunk:
        return next(self._gen)

    def cancel(self) -> None:
        """Stop: cancels the RPC (and the verifier's work). Safe to call twice."""
        self._gen.close()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()

    def __del__(self) -> None:
        gen = getattr(self, "_gen", None)
        if gen is not None:
            gen.close()


class Client(_Base):
    def __init__(self, target: str | Sequence[str], *, api_key: str | None = None, timeout: float | None = None,
                 retries: int = 3, credentials: grpc.ChannelCredentials | None = None, tls: bool = False,
                 root_ca: str | None = None, client_cert: str | None = None, client_key: str | None = None) -> None:
        credentials = _credentials(credentials, tls, root_ca, client_cert, client_key)
        super().__init__(target, api_key, timeout, retries, credentials)
        self._channels = [grpc.secure_channel(a, credentials, CHANNEL_OPTIONS) if credentials else
                          grpc.insecure_channel(a, CHANNEL_OPTIONS) for a in self.addresses]
        self._stubs = [router_pb2_grpc.RouterStub(ch) for ch in self._channels]

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, api_key: str | None = None,
                 **params) -> Stream:
        """Stream one turn. `params`: max_tokens, temperature, top_p, top_k, seed, stop,
        stop_token_ids, ignore_eos, session_id, speculate, budget, depth, fixed_shape, logprobs, prompt_logprobs,
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias, min_tokens, structured
        (see build_request)."""
        return Stream(self, build_request(prompt, **params), timeout or self.timeout, api_key or self.api_key)

    def complete(self, prompt: str | Sequence[int], **kw) -> Completion:
        with self.generate(prompt, **kw) as stream:
            for _ in stream:
                pass
            assert stream.result is not None
            return stream.result

    def _stream(self, box: dict, request, timeout: float | None, api_key: str | None) -> Iterator[Chunk]:
        deadline = None if timeout is None else time.monotonic() + timeout
        got = _Collected()
        attempt = 0
        while True:
            stub = self._stubs[self._pick()]
            call = stub.Generate(request, timeout=_remaining(deadline), metadata=_metadata(api_key))
            received = False
            try:
                for resp in call:
                    received = True
                    if resp.HasField("chunk"):
                        chunk = got.chunk(resp.chunk)
                        if chunk is not None:
                            yield chunk
                    else:
                        box["result"] = got.completion(resp.complete)
                return
            except grpc.RpcError as e:
                wait = None if received else _may_retry(e, attempt, self.retries, deadline)
                if wait is None:
                    raise SpecmeshError(e.code(), e.details() or "") from None
                attempt += 1
                time.sleep(wait)
            finally:
                call.cancel()

    def _unary(self, method: str, request, api_key: str | None):
        """A unary call, retried like a stream before its first response."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                return getattr(self._stubs[self._pick()], method)(
                    request, timeout=_remaining(deadline), metadata=_metadata(api_key or self.api_key))
            except grpc.RpcError as e:
                wait = _may_retry(e, attempt, self.retries, deadline)
                if wait is None:
                    raise SpecmeshError(e.code(), e.details() or "") from None
                attempt += 1
                time.sleep(wait)

    def list_models(self, api_key: str | None = None) -> list[Model]:
        r = self._unary("ListModels", router_pb2.ListModelsRequest(), api_key)
        return [Model(m.id, m.verifiers, m.drafters) for m in r.models]

    def close_session(self, session_id: str, api_key: str | None = None) -> bool:
        """Forget a session (binding, history, the verifier's KV cache); whether it existed."""
        return self._unary("CloseSession", verifier_pb2.CloseSessionRequest(session_id=session_id), api_key).existed

    def close(self) -> None:
        for ch in self._channels:
            ch.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncStream:
    """Async iterator of the chunks of one generation; `result` once exhausted; `aclose()` cancels."""

    def __init__(self, client: AsyncClient, request, timeout: float | None, api_key: str | None) -> None:
        self._box: dict[str, Completion] = {}
        self._gen = client._stream(self._box, request, timeout, api_key)

    @property
    def result(self) -> Completion | None:
        return self._box.get("result")

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> Chunk:
        return await self._gen.__anext__()

    async def aclose(self) -> None:
        await self._gen.aclose()

    cancel = aclose

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class AsyncClient(_Base):
    def __init__(self, target: str | Sequence[str], *, api_key: str | None = None, timeout: float | None = None,
                 retries: int = 3, credentials: grpc.ChannelCredentials | None = None, tls: bool = False,
                 root_ca: str | None = None, client_cert: str | None = None, client_key: str | None = None) -> None:
        credentials = _credentials(credentials, tls, root_ca, client_cert, client_key)
        super().__init__(target, api_key, timeout, retries, credentials)
        self._channels = [grpc.aio.secure_channel(a, credentials, CHANNEL_OPTIONS) if credentials else
                          grpc.aio.insecure_channel(a, CHANNEL_OPTIONS) for a in self.addresses]
        self._stubs = [router_pb2_grpc.RouterStub(ch) for ch in self._channels]

    def generate(self, prompt: str | Sequence[int], *, timeout: float | None = None, api_key: str | None = None,
                 **params) -> AsyncStream:
        return AsyncStream(self, build_request(prompt, **params), timeout or self.timeout, api_key or self.api_key)

    async def complete(self, prompt: str | Sequence[int], **kw) -> Completion:
        async with self.generate(prompt, **kw) as stream:
            async for _ in stream:
                pass
            assert stream.result is not None
            return stream.result

    async def _stream(self, box: dict, request, timeout: float | None,
                      api_key: str | None) -> AsyncIterator[Chunk]:
        deadline = None if timeout is None else time.monotonic() + timeout
        got = _Collected()
        attempt = 0
        while True:
            stub = self._stubs[self._pick()]
            call = stub.Generate(request, timeout=_remaining(deadline), metadata=_metadata(api_key))
            received = False
            try:
                async for resp in call:
                    received = True
                    if resp.HasField("chunk"):
                        chunk = got.chunk(resp.chunk)
                        if chunk is not None:
                            yield chunk
                    else:
                        box["result"] = got.completion(resp.complete)
                return
            except grpc.aio.AioRpcError as e:
                wait = None if received else _may_retry(e, attempt, self.retries, deadline)
                if wait is None:
                    raise SpecmeshError(e.code(), e.details() or "") from None
                attempt += 1
                await asyncio.sleep(wait)
            finally:
                call.cancel()

    async def _unary(self, method: str, request, api_key: str | None):
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        attempt = 0
        while True:
            try:
                return await getattr(self._stubs[self._pick()], method)(
                    request, timeout=_remaining(deadline), metadata=_metadata(api_key or self.api_key))
            except grpc.aio.AioRpcError as e:
                wait = _may_retry(e, attempt, self.retries, deadline)
                if wait is None:
                    raise SpecmeshError(e.code(), e.details() or "") from None
                attempt += 1
                await asyncio.sleep(wait)

    async def list_models(self, api_key: str | None = None) -> list[Model]:
        r = await self._unary("ListModels", router_pb2.ListModelsRequest(), api_key)
        return [Model(m.id, m.verifiers, m.drafters) for m in r.models]

    async def close_session(self, session_id: str, api_key: str | None = None) -> bool:
        r = await self._unary("CloseSession", verifier_pb2.CloseSessionRequest(session_id=session_id), api_key)
        return r.existed

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
