"""Options of a guarded task, resolved once when the task is bound to its app.

Precedence, in one line: per-task attribute > ``app.conf.singleflight_*`` > built-in default.
Django projects that load settings with ``namespace="CELERY"`` write ``CELERY_SINGLEFLIGHT_TTL``.
Everything is validated here, so a bad value fails when the worker starts, not mid-run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import ConfigurationError
from .keys import KeyLayout

__all__ = ["DEFAULTS", "POLICIES", "REDIS_ERROR_MODES", "Options", "resolve_options"]

POLICIES = ("raise", "skip", "retry", "queue", "join")
REDIS_ERROR_MODES = ("fail_closed", "fail_open")
_REDIS_SCHEMES = ("redis", "rediss", "unix")

#: setting name (without the ``singleflight_`` prefix) -> (task attribute, default)
DEFAULTS: dict[str, tuple[str, Any]] = {
    "redis_url": ("", None),
    "namespace": ("lock_namespace", "sf"),
    "ttl": ("lock_ttl", 30.0),
    "heartbeat_interval": ("heartbeat_interval", None),  # None: ttl / 3
    "on_duplicate": ("on_duplicate", "raise"),
    "max_wait": ("max_wait", 60.0),
    "on_redis_error": ("on_redis_error", "fail_closed"),
    "redis_retry_delay": ("redis_retry_delay", 5.0),
    "redis_max_wait": ("redis_max_wait", 600.0),
    "fence_retention": ("", 86400.0),
    "status_retention": ("", 300.0),
    "history_length": ("", 100),
    "progress_rate": ("progress_rate", 10.0),
    "progress_max_bytes": ("progress_max_bytes", 8192),
    "progress_events": ("progress_events", None),  # None: follow the worker's -E
    "status_include_args": ("status_include_args", False),
    "max_queued": ("max_queued", None),  # None: no limit
    "idempotency_ttl": ("idempotency_ttl", 3600.0),
    "dedup_enqueue": ("dedup_enqueue", False),
    "dedup_ttl": ("dedup_ttl", 3600.0),
    "on_beat_duplicate": ("on_beat_duplicate", None),  # None: the task's own on_duplicate, else skip
    "max_concurrency": ("max_concurrency", 1),
}


@dataclass(frozen=True)
class Options:
    """The resolved, validated options of one task."""

    redis_url: str
    namespace: str
    ttl: float
    heartbeat_interval: float
    on_duplicate: str
    max_wait: float
    on_redis_error: str
    redis_retry_delay: float
    redis_max_wait: float | None
    fence_retention: float
    status_retention: float
    history_length: int
    progress_rate: float
    progress_max_bytes: int
    progress_events: bool | None
    status_include_args: bool
    max_queued: int | None
    idempotency_ttl: float
    dedup_enqueue: bool
    dedup_ttl: float
    on_beat_duplicate: str
    max_concurrency: int


def _conf_get(conf: Any, name: str) -> Any:
    for key in (f"singleflight_{name}", f"SINGLEFLIGHT_{name.upper()}"):
        try:
            value = conf.get(key)
        except Exception:  # noqa: BLE001 - a broken config object must not hide the default
            value = None
        if value is not None:
            return value
    return None


def _seconds(where: str, value: Any, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigurationError(f"{where} must be a number of seconds (int or float), not {value!r}")
    number = float(value)
    if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ConfigurationError(f"{where} must be {bound} seconds, not {value!r}")
    return number


def redis_url_for(conf: Any) -> str:
    """``singleflight_redis_url``, else a Redis broker (or result backend) URL."""
    explicit = _conf_get(conf, "redis_url")
    candidates = [explicit] if explicit else [conf.get("broker_url"), conf.get("result_backend")]
    for url in candidates:
        if isinstance(url, str) and urlsplit(url).scheme in _REDIS_SCHEMES:
            return url
        if explicit:
            raise ConfigurationError(
                f"singleflight_redis_url {url!r} is not a Redis URL; use redis://, rediss:// or unix://"
            )
    raise ConfigurationError(
        "celery_singleflight needs Redis: set singleflight_redis_url (Django: CELERY_SINGLEFLIGHT_REDIS_URL),"
        " for example 'redis://localhost:6379/0'; the broker is not Redis, so it cannot be used instead"
    )


def resolve_options(task: Any, conf: Any) -> Options:
    """Resolve and validate the options of ``task`` (a class or instance) against ``conf``."""
    name = getattr(task, "name", None) or getattr(task, "__name__", "task")
    values: dict[str, Any] = {}
    for setting, (attr, default) in DEFAULTS.items():
        value = getattr(task, attr, None) if attr else None
        if value is None:
            value = _conf_get(conf, setting)
        values[setting] = default if value is None else value

    def where(setting: str) -> str:
        attr = DEFAULTS[setting][0]
        return f"task {name}: {attr} (or singleflight_{setting})" if attr else f"singleflight_{setting}"

    ttl = _seconds(where("ttl"), values["ttl"])
    interval = ttl / 3 if values["heartbeat_interval"] is None else _seconds(
        where("heartbeat_interval"), values["heartbeat_interval"]
    )
    if interval >= ttl:
        raise ConfigurationError(
            f"{where('heartbeat_interval')} is {interval}s but must be shorter than the lease TTL ({ttl}s);"
            " leave it unset for TTL/3"
        )
    policy = values["on_duplicate"]
    if policy not in POLICIES:
        raise ConfigurationError(
            f"{where('on_duplicate')} is {policy!r}; choose one of {', '.join(POLICIES)}"
        )
    # beat ticks: per-task on_beat_duplicate > the task's own on_duplicate > the setting > skip
    beat_policy = getattr(task, "on_beat_duplicate", None) or getattr(task, "on_duplicate", None) or (
        _conf_get(conf, "on_beat_duplicate") or "skip"
    )
    if beat_policy not in POLICIES:
        raise ConfigurationError(
            f"{where('on_beat_duplicate')} is {beat_policy!r}; choose one of {', '.join(POLICIES)}"
        )
    if "join" in (policy, beat_policy) and values["max_concurrency"] not in (1, None):
        raise ConfigurationError(
            f"task {name}: on_duplicate='join' needs max_concurrency=1 (with several runs at once"
            " there is no single result to join)"
        )
    mode = values["on_redis_error"]
    if mode not in REDIS_ERROR_MODES:
        raise ConfigurationError(
            f"{where('on_redis_error')} is {mode!r}; choose one of {', '.join(REDIS_ERROR_MODES)}"
        )
    namespace = str(values["namespace"])
    KeyLayout(namespace)  # validates
    redis_max_wait = values["redis_max_wait"]
    return Options(
        redis_url=redis_url_for(conf),
        namespace=namespace,
        ttl=ttl,
        heartbeat_interval=interval,
        on_duplicate=policy,
        max_wait=_seconds(where("max_wait"), values["max_wait"], allow_zero=True),
        on_redis_error=mode,
        redis_retry_delay=_seconds(where("redis_retry_delay"), values["redis_retry_delay"]),
        redis_max_wait=None
        if redis_max_wait in ("none", "None", float("inf"))
        else _seconds(where("redis_max_wait"), redis_max_wait, allow_zero=True),
        fence_retention=max(ttl, _seconds(where("fence_retention"), values["fence_retention"])),
        status_retention=_seconds(where("status_retention"), values["status_retention"], allow_zero=True),
        history_length=_count(where("history_length"), values["history_length"], minimum=1),
        progress_rate=_seconds(where("progress_rate"), values["progress_rate"]),
        progress_max_bytes=_count(where("progress_max_bytes"), values["progress_max_bytes"], minimum=64),
        progress_events=_flag(where("progress_events"), values["progress_events"], allow_none=True),
        status_include_args=bool(_flag(where("status_include_args"), values["status_include_args"])),
        max_queued=None if values["max_queued"] is None else _count(
            where("max_queued"), values["max_queued"], minimum=0
        ),
        idempotency_ttl=_seconds(where("idempotency_ttl"), values["idempotency_ttl"]),
        dedup_enqueue=bool(_flag(where("dedup_enqueue"), values["dedup_enqueue"])),
        dedup_ttl=_seconds(where("dedup_ttl"), values["dedup_ttl"]),
        on_beat_duplicate=beat_policy,
        max_concurrency=_count(where("max_concurrency"), values["max_concurrency"], minimum=1),
    )


def _count(where: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{where} must be a whole number of at least {minimum}, not {value!r}")
    return value


def _flag(where: str, value: Any, *, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise ConfigurationError(f"{where} must be True or False, not {value!r}")
    return value
