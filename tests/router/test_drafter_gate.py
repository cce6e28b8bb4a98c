"""Which drafter a request may make a verifier dial (verifier_service.servicer.DrafterGate), against
a real redis-server holding the registry: registered drafters, the verifier's own --drafter and
--drafter-allow entries pass; anything else, a registered verifier, an expired registration or an
unreadable registry is refused with a message naming drafter_address."""

from __future__ import annotations

import pytest
import redis

from specmesh.redis_server import free_port
from specmesh.registry import Endpoint, Heartbeat, Role
from verifier_service.servicer import DrafterGate


def test_registered_drafters_and_allowed_addresses_pass_the_rest_is_refused(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    drafter = Heartbeat(client, Endpoint("127.0.0.1:5555", Role.DRAFTER))
    drafter.beat()
    Heartbeat(client, Endpoint("127.0.0.1:6666", Role.VERIFIER)).beat()
    gate = DrafterGate("127.0.0.1:7777", ("10.1.1.1:*", "10.2.2.2:80"), redis_server.url)
    gate.CACHE_S = 0.0  # every check reads the registry
    for ok in ("127.0.0.1:5555", "127.0.0.1:7777", "10.1.1.1:9", "10.2.2.2:80"):
        gate.check(ok)
    for bad in ("127.0.0.1:6666", "127.0.0.1:1", "10.2.2.2:81", "evil.example:443"):
        with pytest.raises(ValueError, match="^drafter_address: "):
            gate.check(bad)
    drafter.deregister()
    with pytest.raises(ValueError, match="not a registered drafter"):
        gate.check("127.0.0.1:5555")


def test_without_a_registry_only_configured_drafters_pass():
    gate = DrafterGate("127.0.0.1:7777", (), "")
    gate.check("127.0.0.1:7777")
    with pytest.raises(ValueError, match="--drafter-allow"):
        gate.check("127.0.0.1:5555")


def test_an_unreadable_registry_refuses():
    gate = DrafterGate("", (), f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    with pytest.raises(ValueError, match="registry cannot confirm"):
        gate.check("127.0.0.1:5555")
