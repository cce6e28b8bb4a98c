"""The shared service token (specmesh.service_token) on a real gRPC server on 127.0.0.1: every kind
of call without the token, or with another, ends UNAUTHENTICATED before the handler runs; with
it, through `peer_channel` (sync and asyncio channels), the call is served; health stays open.
The services wire it in (verifier, drafter); `specmesh up` turns it on (tests/test_up.py)."""

from __future__ import annotations

import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specmesh import service_token
from specmesh.tls import PeerTls, peer_channel

TOKEN = "s3cret-token"
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


@pytest.fixture(scope="module")
def server():
    """One method of each kind under /t.T/, echoing its request bytes; `calls` counts handler runs."""
    calls = []

    def one(request, context):
        calls.append(1)
        return b"ok:" + (request if isinstance(request, bytes) else b"".join(request))

    def many(request, context):
        yield one(request, context)

    handlers = {
        "unary_unary": grpc.unary_unary_rpc_method_handler(one),
        "unary_stream": grpc.unary_stream_rpc_method_handler(many),
        "stream_unary": grpc.stream_unary_rpc_method_handler(one),
        "stream_stream": grpc.stream_stream_rpc_method_handler(many),
    }
    s = grpc.server(futures.ThreadPoolExecutor(4), interceptors=service_token.interceptors(TOKEN))
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    hs = health.HealthServicer()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(hs, s)
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    yield f"127.0.0.1:{port}", calls
    s.stop(0)


def call(channel, kind: str) -> bytes:
    method = getattr(channel, kind)(f"/t.T/{kind}")
    request = b"x" if kind.startswith("unary") else iter([b"x"])
    out = method(request, timeout=10)
    return out if kind.endswith("unary") else b"".join(out)


@pytest.mark.parametrize("token", ["", "wrong"])
def test_calls_without_the_token_are_refused_before_the_handler(server, token):
    address, calls = server
    before = len(calls)
    with peer_channel(address, PeerTls(token=token)) as ch:
        for kind in KINDS:
            with pytest.raises(grpc.RpcError) as e:
                call(ch, kind)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "service token" in e.value.details()
        # health stays open: probes carry no metadata
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert len(calls) == before


def test_a_peer_channel_with_the_token_is_served(server):
    address, _ = server
    with peer_channel(address, PeerTls(token=TOKEN)) as ch:
        assert [call(ch, kind) for kind in KINDS] == [b"ok:x"] * 4


def test_an_asyncio_peer_channel_carries_the_token(server):
    """The router dials verifiers with grpc.aio: its channels carry the token too."""
    address, _ = server

    async def main(token: str) -> list:
        ch = peer_channel(address, PeerTls(token=token), aio=True)
        try:
            out = [await ch.unary_unary("/t.T/unary_unary")(b"x", timeout=10)]
            out.append(b"".join([r async for r in ch.unary_stream("/t.T/unary_stream")(b"x", timeout=10)]))
            return out
        finally:
            await ch.close()
    assert asyncio.run(main(TOKEN)) == [b"ok:x", b"ok:x"]
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(main("wrong"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
