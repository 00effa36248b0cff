"""Ending a run lost with its worker: its result becomes FAILURE with :class:`~..errors.RunLost`.

Two places find such runs: the sweeper's look at a run that waited before it started
(:mod:`..policies.lostruns`), and every script that takes, hands on or reserves a slot whose
lease ran out unreleased on a key runs waited on: it names that holder in its reply (ACQUIRE,
RESUME, FAIR_ENTER), and :func:`~.settle.settle` ends it, whichever path called the script (a
holder nobody waited on may only have frozen: its own end stands). A run whose worker merely froze
past its TTL and later finishes overwrites that FAILURE with its own result.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import states as celery_states
from celery.backends.base import DisabledBackend

from ..errors import RunLost

__all__ = ["end_dead_holder", "end_lost_run", "watched"]

log = logging.getLogger("celery_singleflight.release")


def watched(task: Any) -> bool:
    """A lost run of ``task`` would keep its state: its results are stored, and its message is
    acknowledged when it starts (with ``acks_late`` the broker delivers it again)."""
    return not (task.ignore_result or task.acks_late or isinstance(task.backend, DisabledBackend))


def end_lost_run(app: Any, key: str, task_id: str, worker: str) -> bool:
    """End the lost run ``task_id`` as FAILURE with :class:`RunLost`, unless its result is ready;
    False if the result backend could not be reached (the caller tries again later)."""
    try:
        if app.AsyncResult(task_id).state in celery_states.READY_STATES:
            return True
        app.backend.store_result(task_id, RunLost(key, task_id, worker), celery_states.FAILURE)
    except Exception as exc:  # noqa: BLE001 - any backend's error: try again at the next sweep
        log.warning("could not end lost run %s on key=%r: %s", task_id, key, exc)
        return False
    log.warning("run lost: %s on key=%r with worker %s; its lease ran out unreleased, its result is"
                " now FAILURE (RunLost)", task_id, key, worker)
    return True


def end_dead_holder(app: Any, key: str, task_id: str, worker: str, task_name: str) -> None:
    """End the run of a holder that died (not a ``hold()``, nor a task whose message comes again
    or that keeps no result)."""
    task = app.tasks.get(task_name)
    if task is not None and getattr(task, "options", None) is not None and watched(task):
        end_lost_run(app, key, task_id, worker)
