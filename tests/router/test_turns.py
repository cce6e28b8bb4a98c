"""A turn through the router core (router.turns.Router) against scripted in-process verifiers and
a real Redis: what is resent on failover, stops that straddle a move, retries, client faults, and
the OpenAI-style full-context diff. No model: the fake target's next token is a fixed function of
the whole context, so a resumed turn continues exactly when the router resends the right history."""

from __future__ import annotations

import asyncio
import uuid
from concurrent import futures

import grpc
import pytest

from router.config import RouterConfig
from router.errors import Kind, RouterError
from router.state import RouterState
from router.turns import Delta, Done, Router, TurnRequest
from specmesh.registry import Binding, Endpoint, Role
from specmesh.v1 import verifier_pb2, verifier_pb2_grpc

VOCAB = 26


def next_token(context: list[int]) -> int:
    return (sum(context) * 7 + len(context)) % VOCAB


def continuation(context: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(context + out))
    return out


class FakeTokenizer:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


class FakeVerifier(verifier_pb2_grpc.VerifierServicer):
    """Streams one token per chunk; dies (UNAVAILABLE) after `die_after` tokens, or answers `fail`."""

    def __init__(self, die_after: int | None = None, fail: grpc.StatusCode | None = None) -> None:
        self.die_after, self.fail = die_after, fail  # die_after == max_tokens: dies before Complete
        self.requests: list[verifier_pb2.GenerateRequest] = []

    def Generate(self, request, context):
        self.requests.append(request)
        if self.fail is not None:
            context.abort(self.fail, "fake: refused")
        ctx = list(request.history.ids) + list(request.token_ids.ids)
        out: list[int] = []
        for i in range(request.max_tokens):
            if i == self.die_after:
                context.abort(grpc.StatusCode.UNAVAILABLE, "fake: died")
            out.append(next_token(ctx + out))
            yield verifier_pb2.GenerateResponse(chunk=verifier_pb2.Chunk(token_ids=[out[-1]], text="(ignored)"))
        if self.die_after == request.max_tokens:
            context.abort(grpc.StatusCode.UNAVAILABLE, "fake: died")
        yield verifier_pb2.GenerateResponse(complete=verifier_pb2.Complete(
            finish_reason="length", usage=verifier_pb2.Usage(prompt_tokens=len(ctx), completion_tokens=len(out))))


@pytest.fixture
def fleet():
    servers, fakes = [], {}

    def add(fake: FakeVerifier) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        verifier_pb2_grpc.add_VerifierServicer_to_server(fake, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        fakes[f"127.0.0.1:{port}"] = fake
        return f"127.0.0.1:{port}"
    yield add
    for s in servers:
        s.stop(0)


def turn(router: Router, ids: list[int], max_tokens: int, session_id: str = "s", stop: tuple[str, ...] = (),
         full_context: bool = False) -> TurnRequest:
    return TurnRequest(session_id=session_id, ids=ids, stop=router.stop_conditions(max_tokens, stop, (), False),
                       template=verifier_pb2.GenerateRequest(stop=stop), full_context=full_context)


def scenario(redis_url: str, verifiers: list[str], body, bound_to: str | None = None, **cfg):
    """Run `body(router, state)` with the verifiers registered and the session "s" bound."""
    async def main():
        state = RouterState.from_url(redis_url, prefix=f"turns-{uuid.uuid4().hex[:8]}:")
        router = Router(RouterConfig(**cfg), state, FakeTokenizer(), model_name="fake")
        try:
            for v in verifiers:
                await state.register(Endpoint(v, Role.VERIFIER), ttl_s=60)
            if bound_to:
                await state.bind("s", Binding(bound_to), None)
            return await body(router, state)
        finally:
            await router.close()
    return asyncio.run(main())


async def collect(router: Router, req: TurnRequest) -> tuple[list[int], str, Done]:
    ids, text, done = [], [], None
    async for ev in router.run(req):
        if isinstance(ev, Delta):
            ids += ev.token_ids
            text.append(ev.text)
        else:
            done = ev
    return ids, "".join(text), done


PROMPT = [3, 1, 4, 1, 5]


@pytest.mark.parametrize("die_after", [0, 1, 7, 11])
def test_failover_resends_everything_so_far_and_nothing_twice(redis_server, fleet, die_after):
    dying, healthy = FakeVerifier(die_after=die_after), FakeVerifier()
    a, b = fleet(dying), fleet(healthy)

    async def body(router: Router, state: RouterState):
        out = await collect(router, turn(router, PROMPT, 12))
        return out, await state.session("s")
    (ids, text, done), (binding, history) = scenario(redis_server.url, [a, b], body, bound_to=a)
    expected = continuation(PROMPT, 12)
    assert ids == expected and text == FakeTokenizer().decode(expected)
    assert (done.finish_reason, done.completion_tokens, done.prompt_tokens) == ("length", 12, len(PROMPT))
    resumed = healthy.requests[0]
    if die_after == 0:  # before the first token: the same request, elsewhere
        assert list(resumed.history.ids) == [] and list(resumed.token_ids.ids) == PROMPT and resumed.max_tokens == 12
    else:
        assert list(resumed.history.ids) == PROMPT + expected[:die_after] and not resumed.token_ids.ids
        assert resumed.max_tokens == 12 - die_after
    assert binding == Binding(b, "", 2) and history == PROMPT + expected


def test_a_session_redis_lost_mid_turn_is_written_back_whole_with_its_binding(redis_server, fleet):
    """Redis loses the session's keys after the turn's first token (a restart without persistence):
    appending the rest would leave a history of the tail alone; the turn's end writes it whole."""
    a = fleet(FakeVerifier())

    async def body(router: Router, state: RouterState):
        ids: list[int] = []
        async for ev in router.run(turn(router, PROMPT, 8)):
            if isinstance(ev, Delta):
                if not ids:
                    await state.r.delete(state.keys.binding("s"), state.keys.history("s"))
                ids += ev.token_ids
        return ids, await state.session("s")
    ids, (binding, history) = scenario(redis_server.url, [a], body, bound_to=a)
    assert ids == continuation(PROMPT, 8)
    assert binding == Binding(a) and history == PROMPT + ids


def test_after_redis_lost_its_data_a_turn_waits_for_the_verifier_to_write_its_session_back(redis_server, fleet):
    """Redis restarts empty: the registry and the session are gone. A turn arriving before the
    verifier's next heartbeat waits for it (the heartbeat writes the session back, then registers)
    instead of failing with no verifier or starting the session over from nothing."""
    fake = FakeVerifier()
    a = fleet(fake)
    earlier = PROMPT + continuation(PROMPT, 4)

    async def body(router: Router, state: RouterState):
        await router._observe()  # what the router's watcher notes: the generation, verifier a live
        await state.r.delete(*await state.r.keys(state.keys.prefix + "*"))  # Redis lost its data

        async def heartbeat_later():
            await asyncio.sleep(0.5)
            await state.bind("s", Binding(a), None)  # the verifier's write-back, then its registration
            await state.write_history("s", earlier, replace=True)
            await state.register(Endpoint(a, Role.VERIFIER), ttl_s=60)
        beat = asyncio.create_task(heartbeat_later())
        out = await collect(router, turn(router, [2, 7], 3))
        await beat
        return out, await state.session("s")
    (ids, _, _), (binding, history) = scenario(redis_server.url, [a], body, bound_to=a)
    assert list(fake.requests[0].history.ids) == earlier and list(fake.requests[0].token_ids.ids) == [2, 7]
    assert ids == continuation(earlier + [2, 7], 3) and binding == Binding(a)
    assert history == earlier + [2, 7] + ids


def test_death_after_the_last_token_ends_the_turn_without_a_resume(redis_server, fleet):
    spare = FakeVerifier()
    a, b = fleet(FakeVerifier(die_after=6)), fleet(spare)

    async def body(router, state):
        return await collect(router, turn(router, PROMPT, 6))
    ids, _, done = scenario(redis_server.url, [a, b], body, bound_to=a)
    assert ids == continuation(PROMPT, 6) and done.finish_reason == "length" and spare.requests == []


def test_stop_string_straddling_the_move_is_honoured(redis_server, fleet):
    expected = continuation(PROMPT, 12)
    text = FakeTokenizer().decode(expected)
    stop = text[3:5]  # its first character from the dying verifier, its second from the next one
    a, b = fleet(FakeVerifier(die_after=4)), fleet(FakeVerifier())

    async def body(router, state):
        return await collect(router, turn(router, PROMPT, 12, stop=(stop,))), await state.session("s")
    (ids, shown, done), (_, history) = scenario(redis_server.url, [a, b], body, bound_to=a)
    cut = text.find(stop)
    assert shown == text[:cut] and done.finish_reason == "stop"
    assert ids == expected[: cut + len(stop)] and history == PROMPT + ids


def test_every_verifier_failing_is_unavailable_and_records_nothing(redis_server, fleet):
    addrs = [fleet(FakeVerifier(fail=grpc.StatusCode.INTERNAL)) for _ in range(3)]

    async def body(router, state):
        with pytest.raises(RouterError) as e:
            await collect(router, turn(router, PROMPT, 4))
        return e.value, await state.session("s")
    err, (_, history) = scenario(redis_server.url, addrs, body, bound_to=addrs[0], max_attempts=3)
    assert err.kind == Kind.UNAVAILABLE and "after 3 attempts" in err.message and history == []


def test_client_fault_from_the_verifier_is_passed_on_not_retried(redis_server, fleet):
    bad, spare = FakeVerifier(fail=grpc.StatusCode.INVALID_ARGUMENT), FakeVerifier()
    a, b = fleet(bad), fleet(spare)

    async def body(router, state):
        with pytest.raises(RouterError) as e:
            await collect(router, turn(router, PROMPT, 4))
        return e.value, await state.session("s")
    err, (_, history) = scenario(redis_server.url, [a, b], body, bound_to=a)
    assert err.kind == Kind.INVALID and spare.requests == [] and history == []


def test_full_context_sends_only_what_the_session_lacks(redis_server, fleet):
    fake = FakeVerifier()
    a = fleet(fake)

    async def body(router, state):
        first, _, _ = await collect(router, turn(router, PROMPT, 3, full_context=True))
        extended = PROMPT + first + [9, 9]
        second, _, d2 = await collect(router, turn(router, extended, 3, full_context=True))
        edited = [8] + extended[1:]  # an edited conversation: rebuild from it
        third, _, d3 = await collect(router, turn(router, edited, 3, full_context=True))
        after_third = await state.session("s")
        # the same context again (a regenerated answer, the next of n samples): the verifier keeps
        # all of it but the last token, which is sent as new
        fourth, _, _ = await collect(router, turn(router, edited, 3, full_context=True))
        return first, second, third, fourth, d2, d3, after_third, await state.session("s")
    first, second, third, fourth, d2, d3, (_, history), (_, regenerated) = scenario(redis_server.url, [a], body)
    r1, r2, r3, r4 = fake.requests
    assert list(r1.history.ids) == [] and list(r1.token_ids.ids) == PROMPT
    assert list(r2.history.ids) == PROMPT + first and list(r2.token_ids.ids) == [9, 9]
    assert list(r3.history.ids) == [] and list(r3.token_ids.ids) == [8] + (PROMPT + first + [9, 9])[1:]
    assert second == continuation(PROMPT + first + [9, 9], 3) and d2.prompt_tokens == len(PROMPT) + 3 + 2
    assert history == [8] + (PROMPT + first + [9, 9])[1:] + third
    edited = [8] + (PROMPT + first + [9, 9])[1:]
    assert list(r4.history.ids) == edited[:-1] and list(r4.token_ids.ids) == edited[-1:]
    assert fourth == third and regenerated == edited + fourth


def test_no_live_verifier_is_unavailable_naming_it(redis_server):
    async def body(router, state):
        with pytest.raises(RouterError) as e:
            await collect(router, turn(router, PROMPT, 4))
        return e.value
    err = scenario(redis_server.url, [], body)
    assert err.kind == Kind.UNAVAILABLE and "no live verifier" in err.message


@pytest.mark.parametrize("limit, kw", [("prompt_tokens", dict(max_prompt_tokens=4)), ])
def test_prompt_limit_counts_the_whole_context(redis_server, fleet, limit, kw):
    a = fleet(FakeVerifier())

    async def body(router, state):
        await collect(router, turn(router, [1, 2], 1))  # 3 tokens held now
        with pytest.raises(RouterError) as e:
            await collect(router, turn(router, [1, 2], 1))  # 3 + 2 > 4
        return e.value
    err = scenario(redis_server.url, [a], body, **kw)
    assert err.kind == Kind.INVALID and err.message.startswith(limit)
