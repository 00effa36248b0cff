"""Run-time controls of a key, from any process: pause it, resume it, and override its limits.

    from celery_singleflight import pause, resume, set_limits, clear_limits

    pause(app, "sync:42", seconds=300)      # no run takes the key for 5 minutes; runs park in order
    resume(app, "sync:42")                  # the sweeper hands the key to the first parked run now
    set_limits(app, "sync:42", concurrency=2, rate="10/m")   # until cleared
    clear_limits(app, "sync:42")            # the task's own max_concurrency and key_rate_limit

``app`` may be the app or a task (then its ``lock_namespace``). A task that raises
:class:`~..errors.RetryAfter` pauses its own key (see :mod:`..protocol.controls`).
"""

from __future__ import annotations

from typing import Any

from ..policies.ratelimit import parse_rate
from ..protocol.controls import Limits
from ..protocol.store import LeaseStore
from .status import reader

__all__ = ["Limits", "clear_limits", "controls", "pause", "resume", "set_limits"]


def _store(app_or_task: Any, namespace: str | None) -> LeaseStore:
    app = getattr(app_or_task, "app", None)
    if app is not None and hasattr(app_or_task, "render_key"):  # a task: its own namespace
        opts = getattr(app_or_task, "options", None)
        namespace = namespace or (opts.namespace if opts is not None else None)
        app_or_task = app
    return reader(app_or_task, namespace).store


def pause(app_or_task: Any, key: str, seconds: float | None = None, *, namespace: str | None = None
          ) -> float | None:
    """Pause ``key`` for ``seconds`` (None: until :func:`resume`): no run takes it meanwhile;
    runs that come wait parked in its queue, and run in order when the pause ends. Returns when
    it ends (epoch seconds, the Redis server's clock), or None."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"pause {key!r}: seconds must be above zero (or None: until resumed)")
    return _store(app_or_task, namespace).controls.pause(key, seconds)


def resume(app_or_task: Any, key: str, *, namespace: str | None = None) -> bool:
    """End the pause of ``key`` now (the sweeper hands it to the first parked run within about a
    second). Returns whether it was paused."""
    store = _store(app_or_task, namespace)
    was = store.controls.resume(key)
    store.handoff.look_again(key, 0)
    return was


def set_limits(app_or_task: Any, key: str, *, concurrency: int | None = None, rate: Any = None,
               burst: int | None = None, namespace: str | None = None) -> Limits | None:
    """Override ``key``'s ``max_concurrency`` (``concurrency``) and ``key_rate_limit`` (``rate``,
    as the option is written: ``"10/m"``; ``burst``: its ``key_rate_burst``) until
    :func:`clear_limits`; a part not given stays as it was. The rate applies to tasks that have a
    ``key_rate_limit`` of their own. Returns the limits now."""
    if concurrency is not None and (isinstance(concurrency, bool) or concurrency < 1):
        raise ValueError(f"limits of {key!r}: concurrency={concurrency!r} must be a whole number, at least 1")
    parsed = parse_rate(f"limits of {key!r}", rate, burst) if rate is not None else None
    if parsed is None:
        return _store(app_or_task, namespace).controls.set_limits(key, concurrency)
    return _store(app_or_task, namespace).controls.set_limits(
        key, concurrency, parsed.interval_us, parsed.tolerance_us, parsed.text)


def clear_limits(app_or_task: Any, key: str, *, namespace: str | None = None) -> Limits | None:
    """Back to the task's own limits for ``key``; returns the limits cleared (None if none)."""
    return _store(app_or_task, namespace).controls.clear_limits(key)


def controls(app_or_task: Any, key: str, *, namespace: str | None = None
             ) -> tuple[float | None, bool, Limits | None]:
    """(when the pause ends, epoch seconds, or None; whether ``key`` is paused; its limits)."""
    return _store(app_or_task, namespace).controls.read(key)
