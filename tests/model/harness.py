"""What the conformance machines share: a private Redis behind a fault proxy, and its clients."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import redis
from redis.backoff import ExponentialBackoff

from celery_singleflight import constants
from celery_singleflight.connection.clients import AttemptClock
from celery_singleflight.testing import RedisServer

from ..chaos.faultproxy import FaultProxy


@dataclass
class Env:
    """The private Redis, the fault proxy in front of it, the scripts' client (through the
    proxy, with redis-py's retries on as the library's clients have them, with a shorter
    backoff) and a direct client for reads and faults."""

    server: RedisServer
    proxy: FaultProxy
    client: redis.Redis
    direct: redis.Redis


@contextmanager
def conformance_env(preload: Iterable[str] = ()) -> Iterator[Env]:
    """An :class:`Env`; the scripts ``preload`` (sources) loaded first, so that a dropped reply is
    always one of a script that ran."""
    with RedisServer() as server, FaultProxy(server.port) as proxy:
        retry = AttemptClock(ExponentialBackoff(cap=0.002, base=0.001), constants.CLIENT_RETRIES)
        client = redis.Redis(host="127.0.0.1", port=proxy.port, socket_timeout=constants.SOCKET_TIMEOUT,
                             socket_connect_timeout=constants.CONNECT_TIMEOUT, retry=retry)
        direct = server.client()
        for source in preload:
            direct.script_load(source)
        try:
            yield Env(server, proxy, client, direct)
        finally:
            client.close()
            direct.close()


def pick(items: list[Any], choice: int) -> Any:
    """One of ``items``, as a drawn integer picks it."""
    return items[choice % len(items)]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
