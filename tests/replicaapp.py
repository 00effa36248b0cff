"""The app of the failover test (tests/test_min_replicas_failover.py), run by a real worker.

Its leases live behind Sentinel (``SF_REPLICA_LEASES``, ``SF_REPLICA_OPTIONS``); the broker, the
results and the run history live on another private Redis (``SF_REPLICA_SIDE``: db 0, 1 and 3),
which no test kills: every body appends its start and its end, with its fence, to
``history:<key>`` there, so runs of one key that overlapped are seen whatever the lease Redis
lost.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

SIDE = os.environ.get("SF_REPLICA_SIDE", "redis://127.0.0.1:6379")

app = Celery("replicaapp", broker=f"{SIDE}/0", backend=f"{SIDE}/1")
app.conf.update(
    singleflight_redis_url=os.environ.get("SF_REPLICA_LEASES", f"{SIDE}/2"),
    singleflight_redis_transport_options=json.loads(os.environ.get("SF_REPLICA_OPTIONS", "null")),
    singleflight_redis_retry_delay=0.3,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)

history = redis.Redis.from_url(f"{SIDE}/3")


def record(task: SingleFlightTask, key: str, seconds: float) -> str:
    """Append this run's start and end (epoch seconds, its task id and fence) to the history."""
    entry = {"task": task.request.id, "fence": task.lease.fence}
    history.rpush(f"history:{key}", json.dumps({**entry, "event": "start", "at": time.time()}))
    time.sleep(seconds)
    history.rpush(f"history:{key}", json.dumps({**entry, "event": "end", "at": time.time()}))
    return key


@app.task(bind=True, base=SingleFlightTask, lock_key="fo:<key>", on_duplicate="queue")
def unreplicated(self, key, seconds):
    return record(self, key, seconds)


@app.task(bind=True, base=SingleFlightTask, lock_key="fo:<key>", on_duplicate="queue", min_replicas=1,
          min_replicas_timeout=0.3)
def replicated(self, key, seconds):
    return record(self, key, seconds)
