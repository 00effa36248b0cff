"""The Celery app ``benchmarks/bench_recovery.py`` runs in two real workers (and dispatches from).

One task per variant, all with the same shape ``(key, role, seconds)``:

- ``sf_queue_30``, ``sf_queue_5``: ``SingleFlightTask``, ``lock_key="rc:<key>"``,
  ``on_duplicate="queue"``, lease TTL the library's default (30 s: no ``lock_ttl`` given) and
  ``lock_ttl=5``; heartbeat at its default (TTL / 3);
- ``sf_retry_30``, ``sf_retry_5``: the same with ``on_duplicate="retry"`` and ``max_wait=3600``;
- ``once``: ``celery_once.QueueOnce``, ``once={"graceful": True, "keys": ["key"]}`` and its
  default timeout (the ``ONCE`` settings give none, so its source's ``60 * 60`` s applies); the
  lock is taken in ``apply_async`` (the producer) and cleared in ``after_return``;
- ``singleton``: ``celery_singleton.Singleton``, ``unique_on=["key"]``, otherwise its defaults
  (``singleton_lock_expiry`` unset: the lock is ``SET NX`` without expiry);
- ``setnx``: the common hand-written Redis lock around a plain task: ``SET <key> <token> NX EX
  600`` before the body, ``self.retry(countdown=1)`` (no retry limit) if it is taken, and a
  compare-and-delete of its own token after the body.

The body appends ``{task_id, role, start, host, pid}`` (``time.time()``, one host, one clock) to
the key's list in the recorder, then sleeps ``seconds`` (the holder: an hour, it is killed long
before). Every time a run finds its key busy it appends what happened to its task id's list
(``duplicate`` signal of the library: ``queued``, ``retry``; ``busy`` for ``setnx``), so the
benchmark knows the duplicate is parked or retrying before it kills the holder.

Configuration comes from the environment (set by the benchmark before the workers start):
``SF_RC_BROKER``, ``SF_RC_LOCKS`` (leases and the other libraries' locks), ``SF_RC_RECORDER``:
Redis URLs; ``SF_RC_PREFIX``: every key this app writes starts with it (lease namespace, recorder,
the ``setnx`` locks, celery-singleton's key prefix, and with ``SF_RC_SHARED=1`` the broker's keys
via ``global_keyprefix``); celery-once's keys take no prefix (``qo_<task name>_key-<key>``), so
its task's name ends with the prefix instead.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

import redis
from celery import Celery, Task

from celery_singleflight import SingleFlightTask
from celery_singleflight import signals as sf_signals

PREFIX = os.environ.get("SF_RC_PREFIX", "sfrc")
BROKER = os.environ.get("SF_RC_BROKER", "redis://127.0.0.1:6379/0")
LOCKS = os.environ.get("SF_RC_LOCKS", "redis://127.0.0.1:6379/1")
RECORDER = os.environ.get("SF_RC_RECORDER", "redis://127.0.0.1:6379/3")
SHARED = os.environ.get("SF_RC_SHARED") == "1"
SETNX_EX = 600  # seconds: the hand-written lock's expiry
SETNX_RECHECK = 1.0  # seconds between its duplicate's attempts

transport_options: dict[str, Any] = {"global_keyprefix": f"{PREFIX}:kombu:"} if SHARED else {}

app = Celery("recoveryapp", broker=BROKER)
app.conf.update(
    singleflight_redis_url=LOCKS,
    singleflight_namespace=PREFIX,
    task_ignore_result=True,
    broker_transport_options=transport_options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # celery-singleton: its Redis backend on the locks DB, keys under our prefix, default expiry (none)
    singleton_backend_url=LOCKS,
    singleton_key_prefix=f"{PREFIX}:singleton:",
)
# celery-once reads the upper-case ``ONCE`` setting; no default_timeout: its own default applies
app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": LOCKS}}

recorder = redis.Redis.from_url(RECORDER)
locks = redis.Redis.from_url(LOCKS)
_compare_and_delete = locks.register_script(
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)

#: variant -> task
TASKS: dict[str, Any] = {}
#: variant -> why it is unavailable (import error), for the report
UNAVAILABLE: dict[str, str] = {}


def runs_key(key: str) -> str:
    """The recorder list of every body start of ``key``."""
    return f"{PREFIX}:rec:runs:{key}"


def waits_key(task_id: str) -> str:
    """The recorder list of what a run did each time it found its key busy."""
    return f"{PREFIX}:rec:waits:{task_id}"


def setnx_lock(key: str) -> str:
    return f"{PREFIX}:setnx:{key}"


def once_task_name() -> str:
    return f"recoveryapp.once.{PREFIX}"


def _body(task_id: str, key: str, role: str, seconds: float) -> None:
    recorder.rpush(runs_key(key), json.dumps({"task_id": task_id, "role": role, "start": time.time(),
                                              "host": socket.gethostname(), "pid": os.getpid()}))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _make_sf(name: str, policy: str, ttl: float | None) -> Any:
    extra: dict[str, Any] = {"max_wait": 3600} if policy == "retry" else {}
    if ttl is not None:
        extra["lock_ttl"] = ttl

    @app.task(bind=True, base=SingleFlightTask, name=f"recoveryapp.{name}", lock_key="rc:<key>",
              on_duplicate=policy, **extra)
    def task(self: Task, key: str, role: str, seconds: float) -> None:
        _body(self.request.id, key, role, seconds)

    return task


TASKS["sf_queue_30"] = _make_sf("sf_queue_30", "queue", None)  # the default lease TTL (30 s)
TASKS["sf_queue_5"] = _make_sf("sf_queue_5", "queue", 5)
TASKS["sf_retry_30"] = _make_sf("sf_retry_30", "retry", None)
TASKS["sf_retry_5"] = _make_sf("sf_retry_5", "retry", 5)

try:
    from celery_once import QueueOnce
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["once"] = f"not installed ({exc})"
else:

    @app.task(bind=True, base=QueueOnce, name=once_task_name(), once={"graceful": True, "keys": ["key"]})
    def once(self: Task, key: str, role: str, seconds: float) -> None:
        _body(self.request.id, key, role, seconds)

    TASKS["once"] = once

try:
    from celery_singleton import Singleton
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["singleton"] = f"not installed ({exc})"
else:

    @app.task(bind=True, base=Singleton, name="recoveryapp.singleton", unique_on=["key"])
    def singleton(self: Task, key: str, role: str, seconds: float) -> None:
        _body(self.request.id, key, role, seconds)

    TASKS["singleton"] = singleton


@app.task(bind=True, name="recoveryapp.setnx", max_retries=None)
def setnx(self: Task, key: str, role: str, seconds: float) -> None:
    """A plain task behind the usual hand-written lock: SET NX EX 600, or try again in 1 s."""
    lock = setnx_lock(key)
    token = uuid.uuid4().hex
    if not locks.set(lock, token, nx=True, ex=SETNX_EX):
        recorder.rpush(waits_key(self.request.id), "busy")
        raise self.retry(countdown=SETNX_RECHECK, max_retries=None)
    try:
        _body(self.request.id, key, role, seconds)
    finally:
        _compare_and_delete(keys=[lock], args=[token])


TASKS["setnx"] = setnx


@sf_signals.duplicate.connect(weak=False)
def _on_duplicate(sender: Any = None, task_id: str | None = None, outcome: str = "", **_: Any) -> None:
    if task_id:
        recorder.rpush(waits_key(task_id), outcome)
