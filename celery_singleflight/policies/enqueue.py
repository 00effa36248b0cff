"""Enqueue-time dedup (``dedup_enqueue=True``): a duplicate send returns the queued or running
task's ``AsyncResult`` instead of sending a second message.

One Redis call marks the key with the new task id, or answers the id already marked; the
publish follows. The marker is removed if the publish fails, when a run of that task id ends
(its release, atomically) and when the run is turned away as a duplicate; a marker whose run is
over without removing it (its worker died) no longer counts. A lost reply is harmless: marking
again with the same id answers "send it". Sends that carry a ``task_id`` (retries, re-sent runs)
are never deduplicated.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis

from ..config.option import Option, OptionGroup, flag, seconds
from ..protocol.store import LeaseStore
from ..run.stage import Send, Stage

__all__ = ["EnqueueDedup", "EnqueueOptions", "send_once"]

log = logging.getLogger("celery_singleflight.duplicate")


class EnqueueOptions(OptionGroup):
    """Enqueue-time dedup."""

    __slots__ = ()
    title = "Enqueue-time dedup"

    dedup_enqueue = Option[bool](
        task="dedup_enqueue", default=False, check=flag(),
        meaning="`delay()` / `apply_async()` of a task whose key is already queued or running returns that"
        " task's `AsyncResult` instead of sending again ([flow control](flow.md#enqueue-time-dedup)). Sends"
        " by name (`send_task`, beat) or with their own `task_id` are not deduplicated; the lease still"
        " covers them.",
        values="`True` or `False`.",
    )
    dedup_ttl = Option[float](
        task="dedup_ttl", default=3600.0, check=seconds(),
        meaning="The expiry of an enqueue marker, for a message lost in the broker; the marker normally goes"
        " when its run ends.",
        values="Seconds, above zero.",
    )


def send_once(
    task: Any, store: LeaseStore, key: str, ttl: float, slots: int, send: Callable[[str | None], Any],
    task_id: str | None = None,
) -> Any:
    """Send through ``send(task_id)`` unless ``key`` is already queued or running; then return
    that task's ``AsyncResult`` (nothing is sent). Never blocks on the key.

    ``task_id``: the caller's own id (``apply_async(task_id=...)``, a canvas send), marked instead
    of a new one. A key already marked with that very id is a send of that task already made: it
    is not sent again."""
    new_id = task_id or str(uuid.uuid4())
    try:
        if task_id is not None and store.marks.enqueued(key)[0] == task_id:
            log.info("%s[%s] for key=%r is already queued or running: not sent again", task.name, task_id,
                     key)
            return task.AsyncResult(task_id)
        existing = store.marks.mark_enqueued(key, new_id, ttl, slots)
    except redis.RedisError as exc:
        log.warning("enqueue dedup unavailable for key=%r (sending anyway; the lease still guards the run):"
                    " %s", key, exc)
        return send(task_id)
    if existing is not None:
        log.info("%s for key=%r is already queued or running as %s: not sent again", task.name, key, existing)
        return task.AsyncResult(existing)
    try:
        return send(new_id)
    except BaseException:
        with contextlib.suppress(redis.RedisError):
            store.marks.clear_enqueued(key, new_id)  # the publish failed: leave no marker behind
        raise


class EnqueueDedup(Stage):
    """The stage of a ``dedup_enqueue=True`` task: its runs' releases clear their marker."""

    options = EnqueueOptions
    clears_marker = True

    def __init__(self, ttl: float, slots: int) -> None:
        self.ttl, self.slots = ttl, slots

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls(opts.dedup_ttl, opts.max_concurrency) if opts.dedup_enqueue else None

    def send(self, call: Send, proceed: Callable[[Send], Any]) -> Any:
        if call.task_id is not None or call.eager:
            return proceed(call)

        def send(new_id: str | None) -> Any:
            call.task_id = new_id
            return proceed(call)

        return send_once(call.task, call.task.store, call.key, self.ttl, self.slots, send)
