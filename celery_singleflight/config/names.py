"""Misspelled option and setting names, caught when a task is defined or its app's settings read.

Celery passes every keyword of ``@app.task(...)`` on as a class attribute and ignores the ones it
does not know, so ``lease_ttl=3`` (for ``lock_ttl``) would be accepted silently and the task
would run with the default 30 s. Here a task option close to one of ours (a small edit distance,
or a name from celery-once, celery-singleton or another lock library) is an error naming the
right one; names far from ours are left to Celery and to the task's own code. Every
``singleflight_*`` setting is ours, so an unknown one is always an error.

A class attribute that starts with ``_`` is never checked: name your own attributes that way if
one happens to sit close to ours. A base class that takes options of its own (the celery-once
shim's ``once``) lists them in ``_sf_own_options``.
"""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ConfigurationError
from ..spelling import closest

__all__ = ["ALIASES", "check_task_options"]

#: names other lock libraries (and habit) use, and what to write instead
ALIASES: dict[str, str] = {
    # celery-once
    "once": "celery-once's option: use lock_key (a template over the arguments in once['keys']),"
            " on_duplicate ('raise', or 'skip' for graceful=True) and lock_ttl (for timeout), or"
            " base=celery_singleflight.compat.QueueOnce",
    # celery-singleton
    "unique_on": "celery-singleton's option: use lock_key, a template over the arguments"
                 " (e.g. 'sync:<account_id>'), or base=celery_singleflight.compat.singleton.Singleton",
    "raise_on_duplicate": "celery-singleton's option: use on_duplicate='raise' (or 'skip'), or"
                          " base=celery_singleflight.compat.singleton.Singleton",
    "lock_expiry": "celery-singleton's option: use lock_ttl (seconds; the heartbeat renews the lease"
                   " while the task runs), or base=celery_singleflight.compat.singleton.Singleton",
    "challenge_lock_on_startup": "celery-singleton's option: drop it; a dead holder's lease runs out by"
                                 " itself within lock_ttl",
    # celery-heimdall
    "heimdall": "celery-heimdall's option: use lock_key and on_duplicate (key_rate_limit for times/per),"
                " or base=celery_singleflight.compat.heimdall.HeimdallTask",
}
#: names that habit (or another library) suggests for one of our options
_HABITS: dict[str, str] = {
    "lease_ttl": "lock_ttl", "lock_timeout": "lock_ttl", "lock_expire": "lock_ttl",
    "lock_expires": "lock_ttl", "lock_expiration": "lock_ttl", "ttl": "lock_ttl", "key": "lock_key",
    "lock_name": "lock_key",
    "lock_id": "lock_key", "unique_key": "lock_key", "singleflight_key": "lock_key",
    "duplicate_policy": "on_duplicate", "on_conflict": "on_duplicate", "on_locked": "on_duplicate",
    "namespace": "lock_namespace", "lock_prefix": "lock_namespace", "key_prefix": "lock_namespace",
    "concurrency": "max_concurrency", "max_concurrent": "max_concurrency",
    "concurrency_limit": "max_concurrency",
    "heartbeat": "heartbeat_interval", "idempotent_key": "idempotency_key",
}


def check_task_options(
    cls: type, task_name: str, ours: Iterable[str], celery_names: Iterable[str] = ()
) -> None:
    """Raise :class:`ConfigurationError` for an attribute of ``cls`` (the options given to
    ``@app.task``, or a class body) that looks like a misspelled option of ours (``ours``)."""
    ours = set(ours) | set(getattr(cls, "_sf_own_options", ()))
    others = set(celery_names)
    for name in cls.__dict__:
        if name.startswith("_") or name in ours or name in others:
            continue
        advice = ALIASES.get(name)
        if advice is None:
            near = _HABITS.get(name) or closest(name, ours)
            advice = None if near is None else f"did you mean {near}?"
        if advice is not None:
            raise ConfigurationError(
                f"task {task_name}: unknown option {name!r}, {advice} (Celery ignores options it does"
                " not know, so the task would run without it)"
            )
