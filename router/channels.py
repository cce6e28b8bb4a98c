"""The router's channels to verifiers: one grpc.aio channel (and stub) per verifier address, made
on first use with TLS and the service token as `PeerTls` says (specmesh.tls.peer_channel), closed
when that verifier is forgotten (it refused a connection) or when the router closes.

Knows nothing of placement, sessions or Redis: which address to call is the caller's business.
"""

from __future__ import annotations

import grpc

from specmesh.tls import PeerTls, peer_channel
from specmesh.v1 import verifier_pb2_grpc

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


class VerifierChannels:
    def __init__(self, peer: PeerTls) -> None:
        self.peer = peer
        self._open: dict[str, tuple[grpc.aio.Channel, verifier_pb2_grpc.VerifierStub]] = {}

    def stub(self, address: str) -> verifier_pb2_grpc.VerifierStub:
        """The verifier at `address`, over its channel (made on first use; call on the event loop)."""
        hit = self._open.get(address)
        if hit is None:
            ch = peer_channel(address, self.peer, CHANNEL_OPTIONS, aio=True)
            hit = self._open[address] = (ch, verifier_pb2_grpc.VerifierStub(ch))
        return hit[1]

    async def forget(self, address: str) -> None:
        """Close `address`'s channel, if open; the next `stub(address)` makes a new one."""
        hit = self._open.pop(address, None)
        if hit is not None:
            await hit[0].close()

    async def close(self) -> None:
        """Close every channel."""
        open_, self._open = self._open, {}
        for ch, _ in open_.values():
            await ch.close()
