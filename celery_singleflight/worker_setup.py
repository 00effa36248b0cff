"""What the library learns and checks when a worker starts (in its main process, before the fork).

- Whether the worker sends task events (``celery worker -E`` or ``worker_send_task_events``): ``-E``
  is not written to ``app.conf``, the worker object knows it; pool children inherit the answer.
- Checks that need the worker's app as a whole (``join`` needs a result backend): a failure stops
  the worker with one clear sentence.
- The checks against each lease Redis and the broker settings (:mod:`.preflight`): reachable,
  permitted, a primary, keys not evictable, clock, TTL, visibility timeout. Findings are logged;
  a refusal (a replica, an ACL that refuses a command every run needs) stops the worker.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals as celery_signals

from .preflight import run_at_worker_start

__all__ = ["check_worker_app", "worker_sends_task_events"]

_task_events: bool | None = None


def worker_sends_task_events() -> bool:
    """True when the worker running this code sends task events (False outside a worker)."""
    return bool(_task_events)


def check_worker_app(app: Any) -> None:
    """Checks that need the worker's app as a whole; raises ConfigurationError.

    ``join`` needs a result backend. Tasks are shared between apps by default, so this is checked
    for the app the worker runs, not when a task is bound to any app.
    """
    from celery.backends.base import DisabledBackend

    from .errors import ConfigurationError
    from .task import guarded_tasks

    joins = [task.name for task in guarded_tasks(app) if task.options.on_duplicate == "join"]
    if joins and isinstance(app.backend, DisabledBackend):
        raise ConfigurationError(
            f"on_duplicate='join' hands the holder's result to its duplicates, so tasks {', '.join(joins)}"
            " need a result backend: set result_backend (for example to your Redis)"
        )


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    global _task_events
    _task_events = bool(getattr(instance, "task_events", False))
    app = getattr(instance, "app", None)
    if app is not None:
        from .errors import ConfigurationError

        try:
            check_worker_app(app)
            run_at_worker_start(app, instance)  # raises only for a refusal (ConfigurationError)
        except ConfigurationError as exc:
            logging.getLogger("celery_singleflight").critical("%s", exc)
            raise SystemExit(f"celery_singleflight: {exc}") from exc  # signal receivers' errors are swallowed


celery_signals.celeryd_after_setup.connect(_on_worker_setup, weak=False)
