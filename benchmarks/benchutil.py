"""What the benchmarks share: the Redis they run against."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from celery_singleflight.testing import RedisServer


@contextmanager
def redis_for(url: str | None) -> Iterator[tuple[str, bool]]:
    """``(url, private)``: the given Redis (``--redis-url``; the benchmark touches only keys under
    its own prefix there), else a private redis-server on a free loopback port, stopped by its
    PID afterwards."""
    if url:
        yield url, False
        return
    server = RedisServer().start()
    try:
        yield server.url, True
    finally:
        server.close()
