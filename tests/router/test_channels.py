"""The router's channels to verifiers (router.channels): real grpc.aio channels to 127.0.0.1,
nothing listening (a channel is made without a server; a call then fails UNAVAILABLE)."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from router.channels import VerifierChannels
from specmesh.tls import PeerTls
from specmesh.v1 import verifier_pb2


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def call(stub) -> None:
    await stub.CloseSession(verifier_pb2.CloseSessionRequest(session_id="s"), timeout=5)


async def assert_open(stub) -> None:
    """An open channel tries to connect: nothing listens there, so UNAVAILABLE."""
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await call(stub)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def assert_closed(stub) -> None:
    with pytest.raises(grpc.aio.UsageError):
        await call(stub)


def test_the_same_address_gives_the_same_stub():
    a, b = free_address(), free_address()

    async def main():
        pool = VerifierChannels(PeerTls())
        try:
            assert pool.stub(a) is pool.stub(a)
            assert pool.stub(a) is not pool.stub(b)
            await assert_open(pool.stub(a))
        finally:
            await pool.close()
    asyncio.run(main())


def test_forgetting_an_address_closes_its_channel_and_the_next_use_makes_a_new_one():
    a, b = free_address(), free_address()

    async def main():
        pool = VerifierChannels(PeerTls())
        try:
            old, other = pool.stub(a), pool.stub(b)
            await pool.forget(a)
            await assert_closed(old)
            await assert_open(other)                 # other verifiers keep theirs
            new = pool.stub(a)
            assert new is not old
            await assert_open(new)
            await pool.forget("127.0.0.1:9")         # never used: nothing to close
        finally:
            await pool.close()
    asyncio.run(main())


def test_close_closes_every_channel():
    addresses = [free_address() for _ in range(3)]

    async def main():
        pool = VerifierChannels(PeerTls())
        stubs = [pool.stub(a) for a in addresses]
        await pool.close()
        for s in stubs:
            await assert_closed(s)
        again = pool.stub(addresses[0])              # a closed pool is empty, not broken
        assert again is not stubs[0]
        await assert_open(again)
        await pool.close()
    asyncio.run(main())
