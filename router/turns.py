"""One turn of a session through the router: read the session from Redis, place it, forward it to
the verifier as a stream, record the produced tokens, and fail over.

Both front doors (gRPC servicer, HTTP API) call `Router.run(TurnRequest)` and get `Delta`s then
one `Done`, or a RouterError. What a turn sends to the verifier:
- `history` = what the session held before the turn (always set for a session, possibly empty,
  so the verifier's state is exactly Redis's: it reuses its KV cache when its tokens match and
  rebuilds from `history` otherwise), `token_ids` = the turn's new tokens;
- after a failure **before the first token**: the same request to another verifier;
- after a failure **mid-stream**: `history` = everything so far (old history + new tokens +
  tokens already streamed), no new tokens, `max_tokens` reduced by what was streamed, to another
  verifier. Greedy output is then token for token the uninterrupted one; a seeded sample is a
  valid sample but not the uninterrupted one (the generator restarts).
The client sees one stream: text is decoded here from the turn's tokens (specmesh.text), not taken
from the verifiers, and stops are checked here too, so a stop straddling the move is honoured.

Input modes: `full_context=False` (gRPC): `ids` are appended to the session. `full_context=True`
(OpenAI API, stateless by contract): `ids` are the whole context; when the stored history is a
prefix of it only the rest is sent (KV reuse), otherwise the history is replaced by `ids` and the
verifier keeps the KV of the prefix both share (a regenerated answer, the next of n samples).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from enum import Enum

import grpc

from router.auth import Auth, scoped_session
from router.channels import VerifierChannels
from router.config import RouterConfig
from router.errors import Kind, RouterError, client_fault, field_of, invalid
from router.metrics import Metrics
from router.policies import Binding, NoVerifierError, PolicyName, RequestMeta, Role, get_policy
from router.state import RouterState, StateUnavailable
from specmesh.limits import MAX_STOP_STRINGS
from specmesh.registry import INTERVAL_S as HEARTBEAT_INTERVAL_S
from specmesh.registry import TTL_S as HEARTBEAT_TTL_S
from specmesh.text import StopConditions, TextStream, TokenPieces, common_prefix, eos_ids, first_stop
from specmesh.v1 import common_pb2, verifier_pb2

log = logging.getLogger(__name__)

MAX_SESSION_ID = 256  # the verifier allows 320: room for scoped_session's key prefix
BUSY_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8)


@dataclass(frozen=True)
class TurnRequest:
    session_id: str                      # "" = one-shot
    ids: list[int]                       # new tokens, or the whole context (full_context)
    stop: StopConditions                 # max_tokens, stop ids (EOS unless ignore_eos), stop strings
    # sampling, stop, stop_token_ids, ignore_eos, speculation: forwarded to the verifier as they are
    template: verifier_pb2.GenerateRequest = field(default_factory=verifier_pb2.GenerateRequest)
    full_context: bool = False
    deadline: float | None = None        # time.monotonic() by which the turn must end
    key_id: str = ""                     # the caller's API key id (Auth.authenticate); "" = no auth


@dataclass(frozen=True)
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[verifier_pb2.TokenLogprob] = field(default_factory=list)  # one per token id, when asked
    prompt_logprobs: list[verifier_pb2.TokenLogprob] | None = None  # the input's, once, before any token


@dataclass(frozen=True)
class Done:
    finish_reason: str                   # stop | length | cancelled
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    speculation: common_pb2.SpeculationStats


class _History(Enum):
    NONE = 0    # nothing of the turn written yet
    OK = 1      # Redis holds everything streamed so far
    DIRTY = 2   # a write failed, or Redis lost the session: rewrite it whole when the turn ends


@dataclass
class _Turn:
    """Mutable progress of one turn across attempts."""
    req: TurnRequest
    sid: str                             # scoped_session(key, session id): "" = one-shot
    base: list[int]                      # history the verifier must hold before the new tokens
    new: list[int]                       # this turn's new tokens
    text: TextStream                     # its `tokens` are the tokens streamed so far
    history: _History
    replace: bool = False                # the stored history is replaced (full_context mismatch)
    finish: str | None = None            # set when the router saw the turn end
    done: bool = False                   # Done yielded
    excluded: set[str] = field(default_factory=set)
    last_error: str = ""
    bound: Binding | None = None         # the binding of the latest attempt
    prompt_logprobs_sent: bool = False   # a retry does not ask for (or pass on) them again
    t0: float = field(default_factory=time.monotonic)

    @property
    def context(self) -> int:
        return len(self.base) + len(self.new)

    @property
    def produced(self) -> list[int]:
        return self.text.tokens


class Router:
    """The router's core: configuration, Redis state, the tokenizer, API keys (`auth`), channels
    to verifiers (`channels`)."""

    def __init__(self, cfg: RouterConfig, state: RouterState, tokenizer, model_name: str,
                 metrics: Metrics | None = None) -> None:
        self.cfg, self.state, self.tokenizer, self.model_name = cfg, state, tokenizer, model_name
        self.pieces = TokenPieces(tokenizer)  # token id -> (text, bytes), for logprobs
        self.metrics = metrics or Metrics()
        self.auth = Auth.from_config(cfg)
        self.channels = VerifierChannels(cfg.peer_tls)
        self.policy = get_policy(cfg.policy)
        self.eos_ids = eos_ids(tokenizer)
        # the strings the tokenizer turns into control tokens (<|im_start|>, ...): in chat content
        # they would let a message forge the template's structure (another role, a system turn)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.control_strings = sorted({t.content for t in added.values() if getattr(t, "special", False)}
                                      | set(getattr(tokenizer, "all_special_tokens", []) or []))
        # after Redis lost its data (router.state): the generation last seen, the verifiers live at
        # the last placement, and those still to register again (with their sessions) since the loss
        self._gen: str | None = None
        self._known: frozenset[str] = frozenset()
        self._awaiting: frozenset[str] = frozenset()
        self._await_until = 0.0
        self._watch: asyncio.Task | None = None

    # -- tokens and text -----------------------------------------------------------------------
    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def encode(self, text: str) -> list[int]:
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)

    async def encode_chat(self, messages: list[dict]) -> list[int]:
        """The chat template applied to `messages`; content holding one of the template's control
        strings is refused (a 400 naming the message), never rendered as a control token."""
        for i, m in enumerate(messages):
            content = m.get("content", "")
            hit = next((c for c in self.control_strings if c and c in content), None)
            if hit is not None:
                raise invalid(f"messages[{i}].content", f"holds the control token {hit!r} of the chat template")

        def run() -> list[int]:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

        try:
            return await asyncio.to_thread(run)
        except (ValueError, TypeError, KeyError) as e:
            raise invalid("messages", f"cannot apply the chat template ({e})") from e

    def check_request(self, size_bytes: int, max_tokens: int, session_id: str, stop_strings: int,
                      max_tokens_field: str = "max_tokens") -> None:
        """The limits every request is checked against, whatever its front door (`max_tokens_field`:
        what that door calls max_tokens, e.g. OpenAI chat's max_completion_tokens)."""
        if size_bytes > self.cfg.max_request_bytes:
            raise invalid("request_bytes", f"{size_bytes} bytes exceed max_request_bytes {self.cfg.max_request_bytes}")
        if not 1 <= max_tokens <= self.cfg.max_tokens:
            raise invalid(max_tokens_field, f"must be in [1, {self.cfg.max_tokens}], got {max_tokens}")
        if len(session_id) > MAX_SESSION_ID:
            raise invalid("session_id", f"longer than {MAX_SESSION_ID} characters")
        if stop_strings > MAX_STOP_STRINGS:
            raise invalid("stop", f"at most {MAX_STOP_STRINGS} stop strings")

    def stop_conditions(self, max_tokens: int, strings: tuple[str, ...], ids: tuple[int, ...],
                        ignore_eos: bool) -> StopConditions:
        """A turn's stops as the request asks: the tokenizer's EOS is a stop id unless `ignore_eos`."""
        return StopConditions(max_tokens, frozenset(ids) | (frozenset() if ignore_eos else self.eos_ids), strings)

    # -- one turn ------------------------------------------------------------------------------
    async def run(self, req: TurnRequest) -> AsyncIterator[Delta | Done]:
        """The turn's events. A verifier still finishing this session's previous turn (e.g. one
        the client just cancelled) answers BUSY before any token: the turn then starts over,
        re-reading the session, for up to ~1.5 s, so turns of one session run one after another."""
        for delay in (*BUSY_BACKOFF_S, None):
            emitted = False
            try:
                async with aclosing(self._run_once(req)) as events:
                    async for event in events:
                        emitted = True
                        yield event
                return
            except RouterError as e:
                if e.kind != Kind.BUSY or emitted or delay is None:
                    raise
            await asyncio.sleep(delay)

    async def _run_once(self, req: TurnRequest) -> AsyncIterator[Delta | Done]:
        sid = scoped_session(req.key_id, req.session_id)
        binding, history = await self.state.session(sid) if sid else (None, [])
        if sid and binding is None and await self._after_loss():
            binding, history = await self.state.session(sid)  # written back by the verifier holding it
        # 1. what the verifier must hold before generating: `base` (kept history) + `new`
        t = _Turn(req, sid, base=history, new=req.ids, text=TextStream(self.decode, req.stop.stop_strings),
                  history=_History.OK if not sid else _History.NONE)  # one-shot turns keep nothing
        if req.full_context and req.template.prompt_logprobs:
            t.base, t.replace = [], True  # every prompt token's logprob: the whole context is prefilled
        elif req.full_context and req.ids[: len(history)] != history:
            # the verifier keeps the shared prefix's KV (at least one token is sent as new)
            keep = min(common_prefix(history, req.ids), len(req.ids) - 1)
            t.base, t.new, t.replace = req.ids[:keep], req.ids[keep:], True
        elif req.full_context:
            t.new = req.ids[len(history):]
        if t.context == 0:
            raise invalid("input", "a turn needs at least one token")
        if t.context > self.cfg.max_prompt_tokens:
            raise invalid("prompt_tokens", f"{t.context} tokens exceed max_prompt_tokens {self.cfg.max_prompt_tokens}")
        counted = await self._admit(req)
        # 2. attempts: another verifier after any failure, before or after the first token
        try:
            for _ in range(self.cfg.max_attempts):
                binding = t.bound = await self._place(sid, binding, t.context + len(t.produced), t.excluded)
                async with aclosing(self._attempt(t, binding, resumed=bool(t.produced))) as events:
                    async for event in events:
                        yield event
                if t.done:
                    return
                if t.finish is not None:  # the stream ended after the last token, before Complete
                    tail = await self._text_work(t, t.text.finish)
                    if tail:
                        yield Delta([], tail)
                    yield self._done(t, None, whole_turn=False)
                    return
                if t.produced:
                    self.metrics.failovers += 1
                else:
                    self.metrics.retries += 1
            raise RouterError(Kind.UNAVAILABLE, f"no verifier completed the turn after {self.cfg.max_attempts} "
                                                f"attempts (last: {t.last_error})")
        finally:
            if t.history == _History.DIRTY:
                await self._rewrite(sid, t.base + t.new + t.produced, t.bound)
            if counted:
                await self._touch(req)

    async def _admit(self, req: TurnRequest) -> bool:
        """Sessions per API key (router.auth): a session the key does not hold yet is refused when
        the key already holds `max_sessions_per_key` live ones (counted in Redis, across routers).
        Whether the session is counted."""
        if not self.auth.counts(req.key_id, req.session_id):
            return False
        admitted, live = await self.state.admit_session(req.key_id, req.session_id, self.auth.max_sessions_per_key)
        if not admitted:
            raise self.auth.over_quota(live)
        return True

    async def _touch(self, req: TurnRequest) -> None:
        try:
            await self.state.touch_session(req.key_id, req.session_id)
        except StateUnavailable as e:
            log.warning("session %r: sessions-per-key time not refreshed (%s)", req.session_id, e)

    async def _attempt(self, t: _Turn, binding: Binding, resumed: bool) -> AsyncIterator[Delta | Done]:
        """Stream the turn from one verifier until it completes (t.done), the router saw a stop
        (t.finish), or the verifier failed (t.excluded grows)."""
        req, sid = t.req, t.sid
        addrs = (binding.verifier, binding.drafter)
        upstream = self._upstream(t, binding)
        await self._add_load(addrs, 1, t.context)
        self.metrics.in_flight += 1
        call = None
        try:
            call = self.channels.stub(binding.verifier).Generate(
                upstream, timeout=None if req.deadline is None else max(0.001, req.deadline - time.monotonic()))
            async for resp in call:
                if t.history == _History.NONE:  # the verifier accepted the turn: record its prompt
                    await self._record(t, t.base + t.new if t.replace else t.new, t.replace)
                if resp.HasField("complete"):
                    tail = await self._text_work(t, t.text.finish)
                    if tail:
                        yield Delta([], tail)
                    t.done = True
                    yield self._done(t, resp.complete, whole_turn=not resumed)
                    return
                if resp.chunk.prompt_logprobs and not t.prompt_logprobs_sent:
                    t.prompt_logprobs_sent = True
                    yield Delta([], "", prompt_logprobs=list(resp.chunk.prompt_logprobs))
                ids = list(resp.chunk.token_ids)
                lps = list(resp.chunk.logprobs)
                if t.finish is not None and ids:  # the verifier went past a stop it could not see
                    return
                start = len(t.produced)
                cut = await self._text_work(t, first_stop, t.produced + ids, start, req.stop.stop_ids,
                                            req.stop.stop_strings, self.decode)
                if cut is not None:
                    ids, t.finish = ids[: cut - start], "stop"
                elif start + len(ids) >= req.stop.max_new_tokens:
                    ids, t.finish = ids[: req.stop.max_new_tokens - start], "length"
                if not ids:
                    continue
                if t.history == _History.OK and sid:
                    await self._record(t, ids, False)
                if not start:
                    self.metrics.observe_ttft(time.monotonic() - t.t0)
                self.metrics.tokens_generated += len(ids)
                yield Delta(ids, await self._text_work(t, t.text.push, ids), lps[: len(ids)])
        except grpc.aio.AioRpcError as e:
            kind = client_fault(e.code())
            if kind is not None:
                details = e.details() or e.code().name
                raise RouterError(kind, details, code=field_of(details)) from e
            t.last_error = f"{binding.verifier}: {e.code().name} {e.details()}"
            log.warning("turn of %r failed on %s", sid, t.last_error)
            t.excluded.add(binding.verifier)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                await self._forget_endpoint(binding.verifier)
        finally:
            if call is not None:
                call.cancel()
            self.metrics.in_flight -= 1
            await self._add_load(addrs, -1, -t.context)

    @staticmethod
    async def _text_work(t: _Turn, fn, *args):
        """`fn(*args)`: decoding and stop matching of the turn's tokens. With stop strings (up to the
        request's byte limit long) it runs in a worker thread, so no request's text work holds the
        event loop that serves every other request and /health; without, it is a few microseconds."""
        return await asyncio.to_thread(fn, *args) if t.req.stop.stop_strings else fn(*args)

    def _upstream(self, t: _Turn, binding: Binding) -> verifier_pb2.GenerateRequest:
        up = verifier_pb2.GenerateRequest()
        up.CopyFrom(t.req.template)
        up.session_id = t.sid
        up.drafter_address = binding.drafter
        up.max_tokens = t.req.stop.max_new_tokens - len(t.produced)
        if t.produced or t.prompt_logprobs_sent:
            up.prompt_logprobs = False  # the input's logprobs went out with the first attempt
        if t.produced:  # resume mid-turn: everything so far is history, nothing new
            up.history.ids.extend(t.base + t.new + t.produced)
            up.resumed_output_tokens = len(t.produced)  # the turn's output so far, for its penalties
            up.token_ids.SetInParent()
        else:
            if t.sid:
                up.history.SetInParent()
                up.history.ids.extend(t.base)
            up.token_ids.ids.extend(t.new)
        return up

    def _done(self, t: _Turn, complete: verifier_pb2.Complete | None, whole_turn: bool) -> Done:
        """Usage of the whole turn. Cached prompt tokens and speculation stats are the last
        verifier's: after a mid-turn move they cover only the resumed part (cached then 0)."""
        cached = complete.usage.cached_prompt_tokens if complete is not None and whole_turn else 0
        spec = complete.speculation if complete is not None else common_pb2.SpeculationStats()
        self.metrics.prompt_tokens += t.context
        self.metrics.cached_prompt_tokens += cached
        finish = t.finish or (complete.finish_reason if complete is not None else "stop")
        return Done(finish, t.context, len(t.produced), cached, spec)

    async def _place(self, sid: str, current: Binding | None, context: int, excluded: set[str]) -> Binding:
        """The verifier (and drafter) for the next attempt; stored as the session's binding."""
        for _ in range(3):
            endpoints = await self.state.endpoints()
            loads = await self.state.loads([e.address for e in endpoints])
            seq = await self.state.next_seq() if self.cfg.policy == PolicyName.ROUND_ROBIN.value else 0
            meta = RequestMeta(sid, context, self.model_name, seq, frozenset(excluded), self.cfg.overload)
            try:
                chosen = self.policy(meta, endpoints, loads, current)
            except NoVerifierError as e:
                if await self._after_loss():
                    continue
                seen = sorted(f"{x.role.value} {x.address}" for x in endpoints)
                raise RouterError(Kind.UNAVAILABLE, f"{e} (registered: {seen})") from e
            if not sid or chosen == current:
                self.metrics.placements["kept" if chosen == current else "one-shot"] += 1
                return chosen
            stored = await self.state.bind(sid, chosen, current)
            live = {e.address for e in endpoints if e.role == Role.VERIFIER} - excluded
            if stored == chosen or stored.verifier in live:  # ours, or another router's that is usable
                self.metrics.placements["new" if current is None else "moved"] += 1
                return stored
            current = stored
        raise RouterError(Kind.UNAVAILABLE, f"session {sid!r}: binding contended, try again")

    def start_watch(self) -> None:
        """Start `watch_redis` on the running loop (router.server); `close` stops it."""
        self._watch = asyncio.get_running_loop().create_task(self.watch_redis(), name="watch-redis")

    async def watch_redis(self, every_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """Until cancelled: note the verifiers live, and notice within `every_s` when Redis lost
        its data, even with no turn arriving."""
        while True:
            try:
                await self._observe()
            except StateUnavailable:
                pass  # Redis down: turns get UNAVAILABLE; looked at again when it is back
            await asyncio.sleep(every_s)

    async def _observe(self, note_known: bool = True) -> None:
        """Compare Redis's generation with the one last seen (a change starts the wait for the
        verifiers known before); `note_known`: also note the verifiers live now."""
        gen = await self.state.generation()
        if gen != self._gen:
            if self._gen is not None:
                log.warning("redis lost its data (generation %s -> %s): waiting up to %.0f s for %d verifier(s) "
                            "to write back their sessions", self._gen, gen, HEARTBEAT_TTL_S, len(self._known))
                self._awaiting, self._await_until = self._known, time.monotonic() + HEARTBEAT_TTL_S
            self._gen = gen
        if note_known and not self._awaiting:
            self._known = frozenset(e.address for e in await self.state.endpoints() if e.role == Role.VERIFIER)

    async def _after_loss(self) -> bool:
        """Whether Redis lost its data since this router last looked (its generation changed) and
        this turn waited for the verifiers live before to register again, each writing back the
        sessions it holds first (router.register): the caller then reads again what it read.
        Waits at most a heartbeat TTL; verifiers that do not come back by then are not waited for."""
        await self._observe(note_known=False)  # one round trip: the watcher notes the verifiers
        if not self._awaiting:
            return False
        while self._awaiting and time.monotonic() < self._await_until:
            live = {e.address for e in await self.state.endpoints() if e.role == Role.VERIFIER}
            if self._awaiting <= live:
                break
            await asyncio.sleep(0.05)
        self._awaiting = frozenset()
        return True

    async def _record(self, t: _Turn, ids: list[int], replace: bool) -> None:
        """Write tokens to the session's history. A Redis failure does not stop the stream: the
        turn goes on unrecorded and the whole history is rewritten when it ends; so it is when the
        binding vanished meanwhile (Redis lost its data mid-turn: an append would hold only the
        turn's tail)."""
        try:
            kept = await self.state.write_history(t.sid, ids, replace)
            t.history = _History.OK if kept else _History.DIRTY
        except StateUnavailable as e:
            log.error("session %r: history not recorded (%s)", t.sid, e)
            t.history = _History.DIRTY

    async def _rewrite(self, sid: str, ids: list[int], binding: Binding | None) -> None:
        """The session's whole history, and its binding where Redis has none."""
        try:
            await self.state.write_history(sid, ids, True)
            if binding is not None:
                await self.state.bind(sid, binding, None)
        except StateUnavailable as e:
            log.error("session %r: history lost while Redis is unavailable (%s); the next turn rebuilds "
                      "from what Redis holds", sid, e)

    async def _add_load(self, addrs: tuple[str, ...], turns: int, tokens: int) -> None:
        try:
            await self.state.add_load(addrs, turns, tokens)
        except StateUnavailable as e:
            log.warning("load counters: %s", e)

    async def _forget_endpoint(self, address: str) -> None:
        """A verifier that refused the connection leaves placement now, not at its heartbeat TTL;
        if it is alive after all, its next heartbeat registers it again."""
        await self.channels.forget(address)
        try:
            await self.state.deregister(address)
        except StateUnavailable as e:
            log.warning("deregister %s: %s", address, e)

    # -- other operations ----------------------------------------------------------------------
    async def models(self) -> list[tuple[str, int, int]]:
        """(model name, live verifiers, live drafters) of the model this router serves."""
        eps = [e for e in await self.state.endpoints() if not e.model or e.model == self.model_name]
        return [(self.model_name, sum(e.role == Role.VERIFIER for e in eps), sum(e.role == Role.DRAFTER for e in eps))]

    async def close_session(self, session_id: str, key_id: str = "") -> bool:
        if self.auth.counts(key_id, session_id):
            await self.state.release_session(key_id, session_id)
        sid = scoped_session(key_id, session_id)
        binding = await self.state.forget(sid)
        if binding is None:
            return False
        try:
            stub = self.channels.stub(binding.verifier)
            await stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id=sid), timeout=5)
        except grpc.aio.AioRpcError as e:  # its KV cache goes with LRU eviction instead
            log.warning("close session %r on %s: %s", sid, binding.verifier, e.code().name)
        return True

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.channels.close()
        await self.state.close()
