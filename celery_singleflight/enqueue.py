"""Enqueue-time dedup (``dedup_enqueue=True``): a duplicate send returns the queued or running
task's ``AsyncResult`` instead of sending a second message.

One Redis call marks the key with the new task id, or answers the id already marked; the
publish follows. The marker is removed if the publish fails, when a run of that task id ends
(its release, atomically) and when the run is turned away as a duplicate; a marker whose run is
over without removing it (its worker died) no longer counts. A lost reply is harmless: marking
again with the same id answers "send it".
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis

from .store import LeaseStore

__all__ = ["send_once"]

log = logging.getLogger("celery_singleflight.duplicate")


def send_once(
    task: Any, store: LeaseStore, key: str, ttl: float, slots: int, send: Callable[[str | None], Any]
) -> Any:
    """Send through ``send(task_id)`` unless ``key`` is already queued or running; then return
    that task's ``AsyncResult`` (nothing is sent). Never blocks on the key."""
    new_id = str(uuid.uuid4())
    try:
        existing = store.mark_enqueued(key, new_id, ttl, slots)
    except redis.RedisError as exc:
        log.warning("enqueue dedup unavailable for key=%r (sending anyway; the lease still guards the run):"
                    " %s", key, exc)
        return send(None)
    if existing is not None:
        log.info("%s for key=%r is already queued or running as %s: not sent again", task.name, key, existing)
        return task.AsyncResult(existing)
    try:
        return send(new_id)
    except BaseException:
        with contextlib.suppress(redis.RedisError):
            store.clear_enqueued(key, new_id)  # the publish failed: leave no marker behind
        raise
