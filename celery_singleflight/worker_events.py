"""Whether this worker sends task events (``celery worker -E`` or ``worker_send_task_events``).

``-E`` is not written to ``app.conf``; the worker object knows it. It is read in the main process
when the worker is set up, before the pool forks, so pool children inherit the answer.
"""

from __future__ import annotations

from typing import Any

from celery import signals as celery_signals

__all__ = ["worker_sends_task_events"]

_task_events: bool | None = None


def worker_sends_task_events() -> bool:
    """True when the worker running this code sends task events (False outside a worker)."""
    return bool(_task_events)


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    global _task_events
    _task_events = bool(getattr(instance, "task_events", False))


celery_signals.celeryd_after_setup.connect(_on_worker_setup, weak=False)
