"""What the benchmarks share: the Redis they run against."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis

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


def delete_matching(client: redis.Redis, pattern: str) -> int:
    """Delete the keys matching ``pattern`` (SCAN, UNLINK in batches) and return how many there
    were: a benchmark's own keys on a Redis it did not start, never a FLUSH."""
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=pattern, count=1_000):
        batch.append(key)
        if len(batch) == 1_000:
            deleted += int(client.unlink(*batch))
            batch.clear()
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted
