"""The Celery app of the time-policy tests (rate limit, debounce), run in real worker processes.

Redis comes from ``SF_TEST_REDIS``: broker db 0, results db 1, leases db 2, recorder db 3.
``SF_RATE`` and ``SF_BURST`` set the rate of :func:`paced` (the full-length test uses the issue's
60/m; the short one a faster rate, so it runs in seconds).
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

BASE = os.environ.get("SF_TEST_REDIS", "redis://127.0.0.1:6379")

app = Celery("timeapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleflight_redis_url=f"{BASE}/2",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    # the metrics test of the time policies (tests/time/test_time_metrics.py)
    singleflight_metrics=os.environ.get("SF_TEST_METRICS_PORT") is not None,
    singleflight_metrics_port=int(os.environ.get("SF_TEST_METRICS_PORT") or 0) or None,
    singleflight_metrics_dir=os.environ.get("SF_TEST_METRICS_DIR"),
)

recorder = redis.Redis.from_url(f"{BASE}/3")


def record(name: str, key: str, payload: object, planned: float | None = None) -> None:
    """The independent recorder: when each run started (this host's clock), and what it got."""
    task_id = app.current_task.request.id if app.current_task else "?"
    recorder.rpush(f"starts:{name}:{key}", json.dumps(
        {"task_id": task_id, "at": time.time(), "planned": planned, "payload": payload}))


@app.task(bind=True, base=SingleFlightTask, lock_key="pace:<key>", on_duplicate="retry",
          key_rate_limit=os.environ.get("SF_RATE", "20/s"),
          key_rate_burst=int(os.environ.get("SF_BURST", "5")),
          max_concurrency=8)
def paced(self, key, n=0):
    record("paced", key, n, getattr(self.request, "singleflight_planned_start", None))
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="deb:<key>", debounce=1.0, on_duplicate="queue")
def settled(self, key, n=0):
    """A burst of calls on one key becomes one run, 1 s after the last call, with its payload."""
    record("settled", key, n)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="stream:<key>", debounce=1.0, debounce_max_wait=3.0)
def streamed(self, key, n=0):
    """A steady stream still runs at least every 3 s (debounce_max_wait)."""
    record("streamed", key, n)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="first:<key>", debounce=0.5, debounce_keep="first")
def first_kept(self, key, n=0):
    record("first_kept", key, n)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="acct:<acct>", debounce_key="chat:<chat>", debounce=0.5)
def keyed(self, chat, acct, n=0):
    """Debounced per chat, locked per account: the run holds the lock of the chosen call's account."""
    record("keyed", chat, {"n": n, "lock": self.lease.key})
    return n
