"""The registry sidecar (`python -m router.register`), on a real redis-server: it heartbeats for a
process only while that process answers its gRPC health check with SERVING."""

from __future__ import annotations

import time
import uuid

import redis

from router.state import RouterState
from specmesh.registry import Endpoint, Heartbeat, Role
from tests.router.test_state import run


def test_sidecar_heartbeats_only_while_the_endpoint_is_serving(redis_server):
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    from router.register import _health_probe

    server = grpc.server(futures.ThreadPoolExecutor(2))
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    hs.set("", health_pb2.HealthCheckResponse.SERVING)
    prefix = f"side-{uuid.uuid4().hex[:8]}:"
    hb = Heartbeat(redis.Redis.from_url(redis_server.url), Endpoint(address, Role.DRAFTER), interval_s=0.1,
                   ttl_s=0.4, prefix=prefix, alive=_health_probe(address, 0.5)).start()

    async def addresses(s: RouterState):
        return [e.address for e in await RouterState(s.r, prefix).endpoints()]
    try:
        time.sleep(0.3)
        assert run(addresses, redis_server.url) == [address]
        hs.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        time.sleep(0.8)
        assert run(addresses, redis_server.url) == []
        hs.set("", health_pb2.HealthCheckResponse.SERVING)
        time.sleep(0.4)
        assert run(addresses, redis_server.url) == [address]
    finally:
        hb.stop()
        server.stop(0)
