"""A task in a namespace of its own (tests/test_task_namespace.py), in an app of its own on a
private Redis: the other tests' workers, some running as a one-namespace ACL user, never meet it.

Redis comes from ``SF_TEST_REDIS``: broker db 0, results db 1, leases db 2.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

BASE = os.environ.get("SF_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("nsapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleflight_redis_url=f"{BASE}/2",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)
recorder = redis.Redis.from_url(f"{BASE}/3")


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", lock_namespace="billing")
def billing_sleeper(self, key, seconds=30.0):
    recorder.set(f"pid:billing:{key}", os.getpid())
    time.sleep(seconds)
    return "slept"
