"""Options of a guarded task, resolved once when the task is bound to its app.

Precedence, in one line: per-task attribute > ``app.conf.singleflight_*`` > built-in default.
Django projects that load settings with ``namespace="CELERY"`` write ``CELERY_SINGLEFLIGHT_TTL``.
Everything is validated here, so a bad value fails when the worker starts, not mid-run.
"""

from __future__ import annotations

import math
import signal
import weakref
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .clients import CLUSTER_SCHEMES, SENTINEL_SCHEME, STANDALONE_SCHEMES, RedisTarget, target_from_settings
from .errors import ConfigurationError
from .layout import KeyLayout
from .option_names import closest

__all__ = [
    "COALESCE_KEEP", "DEFAULTS", "POLICIES", "REDIS_ERROR_MODES", "RETRY_FIRST_WAIT", "Options",
    "app_options", "check_settings", "redis_target_for", "resolve_options", "task_option_names",
]

POLICIES = ("raise", "skip", "retry", "queue", "join", "coalesce", "supersede")
REDIS_ERROR_MODES = ("fail_closed", "fail_open")
COALESCE_KEEP = ("last", "first")
_REDIS_SCHEMES = (*STANDALONE_SCHEMES, SENTINEL_SCHEME, *CLUSTER_SCHEMES)

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
    # the retry policy's waits, named as Celery's autoretry options (and shared with them)
    "retry_backoff": ("retry_backoff", None),  # None: 0.1 s; True: 1 s; False: no growth
    "retry_backoff_max": ("retry_backoff_max", None),  # None: only the holder's time left caps it
    "retry_jitter": ("retry_jitter", True),
    # where the leases live, beyond the URL (see clients.py): Sentinel, Cluster, TLS, a client factory
    "redis_transport_options": ("", None),
    "redis_client": ("", None),
    "coalesce_keep": ("coalesce_keep", "last"),  # the coalesce policy: which duplicate stays pending
    "supersede_grace": ("supersede_grace", 10.0),  # supersede: seconds before the old run is revoked
    "supersede_signal": ("supersede_signal", "SIGTERM"),  # supersede: the revoke's signal
    "ordered": ("ordered", False),  # queue: runs start in send order (a sequence taken at send)
    "order_timeout": ("order_timeout", 60.0),  # ordered: how long a missing message holds up the rest
}

#: the first wait of the ``retry`` policy when ``retry_backoff`` is not set
RETRY_FIRST_WAIT = 0.1


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
    retry_backoff: float  # the first wait of the ``retry`` policy, seconds
    retry_backoff_grows: bool  # each wait doubles the one before
    retry_backoff_max: float | None  # no wait is longer (the holder's time left caps them too)
    retry_jitter: bool  # a random wait between half and all of the computed one
    redis: RedisTarget  # the URL with its transport options or client factory (one client per target)
    coalesce_keep: str = "last"  # coalesce: the newest duplicate replaces the pending one, or "first"
    supersede_grace: float = 10.0  # supersede: how long a superseded run may take to stop by itself
    supersede_signal: str = "SIGTERM"  # supersede: the signal of the revoke that stops it after that
    ordered: bool = False  # queue: runs of a key start in the order they were sent
    order_timeout: float = 60.0  # ordered: seconds after which a sequence number that never came is skipped


#: task options of ours that are not settings
_TASK_ONLY = ("lock_key", "idempotency_key", "key_rate_limit", "key_rate_burst",
              "debounce", "debounce_max_wait", "debounce_keep", "debounce_key")


def task_option_names() -> set[str]:
    """Every task option of ours: the settings' task attributes and the task-only ones."""
    return {attr for attr, _ in DEFAULTS.values() if attr} | set(_TASK_ONLY)


def check_settings(conf: Any) -> None:
    """Raise :class:`ConfigurationError` for a ``singleflight_*`` setting we do not have (also
    written ``SINGLEFLIGHT_*``, or ``CELERY_SINGLEFLIGHT_*`` in Django), naming the closest: every
    setting with our prefix is ours, so an unknown one is a misspelling, never someone else's."""
    try:
        names = list(conf.keys())
    except Exception:  # noqa: BLE001 - a mapping-like config without keys() has nothing to check
        return
    by_attr = {attr: setting for setting, (attr, _) in DEFAULTS.items() if attr}
    for raw in names:
        if not isinstance(raw, str) or not raw.lower().startswith("singleflight_"):
            continue
        name = raw.lower()[len("singleflight_"):]
        if name in DEFAULTS:
            continue
        near = by_attr.get(name) or closest(name, DEFAULTS)
        hint = (f"did you mean singleflight_{near}?" if near
                else f"the settings are: {', '.join(sorted(DEFAULTS))}")
        raise ConfigurationError(f"unknown setting {raw!r}; {hint}")


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
    """``singleflight_redis_url``, else a Redis broker (or result backend) URL; "" when only
    ``singleflight_redis_client`` says where the leases live."""
    explicit = _conf_get(conf, "redis_url")
    if not explicit and _conf_get(conf, "redis_client") is not None:
        return ""
    candidates = [explicit] if explicit else [conf.get("broker_url"), conf.get("result_backend")]
    for url in candidates:
        usable = _REDIS_SCHEMES if explicit else STANDALONE_SCHEMES  # a sentinel broker needs master_name
        if isinstance(url, str) and urlsplit(url).scheme in usable:
            return url
        if explicit:
            raise ConfigurationError(
                f"singleflight_redis_url {url!r} is not a Redis URL; use redis://, rediss://, unix://,"
                " sentinel:// (with master_name in singleflight_redis_transport_options), redis+cluster://"
                " or rediss+cluster://"
            )
    raise ConfigurationError(
        "celery_singleflight needs Redis: set singleflight_redis_url (Django: CELERY_SINGLEFLIGHT_REDIS_URL),"
        " for example 'redis://localhost:6379/0'; the broker is not Redis, so it cannot be used instead"
    )


def redis_target_for(conf: Any) -> RedisTarget:
    """Where the leases live: the URL, its transport options and the client factory, checked
    together (a bad combination is a :class:`ConfigurationError` naming the setting)."""
    return target_from_settings(
        redis_url_for(conf), _conf_get(conf, "redis_transport_options"), _conf_get(conf, "redis_client")
    )


def resolve_options(task: Any, conf: Any) -> Options:
    """Resolve and validate the options of ``task`` (a class or instance) against ``conf``."""
    check_settings(conf)
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
    if "supersede" in (policy, beat_policy) and values["max_concurrency"] not in (1, None):
        raise ConfigurationError(
            f"task {name}: on_duplicate='supersede' needs max_concurrency=1 (the newcomer takes over"
            " the one running run)"
        )
    if values["ordered"] is True and (policy != "queue" or values["max_concurrency"] not in (1, None)):
        raise ConfigurationError(
            f"task {name}: ordered=True orders the runs of the queue policy: it needs on_duplicate='queue'"
            f" and max_concurrency=1 (not {policy!r}, {values['max_concurrency']!r})"
        )
    mode = values["on_redis_error"]
    if mode not in REDIS_ERROR_MODES:
        raise ConfigurationError(
            f"{where('on_redis_error')} is {mode!r}; choose one of {', '.join(REDIS_ERROR_MODES)}"
        )
    namespace = str(values["namespace"])
    KeyLayout(namespace)  # validates
    redis_max_wait = values["redis_max_wait"]
    backoff = values["retry_backoff"]
    backoff_max = values["retry_backoff_max"]
    target = redis_target_for(conf)
    return Options(
        redis_url=target.url,
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
        retry_backoff=RETRY_FIRST_WAIT if backoff is None or backoff is False else 1.0 if backoff is True
        else _seconds(where("retry_backoff"), backoff),
        retry_backoff_grows=backoff is not False,
        retry_backoff_max=None if backoff_max is None else _seconds(where("retry_backoff_max"), backoff_max),
        retry_jitter=bool(_flag(where("retry_jitter"), values["retry_jitter"])),
        redis=target,
        coalesce_keep=_choice(where("coalesce_keep"), values["coalesce_keep"], COALESCE_KEEP),
        supersede_grace=_seconds(where("supersede_grace"), values["supersede_grace"], allow_zero=True),
        supersede_signal=_signal_name(where("supersede_signal"), values["supersede_signal"]),
        ordered=bool(_flag(where("ordered"), values["ordered"])),
        order_timeout=_seconds(where("order_timeout"), values["order_timeout"]),
    )


def _signal_name(where: str, value: Any) -> str:
    """A signal name as ``revoke(signal=...)`` takes it (``"SIGTERM"``, ``"SIGKILL"``, ...)."""
    name = value.upper() if isinstance(value, str) else ""
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not isinstance(value, str) or not hasattr(signal.Signals, name):
        raise ConfigurationError(
            f"{where} must be a signal name such as 'SIGTERM' or 'SIGKILL', not {value!r}"
        )
    return name


def _choice(where: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigurationError(f"{where} is {value!r}; choose one of {', '.join(choices)}")
    return str(value)


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


class _Overrides:
    """Stands in for a task when resolving an app's settings: no per-task values but the given
    ones (task option names: ``lock_ttl``, ``progress_rate``, ``max_concurrency``)."""

    name = "app"

    def __init__(self, overrides: dict[str, Any]) -> None:
        self.__dict__.update(overrides)


_app_options: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[str, Any], ...], Options]] = (
    weakref.WeakKeyDictionary()
)


def app_options(app: Any, **overrides: Any) -> Options:
    """The options of ``app`` (its settings, no task's), with ``overrides``, resolved once per
    app and overrides: the settings are read when first used, as a task reads them when it is
    bound. ``hold()``, the status reader and the CLI call this on every use, so it must be cheap
    (reading the 22 settings through Celery's configuration costs about 0.4 ms)."""
    key = tuple(sorted(overrides.items()))
    try:
        cache = _app_options[app]
    except KeyError:
        cache = _app_options.setdefault(app, {})
    found = cache.get(key)
    if found is None:
        if len(cache) >= _KEPT_OPTIONS:  # overrides computed per call (a ttl from data) stay bounded
            cache.clear()
        found = cache[key] = resolve_options(_Overrides(overrides), app.conf)
    return found


#: how many sets of overrides an app keeps resolved
_KEPT_OPTIONS = 256
