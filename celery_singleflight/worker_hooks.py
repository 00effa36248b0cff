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
from .worker_setup import worker_sends_task_events

__all__ = ["release_for_ended_child"]

log = logging.getLogger("celery_singleflight.release")


def release_for_ended_child(
    task: Any, task_id: str, args: Any, kwargs: Any, reason: str, *, doomed: bool,
    error: BaseException | None = None,
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
        host = socket.gethostname()
        slot, record = 0, {}
        for slot in range(task.options.max_concurrency):
            record = store.holder_record(key, slot)
            if record.get("task_id") == task_id and record.get("host") == host:
                break
        else:
            if reason == "revoked":
                # the child released on SIGTERM and could only say "terminated"
                store.revise_outcome(key, task_id, "terminated", "revoked")
            return False
        pid = int(record.get("pid", "0") or 0)
        if pid == os.getpid() or (not doomed and process_alive(pid)):
            return False  # the run itself is alive (threads/solo pool) and releases on its own
        released = store.release(key, record["token"], reason, task.options.ttl, slot=slot,
                                 clear_marker=task.options.dedup_enqueue, task_id=task_id,
                                 slots=task.options.max_concurrency)
        if released.handoff is not None:
            from .queueing import send_parked

            send_parked(task.app, released.handoff, key)
        if released.joined:
            from .errors import LeaseLost
            from .joining import answer_joined

            answer_joined(task.app, released.joined, key, task_id,
                          error=error or LeaseLost(key, f"the run it joined ended: {reason}"))
    except (redis.RedisError, TypeError, ValueError) as exc:
        log.warning("could not release the key of %s[%s] after %s: %s", task.name, task_id, reason, exc)
        return False
    if released:
        log.warning(
            "released key=%r of %s[%s]: its pool process %s ended without releasing (%s)",
            key, task.name, task_id, pid, reason,
        )
        signals.lease_released.send(sender=task.name, lease=None, reason=reason)
    return released.ours


def _on_task_failure(
    sender: Any = None, task_id: str = "", exception: BaseException | None = None,
    args: Any = None, kwargs: Any = None, **_: Any,
) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        doomed = isinstance(exception, TimeLimitExceeded)
        reason = "time-limit" if doomed else "worker-lost"
        release_for_ended_child(sender, task_id, args, kwargs, reason, doomed=doomed, error=exception)


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None, **_: Any
) -> None:
    if terminated and request is not None:
        release_for_ended_child(
            sender, getattr(request, "id", ""), getattr(request, "args", None),
            getattr(request, "kwargs", None), "revoked", doomed=True,
        )
        _announce_revoked_state(sender, request, signum)


def _announce_revoked_state(task: Any, request: Any, signum: Any) -> None:
    """Make Flower show REVOKED for a run that reported progress.

    Celery's event state ranks an unknown state such as PROGRESS above REVOKED, so its own
    ``task-revoked`` event only merges fields into a task that is PROGRESS. Fields of an event
    are applied as they are, so the same event with an explicit ``state`` sets it.
    """
    from .task import SingleFlightTask

    if not isinstance(task, SingleFlightTask) or not worker_sends_task_events():
        return
    try:
        with task.app.events.default_dispatcher(hostname=getattr(request, "hostname", None)) as d:
            d.send("task-revoked", uuid=request.id, terminated=True, signum=signum, expired=False,
                   state="REVOKED")
    except Exception as exc:  # noqa: BLE001 - an event must never break the worker
        log.debug("could not send the REVOKED state event for %s: %s", request.id, exc)


celery_signals.task_failure.connect(_on_task_failure, weak=False)
celery_signals.task_revoked.connect(_on_task_revoked, weak=False)
