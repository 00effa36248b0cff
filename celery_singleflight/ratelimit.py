"""A per-key rate limit shared by every worker (``key_rate_limit="10/m"``, ``key_rate_burst``).

Celery's own ``rate_limit`` counts per worker process; this one counts per key in Redis, so four
workers with ``key_rate_limit="10/m"`` still start 10 runs of a key a minute. The algorithm is
GCRA (the generic cell rate algorithm): one number per key, the *theoretical arrival time* (TAT).
A run may start once ``TAT - tolerance`` has passed, and each start pushes the TAT one emission
interval (``1 / rate``) further. ``tolerance = (burst - 1) * interval``, so any window of ``W``
seconds holds at most ``rate * W + burst`` planned starts.

A run over the limit is not refused: the script *reserves* the next free cell for it and answers
its planned start; the run is re-sent with that countdown (its message, the same task id, without
spending ``max_retries``) and ends as ``RETRY``; its meta is a :class:`~.errors.Throttled` (Celery
keeps an exception in ``RETRY``), whose ``.throttled`` is ``{"key", "limit", "planned", "wait"}``. When it
comes back, its reservation is found and it starts. A crashed run needs no release: a cell is a
point in time, not a token held, so the most a lost message wastes is its one cell.

Safe to run twice: a call is named by its task id and ``request.retries`` (a re-sent or
redelivered message of the same run, and a replayed script, get the cell already granted, never
a second one). Granted cells are remembered :data:`GRANT_KEEP` seconds after their planned start.
"""

from __future__ import annotations

import logging
import math
import re
import time as mod_time
from dataclasses import dataclass
from typing import Any

from celery.exceptions import Ignore

from .errors import ConfigurationError, Throttled
from .events import send_task_event
from .store import LeaseStore, _Script

__all__ = ["GRANT_KEEP", "PLANNED_ATTR", "RATE_SCRIPT", "Rate", "RateState", "Slot", "admit", "parse_rate",
           "parse_state", "rate_state", "reserve"]

log = logging.getLogger("celery_singleflight.ratelimit")

#: how long a granted cell is remembered after its planned start, seconds: a re-sent run that
#: arrives later than this takes a new cell (later, never earlier: the limit still holds)
GRANT_KEEP = 60.0
#: a re-sent run that arrives this early (seconds) still starts: the broker's timers are not exact
EARLY_ALLOWANCE = 0.002
#: the request attribute a rate-limited run finds its planned start in (epoch seconds, server clock)
PLANNED_ATTR = "singleflight_planned_start"

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*/\s*([a-z]+)\s*$")

RATE_SCRIPT = """
-- KEYS[1] - the key's theoretical arrival time, emission interval and tolerance (string:
-- '<tat> <interval> <tolerance>', microseconds; the last two for readers such as the CLI)
-- KEYS[2] - cells granted (sorted set: call id -> planned start, microseconds)
-- ARGV[1] - emission interval, microseconds (one cell)
-- ARGV[2] - tolerance, microseconds ((burst - 1) cells)
-- ARGV[3] - call id: task id and retries
-- ARGV[4] - how long a granted cell is remembered after its planned start, microseconds
-- return {planned start, now, 1 if granted by this call, 0 if granted before}: microseconds of
-- the server clock. A call already granted (a replay, a re-sent run) gets its cell again.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval, tolerance, keep = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('%.0f', now - keep))
local planned = redis.call('ZSCORE', KEYS[2], ARGV[3])
if planned then
  return {tonumber(planned), now, 0}
end
local tat = tonumber(string.match(redis.call('GET', KEYS[1]) or '0', '^%d+'))
if tat < now then
  tat = now
end
planned = math.max(now, tat - tolerance)
tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.0f %.0f %.0f', tat, interval, tolerance), 'PX',
  math.floor((tat - now) / 1000) + 1)
redis.call('ZADD', KEYS[2], string.format('%.0f', planned), ARGV[3])
redis.call('PEXPIRE', KEYS[2], math.floor((planned - now + keep) / 1000) + 1)
return {planned, now, 1}
"""


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


@dataclass(frozen=True)
class Slot:
    """The answer of the script: when the call may start, and how long that is from now."""

    planned: float  # server clock, epoch seconds
    wait: float  # seconds from now; 0 when it may start now
    fresh: bool  # this call took the cell (False: granted before, to this call id)


@dataclass(frozen=True)
class RateState:
    """A key's rate state for ``status()`` and the CLI."""

    next_free: float  # epoch seconds: when a new run would start
    planned: int  # runs with a cell planned in the future (throttled, waiting)
    per_second: float  # the limit, in runs a second


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


_scripts: dict[int, tuple[Any, Any]] = {}


def _script(store: LeaseStore) -> Any:
    """The script registered on this store's client (once per client)."""
    client = store.client
    known = _scripts.get(id(client))
    if known is None or known[0] is not client:
        known = _scripts[id(client)] = (client, _Script(client, RATE_SCRIPT))
    return known[1]


def _us(seconds: float) -> int:
    return max(1, round(seconds * 1_000_000))


def reserve(store: LeaseStore, key: str, rate: Rate, call_id: str) -> Slot:
    """One round trip: the cell of ``call_id`` on ``key`` (taken now, or found from before)."""
    layout = store.layout
    interval = _us(rate.interval)
    planned, now, fresh = _script(store)(
        keys=[layout.rate(key), layout.planned(key)],
        args=[interval, interval * (rate.burst - 1), call_id, _us(GRANT_KEEP)],
    )
    wait = (int(planned) - int(now)) / 1_000_000
    return Slot(int(planned) / 1_000_000, 0.0 if wait <= EARLY_ALLOWANCE else wait, bool(fresh))


def rate_state(store: LeaseStore, key: str, now: float | None = None) -> RateState | None:
    """When a new run of ``key`` would start, and how many runs wait for a planned cell; None
    when the key is idle (no run started within one interval)."""
    layout = store.layout
    now_us = round((mod_time.time() if now is None else now) * 1_000_000)
    pipe = store.client.pipeline(transaction=False)
    pipe.get(layout.rate(key))
    pipe.zcount(layout.planned(key), now_us, "+inf")
    raw, waiting = pipe.execute()
    return None if raw is None else parse_state(raw, int(waiting), now_us)


def parse_state(raw: bytes | str, waiting: int, now_us: int) -> RateState:
    """A :class:`RateState` from the rate key's value (``"<tat> <interval> <tolerance>"``)."""
    tat, interval, tolerance = (int(x) for x in (raw.decode() if isinstance(raw, bytes) else raw).split())
    return RateState(max(now_us, tat - tolerance) / 1_000_000, waiting, 1_000_000 / interval)


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
    log.info("%s[%s] key=%r over key_rate_limit=%s: re-sent to start in %.3fs", task.name, task_id, key,
             rate.text, slot.wait)
    # the state first: once sent, the run may start and store its own result at any moment
    if not (request.ignore_result or task.ignore_result):
        task.backend.store_result(task_id, meta, "RETRY")
    sig = task.signature_from_request(request, args, kwargs, countdown=slot.wait, retries=request.retries,
                                      headers=dict(request.headers or {}))
    sig.apply_async()
    send_task_event(task.app, "task-retried", request.hostname, uuid=task_id, exception=repr(meta),
                    traceback="", timestamp=mod_time.time())
    raise Ignore()
