"""What the metrics count: a run's take and release, called by the lifecycle itself (every
run pays for these, so they skip the signal dispatch), and the rarer events read off the
library's own signals, so that the series and the signals an application sees never disagree.

The signals are connected by :func:`connect` when a worker starts recording.
"""

from __future__ import annotations

import time as mod_time
from typing import Any

from celery import current_app
from celery import signals as celery_signals

from .. import signals
from ..run.messages import HEADER_FAIR_WAITED, HEADER_FIRST_SEEN, HEADER_HANDED, HEADER_PARKED_AT, header
from . import record

__all__ = ["acquired", "connect", "policy_of", "released", "waited_since"]

#: the ``policy`` label of a run that is not a task's (a ``hold()``)
NO_POLICY = "none"

_policies: dict[str, str] = {}
#: the headers of a message that waited or was handed on (most runs carry none of them)
_WAITED = (HEADER_FIRST_SEEN, HEADER_FAIR_WAITED, HEADER_PARKED_AT, HEADER_HANDED)


def policy_of(task_name: str) -> str:
    """The duplicate policy of a task, by name (cached: a task's options do not change)."""
    policy = _policies.get(task_name)
    if policy is None:
        task = current_app.tasks.get(task_name)
        options = getattr(task, "options", None)
        policy = str(getattr(options, "on_duplicate", NO_POLICY) or NO_POLICY)
        _policies[task_name] = policy
    return policy


def waited_since(request: Any) -> float | None:
    """When a run that waited made its first attempt (epoch seconds), from its message: parked
    (``queue``), fair share, or re-sent (retry, rate limit, ``fail_closed``); None if it did not wait."""
    stamps = [header(request, name) for name in (HEADER_FIRST_SEEN, HEADER_FAIR_WAITED, HEADER_PARKED_AT)]
    found = [float(stamp) for stamp in stamps if stamp]
    return min(found) if found else None


def acquired(task_name: str, request: Any) -> None:
    """A run of ``task_name`` took its lease (after a wait, or a hand-off, if ``request``'s
    message says so; ``request`` is None for a ``hold()``)."""
    policy = policy_of(task_name)
    record.count("leases_acquired", task_name, policy)
    if request is None:
        return
    headers = request.headers or {}
    if not any(name in headers for name in _WAITED):
        return
    now = mod_time.time()
    since = waited_since(request)
    if since is not None:
        record.observe("wait_seconds", now - since, task_name, policy)
    handed = header(request, HEADER_HANDED)
    if handed:
        record.observe("handoff_seconds", now - float(handed), task_name, policy)


def released(task_name: str, lease: Any) -> None:
    """A run released its lease: how long it held it."""
    if lease is not None:
        record.observe("hold_seconds", mod_time.monotonic() - lease.taken_at, task_name, policy_of(task_name))


def _lost(sender: str, **_: Any) -> None:
    record.count("leases_lost", sender, policy_of(sender))


def _duplicate(sender: str, policy: str = NO_POLICY, outcome: str = "", **_: Any) -> None:
    record.count("duplicates", sender, policy, outcome)


def _queue_timeout(sender: str, **_: Any) -> None:
    record.count("queue_timeouts", sender)


_RECEIVERS = (
    (signals.lease_lost, _lost),
    (signals.duplicate, _duplicate),
    (signals.queue_timeout, _queue_timeout),
)


def _exiting(**_: Any) -> None:
    record.flush()  # a pool process ends with os._exit: atexit does not run there


def connect() -> None:
    """Count the library's signals in this process and the ones it forks, and write a pool
    process's counts as it exits (idempotent)."""
    for signal, receiver in _RECEIVERS:
        signal.connect(receiver, weak=False, dispatch_uid=f"singleflight-metrics-{receiver.__name__}")
    celery_signals.worker_process_shutdown.connect(_exiting, weak=False,
                                                   dispatch_uid="singleflight-metrics-exit")
