"""Sending one turn and timing its stream: over the router's gRPC API (specmesh.client.AsyncClient)
or its OpenAI-compatible HTTP API (aiohttp, /v1/chat/completions with SSE). Both fill a
RequestRecord; neither knows about schedules or arms beyond the `speculate` flag.

gRPC appends a turn to a session, so the client applies the chat template itself and sends only
the tokens past what the session holds (the same prefix rule the router's HTTP API applies to a
stateless chat). When the re-rendered chat does not extend what the session holds (a reply that
re-tokenizes differently), the turn starts a new session with the whole context (`rebuilds`).
Over HTTP the switch is the router's `speculation` request extension ({"disabled": true}).
"""

from __future__ import annotations

import json
import ssl
import time
from dataclasses import asdict, dataclass, field

from loadtest.metrics import RequestRecord
from specmesh.tls import ClientTls


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.0
    ignore_eos: bool = False
    seed: int | None = None


@dataclass
class SessionState:
    """Client-side view of one session: its id and (gRPC) the token ids the server holds."""
    session_id: str                  # "" = one-shot
    held: list[int] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)
    rebuilds: int = 0
    abandoned: list[str] = field(default_factory=list)  # ids left behind by rebuilds (closed at the end)


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


class GrpcBackend:
    name = "grpc"

    def __init__(self, address: str, tokenizer, api_key: str | None = None, timeout_s: float = 300.0,
                 tls: ClientTls = ClientTls()) -> None:
        from specmesh.client import AsyncClient

        self.client = AsyncClient(address, api_key=api_key, timeout=timeout_s, retries=0, **tls.sdk_kwargs())
        self.tokenizer = tokenizer

    async def send(self, state: SessionState, messages: list[dict], sampling: Sampling, speculate: bool,
                   rec: RequestRecord) -> None:
        from specmesh.client import SpecmeshError

        full = chat_ids(self.tokenizer, messages)
        if state.session_id and state.held and full[: len(state.held)] == state.held:
            new = full[len(state.held):]
        else:
            if state.held:  # cannot extend the session: a fresh one with the whole context
                state.rebuilds += 1
                state.abandoned.append(state.session_id)
                state.session_id = f"{state.session_id.split('#')[0]}#{state.rebuilds}"
            new = full
        rec.prompt_len = len(full)
        rec.start = time.perf_counter()
        try:
            async with self.client.generate(
                    new, session_id=state.session_id, max_tokens=sampling.max_tokens,
                    temperature=sampling.temperature, seed=sampling.seed, ignore_eos=sampling.ignore_eos,
                    speculate=speculate) as stream:
                async for chunk in stream:
                    if chunk.token_ids:
                        rec.chunk_times.append(time.perf_counter())
                        rec.chunk_tokens.append(len(chunk.token_ids))
                done = stream.result
        except SpecmeshError as e:
            rec.end, rec.error = time.perf_counter(), str(e)
            return
        rec.end = time.perf_counter()
        rec.success = done is not None
        if done is None:
            rec.error = "stream ended without a completion"
            return
        rec.token_ids, rec.text, rec.finish_reason = done.token_ids, done.text, done.finish_reason
        rec.output_tokens = len(done.token_ids)
        rec.prompt_len = done.usage.prompt_tokens or rec.prompt_len
        rec.cached_prompt_tokens = done.usage.cached_prompt_tokens
        rec.speculation = asdict(done.speculation)
        if state.session_id:
            state.held = full + done.token_ids
        state.replies.append(done.text)

    async def end_session(self, state: SessionState) -> None:
        """Free the session's KV cache and Redis state once its last turn is measured."""
        from specmesh.client import SpecmeshError

        for sid in [*state.abandoned, state.session_id] if state.session_id else []:
            try:
                await self.client.close_session(sid)
            except SpecmeshError:
                pass  # a load test does not fail on cleanup; the session expires with its TTL

    async def close(self) -> None:
        await self.client.close()


class HttpBackend:
    name = "http"

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0, model: str = "",
                 ssl_context: ssl.SSLContext | None = None) -> None:
        import aiohttp  # here, not at import: `specmesh --help` builds this module's flags

        self.url = base_url.rstrip("/") + "/v1/chat/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                             connector=aiohttp.TCPConnector(limit=0, ssl=ssl_context or True))

    async def send(self, state: SessionState, messages: list[dict], sampling: Sampling, speculate: bool,
                   rec: RequestRecord) -> None:
        import aiohttp

        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                "max_tokens": sampling.max_tokens, "temperature": sampling.temperature,
                "ignore_eos": sampling.ignore_eos, "speculation": {"disabled": not speculate}}
        if self.model:
            body["model"] = self.model
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        headers = dict(self.headers, **({"X-Session-ID": state.session_id} if state.session_id else {}))
        text: list[str] = []
        rec.start = time.perf_counter()
        try:
            async with self.session.post(self.url, json=body, headers=headers) as resp:
                if resp.status != 200:
                    rec.end, rec.error = time.perf_counter(), f"HTTP {resp.status}: {(await resp.text())[:300]}"
                    return
                async for event in _sse_events(resp):
                    now = time.perf_counter()
                    if "error" in event:
                        rec.error = json.dumps(event["error"])[:300]
                        continue
                    _read_chunk(event, rec, text, now)
        except (aiohttp.ClientError, TimeoutError) as e:
            rec.end, rec.error = time.perf_counter(), f"{type(e).__name__}: {e}"
            return
        rec.end = time.perf_counter()
        rec.text = "".join(text)
        rec.success = not rec.error and bool(rec.finish_reason)
        if rec.success:
            state.replies.append(rec.text)

    async def end_session(self, state: SessionState) -> None:
        """Nothing to do: the OpenAI API has no session to close (it expires with its TTL)."""

    async def close(self) -> None:
        await self.session.close()


def _read_chunk(event: dict, rec: RequestRecord, text: list[str], now: float) -> None:
    for choice in event.get("choices") or ():
        piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
        if piece:
            rec.chunk_times.append(now)
            rec.chunk_tokens.append(0)  # the HTTP stream carries text, not token counts
            text.append(piece)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    spec = (event.get("specmesh") or {}).get("speculation")
    if spec:
        rec.speculation = spec
    usage = event.get("usage")
    if usage:
        rec.output_tokens = int(usage.get("completion_tokens", 0))
        rec.prompt_len = int(usage.get("prompt_tokens", 0))
        rec.cached_prompt_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0)


async def _sse_events(resp):
    """The JSON objects of an SSE stream's `data:` lines, until `[DONE]`."""
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
