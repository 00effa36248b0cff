"""The idempotency window: a finished run remembered by its idempotency key for a set time.

``idempotency_key="msg:<tenant_id>:<message_id>"``: a successful run stores ``{task_id, result}``
under the rendered key for ``idempotency_ttl`` seconds; a later run of the same message returns
that result without running. It is checked before the lease (cheap, no lease taken) and again
under it (a duplicate that waited for the key finds the run that finished meanwhile). A parked
run handed the key checks only under the lease: it must adopt the slot reserved for it (and hand
it on).
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from kombu.utils.json import dumps, loads

from .. import signals
from ..config.option import Option, OptionGroup, anything, seconds
from ..keys import KeyFunction, compile_key
from ..protocol.store import LeaseStore
from ..run.stage import Ended, Run, Stage

__all__ = ["NOTHING", "Idempotency", "IdempotencyOptions", "remember", "remembered"]

log = logging.getLogger("celery_singleflight.duplicate")

#: no remembered result for an idempotency key
NOTHING: Any = object()


class IdempotencyOptions(OptionGroup):
    """The idempotency window."""

    __slots__ = ()
    title = "Idempotency"

    idempotency_key = Option[Any](
        setting=False, task="idempotency_key", check=anything, default_text="none",
        meaning="The key under which a successful run is remembered for `idempotency_ttl`"
        " ([idempotency](idempotency.md)); independent of `lock_key`.",
        values="A template or callable, as `lock_key`.",
    )
    idempotency_ttl = Option[float](
        task="idempotency_ttl", default=3600.0, check=seconds(),
        meaning="How long a successful run is remembered: a later run with the same idempotency key returns"
        " its result without running ([idempotency](idempotency.md)).",
        values="Seconds, above zero.",
    )


def remembered(store: LeaseStore, idem_key: str, task_name: str, task_id: str | None) -> Any:
    """The remembered result of the run that finished ``idem_key`` within the window, else
    :data:`NOTHING` (also when Redis cannot say: the lease still guards the run)."""
    try:
        raw = store.marks.remembered(idem_key)
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
        store.marks.remember(idem_key, record, ttl)
    except redis.RedisError as exc:
        log.warning("could not remember idempotency key %r: %s", idem_key, exc)


class Idempotency(Stage):
    """The stage of a task with an ``idempotency_key``."""

    options = IdempotencyOptions

    def __init__(self, render: KeyFunction, ttl: float) -> None:
        self.render, self.ttl = render, ttl

    @classmethod
    def define(cls, task_cls: type, signature: Any, name: str) -> KeyFunction | None:
        spec = task_cls.__dict__.get("idempotency_key") or getattr(task_cls, "idempotency_key", None)
        return None if spec is None else compile_key(spec, signature, name)

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return None if defined is None else cls(defined, opts.idempotency_ttl)

    def _remembered(self, run: Run) -> Any:
        key = run.notes.get(Idempotency)
        if key is None:
            key = run.notes[Idempotency] = self.render(run.args, run.kwargs)
        return remembered(run.task.store, key, run.task.name, run.request.id)

    def before_lease(self, run: Run) -> Ended | None:
        if run.handoff:
            return None
        found = self._remembered(run)
        return None if found is NOTHING else Ended(found)

    def on_start(self, run: Run) -> Ended | None:
        found = self._remembered(run)
        return None if found is NOTHING else Ended(found)

    def after_body(self, run: Run, result: Any) -> None:
        remember(run.task.store, run.notes[Idempotency], run.task.name, run.request.id, result, self.ttl)
