"""``QueueOnce`` for code written against celery-once: change the import, keep the tasks.

::

    from celery_singleflight.compat import AlreadyQueued, QueueOnce   # was: from celery_once import ...

    @app.task(base=QueueOnce, once={"keys": ["account_id"], "graceful": False, "timeout": 3600})
    def sync_account(account_id, full=False):
        ...

    try:
        sync_account.delay(42)
    except AlreadyQueued as exc:      # a run of account 42 is already queued or running
        result = sync_account.AsyncResult(exc.holder)    # follow that run instead

What each option and setting maps to is in docs/migrating.md. In short: ``keys`` chooses the
parameters of the key (absent: every parameter, ``*args`` and ``**kwargs`` included);
``graceful`` returns the queued or running task's ``AsyncResult`` instead of raising;
``timeout`` (or the ``ONCE`` setting's ``default_timeout``, else ``ONCE_DEFAULT_TIMEOUT``) is
how long the send's marker may outlive a lost message, while the running task holds a
heartbeat-renewed lease; the ``ONCE`` setting's ``url`` is where the leases live unless
``singleflight_redis_url`` says otherwise (``?ssl=true`` becomes ``rediss://``, as celery-once
turned TLS on). ``unlock_before_run``, a file backend, a blocking send and ``keys`` per call are
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..config.option import Resolving, seconds
from ..errors import ConfigurationError, LockHeld, SingleFlightError
from ..ops.status import StatusReader
from ..task import SingleFlightTask
from ..worker.registry import known_slots
from .shared import (
    ArgumentsKey,
    NotSupported,
    adopt_redis_url,
    call_signature,
    default,
    send_checked,
    time_left,
)

__all__ = ["AlreadyQueued", "OnceBackend", "QueueOnce"]

_ONCE_OPTIONS = ("keys", "graceful", "timeout", "unlock_before_run")
_BACKENDS = ("celery_once.backends.Redis", "celery_once.backends.redis.Redis")
_SETTINGS = ("url", "default_timeout", "blocking", "blocking_timeout")
#: celery-once's default marker lifetime (its ``default_timeout``)
_DEFAULT_TIMEOUT = 60 * 60


class AlreadyQueued(LockHeld):
    """``delay()`` / ``apply_async()`` of a duplicate, with ``graceful=False``: a task of the same
    key is queued or running as ``holder``. A :class:`~..errors.LockHeld`; ``countdown`` is a
    number of seconds, always (see :attr:`countdown`). celery-once's own constructor,
    ``AlreadyQueued(countdown)`` (in tests and mocks), is taken too."""

    def __init__(self, key: str | float = "", holder: str | None = None, ttl_left: float | None = None,
                 countdown: float | None = None) -> None:
        if isinstance(key, (int, float)) and not isinstance(key, bool):  # celery-once's AlreadyQueued(60)
            countdown = key if countdown is None else countdown
            key = ""
        SingleFlightError.__init__(self, key, holder, ttl_left, countdown)
        self.key, self.holder, self.ttl_left = str(key), holder, ttl_left
        #: celery-once's name: seconds until the key could be free at the earliest: the marker's
        #: time left while the holder is queued, its lease's (renewed while it runs) once it runs
        self.countdown: float = countdown if countdown is not None else (ttl_left or 0.0)

    @property
    def message(self) -> str:
        """celery-once's ``message``: the text of the error."""
        return str(self)

    def __str__(self) -> str:
        if not self.key:  # built as celery-once built it, from a countdown alone
            return f"Expires in {self.countdown} seconds"
        return (f"key {self.key!r} is already queued or running as task {self.holder or '<unknown>'};"
                f" expires in {self.countdown:.1f} seconds unless renewed")


class OnceBackend:
    """What ``task.once_backend`` is here: ``clear_lock(key)``; celery-once's other backend calls
    are refused (:class:`~.shared.NotSupported`) rather than half-done."""

    def __init__(self, task: Any) -> None:
        self._task = task

    def clear_lock(self, key: str) -> bool:
        """Free ``key`` (as ``get_key`` renders it): forget its send marker, so the next send goes
        out, and force-release its lease (recorded; the running holder learns its lease is lost).
        True if there was anything to free."""
        task = self._task
        store = task.store
        holder, _ = store.marks.enqueued(key)
        cleared = holder is not None and store.marks.clear_enqueued(key, holder)
        released = StatusReader(store, task.app).force_release(
            key, "celery-once clear_lock", slots=known_slots(task.app), ttl=task.options.ttl)
        return bool(cleared or released is not None)

    def __getattr__(self, name: str) -> Any:
        raise NotSupported(
            f"once_backend.{name} is not offered: the shim's backend has clear_lock(key) only (the lease"
            " store is celery_singleflight's; use task.status(...), hold() or force_release())"
        )


def _once_of(name: str, once: Any) -> dict[str, Any]:
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


def _once_setting(app: Any) -> dict[str, Any]:
    """celery-once's ``ONCE`` setting, checked: its ``settings``, or {} when it is unset;
    ``default_timeout`` falls back to ``ONCE_DEFAULT_TIMEOUT`` (the name celery-once's README gives)."""
    conf = app.conf.get("ONCE")
    fallback = app.conf.get("ONCE_DEFAULT_TIMEOUT")
    if conf is None:
        return {} if fallback is None else {"default_timeout": fallback}
    backend = conf.get("backend") if isinstance(conf, Mapping) else None
    if backend not in _BACKENDS:
        raise ConfigurationError(
            f"ONCE backend {backend!r} is not supported: leases live in Redis only; set ONCE['backend'] to"
            " 'celery_once.backends.Redis' or remove ONCE and set singleflight_redis_url"
        )
    settings = dict(conf.get("settings") or {})
    unknown = sorted(set(settings) - set(_SETTINGS))
    if unknown:
        raise ConfigurationError(f"ONCE settings {', '.join(map(repr, unknown))} are not known to"
                                 " celery-once's Redis backend")
    if settings.get("blocking"):
        raise ConfigurationError(
            "ONCE settings 'blocking': True is not supported: sending never waits for a key here. Drop it;"
            " to wait at run time, use SingleFlightTask with on_duplicate='retry' or 'queue'"
        )
    if settings.get("default_timeout") is None and fallback is not None:
        settings["default_timeout"] = fallback
    return settings


def _once_url(url: Any) -> Any:
    """celery-once's Redis URL as redis-py reads it: ``?ssl=true`` (which celery-once handed to
    redis-py as a keyword) becomes ``rediss://``; another ``ssl`` value is refused."""
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss"):
        return url
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ssl = [value for name, value in query if name == "ssl"]
    if not ssl:
        return url
    if [value.lower() for value in ssl] != ["true"] * len(ssl):
        raise ConfigurationError(
            f"ONCE['settings']['url'] has ssl={ssl[-1]!r}: write rediss:// for TLS (what ssl=true meant),"
            " or drop the ssl parameter"
        )
    rest = urlencode([(name, value) for name, value in query if name != "ssl"])
    return urlunsplit(("rediss", parts.netloc, parts.path, rest, parts.fragment))


class QueueOnce(SingleFlightTask):
    """celery-once's ``QueueOnce`` on this library's leases (see the module docstring)."""

    once: ClassVar[dict[str, Any]] = {"graceful": False}
    _sf_own_options: ClassVar[tuple[str, ...]] = ("once",)  # not a misspelling of ours
    dedup_enqueue: ClassVar[bool | None] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        once = _once_of(name, cls.__dict__.get("once", cls.once))
        signature = call_signature(cls)
        if signature is not None and "lock_key" not in cls.__dict__:
            keys = once.get("keys")
            cls.lock_key = ArgumentsKey(name, signature, None if keys is None else list(keys),
                                        f"task {name}: once={{'keys': ...}}")
        if "on_duplicate" not in cls.__dict__:
            cls.on_duplicate = "skip" if once.get("graceful") else "raise"
        if once.get("timeout") is not None:
            default(cls, "dedup_ttl", once["timeout"])
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Read celery-once's ``ONCE`` setting: ``url`` for the leases' Redis (unless
        ``singleflight_redis_url`` is set), ``default_timeout`` for the marker's lifetime."""
        if cls._sf_render is not None:
            settings = _once_setting(app)
            adopt_redis_url(app, _once_url(settings.get("url")), "ONCE['settings']['url']")
            if settings.get("default_timeout") is not None and cls.once.get("timeout") is None:
                default(cls, "dedup_ttl", settings["default_timeout"])
        super().on_bound(app)

    @property
    def config(self) -> Any:
        """celery-once's ``config``: the app's configuration."""
        return self.app.conf

    @property
    def once_config(self) -> Any:
        """celery-once's ``once_config``: the ``ONCE`` setting (None when unset)."""
        return self.app.conf.get("ONCE")

    @property
    def default_timeout(self) -> float:
        """celery-once's ``default_timeout``: the marker lifetime of tasks without ``timeout``."""
        return float(_once_setting(self.app).get("default_timeout") or _DEFAULT_TIMEOUT)

    def unlock_before_run(self) -> bool:
        """celery-once's ``unlock_before_run()``: always False (True is refused)."""
        return False

    def get_key(self, args: Any = None, kwargs: Any = None) -> str:
        """celery-once's ``get_key(args, kwargs)``: the key this call holds (``render_key``)."""
        return self.render_key(*(args or ()), **(kwargs or {}))

    @property
    def once_backend(self) -> OnceBackend:
        """celery-once's backend object; here it offers ``clear_lock(key)``."""
        return OnceBackend(self)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, once: Mapping[str, Any] | None = None, **options: Any) -> Any:
        """Send the task unless one of its key is queued or running (eager too): then raise
        :class:`AlreadyQueued`, or with ``graceful`` return that task's ``AsyncResult``."""
        if type(self)._sf_render is None:
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        per_call = _once_of(self.name, once or {})
        if "keys" in per_call:
            raise ConfigurationError(
                f"task {self.name}: apply_async(once={{'keys': ...}}) is not read (celery-once did not read"
                " it either): the key comes from the task's own once={'keys': [...]}"
            )
        call = {**type(self).once, **per_call}
        ttl = self.options.dedup_ttl if call.get("timeout") is None else seconds()(
            f"task {self.name}: apply_async(once={{'timeout': ...}})", call["timeout"],
            Resolving(self, self.name, {}),
        )
        result, sent, key = send_checked(self, args, kwargs, task_id, rest, options, ttl)
        if sent or call.get("graceful"):
            return result
        raise AlreadyQueued(key, result.id, *time_left(self, key))
