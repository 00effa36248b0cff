"""The idempotency window: a finished run remembered by its idempotency key for a set time.

``idempotency_key="msg:<tenant_id>:<message_id>"``: a successful run stores ``{task_id, result}``
under the rendered key for ``idempotency_ttl`` seconds; a later run of the same message returns
that result without running. It is checked before the lease (cheap, no lease taken) and again
under it (a duplicate that waited for the key finds the run that finished meanwhile).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from kombu.utils.json import dumps, loads

from . import signals
from .store import LeaseStore

__all__ = ["NOTHING", "remember", "remembered"]

log = logging.getLogger("celery_singleflight.duplicate")

#: no remembered result for an idempotency key
NOTHING: Any = object()


def remembered(store: LeaseStore, idem_key: str, task_name: str, task_id: str | None) -> Any:
    """The remembered result of the run that finished ``idem_key`` within the window, else
    :data:`NOTHING` (also when Redis cannot say: the lease still guards the run)."""
    try:
        raw = store.remembered(idem_key)
    except redis.RedisError as exc:
        log.warning("could not read idempotency record %r: %s", idem_key, exc)
        return NOTHING
    if raw is None:
        return NOTHING
    record = loads(raw)  # type: ignore[no-untyped-call]
    log.info("%s[%s] is a repeat of %s (idempotency key %r): returning its result",
             task_name, task_id, record.get("task_id"), idem_key)
    signals.duplicate.send(sender=task_name, key=idem_key, task_id=task_id, holder=record.get("task_id"),
                           ttl_left=None, policy="idempotency", outcome="remembered",
                           detail="returned the remembered result")
    return record.get("result")


def remember(store: LeaseStore, idem_key: str, task_name: str, task_id: str | None, result: Any,
             ttl: float) -> None:
    """Remember a successful run's result under ``idem_key`` for ``ttl`` seconds."""
    try:
        record = dumps({"task_id": task_id, "result": result})  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        log.warning("result of %s[%s] is not JSON-serializable; idempotency key %r not remembered: %s",
                    task_name, task_id, idem_key, exc)
        return
    try:
        store.remember(idem_key, record, ttl)
    except redis.RedisError as exc:
        log.warning("could not remember idempotency key %r: %s", idem_key, exc)
