"""The Celery app ``benchmarks/bench_throughput.py`` runs in a real worker (and dispatches from).

One no-op task per variant, all with the same shape ``(i, round_id, target)`` and
``ignore_result=True``:

- ``plain``: a plain Celery ``Task`` (the baseline);
- ``two_pings``: a plain task plus two PINGs to the lease Redis (the floor of any 2-round-trip lease);
- ``redis_lock``: a plain task inside redis-py's ``Lock`` (acquire, body, release): the simplest
  real lock taken in the worker, with a unique name per task;
- ``singleflight``: ``SingleFlightTask`` with ``lock_key="tp:<round_id>:<i>"``: a unique key per
  task, so every run takes an uncontended lease (acquire, heartbeat registration, release);
- ``singleflight_metrics``: the same task, run by a worker with Prometheus metrics on
  (``SF_TP_METRICS_DIR``: the worker counts into that directory), for the cost of counting;
- ``once``: ``celery_once.QueueOnce`` (its Redis backend): the lock is taken in ``apply_async``,
  by the producer, and cleared in ``after_return`` by the worker; only if celery-once imports;
- ``singleton``: ``celery_singleton.Singleton`` (its Redis backend): the lock is taken in
  ``apply_async`` and removed in ``on_success``/``on_failure``; only if celery-singleton imports.

The body is the same for all: ``INCR`` of the round's counter in the recorder; the run that
makes it 1 writes ``time.time()`` as the round's ``first``, the run that makes it ``target``
writes it as ``last`` (one host, one clock). Every variant pays the same recorder round trip
(plus one ``SET`` for two runs of the round).

Configuration comes from the environment (set by the benchmark before the worker starts):

- ``SF_TP_BROKER``: broker URL; ``SF_TP_LOCKS``: Redis URL of the leases and of the other
  libraries' locks; ``SF_TP_RECORDER``: Redis URL of the recorder;
- ``SF_TP_PREFIX``: every key this app writes starts with it (lease namespace, recorder keys,
  celery-singleton's key prefix, the broker's keys when ``SF_TP_BROKER_PREFIX=1`` via kombu's
  ``global_keyprefix``); celery-once's keys cannot be given a prefix (they are
  ``qo_<task name>_<args>``), so its task's name ends with the prefix instead;
- ``SF_TP_METRICS_DIR``: metrics on (``singleflight_metrics``), counted into this directory;
- ``SF_TP_TASK_LOGS=1`` keeps Celery's two INFO lines per task ("received", "succeeded"); by
  default they are turned off (the same for every variant), so the fixed per-task cost the lease
  is compared against is not padded with log writes.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

from celery_singleflight import SingleFlightTask

PREFIX = os.environ.get("SF_TP_PREFIX", "sftp")
BROKER = os.environ.get("SF_TP_BROKER", "redis://127.0.0.1:6379/0")
LOCKS = os.environ.get("SF_TP_LOCKS", "redis://127.0.0.1:6379/1")
RECORDER = os.environ.get("SF_TP_RECORDER", "redis://127.0.0.1:6379/2")
TASK_LOGS = os.environ.get("SF_TP_TASK_LOGS") == "1"

transport_options: dict[str, Any] = {}
if os.environ.get("SF_TP_BROKER_PREFIX") == "1":
    transport_options["global_keyprefix"] = f"{PREFIX}:kombu:"

app = Celery("throughputapp", broker=BROKER)
app.conf.update(
    singleflight_redis_url=LOCKS,
    singleflight_namespace=PREFIX,
    task_ignore_result=True,
    broker_transport_options=transport_options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # celery-singleton: its Redis backend on the locks DB, keys under our prefix (no expiry: its default)
    singleton_backend_url=LOCKS,
    singleton_key_prefix=f"{PREFIX}:singleton:",
    singleflight_metrics=bool(os.environ.get("SF_TP_METRICS_DIR")),
    singleflight_metrics_dir=os.environ.get("SF_TP_METRICS_DIR") or None,
)
# celery-once reads the upper-case ``ONCE`` setting (its documented form)
app.conf.ONCE = {
    "backend": "celery_once.backends.Redis",
    "settings": {"url": LOCKS, "default_timeout": 3600},
}

recorder = redis.Redis.from_url(RECORDER)

#: variant -> why it is unavailable (import error), for the report
UNAVAILABLE: dict[str, str] = {}
#: variant -> task
TASKS: dict[str, Any] = {}
#: variant -> whether it locks at dispatch (in the producer) rather than in the worker
LOCKS_AT_DISPATCH = {"plain": False, "two_pings": False, "redis_lock": False, "singleflight": False,
                     "singleflight_metrics": False, "once": True, "singleton": True}


def count_key(round_id: str) -> str:
    return f"{PREFIX}:tp:{round_id}:count"


def first_key(round_id: str) -> str:
    return f"{PREFIX}:tp:{round_id}:first"


def last_key(round_id: str) -> str:
    return f"{PREFIX}:tp:{round_id}:last"


def once_task_name() -> str:
    return f"throughputapp.once.{PREFIX}"


def _body(round_id: str, target: int) -> None:
    n = recorder.incr(count_key(round_id))
    if n == 1:
        recorder.set(first_key(round_id), repr(time.time()))
    if n == target:
        recorder.set(last_key(round_id), repr(time.time()))


@app.task(name="throughputapp.plain", ignore_result=True)
def plain(i: int, round_id: str, target: int) -> None:
    _body(round_id, target)


@app.task(name="throughputapp.singleflight", base=SingleFlightTask, lock_key="tp:<round_id>:<i>",
          ignore_result=True)
def singleflight(i: int, round_id: str, target: int) -> None:
    _body(round_id, target)


locks = redis.Redis.from_url(LOCKS)


@app.task(name="throughputapp.two_pings", ignore_result=True)
def two_pings(i: int, round_id: str, target: int) -> None:
    """The floor of any design with two round trips per task (the lease's acquire and release):
    two PINGs to the lease Redis, nothing else."""
    locks.ping()
    _body(round_id, target)
    locks.ping()


def lock_name(round_id: str, i: int) -> str:
    return f"{PREFIX}:lock:{round_id}:{i}"


@app.task(name="throughputapp.redis_lock", ignore_result=True)
def redis_lock(i: int, round_id: str, target: int) -> None:
    """The simplest real lock taken in the worker: redis-py's ``Lock`` (``SET NX PX``, then a
    release script), a unique name per task as for ``singleflight``; no holder, fence, status or
    outcome is recorded, no heartbeat."""
    lock = locks.lock(lock_name(round_id, i), timeout=30)
    if not lock.acquire(blocking=False):
        raise RuntimeError(f"lock {lock.name!r} was taken")
    try:
        _body(round_id, target)
    finally:
        lock.release()


TASKS["plain"] = plain
TASKS["singleflight"] = singleflight
TASKS["singleflight_metrics"] = singleflight  # the worker differs (metrics on), not the task
TASKS["two_pings"] = two_pings
TASKS["redis_lock"] = redis_lock

try:
    from celery_once import QueueOnce
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["once"] = f"not installed ({exc})"
else:

    @app.task(name=once_task_name(), base=QueueOnce, once={"graceful": False}, ignore_result=True)
    def once(i: int, round_id: str, target: int) -> None:
        _body(round_id, target)

    TASKS["once"] = once

try:
    from celery_singleton import Singleton
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["singleton"] = f"not installed ({exc})"
else:

    @app.task(name="throughputapp.singleton", base=Singleton, ignore_result=True)
    def singleton(i: int, round_id: str, target: int) -> None:
        _body(round_id, target)

    TASKS["singleton"] = singleton


@celery_signals.after_setup_logger.connect(weak=False)
def _quiet_task_logs(**_: Any) -> None:
    """Drop Celery's per-task INFO lines (received/succeeded) unless SF_TP_TASK_LOGS=1.

    Runs in the worker's main process after its logging is set up, before the pool forks and
    before the consumer and the tracers read ``isEnabledFor(INFO)``. "<hostname> ready." (which
    ``WorkerProcess.start`` waits for) still comes through.
    """
    if not TASK_LOGS:
        logging.getLogger("celery.app.trace").setLevel(logging.WARNING)
        logging.getLogger("celery.worker.strategy").setLevel(logging.WARNING)
