"""Debounce (``debounce=2.0``, ``debounce_max_wait``, ``debounce_keep``, ``debounce_key``): a burst
of calls on one key becomes one run, once the key has been quiet for ``debounce`` seconds or
``debounce_max_wait`` has passed since the burst's first call.

**A burst and its leader.** The first call of a burst is its *leader*: its message is the one that
runs, with the burst's payload (unless it is lost: see below). Each call
is recorded in one script at ``apply_async`` (one round trip, never blocking) and sent with a
countdown and a header naming the leader; with ``debounce_keep="last"`` the call's arguments
become the burst's payload, so the run gets the latest ones.

**When a message comes due** (:func:`on_due`, one script):

- the leader, once the burst is due, closes it and runs with the payload; before that it is
  re-sent with the countdown left, in the custom state ``DEBOUNCED`` (key, calls, planned run);
- any other call waits (``DEBOUNCED``, re-sent) until the burst's run has started, then ends
  ``SUCCESS`` with ``{"singleflight": "debounced", "key", "into": <the run's task id>, "calls"}``
  (:func:`is_debounced`); if the burst is :data:`GRACE` past due and its leader never started
  (its message was lost with a killed worker), the first call to notice takes the leader's place
  and runs with the payload: nothing is lost as long as one message of the burst survives;
- a message without the header (``send_task``, beat, a failed record at send) is recorded when it
  comes, then re-sent as any call would have been.

Safe to run twice: a call is recorded once per task id (the open burst and the last closed one
remember their calls), and closing a burst records who ran it, so a replayed close runs the same
run. A second delivery of that run's message (``acks_late``) goes on to the lease, as any
redelivery does: turned away while the first still runs, run again after a crash.
The arguments of ``debounce_keep="last"`` are stored as JSON.
"""

from __future__ import annotations

import logging
import time as mod_time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import redis
from celery.exceptions import Ignore
from kombu.utils.json import dumps, loads

from .errors import ConfigurationError
from .events import send_task_event
from .keys import KeyFunction, compile_key
from .messages import header
from .states import DEBOUNCED
from .store import LeaseStore, _Script

__all__ = [
    "CALL_SCRIPT", "DUE_SCRIPT", "GRACE", "HEADER_LEADER", "HEADER_RAN", "Debounce", "DebounceState",
    "DebouncedRun", "debounce_state", "is_debounced", "on_due", "parse_burst", "parse_debounce", "record",
    "send",
]

log = logging.getLogger("celery_singleflight.debounce")

#: the header naming a debounced call's burst leader (its task id)
HEADER_LEADER = "singleflight_debounce"
#: the header of a run that was decided to go ahead (re-sends of it skip the debounce)
HEADER_RAN = "singleflight_debounce_ran"
#: how long past the burst's due time another call waits before it takes a lost leader's place
GRACE = 1.0
#: how long the last closed burst of a key is kept, seconds (replays, late and re-sent messages)
CLOSED_KEEP = 600.0
KEEPS = ("last", "first")

_HMS = """
local function clock()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ms(x)
  return string.format('%.0f', x)
end
"""

CALL_SCRIPT = _HMS + """
-- KEYS[1] - the key's open burst (hash: leader, first, last, due, count, payload, c:<task id>)
-- KEYS[2] - the key's last closed burst (the same hash, renamed, with ran: who ran it)
-- ARGV[1] - the call's task id
-- ARGV[2] - debounce, ms
-- ARGV[3] - max wait, ms (0: none)
-- ARGV[4] - 'last' (the call's arguments become the payload) or 'first'
-- ARGV[5] - the call's arguments (JSON)
-- ARGV[6] - how long a burst is kept past its due time, ms
-- return {leader's task id, ms until the burst's run is due, calls folded}. A call already
-- recorded (a replay) gets the same leader; one recorded in a burst closed since, wait 0.
local now = clock()
local id = ARGV[1]
local b = redis.call('HMGET', KEYS[1], 'leader', 'first', 'due', 'count', 'c:' .. id)
if b[1] and b[5] then
  return {b[1], math.max(0, tonumber(b[3]) - now), tonumber(b[4])}
end
local c = redis.call('HMGET', KEYS[2], 'leader', 'count', 'c:' .. id)
if c[1] and c[3] then
  return {c[1], 0, tonumber(c[2])}
end
local debounce, max_wait = tonumber(ARGV[2]), tonumber(ARGV[3])
local leader, first, count = b[1], tonumber(b[2]), tonumber(b[4] or '0') + 1
if not leader then
  leader, first = id, now
  redis.call('HSET', KEYS[1], 'leader', id, 'first', ms(now), 'payload', ARGV[5])
elseif ARGV[4] == 'last' then
  redis.call('HSET', KEYS[1], 'payload', ARGV[5])
end
local due = now + debounce
if max_wait > 0 and due > first + max_wait then
  due = math.max(now, first + max_wait)
end
redis.call('HSET', KEYS[1], 'last', ms(now), 'due', ms(due), 'count', count, 'c:' .. id, 1)
redis.call('PEXPIRE', KEYS[1], math.floor(due - now + tonumber(ARGV[6])))
return {leader, due - now, count}
"""

DUE_SCRIPT = _HMS + """
-- KEYS[1] - the key's open burst; KEYS[2] - its last closed burst (see CALL_SCRIPT)
-- ARGV[1] - the task id whose message came due
-- ARGV[2] - the leader its header names ('' if none: sent by name)
-- ARGV[3] - grace, ms: how long past due another call waits for the leader to start
-- (the leader goes ahead 5 ms early: the broker's countdown timers are not exact)
-- ARGV[4] - how long a closed burst is kept, ms
-- ARGV[5] - a token unique to this execution (a replay of this call carries the same one)
-- return {'run', payload, calls, first call ms} (this run goes ahead with the payload; also on a
-- replay, with a 5th element 1; 0 when another delivery of this task id closed the burst),
-- {'wait', ms left, calls, due ms} (the burst is still open: come back when it is due,
-- or, for another call, grace after that), {'folded', the run's task id, calls} (the burst was
-- run by another call) or {'unknown'} (no burst of that leader is known: record the call now).
local now = clock()
local id, leader = ARGV[1], ARGV[2]
local c = redis.call('HMGET', KEYS[2], 'leader', 'ran', 'payload', 'count', 'first', 'ran_token')
if c[2] == id then
  return {'run', c[3], tonumber(c[4]), tonumber(c[5]), c[6] == ARGV[5] and 1 or 0}
end
local b = redis.call('HMGET', KEYS[1], 'leader', 'due', 'payload', 'count', 'first')
if leader ~= '' and b[1] == leader then
  local due = tonumber(b[2])
  if (id == leader and now >= due - 5) or (id ~= leader and now >= due + tonumber(ARGV[3])) then
    redis.call('HSET', KEYS[1], 'ran', id, 'ran_at', ms(now), 'ran_token', ARGV[5])
    redis.call('RENAME', KEYS[1], KEYS[2])
    redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[4]))
    return {'run', b[3], tonumber(b[4]), tonumber(b[5]), 1}
  end
  if id == leader then
    return {'wait', due - now, tonumber(b[4]), due}
  end
  return {'wait', due + tonumber(ARGV[3]) - now, tonumber(b[4]), due}
end
if leader ~= '' and c[1] == leader then
  return {'folded', c[2], tonumber(c[4])}
end
if leader ~= '' and leader ~= id then
  return {'folded', leader, 0}
end
return {'unknown'}
"""


@dataclass(frozen=True)
class Debounce:
    """A task's parsed debounce options; ``render`` builds the debounce key (None: the lock key)."""

    wait: float
    max_wait: float | None
    keep: str
    render: KeyFunction | None


class DebouncedRun(TypedDict):
    """The result of a call folded into another run of its burst."""

    singleflight: str
    key: str
    into: str
    calls: int


class DebounceState(NamedTuple):
    """A key's open burst, for ``status()`` and the CLI."""

    leader: str
    calls: int
    first: float  # epoch seconds
    planned: float  # when its run is due, epoch seconds


def is_debounced(result: Any) -> bool:
    """True if ``result`` (``AsyncResult.get()``) is a call folded into another run of its burst;
    ``result["into"]`` is that run's task id (``app.AsyncResult(result["into"]).get()``)."""
    return isinstance(result, dict) and result.get("singleflight") == "debounced"


def _number(where: str, name: str, value: Any, *, allow_none: bool = False) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigurationError(f"{where}: {name}={value!r} must be a number of seconds above zero")
    return float(value)


def parse_debounce(cls: Any, where: str, signature: Any, name: str) -> Debounce | None:
    """The debounce options of a task class, validated (:class:`ConfigurationError` naming the
    option); None when ``debounce`` is not set."""
    wait = cls.debounce
    if wait is None:
        for option in ("debounce_max_wait", "debounce_keep", "debounce_key"):
            if getattr(cls, option, None) is not None:
                raise ConfigurationError(f"{where}: {option} needs debounce (seconds of quiet)")
        return None
    seconds = _number(where, "debounce", wait)
    assert seconds is not None
    max_wait = _number(where, "debounce_max_wait", cls.debounce_max_wait, allow_none=True)
    if max_wait is not None and max_wait < seconds:
        raise ConfigurationError(
            f"{where}: debounce_max_wait={max_wait!r} must be at least debounce={wait!r}")
    keep = cls.debounce_keep or "last"
    if keep not in KEEPS:
        raise ConfigurationError(f"{where}: debounce_keep={keep!r}; choose 'last' or 'first'")
    if getattr(cls, "dedup_enqueue", None):
        raise ConfigurationError(f"{where}: debounce and dedup_enqueue both decide at send; choose one")
    spec = cls.debounce_key
    render = None if spec is None else compile_key(spec, signature, name)
    return Debounce(seconds, max_wait, keep, render)


_scripts: dict[tuple[int, str], tuple[Any, Any]] = {}


def _script(store: LeaseStore, source: str) -> Any:
    """The script on this store's client, called the lease scripts' short way (:class:`_Script`)."""
    client = store.client
    known = _scripts.get((id(client), source[-40:]))
    if known is None or known[0] is not client:
        known = _scripts[(id(client), source[-40:])] = (client, _Script(client, source))
    return known[1]


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _keys(store: LeaseStore, key: str) -> list[str]:
    return [store.layout.debounce(key), store.layout.debounced(key)]


def record(
    store: LeaseStore, key: str, task_id: str, deb: Debounce, args: Any, kwargs: Any
) -> tuple[str, float]:
    """One round trip: record a call; (its burst's leader, seconds until the burst's run is due)."""
    payload = dumps({"args": list(args or ()), "kwargs": dict(kwargs or {})})  # type: ignore[no-untyped-call]
    leader, wait_ms, _count = _script(store, CALL_SCRIPT)(
        keys=_keys(store, key),
        args=[task_id, _ms(deb.wait), _ms(deb.max_wait) if deb.max_wait else 0, deb.keep, payload,
              _ms(CLOSED_KEEP)],
    )
    return _text(leader), int(wait_ms) / 1000


def send(task: Any, store: LeaseStore, key: str, deb: Debounce, args: Any, kwargs: Any, new_id: str,
         publish: Callable[[str, float | None, dict[str, Any]], Any]) -> Any:
    """Record the call and publish its message with the countdown to its burst's run (the
    leader) or that plus :data:`GRACE` (any other call: it stands by in case the leader is lost).
    If Redis cannot record it, the message goes without the header and is recorded when it comes."""
    try:
        leader, wait = record(store, key, new_id, deb, args, kwargs)
    except redis.RedisError as exc:
        log.warning("%s key=%r: could not record the debounced call (it is recorded when it runs): %s",
                    task.name, key, exc)
        return publish(new_id, None, {})
    countdown = wait if leader == new_id else wait + GRACE
    return publish(new_id, countdown, {HEADER_LEADER: leader})


def _resend(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float, leader: str,
            key: str, calls: int, planned: float) -> None:
    """Re-send the current message with ``countdown``, naming ``leader``; ``DEBOUNCED`` first."""
    request = task.request
    task_id = request.id or ""
    meta: dict[str, Any] = {"key": key, "leader": leader, "calls": calls, "planned": round(planned, 3)}
    if not (request.ignore_result or task.ignore_result):
        task.backend.store_result(task_id, meta, DEBOUNCED)
    headers = {**(request.headers or {}), HEADER_LEADER: leader}
    sig = task.signature_from_request(request, args, kwargs, countdown=countdown, retries=request.retries,
                                      headers=headers)
    sig.apply_async()
    send_task_event(task.app, "task-debounced", request.hostname, uuid=task_id, **meta)


def on_due(task: Any, store: LeaseStore, key: str, deb: Debounce, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | DebouncedRun:
    """The current message came due: the arguments to run with, a folded call's result, or
    (``Ignore``) re-sent for later. Redis errors propagate."""
    request = task.request
    task_id = request.id or ""
    leader = str(header(request, HEADER_LEADER) or "")
    token = uuid.uuid4().hex  # this execution's: a replay of the script carries it, a second delivery not
    reply = _script(store, DUE_SCRIPT)(keys=_keys(store, key), args=[task_id, leader, _ms(GRACE),
                                                                       _ms(CLOSED_KEEP), token])
    kind = _text(reply[0])
    if kind == "run":
        payload = loads(_text(reply[1]))  # type: ignore[no-untyped-call]
        if not int(reply[4]):
            # the broker delivered this run twice (acks_late after a crash, a visibility timeout):
            # it goes on as any redelivery does; the lease turns it away while the other runs
            log.warning("%s[%s] key=%r: another delivery of a debounced run", task.name, task_id, key)
        # re-sends of this run (rate limit, retry policy, self.retry()) skip the debounce
        request.headers = {**(request.headers or {}), HEADER_RAN: task_id}
        log.info("%s[%s] key=%r: runs for %s debounced calls", task.name, task_id, key, reply[2])
        return tuple(payload.get("args") or ()), dict(payload.get("kwargs") or {})
    if kind == "folded":
        into = _text(reply[1])
        log.info("%s[%s] key=%r: debounced into %s", task.name, task_id, key, into)
        return {"singleflight": "debounced", "key": key, "into": into, "calls": int(reply[2])}
    if kind == "wait":
        wait = int(reply[1]) / 1000
        _resend(task, args, kwargs, wait, leader, key, int(reply[2]), int(reply[3]) / 1000)
        raise Ignore()
    # not recorded yet (sent by name, or the record at send failed): record it now
    leader, wait = record(store, key, task_id, deb, args, kwargs)
    countdown = wait if leader == task_id else wait + GRACE
    _resend(task, args, kwargs, countdown, leader, key, 0, mod_time.time() + wait)
    raise Ignore()


def debounce_state(store: LeaseStore, key: str) -> DebounceState | None:
    """The key's open burst: its leader, calls folded so far, and when its run is planned."""
    return parse_burst(store.client.hmget(store.layout.debounce(key), "leader", "count", "first", "due"))


def parse_burst(fields: list[Any]) -> DebounceState | None:
    """A :class:`DebounceState` from the burst hash's leader, count, first and due (None: none)."""
    leader, count, first, due = fields
    if leader is None:
        return None
    return DebounceState(_text(leader), int(count or 0), int(first or 0) / 1000, int(due or 0) / 1000)
