"""Celery task events sent by the library (``task-progress``, the answers of joined runs, the
REVOKED state for Flower), and whether this worker sends task events at all.

Whether a worker sends task events (``celery worker -E`` or ``worker_send_task_events``) is known
to the worker object, not to ``app.conf``; the worker wiring records it at start in the main
process, and pool children inherit it.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["send_task_event", "set_worker_sends_task_events", "worker_sends_task_events"]

log = logging.getLogger("celery_singleflight")
_task_events = [False]


def worker_sends_task_events() -> bool:
    """True when the worker running this code sends task events (False outside a worker)."""
    return _task_events[0]


def set_worker_sends_task_events(value: bool) -> None:
    _task_events[0] = bool(value)


def send_task_event(
    app: Any, type_: str, hostname: str | None = None, *, enabled: bool | None = None, **fields: Any
) -> None:
    """Send one task event if this worker sends them (``enabled`` overrides that, as a task's
    ``progress_events`` option does); an event never breaks the caller."""
    if not (worker_sends_task_events() if enabled is None else enabled):
        return
    try:
        with app.events.default_dispatcher(hostname=hostname) as dispatcher:
            dispatcher.send(type_, **fields)
    except Exception as exc:  # noqa: BLE001 - an event must never break a run or a release
        log.debug("could not send %s for %s: %s", type_, fields.get("uuid"), exc)
