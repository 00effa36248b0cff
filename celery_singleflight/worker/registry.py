"""Which tasks of an app are guarded, known without importing the task class.

A ``SingleFlightTask`` subclass that is a task (not an intermediate base class) compiles its
``lock_key`` when it is defined and carries the marker :data:`MARK`. The worker wiring, the
start checks and the CLI find guarded tasks by it, so none of them imports :mod:`..task`.
"""

from __future__ import annotations

from typing import Any

from ..config.options import app_options
from ..policies.fair import FairShare

__all__ = ["MARK", "guarded_tasks", "is_guarded", "known_slots", "slots_of"]

#: the class attribute holding a guarded task's compiled lock key (None on base classes)
MARK = "_sf_render"


def is_guarded(task: Any) -> bool:
    """True for a registered task whose class is a ``SingleFlightTask`` with a lock key."""
    return getattr(type(task), MARK, None) is not None


def guarded_tasks(app: Any) -> list[Any]:
    """The app's guarded tasks, by name."""
    return [task for _, task in sorted(app.tasks.items()) if is_guarded(task)]


def known_slots(app: Any) -> int:
    """The most slots a key of ``app`` can have: the largest ``max_concurrency`` of its setting
    and of its guarded tasks, and ``fair_concurrency`` of their gates (what force-release and the
    CLI assume)."""
    most = int(app_options(app).max_concurrency)
    for task in guarded_tasks(app):
        try:
            most = max(most, int(task.options.max_concurrency), int(task.options.fair_concurrency or 1))
        except ValueError:  # a task with a bad option: not ours to report here
            continue
    return most


def slots_of(app: Any, key: str) -> int:
    """The slots of ``key``: a fair task's gate has ``fair_concurrency``, any other key the
    most a key of the app can have."""
    for task in guarded_tasks(app):
        stage = task.pipeline.stage(FairShare)
        if isinstance(stage, FairShare) and stage.gate == key:
            return int(stage.opts.fair_concurrency)
    return known_slots(app)
