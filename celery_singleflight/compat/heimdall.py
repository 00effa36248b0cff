"""``HeimdallTask`` for code written against celery-heimdall: change the import, keep the tasks.

::

    from celery_singleflight.compat.heimdall import AlreadyQueuedError, HeimdallTask

    @app.task(base=HeimdallTask, heimdall={"unique": True, "unique_timeout": 60 * 60})
    def generate_report(customer_id):
        ...

    @app.task(base=HeimdallTask, heimdall={"times": 2, "per": 60})    # 2 starts a minute per key
    def download_report(customer_id):
        ...

``unique``: a duplicate send returns the queued or running task's ``AsyncResult`` (with
``unique_raises``, raises :class:`AlreadyQueuedError`), and a duplicate that reaches a worker
(beat) is skipped. ``times`` / ``per`` (or ``rate_limit=RateLimit((times, per))``) become
``key_rate_limit`` with a burst of ``times``: a run over the limit is re-sent to start later. The
key is the task name and every argument, or ``key`` (a string, or ``lambda args, kwargs: ...``).
What has no equivalent here is refused when the task is defined or bound (docs/migrating.md).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import ConfigurationError, LockHeld, SingleFlightError
from ..task import SingleFlightTask
from .shared import ArgumentsKey, NotSupported, call_signature, default, send_checked, time_left

__all__ = ["AlreadyQueuedError", "HeimdallTask", "RateLimit", "Strategy"]

_OPTIONS = ("unique", "unique_raises", "unique_timeout", "key", "times", "per", "rate_limit",
            "unique_wait_for_expiry", "unique_lock_blocking", "unique_lock_timeout", "lock_prefix",
            "rate_limit_prefix")
_PREFIX_WHY = "keys live under singleflight_namespace (default 'sf'); set that instead"
_WAIT_WHY = "sending never waits for a key here"
#: what is refused, and why (in the task's ``heimdall`` or as an app setting ``heimdall_<name>``),
#: with the one value accepted, because it is what the shim does: celery-heimdall's default
#: prefixes, ``False`` for the others (``unique_lock_timeout``: see :func:`_refuse`)
_REFUSED: dict[str, tuple[str, Any]] = {
    "unique_wait_for_expiry": ("a finished run frees its key here; to answer later sends from a finished"
                               " run, use SingleFlightTask's idempotency_key and idempotency_ttl", False),
    "unique_lock_blocking": (_WAIT_WHY, False),
    "unique_lock_timeout": (_WAIT_WHY, 0),
    "lock_prefix": (_PREFIX_WHY, "h-lock:"),
    "rate_limit_prefix": (_PREFIX_WHY, "h-rate:"),
}


def _refuse(values: Mapping[str, Any], blocking: Any, label: Callable[[str], str]) -> None:
    """Refuse each option of ``values`` set to a value the shim does not behave as.
    ``unique_lock_timeout`` is accepted too when ``blocking`` (``unique_lock_blocking``) is False:
    it then meant nothing."""
    for option, (why, accepted) in _REFUSED.items():
        value = values.get(option)
        if value is None or (value == accepted and type(value) is type(accepted)):
            continue
        if option == "unique_lock_timeout" and blocking is False:
            continue
        raise ConfigurationError(f"{label(option)} = {value!r} is not supported: {why}")


class Strategy(enum.Enum):
    """celery-heimdall's rate limit strategy; it has one."""

    DEFAULT = 10


@dataclass(frozen=True)
class RateLimit:
    """``heimdall={"rate_limit": RateLimit((times, per))}``: ``times`` starts per ``per`` seconds
    (any two-item sequence, as celery-heimdall unpacked it)."""

    rate_limit: Sequence[Any] | Callable[..., Any]
    strategy: Strategy = Strategy.DEFAULT


class AlreadyQueuedError(LockHeld):
    """A duplicate send with ``unique_raises``: ``likely_culprit`` is the queued or running task
    (read atomically with the check here), ``expires_in`` the seconds until its key could free."""

    def __init__(self, expires_in: int | None = None, likely_culprit: str | None = None,
                 key: str = "") -> None:
        SingleFlightError.__init__(self, expires_in, likely_culprit, key)
        self.expires_in, self.likely_culprit = expires_in, likely_culprit
        self.key, self.holder = key, likely_culprit
        self.ttl_left = None if expires_in is None else float(expires_in)

    def __repr__(self) -> str:
        return f"<AlreadyQueuedError(likely_culprit={self.likely_culprit!r}, expires_in={self.expires_in!r})>"


class _Key:
    """celery-heimdall's ``key``: a string, or a callable of ``(args, kwargs)``."""

    def __init__(self, key: str | Callable[[list[Any], dict[str, Any]], str]) -> None:
        self.key = key

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        return self.key(list(args), dict(kwargs)) if callable(self.key) else self.key

    def __repr__(self) -> str:
        return repr(self.key)


def _rate(name: str, options: Mapping[str, Any]) -> tuple[int, float] | None:
    times: Any
    per: Any
    if "rate_limit" in options:
        limit = options["rate_limit"]
        pair = limit.rate_limit if isinstance(limit, RateLimit) else None
        if not isinstance(pair, Sequence) or isinstance(pair, (str, bytes)) or len(pair) != 2:
            raise ConfigurationError(
                f"task {name}: heimdall rate_limit must be RateLimit((times, per)); a rate computed per"
                " call is not supported: give each rate its own task or key_rate_limit"
            )
        times, per = pair[0], pair[1]
    elif "times" in options or "per" in options:
        times, per = options.get("times"), options.get("per")
    else:
        return None
    whole = isinstance(times, int) and not isinstance(times, bool) and times >= 1
    number = isinstance(per, (int, float)) and not isinstance(per, bool) and math.isfinite(per) and per > 0
    if not (whole and number):
        raise ConfigurationError(f"task {name}: heimdall times={times!r}, per={per!r} must be a whole number"
                                 " of at least 1 and a number of seconds above zero")
    return int(times), float(per)


def _heimdall_of(name: str, options: Any) -> dict[str, Any]:
    if not isinstance(options, Mapping):
        raise ConfigurationError(f"task {name}: heimdall= must be a dict like celery-heimdall's,"
                                 f" not {options!r}")
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"task {name}: heimdall= has {', '.join(map(repr, unknown))};"
            f" HeimdallTask knows {', '.join(_OPTIONS)}")
    if "unique" in options and not options["unique"]:
        raise ConfigurationError(
            f"task {name}: heimdall 'unique' = {options['unique']!r} is refused: celery-heimdall made a task"
            " unique whenever 'unique' was there, whatever its value; write 'unique': True, or remove it"
        )
    _refuse(options, options.get("unique_lock_blocking"), lambda option: f"task {name}: heimdall {option!r}")
    return dict(options)


class HeimdallTask(SingleFlightTask):
    """celery-heimdall's ``HeimdallTask`` on this library's leases (see the module docstring)."""

    heimdall: ClassVar[dict[str, Any]] = {}
    _sf_own_options: ClassVar[tuple[str, ...]] = ("heimdall",)  # not a misspelling of ours
    _sf_unique: ClassVar[bool] = False
    _sf_raises: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        if "setup_redis" in cls.__dict__:
            raise ConfigurationError(f"task {name}: setup_redis() is not called here; set"
                                     " singleflight_redis_url or singleflight_redis_client")
        options = _heimdall_of(name, cls.__dict__.get("heimdall", cls.heimdall))
        signature = call_signature(cls)
        if signature is not None:
            cls._sf_unique = bool(options.get("unique"))
            rate = _rate(name, options)
            if not cls._sf_unique and rate is None:
                raise ConfigurationError(f"task {name}: heimdall= needs 'unique' or a rate ('times' and"
                                         " 'per', or 'rate_limit'): every run here holds its key")
            if "lock_key" not in cls.__dict__:
                key = options.get("key")
                everything = ArgumentsKey(name, signature, None, f"task {name}")
                cls.lock_key = everything if key is None else _Key(key)
            default(cls, "dedup_enqueue", cls._sf_unique)
            default(cls, "on_duplicate", "skip" if cls._sf_unique else "queue")
            if rate is not None:
                times, per = rate
                default(cls, "key_rate_limit", times / per)
                default(cls, "key_rate_burst", times)
                if not cls._sf_unique:  # runs of one key may overlap as the rate lets them start
                    default(cls, "max_concurrency", times)
            if options.get("unique_timeout") is not None:
                default(cls, "dedup_ttl", options["unique_timeout"])
        super().__init_subclass__(**kwargs)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Read celery-heimdall's settings (the task's ``heimdall`` options win)."""
        if cls._sf_render is not None:
            options = cls.__dict__.get("heimdall", cls.heimdall)
            # a task's own value wins over the setting, as in celery-heimdall (its own are checked)
            settings = {option: app.conf.get(f"heimdall_{option}") for option in _REFUSED
                        if options.get(option) is None}
            blocking = options.get("unique_lock_blocking")
            blocking = app.conf.get("heimdall_unique_lock_blocking") if blocking is None else blocking
            _refuse(settings, blocking, lambda option: f"setting heimdall_{option}")
            raises = options.get("unique_raises")
            cls._sf_raises = bool(app.conf.get("heimdall_unique_raises") if raises is None else raises)
            timeout = app.conf.get("heimdall_unique_timeout")
            if options.get("unique_timeout") is None and timeout is not None:
                default(cls, "dedup_ttl", timeout)
        super().on_bound(app)

    def only_after(self, key: str, seconds: int) -> bool:
        """Refused: see the message."""
        raise NotSupported("only_after() is not offered: use hold(app, key, ...) for a block that must not"
                           " overlap, or idempotency_key for work done once per window")

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, **options: Any) -> Any:
        """A ``unique`` task is sent unless one of its key is queued or running (eager too): then
        that task's ``AsyncResult`` is returned, or with ``unique_raises`` :class:`AlreadyQueuedError`
        raised. Other tasks are sent as any guarded task."""
        if type(self)._sf_render is None or not type(self)._sf_unique:
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        result, sent, key = send_checked(self, args, kwargs, task_id, rest, options, self.options.dedup_ttl)
        if sent or not type(self)._sf_raises:
            return result
        raise AlreadyQueuedError(math.ceil(time_left(self, key)[1]), result.id, key)
