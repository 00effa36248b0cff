"""What a task's progress write adds for Celery: ``PROGRESS`` meta in the result backend (what
``AsyncResult.info`` and celery-progress bars read: current, total, percent, description) and a
``task-progress`` event for Flower."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..states import PROGRESS
from .events import send_task_event, worker_sends_task_events
from .lease import Lease
from .progress import result_meta

__all__ = ["progress_hook"]


def progress_hook(task: Any) -> Callable[[Lease, dict[str, Any]], None]:
    """The hook of the current run of ``task``, with what it needs captured now: the write may
    run on the heartbeat thread."""
    request = task.request
    task_id, hostname = request.id, request.hostname
    opts = task.options
    store_meta = bool(task_id) and not (request.ignore_result or task.ignore_result)
    send_event = bool(task_id) and (
        worker_sends_task_events() if opts.progress_events is None else bool(opts.progress_events)
    )
    app, backend = task.app, task.backend

    def hook(lease: Lease, data: dict[str, Any]) -> None:
        meta = result_meta(data, lease.key, lease.fence)
        if store_meta:
            backend.store_result(task_id, meta, PROGRESS)
        if send_event:
            send_task_event(app, "task-progress", hostname, enabled=True, uuid=task_id, progress=meta)

    return hook
