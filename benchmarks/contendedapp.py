"""The Celery app ``benchmarks/bench_contended.py`` runs in a real worker (and dispatches from).

One task per variant, all with the same shape ``(key, i, round_id)``, results stored in the
result backend (every variant alike, so "left non-terminal" can be checked for each):

- ``raise``, ``skip``, ``retry``, ``queue``, ``join``: ``SingleFlightTask`` with
  ``lock_key="ct:<key>"`` and that ``on_duplicate`` (``retry`` with ``max_wait=3600``, far longer
  than any drain, so it never gives up here); everything else at the library's defaults
  (lease TTL 30 s);
- ``once``: ``celery_once.QueueOnce`` with ``once={"graceful": True, "keys": ["key"]}`` (the lock is
  the ``key`` argument alone, the same key as ours) and its default timeout (the ``ONCE`` settings
  give none, so its source's ``60 * 60`` s applies); the lock is taken in ``apply_async`` by the
  producer, cleared in ``after_return`` by the worker; only if celery-once imports;
- ``singleton``: ``celery_singleton.Singleton`` with ``unique_on=["key"]`` (the same key) and
  otherwise its defaults (no lock expiry; a duplicate gets the queued task's ``AsyncResult``);
  the lock is taken in ``apply_async``, removed in ``on_success``/``on_failure``; only if
  celery-singleton imports.

The body is the same for all and writes only to the recorder (a Redis DB of its own, never
through the library): ``INCR`` of the key's ``active`` counter (a result above 1 means two runs
of one key were inside their bodies at once, and is counted in the round's ``overlaps``), a
sleep of ``SF_CT_SLEEP`` seconds, ``DECR``, and one entry ``task id|start|end|active`` appended to
the key's ``runs`` list. It returns ``{"key", "i", "ran": its task id}``, so a ``join`` duplicate
answered with the holder's result can be told from a run of its own.

``task_prerun``/``task_postrun`` receivers stamp the round's first start and last end (a sorted
set updated with ``ZADD LT``/``GT``, so concurrent pool processes cannot overwrite a later stamp
with an earlier one): every message counts, also a duplicate that is turned away.

Configuration comes from the environment (set by the benchmark before the worker starts):
``SF_CT_BROKER``, ``SF_CT_LOCKS`` (leases and the other libraries' locks), ``SF_CT_BACKEND``
(results), ``SF_CT_RECORDER``: Redis URLs; ``SF_CT_PREFIX``: every key this app writes starts
with it (lease namespace, recorder, celery-singleton's key prefix, and with
``SF_CT_SHARED=1`` the broker's and the result backend's keys via ``global_keyprefix``);
celery-once's keys take no prefix (``qo_<task name>_key-<key>``), so its task's name ends with
the prefix instead. Celery's per-task INFO lines and the library's per-duplicate INFO lines are
turned off in the worker (the same for every variant).
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

PREFIX = os.environ.get("SF_CT_PREFIX", "sfct")
BROKER = os.environ.get("SF_CT_BROKER", "redis://127.0.0.1:6379/0")
LOCKS = os.environ.get("SF_CT_LOCKS", "redis://127.0.0.1:6379/1")
BACKEND = os.environ.get("SF_CT_BACKEND", "redis://127.0.0.1:6379/2")
RECORDER = os.environ.get("SF_CT_RECORDER", "redis://127.0.0.1:6379/3")
SLEEP = float(os.environ.get("SF_CT_SLEEP", "0.02"))
SHARED = os.environ.get("SF_CT_SHARED") == "1"

transport_options: dict[str, Any] = {}
backend_options: dict[str, Any] = {}
if SHARED:
    transport_options["global_keyprefix"] = f"{PREFIX}:kombu:"
    backend_options["global_keyprefix"] = f"{PREFIX}:results:"

app = Celery("contendedapp", broker=BROKER, backend=BACKEND)
app.conf.update(
    singleflight_redis_url=LOCKS,
    singleflight_namespace=PREFIX,
    task_ignore_result=False,
    broker_transport_options=transport_options,
    result_backend_transport_options=backend_options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # celery-singleton: its Redis backend on the locks DB, keys under our prefix, default expiry (none)
    singleton_backend_url=LOCKS,
    singleton_key_prefix=f"{PREFIX}:singleton:",
)
# celery-once reads the upper-case ``ONCE`` setting (its documented form); no default_timeout given,
# so its own default (60 * 60 s) applies
app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": LOCKS}}

recorder = redis.Redis.from_url(RECORDER)

#: variant -> task
TASKS: dict[str, Any] = {}
#: variant -> why it is unavailable (import error), for the report
UNAVAILABLE: dict[str, str] = {}
POLICIES = ("raise", "skip", "retry", "queue", "join")


def rec(round_id: str, *parts: str) -> str:
    return ":".join((PREFIX, "rec", round_id, *parts))


def active_key(round_id: str, key: str) -> str:
    return rec(round_id, "active", key)


def runs_key(round_id: str, key: str) -> str:
    return rec(round_id, "runs", key)


def overlaps_key(round_id: str) -> str:
    return rec(round_id, "overlaps")


def span_key(round_id: str) -> str:
    return rec(round_id, "span")


def once_task_name() -> str:
    return f"contendedapp.once.{PREFIX}"


def _body(task_id: str, key: str, i: int, round_id: str) -> dict[str, Any]:
    active = int(recorder.incr(active_key(round_id, key)))
    start = time.time()
    if active > 1:
        recorder.incr(overlaps_key(round_id))
    time.sleep(SLEEP)
    end = time.time()
    pipe = recorder.pipeline(transaction=False)
    pipe.decr(active_key(round_id, key))
    pipe.rpush(runs_key(round_id, key), f"{task_id}|{start!r}|{end!r}|{active}")
    pipe.execute()
    return {"key": key, "i": i, "ran": task_id}


def _make_policy_task(policy: str) -> Any:
    extra: dict[str, Any] = {"max_wait": 3600} if policy == "retry" else {}

    @app.task(bind=True, base=SingleFlightTask, name=f"contendedapp.{policy}", lock_key="ct:<key>",
              on_duplicate=policy, **extra)
    def task(self: Any, key: str, i: int, round_id: str) -> dict[str, Any]:
        return _body(self.request.id, key, i, round_id)

    return task


for _policy in POLICIES:
    TASKS[_policy] = _make_policy_task(_policy)

try:
    from celery_once import QueueOnce
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["once"] = f"not installed ({exc})"
else:

    @app.task(bind=True, base=QueueOnce, name=once_task_name(), once={"graceful": True, "keys": ["key"]})
    def once(self: Any, key: str, i: int, round_id: str) -> dict[str, Any]:
        return _body(self.request.id, key, i, round_id)

    TASKS["once"] = once

try:
    from celery_singleton import Singleton
except ImportError as exc:  # pragma: no cover - depends on the environment
    UNAVAILABLE["singleton"] = f"not installed ({exc})"
else:

    @app.task(bind=True, base=Singleton, name="contendedapp.singleton", unique_on=["key"])
    def singleton(self: Any, key: str, i: int, round_id: str) -> dict[str, Any]:
        return _body(self.request.id, key, i, round_id)

    TASKS["singleton"] = singleton


def _round_of(args: Any, kwargs: Any) -> str | None:
    if args and len(args) >= 3:
        return str(args[2])
    return str((kwargs or {}).get("round_id") or "") or None


def _ours(sender: Any) -> bool:
    return str(getattr(sender, "name", "")).startswith("contendedapp.")


@celery_signals.task_prerun.connect(weak=False)
def _stamp_start(sender: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    now = time.time()
    round_id = _round_of(args, kwargs)
    if round_id and _ours(sender):
        recorder.zadd(span_key(round_id), {"first": now}, lt=True)


@celery_signals.task_postrun.connect(weak=False)
def _stamp_end(sender: Any = None, args: Any = None, kwargs: Any = None, **_: Any) -> None:
    now = time.time()
    round_id = _round_of(args, kwargs)
    if round_id and _ours(sender):
        recorder.zadd(span_key(round_id), {"last": now}, gt=True)


@celery_signals.after_setup_logger.connect(weak=False)
def _quiet_logs(**_: Any) -> None:
    """Drop the per-task INFO lines (Celery's received/succeeded/retry, the library's per-duplicate
    lines): thousands per measurement, the same for every variant. WARNING and above stay."""
    for name in ("celery.app.trace", "celery.worker.strategy", "celery_singleflight.duplicate",
                 "celery_singleflight.queue", "celery_singleflight.join", "celery_singleflight.acquire"):
        logging.getLogger(name).setLevel(logging.WARNING)
