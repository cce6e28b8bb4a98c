"""The registry sidecar: `python -m router.register --redis-url URL --role drafter --address HOST:PORT`
heartbeats into the router registry (specmesh.registry) on behalf of a process that has no hook —
a drafter that is not specmesh's — while that process answers grpc.health.v1 Check with SERVING
(k8s sidecar pattern); a beat is skipped while it does not, so its entry lapses within the TTL.
`--peer-ca/--peer-cert/--peer-key` when that process serves TLS / mTLS (specmesh.tls).

specmesh's own services register themselves (`--redis-url`: specmesh.registry.start_heartbeat).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable

from specmesh.registry import DEFAULT_PREFIX, INTERVAL_S, PREFIX_ENV, TTL_S, Endpoint, Heartbeat, Role, connect
from specmesh.tls import PLAINTEXT_PEER, PeerTls, add_peer_args, peer_channel, peer_from_args


def _health_probe(address: str, timeout_s: float, peer: PeerTls = PLAINTEXT_PEER) -> Callable[[], bool]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(peer_channel(address, peer))

    def alive() -> bool:
        try:
            r = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    return alive


def main(argv: list[str] | None = None) -> int:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m router.register",
                                description="Heartbeat a verifier or drafter into the router registry (sidecar).")
    p.add_argument("--redis-url", default=env("SPECMESH_REDIS_URL", ""), required=not env("SPECMESH_REDIS_URL"))
    p.add_argument("--redis-prefix", default=env(PREFIX_ENV, DEFAULT_PREFIX))
    p.add_argument("--role", choices=[r.value for r in Role], required=True)
    p.add_argument("--address", required=True, help="host:port routers dial (health-checked before each beat)")
    p.add_argument("--model", default="", help="model name served / drafted for ('' = any)")
    p.add_argument("--capacity", type=int, default=0)
    p.add_argument("--interval-s", type=float, default=INTERVAL_S)
    p.add_argument("--ttl-s", type=float, default=TTL_S)
    add_peer_args(p, env, "the process (its health check)")
    a = p.parse_args(argv)
    peer = peer_from_args(vars(a))
    try:
        peer.validate()
    except ValueError as e:
        p.error(str(e))
    ep = Endpoint(address=a.address, role=Role(a.role), model=a.model, capacity=a.capacity)
    hb = Heartbeat(connect(a.redis_url), ep, None, a.interval_s, a.ttl_s, a.redis_prefix,
                   alive=_health_probe(a.address, min(1.0, a.interval_s), peer))
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    hb.start()
    print(f"router.register: heartbeating {a.role} {a.address} every {a.interval_s}s (ttl {a.ttl_s}s)", flush=True)
    done.wait()
    hb.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
