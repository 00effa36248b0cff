"""The Celery app of the beat test (tests/test_beat.py): periodic tasks that must not overlap.

Redis comes from ``SF_TEST_REDIS`` (the tests' private server), on databases sfapp does not use:
broker db 4, results db 5, leases db 6, and the independent recorder db 7.

- ``SF_BEAT_QUEUE``: the only queue these tasks are sent to (the test's worker consumes it, so no
  other test's worker ever sees them).
- ``SF_BEAT_SCHEDULE=1``: enables ``beat_schedule``; importing this module anywhere else schedules
  nothing.
- ``SF_BEAT_SECONDS``: how long each run works (default 3 s) and ``SF_BEAT_EVERY`` the schedule
  interval (default 1 s).

The recorder knows nothing of the library: every run INCRs/DECRs ``active:<task>`` and pushes to
``overlaps`` when it is not alone, and keeps its span (``runs:``, ``ended:``, ``spans:<task>``); the
beat process records the id of every tick it published (``sent:<task>``); the worker counts the
duplicates the library turned away from its ``duplicate`` signal (``skipped:<task>``,
``duplicates:<task>``).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, signals

from celery_singleflight import SingleFlightTask
from celery_singleflight import signals as sf_signals

BASE = os.environ.get("SF_TEST_REDIS", "redis://127.0.0.1:6379")
QUEUE = os.environ.get("SF_BEAT_QUEUE", "beat-test")
SECONDS = float(os.environ.get("SF_BEAT_SECONDS", "3"))
EVERY = float(os.environ.get("SF_BEAT_EVERY", "1"))

app = Celery("beatapp", broker=f"{BASE}/4", backend=f"{BASE}/5")
app.conf.update(
    singleflight_redis_url=f"{BASE}/6",
    singleflight_namespace="beat",
    task_default_queue=QUEUE,
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
)
if os.environ.get("SF_BEAT_SCHEDULE") == "1":
    app.conf.beat_schedule = {
        "report-skip": {"task": "beatapp.report_skip", "schedule": EVERY},
        "report-queue": {"task": "beatapp.report_queue", "schedule": EVERY},
    }

recorder = redis.Redis.from_url(f"{BASE}/7")


def record_run(task: Any, seconds: float) -> None:
    """Counts concurrent runs of ``task`` without the library, and keeps each run's span.

    Also notes whether the run's message carries the ``celery_beat_task`` header that recent Celery
    beat adds (celery/celery#9702; present in 5.7), which could tell ticks from other calls."""
    name, task_id = task.name, task.request.id
    started = time.time()
    if recorder.incr(f"active:{name}") > 1:
        recorder.rpush("overlaps", f"{name}:{task_id}")
    recorder.rpush(f"runs:{name}", task_id)
    request = task.request
    from_beat = getattr(request, "celery_beat_task", None) or (request.headers or {}).get("celery_beat_task")
    recorder.hset("from_beat", task_id, json.dumps(from_beat))
    try:
        time.sleep(seconds)
    finally:
        recorder.decr(f"active:{name}")
        ended = time.time()
        recorder.rpush(f"ended:{name}", task_id)
        recorder.rpush(f"spans:{name}", json.dumps({"id": task_id, "start": started, "end": ended}))


@app.task(bind=True, base=SingleFlightTask, name="beatapp.report_skip", lock_key="report:<@task>")
def report_skip(self: Any, seconds: float = SECONDS) -> str:
    """A periodic report with no policy set: a beat tick that finds the previous run still
    working is skipped (the library's default for beat ticks, on_beat_duplicate)."""
    record_run(self, seconds)
    return "reported"


@app.task(bind=True, base=SingleFlightTask, name="beatapp.report_queue", lock_key="report:<@task>",
          on_duplicate="queue", max_queued=1)
def report_queue(self: Any, seconds: float = SECONDS) -> str:
    """A periodic report: one tick waits for the run in progress (a catch-up run), others are
    refused with QueueFull."""
    record_run(self, seconds)
    return "reported"


def count_duplicate(sender: Any = None, task_id: Any = None, outcome: Any = None, **_: Any) -> None:
    """Worker side: every duplicate the library turned away, by task and by what happened to it."""
    if outcome == "skipped":
        recorder.incr(f"skipped:{sender}")
    recorder.rpush(f"duplicates:{sender}", f"{task_id}|{outcome}")


sf_signals.duplicate.connect(count_duplicate, weak=False)

_in_beat = False


def _beat_started(**_: Any) -> None:
    global _in_beat
    _in_beat = True


def record_tick(sender: Any = None, headers: Any = None, body: Any = None, **_: Any) -> None:
    """Beat side: the id of every tick beat published (after the broker accepted it)."""
    if not _in_beat:
        return  # a worker re-sending a parked run is not a tick
    task_id = (headers or {}).get("id") or (body or {}).get("id")
    recorder.rpush(f"sent:{sender}", str(task_id))


signals.beat_init.connect(_beat_started, weak=False)
signals.after_task_publish.connect(record_tick, weak=False)
