"""The Celery app ``benchmarks/bench_policies.py`` runs in a real worker (and dispatches from).

- ``superseded``: ``on_duplicate="supersede"``. Its body calls ``self.lease.check()`` every
  millisecond (no Redis call: the lease is marked by the push to its process, or else by the
  heartbeat's renewal) and stamps ``told`` when it raises (``Superseded``, or ``LeaseLost`` after a
  force-release). A newcomer stamps ``start`` when its body begins.
- ``coalesced``: ``on_duplicate="coalesce"``. Stamps ``start``; a ``lease_released`` receiver
  stamps ``released``.

Stamps are ``time.time()`` in a recorder Redis hash per task id (one host, one clock).
Configuration from the environment, set by the benchmark: ``SF_BENCH_BROKER``,
``SF_BENCH_LEASES``, ``SF_BENCH_RECORDER``, ``SF_BENCH_PREFIX`` (every key starts with it),
``SF_BENCH_QUEUE``, ``SF_BENCH_TTL`` (the lease TTL; the heartbeat renews every TTL/3).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleflight import LeaseLost, SingleFlightTask
from celery_singleflight import signals as sf_signals

PREFIX = os.environ.get("SF_BENCH_PREFIX", "sfbench")
BROKER = os.environ.get("SF_BENCH_BROKER", "redis://127.0.0.1:6379/0")
LEASES = os.environ.get("SF_BENCH_LEASES", "redis://127.0.0.1:6379/2")
RECORDER = os.environ.get("SF_BENCH_RECORDER", "redis://127.0.0.1:6379/3")
QUEUE = os.environ.get("SF_BENCH_QUEUE", f"{PREFIX}-queue")
TTL = float(os.environ.get("SF_BENCH_TTL", "30"))

app = Celery("policiesapp", broker=BROKER)
app.conf.update(
    singleflight_redis_url=LEASES,
    singleflight_namespace=f"{PREFIX}-sf",
    singleflight_ttl=TTL,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=1,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
recorder = redis.Redis.from_url(RECORDER)


def stamp(task_id: str, field: str) -> None:
    recorder.hset(f"{PREFIX}:t:{task_id}", field, repr(time.time()))


@app.task(bind=True, base=SingleFlightTask, lock_key="sup:<key>", on_duplicate="supersede",
          supersede_grace=60.0)
def superseded(self: Any, key: str, seconds: float) -> str:
    stamp(self.request.id, "start")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            self.lease.check()  # no Redis call: raises once the lease is marked superseded or lost
        except LeaseLost:
            stamp(self.request.id, "told")
            raise
        time.sleep(0.001)
    return "done"


@app.task(bind=True, base=SingleFlightTask, lock_key="co:<key>", on_duplicate="coalesce")
def coalesced(self: Any, key: str, seconds: float) -> str:
    stamp(self.request.id, "start")
    time.sleep(seconds)
    return "done"


def _released(sender: Any = None, lease: Any = None, **_: Any) -> None:
    if lease is not None and lease.task_id:
        stamp(lease.task_id, "released")


sf_signals.lease_released.connect(_released, weak=False)
