"""``QueueOnce`` for code written against celery-once: change the import, keep the tasks.

::

    from celery_singleflight.compat import AlreadyQueued, QueueOnce   # was: from celery_once import ...

    @app.task(base=QueueOnce, once={"keys": ["account_id"], "graceful": False, "timeout": 3600})
    def sync_account(account_id, full=False):
        ...

    try:
        sync_account.delay(42)
    except AlreadyQueued as exc:      # a run of account 42 is already queued or running
        print(exc.holder, exc.countdown)

The ``once`` options map onto this library's (docs/migrating.md says what changes):

- ``keys``: the lock key is ``<@task>:<name>:...`` over those parameters, bound with the task's
  signature (``f(1)`` and ``f(a=1)`` are one key); ``[]`` one key per task; absent, every parameter.
- ``graceful``: ``False`` (default) raises :class:`AlreadyQueued` from ``delay()`` /
  ``apply_async()`` of a duplicate; ``True`` returns the queued or running task's ``AsyncResult``
  (celery-once returned an empty result in state ``REJECTED``). A duplicate found when it runs
  (a send by name, beat) fails with ``LockHeld`` (``graceful=False``) or is skipped (``True``).
- ``timeout``: how long the "already queued" marker may outlive a message lost in the broker
  (``dedup_ttl``); default ``singleflight_dedup_ttl``, one hour, as celery-once's. The running task
  holds a heartbeat-renewed lease (``lock_ttl``, 30 s) instead, so a crashed worker frees the key
  in seconds, not after the timeout.
- ``unlock_before_run`` is refused: every run here holds its key while it runs.

``apply_async(..., once={"graceful": ..., "timeout": ...})`` overrides them per call, as in
celery-once. celery-once's ``ONCE`` setting is not read: leases live in ``singleflight_redis_url``
(else the broker's or result backend's Redis).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, ClassVar

import redis
from celery import Task

from .config.option import Resolving, seconds
from .errors import ConfigurationError, LockHeld
from .policies.enqueue import send_once
from .task import SingleFlightTask

__all__ = ["AlreadyQueued", "QueueOnce"]

_ONCE_OPTIONS = ("keys", "graceful", "timeout", "unlock_before_run")


class AlreadyQueued(LockHeld):
    """``delay()`` / ``apply_async()`` of a duplicate, with ``graceful=False``: a task of the same
    key is queued or running as ``holder``. Also a :class:`~.errors.LockHeld`."""

    @property
    def countdown(self) -> float | None:
        """celery-once's name: the seconds the running holder's lease has left (it is renewed
        while the holder runs, so this is not when it will finish); None while it is queued."""
        return self.ttl_left


def _once_of(cls: type, once: Any) -> dict[str, Any]:
    name = cls.__dict__.get("name") or cls.__name__
    if not isinstance(once, Mapping):
        raise ConfigurationError(f"task {name}: once= must be a dict like celery-once's, not {once!r}")
    unknown = sorted(set(once) - set(_ONCE_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"task {name}: once= has {', '.join(map(repr, unknown))};"
            f" QueueOnce knows {', '.join(_ONCE_OPTIONS)}"
        )
    if once.get("unlock_before_run"):
        raise ConfigurationError(
            f"task {name}: once={{'unlock_before_run': True}} is not supported: here every run holds its"
            " key while it runs. Drop it to keep one run per key, or use a plain Task with"
            " SingleFlightTask's dedup_enqueue if only queued duplicates should be refused"
        )
    return dict(once)


def _parameters(cls: type) -> list[str]:
    """The task's parameters as callers pass them (without ``self`` for ``bind=True`` tasks)."""
    run = cls.__dict__.get("run")
    if isinstance(run, staticmethod):
        params = list(inspect.signature(run.__func__).parameters.values())
    elif run is not None:
        params = list(inspect.signature(run).parameters.values())[1:]
    else:
        return []
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
             inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in plain]


class QueueOnce(SingleFlightTask):
    """celery-once's ``QueueOnce`` on this library's leases (see the module docstring)."""

    once: ClassVar[dict[str, Any]] = {"graceful": False}
    _sf_own_options: ClassVar[tuple[str, ...]] = ("once",)  # not a misspelling of ours
    dedup_enqueue: ClassVar[bool | None] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        once = _once_of(cls, cls.__dict__.get("once", cls.once))
        if cls.__dict__.get("run") is not None and "lock_key" not in cls.__dict__:
            keys = once.get("keys")
            names = _parameters(cls) if keys is None else list(keys)
            cls.lock_key = ":".join(["<@task>", *(f"<{name}>" for name in names)])
        if "on_duplicate" not in cls.__dict__:
            cls.on_duplicate = "skip" if once.get("graceful") else "raise"
        if once.get("timeout") is not None and "dedup_ttl" not in cls.__dict__:
            cls.dedup_ttl = once["timeout"]
        super().__init_subclass__(**kwargs)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, once: Mapping[str, Any] | None = None, **options: Any) -> Any:
        """Send the task unless one of its key is queued or running: then raise
        :class:`AlreadyQueued`, or with ``graceful`` return that task's ``AsyncResult``."""
        call = {**type(self).once, **_once_of(type(self), once or {})}
        key = self.render_key(*(args or ()), **(kwargs or {}))
        if task_id is not None or options.get("retries") or self.app.conf.task_always_eager:
            return Task.apply_async(self, args, kwargs, task_id, *rest, **options)
        opts = self.options
        ttl = opts.dedup_ttl if call.get("timeout") is None else seconds()(
            f"task {self.name}: apply_async(once={{'timeout': ...}})", call["timeout"],
            Resolving(self, self.name, {}),
        )
        sent: list[str | None] = []

        def send(new_id: str | None) -> Any:
            sent.append(new_id)
            return Task.apply_async(self, args, kwargs, new_id, *rest, **options)

        result = send_once(self, self.store, key, ttl, opts.max_concurrency, send)
        if sent or call.get("graceful"):
            return result
        try:
            left = self.store.time_left(key)
        except redis.RedisError:
            left = None
        raise AlreadyQueued(key, result.id, left)
