"""Reading the app's settings: where the leases live, and misspelled ``singleflight_*`` names.

Settings live in ``app.conf`` as ``singleflight_<name>`` (also ``SINGLEFLIGHT_<NAME>``); Django
projects that load settings with ``namespace="CELERY"`` write ``CELERY_SINGLEFLIGHT_TTL``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any
from urllib.parse import urlsplit

from ..connection.targets import (
    CLUSTER_SCHEMES,
    SENTINEL_SCHEME,
    STANDALONE_SCHEMES,
    RedisTarget,
    target_from_settings,
)
from ..errors import ConfigurationError
from ..spelling import closest

__all__ = ["check_settings", "conf_get", "redis_target_for", "redis_url_for"]

_REDIS_SCHEMES = (*STANDALONE_SCHEMES, SENTINEL_SCHEME, *CLUSTER_SCHEMES)


def conf_get(conf: Any, name: str) -> Any:
    """``singleflight_<name>`` (or ``SINGLEFLIGHT_<NAME>``) from ``conf``, or None."""
    for key in (f"singleflight_{name}", f"SINGLEFLIGHT_{name.upper()}"):
        try:
            value = conf.get(key)
        except Exception:  # noqa: BLE001 - a broken config object must not hide the default
            value = None
        if value is not None:
            return value
    return None


def check_settings(
    conf: Any, settings: Collection[str], task_options: Mapping[str, str], namespace: str | None = None
) -> None:
    """Raise :class:`ConfigurationError` for a ``singleflight_*`` setting that is not one of
    ``settings``, naming the closest (``task_options``: task option name -> its setting, for
    ``singleflight_lock_ttl``). Also written ``SINGLEFLIGHT_*``, or with the app's config
    namespace in front (``namespace``: Django's ``config_from_object(settings, namespace="CELERY")``
    keeps ``CELERY_SINGLEFLIGHT_TTL`` under that name; ``CELERY_`` is always recognised). Every
    setting with our prefix is ours, so an unknown one is a misspelling, never someone else's."""
    try:
        names = list(conf.keys())
    except Exception:  # noqa: BLE001 - a mapping-like config without keys() has nothing to check
        return
    fronts = {"", "celery_"} | ({f"{namespace.lower()}_"} if namespace else set())
    for raw in names:
        if not isinstance(raw, str):
            continue
        front = next((f for f in fronts if raw.lower().startswith(f"{f}singleflight_")), None)
        if front is None:
            continue
        name = raw.lower()[len(front) + len("singleflight_"):]
        if name in settings:
            continue
        near = task_options.get(name) or closest(name, settings)
        written = raw[: len(front) + len("singleflight_")]
        if near is None:
            hint = f"the settings are: {', '.join(sorted(settings))}"
        else:
            hint = f"did you mean {written}{near.upper() if written.isupper() else near}?"
        raise ConfigurationError(f"unknown setting {raw!r}; {hint}")


def redis_url_for(conf: Any) -> str:
    """``singleflight_redis_url``, else a Redis broker (or result backend) URL; "" when only
    ``singleflight_redis_client`` says where the leases live."""
    explicit = conf_get(conf, "redis_url")
    if not explicit and conf_get(conf, "redis_client") is not None:
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
    raise ConfigurationError(f"celery_singleflight needs Redis: {_advice(candidates)}")


def _advice(urls: list[Any]) -> str:
    """What to set when neither the broker nor the result backend is a plain Redis URL: a
    Sentinel or Cluster broker needs what a URL alone cannot say, anything else a Redis of its own."""
    schemes = [urlsplit(url).scheme for url in urls if isinstance(url, str)]
    if SENTINEL_SCHEME in schemes:
        return (
            "the broker (or result backend) is Sentinel, whose master name is in Celery's transport"
            " options, not the URL: set singleflight_redis_url to the same sentinel:// URL and"
            " singleflight_redis_transport_options = {'master_name': ...}"
            " (Django: CELERY_SINGLEFLIGHT_REDIS_URL, CELERY_SINGLEFLIGHT_REDIS_TRANSPORT_OPTIONS)"
        )
    if any(scheme in CLUSTER_SCHEMES for scheme in schemes):
        return (
            "the broker (or result backend) is a Redis Cluster URL: set singleflight_redis_url to it"
            " as redis+cluster://host:port[,host:port...] (Django: CELERY_SINGLEFLIGHT_REDIS_URL)"
        )
    found = f" (the broker is {schemes[0]}://)" if schemes else ""
    return (
        "set singleflight_redis_url (Django: CELERY_SINGLEFLIGHT_REDIS_URL), for example"
        f" 'redis://localhost:6379/0'; neither the broker nor the result backend is a Redis URL{found}"
    )


def redis_target_for(conf: Any) -> RedisTarget:
    """Where the leases live: the URL, its transport options and the client factory, checked
    together (a bad combination is a :class:`ConfigurationError` naming the setting)."""
    return target_from_settings(
        redis_url_for(conf), conf_get(conf, "redis_transport_options"), conf_get(conf, "redis_client")
    )
