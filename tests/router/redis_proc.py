"""Re-export: the router tests start a real redis-server with specmesh.redis_server (shared with
`specmesh up`)."""

from specmesh.redis_server import RedisServer, redis_server_binary

__all__ = ["RedisServer", "redis_server_binary"]
