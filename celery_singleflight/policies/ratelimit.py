"""A per-key rate limit shared by every worker (``key_rate_limit="10/m"``, ``key_rate_burst``).

Celery's own ``rate_limit`` counts per worker process; this one counts per key in Redis, so four
workers with ``key_rate_limit="10/m"`` still start 10 runs of a key a minute. The algorithm is
GCRA (the generic cell rate algorithm): one number per key, the *theoretical arrival time* (TAT).
A run may start once ``TAT - tolerance`` has passed, and each start pushes the TAT one emission
interval (``1 / rate``) further. ``tolerance = (burst - 1) * interval``, so any window of ``W``
seconds holds at most ``rate * W + burst`` planned starts.

A run over the limit is not refused: the script *reserves* the next free cell for it and answers
its planned start; the run is re-sent with that countdown (its message, the same task id, without
spending ``max_retries``; a copy waits in Redis in case the worker holding it dies:
:mod:`..run.delay`) and ends as ``RETRY``; its meta is a :class:`~.errors.Throttled` (Celery
keeps an exception in ``RETRY``), whose ``.throttled`` is ``{"key", "limit", "planned", "wait"}``. When it
comes back, its reservation is found and it starts. A crashed run needs no release: a cell is a
point in time, not a token held, so the most a lost message wastes is its one cell.

Safe to run twice: a call is named by its task id and ``request.retries`` (a re-sent or
redelivered message of the same run, and a replayed script, get the cell already granted, never
a second one). Granted cells are remembered :data:`~..constants.RATE_GRANT_KEEP` seconds after their
planned start.
"""

from __future__ import annotations

import logging
import math
import re
import time as mod_time
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore

from .. import constants
from ..config.option import Option, OptionGroup, anything
from ..errors import ConfigurationError, Throttled
from ..metrics import record as metrics
from ..protocol.store import LeaseStore
from ..protocol.timing import ACL_COMMANDS
from ..run.delay import delay_again
from ..run.events import send_task_event
from ..run.stage import Ended, Run, Stage

__all__ = ["PLANNED_ATTR", "Rate", "RateLimit", "RateOptions", "Slot", "admit", "parse_rate",
           "reserve"]

log = logging.getLogger("celery_singleflight.ratelimit")

#: the request attribute a rate-limited run finds its planned start in (epoch seconds, server clock)
PLANNED_ATTR = "singleflight_planned_start"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*/\s*([a-z]+)\s*$")


class RateOptions(OptionGroup):
    """The per-key rate limit."""

    __slots__ = ()
    title = "Rate limit"

    key_rate_limit = Option[Any](
        setting=False, task="key_rate_limit", check=anything, default_text="none",
        meaning="How many runs of one key may start per second, minute or hour, across all workers (Celery's"
        " `rate_limit` counts per process). A run over it is re-sent to start at the next free slot, shows"
        " `RETRY` meanwhile and does not spend `max_retries` ([time policies](time-policies.md)). Combines"
        " with `max_concurrency`.",
        values="`\"N/s\"`, `\"N/m\"` or `\"N/h\"` with N above zero (`\"10/m\"`, `\"0.5/s\"`), or a number"
        " (per second); anything else fails when the task is defined.",
    )
    key_rate_burst = Option[Any](
        setting=False, task="key_rate_burst", check=anything, default_text="1: runs are spread evenly",
        meaning="How many runs of an idle key may start at once. Any W seconds hold at most `rate * W +"
        " key_rate_burst` starts.",
        values="A whole number, at least 1; needs `key_rate_limit`.",
    )


@dataclass(frozen=True)
class Rate:
    """A parsed ``key_rate_limit``: ``per_second`` starts a second, ``burst`` at once."""

    per_second: float
    burst: int
    text: str

    @property
    def interval(self) -> float:
        """Seconds between two cells."""
        return 1.0 / self.per_second

    @property
    def interval_us(self) -> int:
        """The emission interval, as the script counts it (µs, at least 1)."""
        return max(1, round(self.interval * 1_000_000))

    @property
    def tolerance_us(self) -> int:
        """How far before its TAT a cell may start: ``(burst - 1)`` intervals (µs)."""
        return self.interval_us * (self.burst - 1)


@dataclass(frozen=True)
class Slot:
    """The answer of the script: when the call may start, and how long that is from now."""

    planned: float  # server clock, epoch seconds
    wait: float  # seconds from now; 0 when it may start now
    fresh: bool  # this call took the cell (False: granted before, to this call id)


def parse_rate(where: str, value: Any, burst: Any = None) -> Rate | None:
    """``"N/s"``, ``"N/m"``, ``"N/h"`` (or a number: per second); None when ``value`` is None.

    Raises :class:`ConfigurationError` naming ``where`` for anything else, for zero or negative
    rates, and for a ``key_rate_burst`` that is not a whole number of at least 1."""
    if value is None:
        if burst is not None:
            raise ConfigurationError(f"{where}: key_rate_burst={burst!r} needs key_rate_limit")
        return None
    if isinstance(value, bool):
        per_second = math.nan
    elif isinstance(value, (int, float)):
        per_second = float(value)
    elif isinstance(value, str) and (found := _RATE.match(value)) and found[2] in _UNITS:
        per_second = float(found[1]) / _UNITS[found[2]]
    else:
        raise ConfigurationError(
            f"{where}: key_rate_limit={value!r} is not a rate; write 'N/s', 'N/m' or 'N/h' (e.g. '10/m')"
        )
    if not math.isfinite(per_second) or per_second <= 0:
        raise ConfigurationError(f"{where}: key_rate_limit={value!r} must be a rate above zero, e.g. '10/m'")
    if burst is None:
        burst = 1
    if isinstance(burst, bool) or not isinstance(burst, int) or burst < 1:
        raise ConfigurationError(f"{where}: key_rate_burst={burst!r} must be a whole number of at least 1")
    return Rate(per_second, burst, "".join(str(value).split()))


def reserve(store: LeaseStore, key: str, rate: Rate, call_id: str) -> Slot:
    """One round trip: the cell of ``call_id`` on ``key`` (taken now, or found from before)."""
    planned, now, fresh = store.timing.reserve(key, rate.interval_us, rate.tolerance_us, call_id)
    wait = (planned - now) / 1_000_000
    return Slot(planned / 1_000_000, 0.0 if wait <= constants.RATE_EARLY_ALLOWANCE else wait, fresh)


def admit(task: Any, store: LeaseStore, key: str, rate: Rate, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Slot:
    """Take the current run's cell. If it is in the future, re-send the run with that countdown
    (``RETRY`` with :class:`~.errors.Throttled` first, then the message) and end it (``Ignore``);
    else return the slot and let the run go on. Redis errors propagate (the caller's
    ``on_redis_error`` applies)."""
    request = task.request
    task_id = request.id or ""
    slot = reserve(store, key, rate, f"{task_id}:{request.retries or 0}")
    if slot.wait <= 0:
        return slot
    meta = Throttled(key, rate.text, round(slot.planned, 6), round(slot.wait, 6))
    metrics.count("rate_limited", task.name)
    metrics.observe("rate_limit_delay_seconds", slot.wait, task.name)
    log.info("%s[%s] key=%r over key_rate_limit=%s: re-sent to start in %.3fs", task.name, task_id, key,
             rate.text, slot.wait)
    # the state first: once sent, the run may start and store its own result at any moment
    if not (request.ignore_result or task.ignore_result):
        task.backend.store_result(task_id, meta, "RETRY")
    delay_again(task, args, kwargs, slot.wait, key)
    send_task_event(task.app, "task-retried", request.hostname, uuid=task_id, exception=repr(meta),
                    traceback="", timestamp=mod_time.time())
    raise Ignore()


class RateLimit(Stage):
    """The stage of a task with a ``key_rate_limit``."""

    options = RateOptions
    acl_commands = ACL_COMMANDS

    def __init__(self, rate: Rate) -> None:
        self.rate = rate

    @classmethod
    def define(cls, task_cls: type, signature: Any, name: str) -> Rate | None:
        return parse_rate(f"task {name}", getattr(task_cls, "key_rate_limit", None),
                          getattr(task_cls, "key_rate_burst", None))

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return None if defined is None else cls(defined)

    def before_lease(self, run: Run) -> Ended | None:
        if run.handoff or run.eager:
            return None  # a parked run handed the key took its cell when it first came (before it parked)
        slot = admit(run.task, run.task.store, run.key, self.rate, run.args, run.kwargs)
        setattr(run.request, PLANNED_ATTR, slot.planned)
        return None
