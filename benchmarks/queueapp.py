"""The Celery app ``benchmarks/bench_queue.py`` runs in a real worker (and dispatches from).

Three tasks with the same shape, ``(key, role, seconds)``, one per way of waiting for a busy key:

- ``via_queue``: ``SingleFlightTask``, ``on_duplicate="queue"`` (a duplicate parks in the key's
  FIFO; the releaser re-sends its message to the broker);
- ``via_retry``: ``SingleFlightTask``, ``on_duplicate="retry"`` with the library's default backoff
  and a ``max_wait`` far longer than any round;
- ``via_recheck``: a plain Celery task emulating Rotor: ``SET NX PX`` on a lock key of its own and,
  if that is taken, ``self.retry(countdown=10, max_retries=None)``; released with a
  compare-and-delete script.

Each run writes wall-clock timestamps (``time.time()``, one host, so comparable across
processes) to the recorder, a Redis hash per task id:

- ``start``: first thing in the body (after the lease was taken);
- ``end``: last thing in the body, just before it returns (the release follows);
- ``released``: the release itself. For the two ``SingleFlightTask`` tasks this is written by a
  receiver of ``celery_singleflight.signals.lease_released``, connected below; for
  ``via_recheck`` right after its compare-and-delete;
- ``dup``: a list of what happened each time the run found its key busy (from
  ``celery_singleflight.signals.duplicate``, or ``recheck`` for ``via_recheck``).

With ``SF_BENCH_TRACE=1`` the worker also records, per task id, when its message was about to be
published and was published by a pool process (``before_task_publish``/``after_task_publish``; a
parked run's handoff is published this way; only the last publish is kept), received
by the worker's main process (``task_received``) and about to run in a pool process
(``task_prerun``), so the time from release to start can be broken down.

Configuration comes from the environment (set by the benchmark before the worker starts):

- ``SF_BENCH_BROKER``: broker URL; ``SF_BENCH_LEASES``: Redis URL of the leases and of the
  Rotor-style locks; ``SF_BENCH_RECORDER``: Redis URL of the recorder;
- ``SF_BENCH_PREFIX``: every key this app writes starts with it (lease namespace, recorder keys,
  lock keys; and the broker's keys when ``SF_BENCH_BROKER_PREFIX=1``, via kombu's
  ``global_keyprefix``), so a shared Redis is touched only under that prefix;
- ``SF_BENCH_QUEUE``: the dedicated queue; ``SF_BENCH_RECHECK``: the fixed re-check delay
  (seconds, default 10); ``SF_BENCH_TRANSPORT_OPTIONS``: extra kombu transport options (JSON).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Any

import redis
from celery import Celery, Task
from celery import signals as celery_signals

from celery_singleflight import SingleFlightTask
from celery_singleflight import signals as sf_signals

PREFIX = os.environ.get("SF_BENCH_PREFIX", "sfbench")
BROKER = os.environ.get("SF_BENCH_BROKER", "redis://127.0.0.1:6379/0")
LEASES = os.environ.get("SF_BENCH_LEASES", "redis://127.0.0.1:6379/2")
RECORDER = os.environ.get("SF_BENCH_RECORDER", "redis://127.0.0.1:6379/3")
QUEUE = os.environ.get("SF_BENCH_QUEUE", f"{PREFIX}-queue")
RECHECK_SECONDS = float(os.environ.get("SF_BENCH_RECHECK", "10"))
TRACE = os.environ.get("SF_BENCH_TRACE") == "1"
LOCK_TTL_MS = 30_000  # the Rotor-style lock's TTL; the library's default lease TTL is 30 s too

transport_options: dict[str, Any] = json.loads(os.environ.get("SF_BENCH_TRANSPORT_OPTIONS") or "{}")
if os.environ.get("SF_BENCH_BROKER_PREFIX") == "1":
    transport_options["global_keyprefix"] = f"{PREFIX}:kombu:"

app = Celery("queueapp", broker=BROKER)
app.conf.update(
    singleflight_redis_url=LEASES,
    singleflight_namespace=PREFIX,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    broker_transport_options=transport_options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

recorder = redis.Redis.from_url(RECORDER)
locks = redis.Redis.from_url(LEASES)
_compare_and_delete = locks.register_script(
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


def record_key(task_id: str) -> str:
    """The recorder hash of one run."""
    return f"{PREFIX}:rec:{task_id}"


def dup_key(task_id: str) -> str:
    """The recorder list of what a run did each time it found its key busy."""
    return f"{PREFIX}:rec:{task_id}:dup"


def _record(task_id: str | None, field: str, when: float) -> None:
    if task_id:
        recorder.hset(record_key(task_id), field, repr(when))


def _body(task: Task, seconds: float) -> None:
    task_id = task.request.id
    _record(task_id, "start", time.time())
    if seconds:
        time.sleep(seconds)
    _record(task_id, "end", time.time())


@app.task(bind=True, base=SingleFlightTask, name="queueapp.via_queue", lock_key="bq:<key>",
          on_duplicate="queue")
def via_queue(self: Task, key: str, role: str, seconds: float = 0.0) -> None:
    _body(self, seconds)


@app.task(bind=True, base=SingleFlightTask, name="queueapp.via_retry", lock_key="bq:<key>",
          on_duplicate="retry", max_wait=3600)
def via_retry(self: Task, key: str, role: str, seconds: float = 0.0) -> None:
    _body(self, seconds)


@app.task(bind=True, name="queueapp.via_recheck", max_retries=None)
def via_recheck(self: Task, key: str, role: str, seconds: float = 0.0) -> None:
    """What Rotor does: take a lock or come back in a fixed 10 s."""
    lock = f"{PREFIX}:rotor:{key}"
    token = uuid.uuid4().hex
    if not locks.set(lock, token, nx=True, px=LOCK_TTL_MS):
        recorder.rpush(dup_key(self.request.id), "recheck")
        raise self.retry(countdown=RECHECK_SECONDS, max_retries=None)
    try:
        _body(self, seconds)
    finally:
        _compare_and_delete(keys=[lock], args=[token])
        _record(self.request.id, "released", time.time())


@sf_signals.lease_released.connect(weak=False)
def _on_released(sender: Any = None, lease: Any = None, **_: Any) -> None:
    now = time.time()
    if lease is not None:
        _record(lease.task_id, "released", now)


@sf_signals.duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, task_id: str | None = None, outcome: str = "", **_: Any) -> None:
    if task_id:
        recorder.rpush(dup_key(task_id), outcome)


if TRACE:

    @celery_signals.before_task_publish.connect(weak=False)
    def _on_publishing(sender: Any = None, headers: Any = None, **_: Any) -> None:
        now = time.time()
        task_id = (headers or {}).get("id")
        if task_id and app.current_task is not None:
            recorder.hset(record_key(task_id), "publishing", repr(now))

    @celery_signals.after_task_publish.connect(weak=False)
    def _on_published(sender: Any = None, headers: Any = None, **_: Any) -> None:
        now = time.time()
        task_id = (headers or {}).get("id")
        if task_id and app.current_task is not None:  # published from inside a run: handoffs, retries
            recorder.hset(record_key(task_id), "published", repr(now))

    @celery_signals.task_received.connect(weak=False)
    def _on_received(request: Any = None, **_: Any) -> None:
        now = time.time()
        if request is not None:
            recorder.hset(record_key(request.id), "received", repr(now))

    @celery_signals.task_prerun.connect(weak=False)
    def _on_prerun(task_id: str | None = None, **_: Any) -> None:
        _record(task_id, "prerun", time.time())
