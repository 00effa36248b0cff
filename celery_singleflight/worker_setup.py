"""What the library learns and checks when a worker starts (in its main process, before the fork).

- Whether the worker sends task events (``celery worker -E`` or ``worker_send_task_events``): ``-E``
  is not written to ``app.conf``, the worker object knows it; pool children inherit the answer.
- Checks that need the worker's app as a whole (``join`` needs a result backend): a failure stops
  the worker with one clear sentence.
- A warning when the lease Redis could evict lease keys under memory pressure.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import signals as celery_signals

__all__ = ["check_worker_app", "warn_if_leases_evictable", "worker_sends_task_events"]

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
    from .task import SingleFlightTask

    joins = sorted(
        name for name, task in list(app.tasks.items())
        if isinstance(task, SingleFlightTask) and type(task)._sf_render is not None
        and task.options.on_duplicate == "join"
    )
    if joins and isinstance(app.backend, DisabledBackend):
        raise ConfigurationError(
            f"on_duplicate='join' hands the holder's result to its duplicates, so tasks {', '.join(joins)}"
            " need a result backend: set result_backend (for example to your Redis)"
        )


def warn_if_leases_evictable(app: Any) -> list[str]:
    """Warn (and return the warnings) for each lease Redis that may evict keys.

    Leases carry TTLs, so ``volatile-*`` policies evict them too: only ``noeviction`` (or no
    ``maxmemory``) keeps a held lease from vanishing under memory pressure, which would let a
    second run take a key that is still held.
    """
    from .task import SingleFlightTask, _options_store

    log = logging.getLogger("celery_singleflight")
    warnings: list[str] = []
    seen: set[int] = set()
    for task in list(app.tasks.values()):
        if not isinstance(task, SingleFlightTask) or type(task)._sf_render is None:
            continue
        store = _options_store(task.options)
        if id(store.client) in seen:
            continue
        seen.add(id(store.client))
        try:
            conf = store.client.config_get("maxmemory*")
        except Exception as exc:  # noqa: BLE001 - CONFIG may be refused (ACL, managed Redis): skip
            log.debug("could not read the lease Redis's maxmemory settings: %s", exc)
            continue
        limit = int(conf.get("maxmemory", 0) or 0)
        policy = str(conf.get("maxmemory-policy", "noeviction"))
        if limit > 0 and policy != "noeviction":
            message = (
                f"the lease Redis has maxmemory={limit} with maxmemory-policy={policy}: under memory"
                " pressure it may evict lease keys (they carry TTLs), letting a second run take a held"
                " key; use maxmemory-policy noeviction for the singleflight Redis"
            )
            log.warning("%s", message)
            warnings.append(message)
    return warnings


def _on_worker_setup(sender: Any = None, instance: Any = None, **_: Any) -> None:
    global _task_events
    _task_events = bool(getattr(instance, "task_events", False))
    app = getattr(instance, "app", None)
    if app is not None:
        from .errors import ConfigurationError

        try:
            check_worker_app(app)
        except ConfigurationError as exc:
            logging.getLogger("celery_singleflight").critical("%s", exc)
            raise SystemExit(f"celery_singleflight: {exc}") from exc  # signal receivers' errors are swallowed
        try:
            warn_if_leases_evictable(app)
        except Exception as exc:  # noqa: BLE001 - a check must never keep a worker from starting
            logging.getLogger("celery_singleflight").debug("eviction check failed: %s", exc)


celery_signals.celeryd_after_setup.connect(_on_worker_setup, weak=False)
