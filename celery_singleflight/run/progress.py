"""Progress updates: validated at the call, throttled per run, written in one round trip.

``self.progress("loading", current=3, total=10, message="page 3", rows=120)`` builds a
:class:`ProgressUpdate`. :class:`ProgressReporter` (one per run, on its lease) writes it at most
``rate`` times a second; calls in between replace a pending update, which the process's heartbeat
thread writes when its turn comes, so the last state is always written.
"""

from __future__ import annotations

import json
import math
import threading
import time as mod_time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import ProgressError

__all__ = ["ProgressReporter", "ProgressUpdate", "make_update", "result_meta"]

_MAX_STATE = 64


@dataclass(frozen=True)
class ProgressUpdate:
    """One validated progress report."""

    state: str
    current: float | None = None
    total: float | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    args: str | None = None  # canonical JSON of the arguments, only when the task opts in

    @property
    def percent(self) -> float | None:
        if self.current is None or not self.total:
            return None
        return round(100.0 * self.current / self.total, 2)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"state": self.state}
        for name in ("current", "total", "message"):
            value = getattr(self, name)
            if value is not None:
                out[name] = value
        if self.percent is not None:
            out["percent"] = self.percent
        if self.fields:
            out["fields"] = self.fields
        return out


def result_meta(data: dict[str, Any], key: str, fence: int | None) -> dict[str, Any]:
    """The ``PROGRESS`` meta of a run in the result backend (``AsyncResult.info``).

    ``data`` is the written update (state, current, total, percent, message, fields); the meta
    adds the run's key and fence, and what celery-progress bars read (its ``ProgressRecorder``
    stores the same names): ``current``, ``total`` and ``percent`` always as numbers, 0 when the
    run did not report them (the key's status keeps None there), ``pending`` False and
    ``description``, the message or else the state.
    """
    meta = {**data, "key": key, "fence": fence, "pending": False,
            "description": data.get("message") or data.get("state") or ""}
    for name in ("current", "total", "percent"):
        if meta.get(name) is None:
            meta[name] = 0
    return meta


def _number(name: str, value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProgressError(f"progress {name}= must be a finite number, not {value!r}")
    if value < 0:
        raise ProgressError(f"progress {name}= must not be negative, not {value!r}")
    return value


def make_update(
    state: Any, current: Any, total: Any, message: Any, fields: dict[str, Any], *,
    max_bytes: int, args: str | None = None,
) -> ProgressUpdate:
    """Validate a ``progress()`` call; raise :class:`ProgressError` naming the bad value."""
    if not isinstance(state, str) or not state.strip() or len(state) > _MAX_STATE:
        raise ProgressError(
            f"progress state must be a non-empty string of at most {_MAX_STATE} chars, not {state!r}"
        )
    cur, tot = _number("current", current), _number("total", total)
    if cur is not None and tot is not None and cur > tot:
        raise ProgressError(f"progress current={cur!r} is more than total={tot!r}")
    if message is not None and not isinstance(message, str):
        raise ProgressError(f"progress message= must be a string, not {type(message).__name__}")
    for name, value in fields.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ProgressError(
                f"progress field {name!r} is not JSON-serializable ({type(value).__name__}): {exc}"
            ) from None
    update = ProgressUpdate(state, cur, tot, message, dict(fields), args)
    size = len(json.dumps(update.as_dict()))
    if size > max_bytes:
        raise ProgressError(
            f"progress update is {size} bytes, more than the limit of {max_bytes}"
            " (singleflight_progress_max_bytes); keep fields small"
        )
    return update


class ProgressReporter:
    """Throttles one run's progress writes to ``rate`` per second; the last update always lands.

    ``write(update)`` does the Redis round trip (and the Celery event / result meta) and raises
    :class:`LeaseLost` if the lease is gone; ``schedule(when)`` asks the heartbeat thread to call
    :meth:`flush` at monotonic time ``when``.
    """

    def __init__(
        self, rate: float, write: Callable[[ProgressUpdate], None],
        schedule: Callable[[float], None],
    ) -> None:
        self.interval = 1.0 / rate
        self._write = write
        self._schedule = schedule
        self._lock = threading.Lock()
        # held around each write, so the end-of-run flush waits for one in flight on the
        # heartbeat thread instead of letting the release overtake it
        self._write_lock = threading.Lock()
        self._pending: ProgressUpdate | None = None
        self._last = -math.inf
        self.writes = 0

    @property
    def due(self) -> float | None:
        """When the pending update is due (monotonic), or None."""
        return None if self._pending is None else self._last + self.interval

    def submit(self, update: ProgressUpdate) -> bool:
        """Write now if the rate allows, else keep it pending; True if written now."""
        with self._write_lock:
            with self._lock:
                now = mod_time.monotonic()
                if now - self._last < self.interval:
                    first = self._pending is None
                    self._pending = update
                    if first:
                        self._schedule(self._last + self.interval)
                    return False
                self._pending = None
                self._last = now
            self._write(update)
            self.writes += 1
            return True

    def flush(self) -> None:
        """Write the pending update, if any (the heartbeat thread and the end of the run call it)."""
        with self._write_lock:
            with self._lock:
                update, self._pending = self._pending, None
                if update is None:
                    return
                self._last = mod_time.monotonic()
            self._write(update)
            self.writes += 1
