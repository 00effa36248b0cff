"""One ``redis.asyncio`` client per lease Redis and event loop, for ``astatus``/``awatch`` in ASGI apps.

It is built from the same settings as the blocking client (:func:`~.targets.build_client` with
asyncio's classes, :func:`~.clients.client_options` with asyncio's ``Retry``): standalone, TLS,
Sentinel and Cluster alike. An asyncio connection belongs to the loop that opened it, so each loop
gets its own client; it is closed when that loop shuts down its async generators (``asyncio.run``,
uvicorn and other ASGI servers do), so no connection is left for the garbage collector to find.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel

from ..errors import ConfigurationError
from .clients import client_options
from .targets import ClientClasses, RedisTarget, build_client

__all__ = ["ASYNCIO", "async_client"]

ASYNCIO = ClientClasses(redis=redis.asyncio.Redis, sentinel=Sentinel, cluster=RedisCluster, node=ClusterNode)

#: per running loop: the target's cache key -> (its client, the generator that closes it)
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, tuple[Any, AsyncIterator[None]]]] = (
    weakref.WeakKeyDictionary()
)


async def async_client(target: RedisTarget) -> Any:
    """The asyncio client of the running loop for ``target`` (made at the first call)."""
    loop = asyncio.get_running_loop()
    per_loop = _clients.setdefault(loop, {})
    found = per_loop.get(target.cache_key)
    if found is None:
        if target.factory is not None:
            raise ConfigurationError(
                f"singleflight_redis_client ({target.factory_name}) makes blocking clients only:"
                " astatus()/awatch() need a redis.asyncio client; set singleflight_redis_url"
                " (and its transport options) instead"
            )
        client = build_client(target, client_options(target, Retry), ASYNCIO)
        closer = _closed_with_the_loop(client)
        found = per_loop[target.cache_key] = (client, closer)
        await anext(closer)  # from here on, the loop's shutdown runs its ``finally``
    return found[0]


async def _closed_with_the_loop(client: Any) -> AsyncIterator[None]:
    """Kept suspended at its ``yield``: a loop closes the async generators still open when it
    shuts down, which closes ``client`` on that loop (its sentinels' clients too)."""
    try:
        yield
    finally:
        if isinstance(client, RedisCluster):
            await client.aclose()
        else:  # its pool too, also when a Sentinel made it from a pool of its own
            await client.aclose(close_connection_pool=True)
        manager = getattr(getattr(client, "connection_pool", None), "sentinel_manager", None)
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()
