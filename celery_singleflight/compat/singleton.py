"""``Singleton`` for code written against celery-singleton: change the import, keep the tasks.

::

    from celery_singleflight.compat.singleton import DuplicateTaskError, Singleton, clear_locks

    @app.task(base=Singleton, unique_on=["account_id"], lock_expiry=600)
    def sync_account(account_id, full=False):
        ...

    first = sync_account.delay(42)
    assert sync_account.delay(42, full=True).id == first.id   # the queued or running one

A duplicate send returns the queued or running task's ``AsyncResult``, or with
``raise_on_duplicate`` raises :class:`DuplicateTaskError` carrying its ``task_id``. The key is
the task name and the ``unique_on`` parameters (absent or empty: every parameter, ``*args`` and
``**kwargs`` included), bound with the signature. ``lock_expiry`` is how long the send's marker
may outlive a lost message; the running task holds a heartbeat-renewed lease. Settings:
``singleton_backend_url`` (the leases' Redis unless ``singleflight_redis_url`` is set),
``singleton_raise_on_duplicate``, ``singleton_lock_expiry``; ``singleton_key_prefix``, a backend
class other than celery-singleton's Redis one, backend kwargs, a JSON encoder class and an
``on_duplicate`` hook are refused; its lock methods raise :class:`~.shared.NotSupported`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ..errors import ConfigurationError, LockHeld, SingleFlightError
from ..ops.keystatus import glob_escape
from ..protocol.marks import ENQUEUED
from ..task import SingleFlightTask
from .shared import ArgumentsKey, NotSupported, adopt_redis_url, call_signature, default, send_checked

__all__ = ["CelerySingletonException", "DuplicateTaskError", "Singleton", "clear_locks"]

#: celery-singleton's Redis backend, by each name it could be given
_DEFAULT_BACKENDS = ("celery_singleton.backends.redis.RedisBackend", "celery_singleton.backends.RedisBackend",
                     "celery_singleton.backend.RedisBackend")
#: celery-singleton's names that are not offered, and what to use instead
_NOT_OFFERED = {
    "generate_lock": "use task.render_key(*args, **kwargs) for the key of a call",
    "get_existing_task_id": "use task.status(*args, **kwargs).task_id for the run holding a call's key",
    "release_lock": "use clear_locks(app) to forget queued markers, or"
                    " force_release(app, task.render_key(...), by=...) to free a key",
    "unlock": "use force_release(app, key, by=...) to free a key, or clear_locks(app) for queued markers",
    "aquire_lock": "the key is marked by delay()/apply_async() and leased when the task runs",
    "lock_and_run": "the key is marked by delay()/apply_async() and leased when the task runs",
    "singleton_backend": "leases live in celery_singleflight's Redis store; use task.status(...),"
                         " force_release(app, key, by=...) or clear_locks(app)",
    "singleton_config": "settings are read from app.conf when the task is bound (docs/migrating.md)",
}


class CelerySingletonException(SingleFlightError):
    """celery-singleton's base error; here the base of :class:`DuplicateTaskError`."""


class DuplicateTaskError(LockHeld, CelerySingletonException):
    """A duplicate send with ``raise_on_duplicate``: ``task_id`` is the queued or running task
    (also ``holder``, as a :class:`~..errors.LockHeld`)."""

    def __init__(self, message: str, task_id: str, key: str = "") -> None:
        SingleFlightError.__init__(self, message, task_id, key)
        self.message, self.task_id = message, task_id
        self.key, self.holder, self.ttl_left = key, task_id, None

    def __str__(self) -> str:
        return self.message


def _refuse_settings(app: Any) -> None:
    conf = app.conf
    if conf.get("singleton_key_prefix") is not None:
        raise ConfigurationError(
            "singleton_key_prefix is not read: keys live under singleflight_namespace (default 'sf');"
            " set that instead, or remove the setting"
        )
    backend = conf.get("singleton_backend_class")
    if backend is not None and backend not in _DEFAULT_BACKENDS:
        raise ConfigurationError(
            f"singleton_backend_class {backend!r} is not supported: leases live in Redis only;"
            " remove it (and singleton_backend_kwargs)"
        )
    if conf.get("singleton_backend_kwargs"):
        raise ConfigurationError(
            "singleton_backend_kwargs is not read: put connection options in singleflight_redis_url or"
            " singleflight_redis_transport_options"
        )
    if conf.get("singleton_json_encoder_class") is not None:
        raise ConfigurationError(
            "singleton_json_encoder_class is not read: a key renders arguments as canonical JSON and refuses"
            " what it cannot render; give the task a lock_key (a template or a callable) instead"
        )


class Singleton(SingleFlightTask):
    """celery-singleton's ``Singleton`` on this library's leases (see the module docstring)."""

    unique_on: ClassVar[list[str] | str | None] = None
    raise_on_duplicate: ClassVar[bool | None] = None
    lock_expiry: ClassVar[float | None] = None
    _sf_own_options: ClassVar[tuple[str, ...]] = ("unique_on", "raise_on_duplicate", "lock_expiry")
    _sf_raises: ClassVar[bool] = False
    dedup_enqueue: ClassVar[bool | None] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        if callable(cls.__dict__.get("on_duplicate")):
            raise ConfigurationError(
                f"task {name}: celery-singleton's on_duplicate(self, existing_task_id) hook is not called"
                " here (on_duplicate is the duplicate policy, 'skip' or 'raise'); use raise_on_duplicate and"
                " catch DuplicateTaskError, or compare the AsyncResult that delay() returns"
            )
        signature = call_signature(cls)
        if signature is not None and "lock_key" not in cls.__dict__:
            unique_on = cls.unique_on
            names = [unique_on] if isinstance(unique_on, str) else list(unique_on or ()) or None
            cls.lock_key = ArgumentsKey(name, signature, names, f"task {name}: unique_on")
        if cls.lock_expiry is not None:
            default(cls, "dedup_ttl", cls.lock_expiry)
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Read celery-singleton's settings (the task's own options win)."""
        if cls._sf_render is not None:
            _refuse_settings(app)
            adopt_redis_url(app, app.conf.get("singleton_backend_url"), "singleton_backend_url")
            raises = cls.raise_on_duplicate
            if raises is None:
                raises = bool(app.conf.get("singleton_raise_on_duplicate") or False)
            cls._sf_raises = bool(raises)
            # a duplicate that reaches a worker (sent by name, by beat) is refused like one at send
            default(cls, "on_duplicate", "raise" if raises else "skip")
            expiry = app.conf.get("singleton_lock_expiry")
            if cls.lock_expiry is None and expiry is not None:
                default(cls, "dedup_ttl", expiry)
        super().on_bound(app)

    def __getattr__(self, name: str) -> Any:
        """celery-singleton's names that are not offered raise :class:`~.shared.NotSupported`
        (an ``AttributeError``) saying what to use instead."""
        if name in _NOT_OFFERED:
            raise NotSupported(f"Singleton.{name} is not offered here: {_NOT_OFFERED[name]}")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, **options: Any) -> Any:
        """Send the task unless one of its key is queued or running (eager too): then return
        that task's ``AsyncResult``, or with ``raise_on_duplicate`` raise :class:`DuplicateTaskError`."""
        if type(self)._sf_render is None:
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        result, sent, key = send_checked(self, args, kwargs, task_id, rest, options, self.options.dedup_ttl)
        if sent or not type(self)._sf_raises:
            return result
        raise DuplicateTaskError(f"Attempted to queue a duplicate of task ID {result.id}", result.id, key)


def clear_locks(app: Any) -> int:
    """Forget the send markers of every ``Singleton`` task of ``app`` (after a ``celery purge``,
    say), so their next send goes out; returns how many were cleared. Running tasks keep their
    leases: a lease ends with its run, or within ``lock_ttl`` of a crash."""
    cleared = 0
    tasks = [task for task in app.tasks.values() if isinstance(task, Singleton) and type(task)._sf_render]
    stores = {id(task.store): task.store for task in tasks}
    names = {task.name for task in tasks}
    for store in stores.values():
        layout = store.layout
        pattern = f"{glob_escape(layout.namespace)}:{{*}}:{ENQUEUED.name}"
        for redis_key in store.reads.scan(pattern, 500):
            key = layout.user_key(redis_key)
            if key is None or key.partition(":")[0] not in names:
                continue
            holder, _ = store.marks.enqueued(key)
            if holder is not None and store.marks.clear_enqueued(key, holder):
                cleared += 1
    return cleared
