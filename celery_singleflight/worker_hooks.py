"""Release leases whose pool child ended without running its own ``finally``.

A child killed by SIGKILL (or by the hard time limit, or by ``revoke(terminate=True)``) runs no
code. The worker's main process still learns about it: ``task_failure`` with
``WorkerLostError`` / ``TimeLimitExceeded``, or ``task_revoked`` with ``terminated=True``. Both
carry the task's arguments, so the main process renders the key and frees it, checking that the
lease is the dead child's (same task id, this host, a process that is gone) before it does.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import signals as celery_signals
from celery.exceptions import TimeLimitExceeded

from . import signals
from .lease import process_alive

__all__ = ["release_for_ended_child"]

log = logging.getLogger("celery_singleflight.release")


def release_for_ended_child(
    task: Any, task_id: str, args: Any, kwargs: Any, reason: str, *, doomed: bool
) -> bool:
    """Free the key of ``task_id`` if a pool child of this host held it and ended.

    ``doomed``: the main process is killing that child itself (hard time limit, terminate), so
    its lease is released without waiting for it to exit (the kill comes after this signal).
    Otherwise the holder's process must already be gone.
    """
    from .task import SingleFlightTask

    if not isinstance(task, SingleFlightTask) or not task_id:
        return False
    try:
        key = task.render_key(*(args or ()), **(kwargs or {}))
        store = task.store
        record = store.holder_record(key)
        host = socket.gethostname()
        if record.get("task_id") != task_id or record.get("host") != host:
            return False
        pid = int(record.get("pid", "0") or 0)
        if pid == os.getpid() or (not doomed and process_alive(pid)):
            return False  # the run itself is alive (threads/solo pool) and releases on its own
        released = store.release(key, record["token"])
    except (redis.RedisError, TypeError, ValueError) as exc:
        log.warning("could not release the key of %s[%s] after %s: %s", task.name, task_id, reason, exc)
        return False
    if released:
        log.warning(
            "released key=%r of %s[%s]: its pool process %s ended without releasing (%s)",
            key, task.name, task_id, pid, reason,
        )
        signals.lease_released.send(sender=task.name, lease=None, reason=reason)
    return released


def _on_task_failure(
    sender: Any = None, task_id: str = "", exception: BaseException | None = None,
    args: Any = None, kwargs: Any = None, **_: Any,
) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        doomed = isinstance(exception, TimeLimitExceeded)
        release_for_ended_child(sender, task_id, args, kwargs, type(exception).__name__, doomed=doomed)


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
) -> None:
    if terminated and request is not None:
        release_for_ended_child(
            sender, getattr(request, "id", ""), getattr(request, "args", None),
            getattr(request, "kwargs", None), "revoked", doomed=True,
        )


celery_signals.task_failure.connect(_on_task_failure, weak=False)
celery_signals.task_revoked.connect(_on_task_revoked, weak=False)
