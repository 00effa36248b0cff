"""Who owns a waiting run: a worker, as the namespace's live-workers index knows it.

A copy of a delayed run that a worker noted holding, or that a run of a worker claimed, waits
for that worker: a sweeper sends it again once the worker is gone (:mod:`..protocol.delayed`).
A worker is known by its node name and the id of this life of its main process
(:data:`INSTANCE`, drawn when this module is first imported: in the worker's main process,
before its pool forks, so its pool processes share it). A worker started again under the same
name is another worker: what its earlier life held counts as gone.
"""

from __future__ import annotations

import uuid
from typing import Any

__all__ = ["INSTANCE", "worker_instance"]

#: this worker's own id (the main process's, shared by the processes it forks)
INSTANCE = uuid.uuid4().hex[:12]


def worker_instance(node: Any) -> str:
    """How the worker ``node`` (Celery's hostname) of this process is known in the live-workers
    index: its node name and :data:`INSTANCE`."""
    return f"{node or ''}#{INSTANCE}"
