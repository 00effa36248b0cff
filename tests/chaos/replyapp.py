"""The Celery app of the lost-reply scenarios: every policy, its lease Redis behind a fault proxy.

- ``CHAOS_REDIS``: broker (db 0), results (db 1) and the run recorder (db 3), reached directly;
- ``REPLY_LEASE_URL``: the lease Redis, reached through a :class:`~faultproxy.FaultProxy` that
  drops, stalls or cuts the replies of chosen scripts (the caller's ``apply_async`` and ``hold()``
  go through it too).

The recorder does not use the library: each body run appends its task id to ``runs:<key>`` and
counts itself in ``active:<key>``; more than the key's limit at once is an overlap.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask
from tests.gates import hold

BASE = os.environ.get("CHAOS_REDIS", "redis://127.0.0.1:6379")
LEASE_URL = os.environ.get("REPLY_LEASE_URL", f"{BASE}/2")

app = Celery("replyapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleflight_redis_url=LEASE_URL,
    singleflight_namespace="lr",
    singleflight_ttl=3.0,
    singleflight_redis_retry_delay=0.5,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    task_default_queue=os.environ.get("REPLY_QUEUE", "celery"),
)

recorder = redis.Redis.from_url(f"{BASE}/3")


def body(task: Any, key: str, seconds: float, limit: int = 1, gate: str | None = None) -> dict[str, Any]:
    """A run on ``key``: recorded, reports progress twice, takes ``seconds``, or less once the
    recorder key ``gate`` exists (a holder the scenario must outlast waits for the scenario, not
    for a duration it hopes is long enough); ``working:<key>`` names it once it reported."""
    task_id = task.request.id
    recorder.rpush(f"runs:{key}", task_id)
    active = recorder.incr(f"active:{key}")
    if active > limit:
        recorder.rpush("overlaps", f"{key}:{task_id}:{active}")
    try:
        task.progress("working", current=0, total=1)
        recorder.rpush(f"working:{key}", task_id)
        hold(recorder, seconds, gate)
        task.progress("done", current=1, total=1)
    finally:
        recorder.decr(f"active:{key}")
    return {"key": key, "ran": task_id, "fence": task.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="raise")
def refuse(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="skip")
def skip(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="retry", max_wait=60)
def retry(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="queue")
def queue(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="join")
def join(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="skip", dedup_enqueue=True)
def dedup(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="queue",
          idempotency_key="m:<key>:<message>")
def idem(self: Any, key: str, message: str, seconds: float = 0.1) -> dict[str, Any]:
    return body(self, key, seconds)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_duplicate="queue", max_concurrency=2)
def limited(self: Any, key: str, seconds: float = 0.1, gate: str | None = None) -> dict[str, Any]:
    return body(self, key, seconds, limit=2, gate=gate)


@app.task(bind=True, base=SingleFlightTask, lock_key="r:<key>", on_redis_error="fail_open")
def fail_open(self: Any, key: str, seconds: float = 0.1) -> dict[str, Any]:
    recorder.rpush(f"runs:{key}", self.request.id)
    time.sleep(seconds)
    return {"key": key, "ran": self.request.id}
