"""What the three shims share: the key over a call's arguments, the old libraries' Redis URL,
and a send that checks the enqueue marker the way the old libraries checked their lock.

celery-once, celery-singleton and celery-heimdall all take their lock in ``apply_async``, in the
caller, eager or not; a duplicate gets an error or the existing task's ``AsyncResult``. Here the
same check is the enqueue marker (:func:`~..policies.enqueue.send_once`), and the worker's lease
guards the run. The key covers every argument the old library keyed on, ``*args`` and
``**kwargs`` included, bound with the task's signature so that ``f(1)`` and ``f(a=1)`` agree.
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Task

from ..config.settings import conf_get
from ..errors import ConfigurationError, KeyTemplateError
from ..keys import canonical, render_value
from ..policies.enqueue import send_once
from ..run.messages import HEADER_ATTEMPT, HEADER_EARLIER, HEADER_FIRST_SEEN, HEADER_HANDOFF, HEADER_REJOIN

__all__ = ["ArgumentsKey", "NotSupported", "adopt_redis_url", "call_signature", "default", "is_resend",
           "send_checked", "time_left"]

#: the headers of this library's own re-sends of a run (see run/messages.py)
_RESEND_HEADERS = (HEADER_FIRST_SEEN, HEADER_ATTEMPT, HEADER_HANDOFF, HEADER_EARLIER, HEADER_REJOIN)
#: the attribute a shim notes the options it set itself in (a user's own value always wins)
_SET_BY_SHIM = "_sf_shim_set"


class NotSupported(ConfigurationError, AttributeError):
    """A name of the old library that the shim does not offer; the message says what to use."""


def call_signature(cls: type) -> inspect.Signature | None:
    """The task's signature as callers use it: ``run`` without ``self`` (unless a staticmethod)."""
    run = cls.__dict__.get("run")
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    sig = inspect.signature(run)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


def _render(value: Any) -> str:
    # a name-like string bare, anything else canonical JSON: what a ``<name>`` placeholder gives
    return render_value(value) if type(value) is str else canonical(value)


class ArgumentsKey:
    """A shim task's ``lock_key``: the task name, then each chosen parameter's value, ``:``-joined,
    rendered as key templates render them (``*args`` as a list, ``**kwargs`` as an object).

    ``names=None`` keys on every parameter. Different arguments give different keys (each value
    renders to one self-delimiting text), and a call bound the same way gives the same key.
    """

    def __init__(self, task_name: str, signature: inspect.Signature, names: Sequence[str] | None,
                 where: str) -> None:
        params = list(signature.parameters)
        chosen = params if names is None else list(names)
        for name in chosen:
            if name not in params:
                raise KeyTemplateError(
                    f"{where} names <{name}>, which is not a parameter of the task (its parameters:"
                    f" {', '.join(params) or 'none'})"
                )
        self.task_name, self.signature, self.names = task_name, signature, tuple(chosen)

    def __call__(self, *args: Any, **kwargs: Any) -> str:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = bound.arguments
        return ":".join([self.task_name, *(_render(values[name]) for name in self.names)])

    def __repr__(self) -> str:
        return ":".join(["<@task>", *(f"<{name}>" for name in self.names)])


def default(cls: type, name: str, value: Any) -> None:
    """Set option ``name`` of ``cls`` to the old library's ``value`` unless the task sets it itself."""
    ours: set[str] = set(cls.__dict__.get(_SET_BY_SHIM, ()))
    if name in cls.__dict__ and name not in ours:
        return
    setattr(cls, name, value)
    setattr(cls, _SET_BY_SHIM, frozenset(ours | {name}))


def adopt_redis_url(app: Any, url: Any, setting: str) -> None:
    """Keep the leases in the old library's Redis (``setting``) when ``singleflight_redis_url``
    (and ``singleflight_redis_client``) are unset. Tasks bound before must agree: a guarded task
    that already resolved another Redis is a :class:`ConfigurationError`, not two lock stores."""
    if url is None or conf_get(app.conf, "redis_url") or conf_get(app.conf, "redis_client") is not None:
        return
    if not isinstance(url, str) or urlsplit(url).scheme not in ("redis", "rediss", "redis+socket", "unix"):
        raise ConfigurationError(f"{setting} {url!r} is not a Redis URL; set singleflight_redis_url instead")
    if url.startswith("redis+socket://"):
        url = "unix://" + url[len("redis+socket://"):]
    for task in list(app._tasks.values()):
        opts = getattr(type(task), "_sf_options", None)
        if opts is not None and opts.redis_url != url:
            raise ConfigurationError(
                f"{setting} is {url!r}, but task {task.name} already keeps its leases in {opts.redis_url!r};"
                " set singleflight_redis_url to the Redis every task should use"
            )
    app.conf.singleflight_redis_url = url


def time_left(task: Any, key: str) -> tuple[float | None, float]:
    """``(lease, earliest)``: the holder's lease time left (None while it is queued, or when Redis
    cannot say), and the seconds until ``key`` could be taken at the earliest: that lease's
    (renewed while it runs), else the enqueue marker's; 0.0 when neither is known."""
    store = task.store
    lease = None
    with contextlib.suppress(redis.RedisError):
        lease = store.time_left(key)
        left = lease if lease is not None else store.marks.enqueued(key)[1]
        if left is not None and math.isfinite(left):
            return lease, max(0.0, float(left))
    return lease, 0.0


def is_resend(options: dict[str, Any]) -> bool:
    """A send of a message that was sent before: a retry, or this library's re-send of a run
    (rate limit, ``queue``, Redis outage), which keeps the ``retries`` option (even at 0) and
    carries the library's headers. Those are not checked again: their first send was."""
    headers = options.get("headers") or {}
    return "retries" in options or any(name in headers for name in _RESEND_HEADERS)


def send_checked(task: Any, args: Any, kwargs: Any, task_id: str | None, rest: tuple[Any, ...],
                 options: dict[str, Any], ttl: float) -> tuple[Any, bool, str]:
    """Send ``task`` unless its key is already queued or running: ``(result, sent, key)``, where
    ``result`` is the existing task's ``AsyncResult`` when not sent. A send with its own
    ``task_id`` (``apply_async(task_id=...)``, a chain, group or chord) is checked too, under that
    id, as the old libraries did; only re-sends (:func:`is_resend`) are not. Under
    ``task_always_eager`` the key is marked too and cleared when the inline run returns, as the
    old libraries locked and unlocked."""
    key = task.render_key(*(args or ()), **(kwargs or {}))
    if is_resend(options):
        return Task.apply_async(task, args, kwargs, task_id, *rest, **options), True, key
    eager = bool(task.app.conf.task_always_eager)
    sent: list[str | None] = []

    def send(new_id: str | None) -> Any:
        sent.append(new_id)
        try:
            return Task.apply_async(task, args, kwargs, new_id, *rest, **options)
        finally:
            if eager and new_id is not None:
                with contextlib.suppress(redis.RedisError):
                    task.store.marks.clear_enqueued(key, new_id)

    result = send_once(task, task.store, key, ttl, task.options.max_concurrency, send, task_id)
    return result, bool(sent), key
