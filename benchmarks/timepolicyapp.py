"""The Celery app ``benchmarks/bench_time_policies.py`` dispatches from and runs in a worker.

- ``plain``: a plain Celery task (the baseline of an ``apply_async``);
- ``guarded``: a ``SingleFlightTask`` without time policies (what the library adds to a send:
  rendering the key);
- ``debounced``: the same with ``debounce`` (a send records the call: one script);
- ``paced``: ``key_rate_limit`` from ``SF_BENCH_RATE`` (burst ``SF_BENCH_BURST``); each run writes
  its planned start (the cell the script gave it) and its actual start (``time.time()`` first
  thing in the body; one host, one clock) to the recorder, a list per key.

Configuration from the environment: ``SF_BENCH_REDIS`` (broker db 0, leases db 2, recorder db 3).
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

BASE = os.environ.get("SF_BENCH_REDIS", "redis://127.0.0.1:6379")

app = Celery("timepolicyapp", broker=f"{BASE}/0")
app.conf.update(singleflight_redis_url=f"{BASE}/2", worker_hijack_root_logger=False,
                broker_connection_retry_on_startup=True, task_ignore_result=True)

recorder = redis.Redis.from_url(f"{BASE}/3")


@app.task
def plain(key, n=0):
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="g:<key>")
def guarded(self, key, n=0):
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="d:<key>", debounce=60.0)
def debounced(self, key, n=0):
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="p:<key>", max_concurrency=4,
          key_rate_limit=os.environ.get("SF_BENCH_RATE", "20/s"),
          key_rate_burst=int(os.environ.get("SF_BENCH_BURST", "1")))
def paced(self, key, n=0):
    at = time.time()
    recorder.rpush(f"paced:{key}", json.dumps({"at": at, "planned": self.request.singleflight_planned_start}))
    return n
