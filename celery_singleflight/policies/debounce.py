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
  (:func:`is_debounced`); if the burst is :data:`~..constants.DEBOUNCE_GRACE` past due and its leader
  never started
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
from typing import Any, TypedDict

import redis
from celery.exceptions import Ignore
from kombu.utils.json import dumps, loads

from .. import constants
from ..config.option import Option, OptionGroup, anything
from ..errors import ConfigurationError
from ..keys import KeyFunction, compile_key
from ..metrics import record as metrics
from ..protocol.store import LeaseStore
from ..protocol.timing import ACL_COMMANDS, DebounceState, DelayedCopy, DueReply
from ..run.delay import copy_message, delay_again, delayed_header
from ..run.events import send_task_event
from ..run.messages import HEADER_DELAYED, HEADER_SENT, header
from ..run.stage import Ended, Run, Send, Stage
from ..states import DEBOUNCED

__all__ = [
    "HEADER_LEADER", "HEADER_RAN", "Debounce", "DebounceOptions", "DebounceState", "DebouncedRun",
    "Debouncing", "is_debounced", "on_due", "parse_debounce", "record", "send",
]

log = logging.getLogger("celery_singleflight.debounce")

#: the header naming a debounced call's burst leader (its task id)
HEADER_LEADER = "singleflight_debounce"
#: the header of a run that was decided to go ahead (re-sends of it skip the debounce)
HEADER_RAN = "singleflight_debounce_ran"
KEEPS = ("last", "first")


class DebounceOptions(OptionGroup):
    """Debounce: a burst of calls on one key becomes one run."""

    __slots__ = ()
    title = "Debounce"

    debounce = Option[Any](
        setting=False, task="debounce", check=anything, default_text="none",
        meaning="Seconds of quiet before a burst of calls on one key becomes one run ([time"
        " policies](time-policies.md)). Each `apply_async` records the call (one round trip) and sends it"
        " with a countdown; the burst's first call runs, with the kept call's arguments (`debounce_keep`),"
        " once no call came for this long; the others end `SUCCESS` with `{\"singleflight\": \"debounced\","
        " \"into\": <task id>}` (`is_debounced()`).",
        values="Seconds, above zero.",
    )
    debounce_max_wait = Option[Any](
        setting=False, task="debounce_max_wait", check=anything,
        default_text="none",
        meaning="The longest a burst waits for quiet: its run starts at most this long after its first call.",
        values="Seconds, at least `debounce`; needs `debounce`.",
    )
    debounce_keep = Option[Any](
        setting=False, task="debounce_keep", check=anything, default_text="`\"last\"`",
        meaning="Which call's arguments the run gets: the last one's (stored as JSON in Redis) or the first"
        " one's.",
        values="`\"last\"` or `\"first\"`; needs `debounce`.",
    )
    debounce_key = Option[Any](
        setting=False, task="debounce_key", check=anything, default_text="the lock key",
        meaning="The key calls are grouped by, if not the lock key (e.g. debounce per chat, lock per"
        " account).",
        values="A template or callable, as `lock_key`; needs `debounce`.",
    )


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
    wait = getattr(cls, "debounce", None)
    if wait is None:
        for option in ("debounce_max_wait", "debounce_keep", "debounce_key"):
            if getattr(cls, option, None) is not None:
                raise ConfigurationError(f"{where}: {option} needs debounce (seconds of quiet)")
        return None
    seconds = _number(where, "debounce", wait)
    assert seconds is not None
    max_wait = _number(where, "debounce_max_wait", getattr(cls, "debounce_max_wait", None), allow_none=True)
    if max_wait is not None and max_wait < seconds:
        raise ConfigurationError(
            f"{where}: debounce_max_wait={max_wait!r} must be at least debounce={wait!r}")
    keep = getattr(cls, "debounce_keep", None) or "last"
    if keep not in KEEPS:
        raise ConfigurationError(f"{where}: debounce_keep={keep!r}; choose 'last' or 'first'")
    if getattr(cls, "dedup_enqueue", None):
        raise ConfigurationError(f"{where}: debounce and dedup_enqueue both decide at send; choose one")
    spec = getattr(cls, "debounce_key", None)
    render = None if spec is None else compile_key(spec, signature, name)
    return Debounce(seconds, max_wait, keep, render)


def _payload(args: Any, kwargs: Any) -> str:
    payload: str = dumps({"args": list(args or ()), "kwargs": dict(kwargs or {})})  # type: ignore[no-untyped-call]
    return payload


def _sent(headers: Any) -> float | None:
    """When a call was sent (epoch seconds), from its stamp header, if it has one."""
    stamp = headers.get(HEADER_SENT) if isinstance(headers, dict) else header(headers, HEADER_SENT)
    return int(stamp) / 1e9 if stamp else None


def record(
    store: LeaseStore, key: str, task_id: str, deb: Debounce, args: Any, kwargs: Any,
    copy: DelayedCopy | None = None, sent: float | None = None, wait: float | None = None,
) -> tuple[str, float]:
    """One round trip: record a call (and keep ``copy``, its message; ``sent``: when it was
    sent; ``wait``: the quiet it waits for, if not ``deb.wait``); (its burst's leader, seconds
    until the burst's run is due)."""
    return store.timing.record_call(key, task_id, deb.wait if wait is None else wait, deb.max_wait, deb.keep,
                                    _payload(args, kwargs), copy, sent)


def send(task: Any, store: LeaseStore, key: str, deb: Debounce, args: Any, kwargs: Any, new_id: str,
         publish: Callable[[str, float | None, dict[str, Any]], Any], message: str | None = None,
         sent: float | None = None) -> Any:
    """Record the call and publish its message with the countdown to its burst's run (the
    leader) or that plus the grace (any other call: it stands by in case the leader is lost).
    ``message``: the call's message, kept in Redis in the same round trip, in case the worker
    holding the countdown message dies (:mod:`..run.delay`). If Redis cannot record it, the
    message goes without the headers and is recorded when it comes."""
    copy = None if message is None else DelayedCopy(uuid.uuid4().hex, message, HEADER_LEADER)
    try:
        leader, wait = record(store, key, new_id, deb, args, kwargs, copy, sent)
    except redis.RedisError as exc:
        log.warning("%s key=%r: could not record the debounced call (it is recorded when it runs): %s",
                    task.name, key, exc)
        return publish(new_id, None, {})
    countdown = wait if leader == new_id else wait + constants.DEBOUNCE_GRACE
    headers = {HEADER_LEADER: leader}
    if copy is not None:
        headers[HEADER_DELAYED] = delayed_header(copy.token, key)
    return publish(new_id, countdown, headers)


def _resend(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], countdown: float, leader: str,
            key: str, calls: int, planned: float) -> None:
    """Re-send the current message with ``countdown``, naming ``leader``; ``DEBOUNCED`` first."""
    request = task.request
    task_id = request.id or ""
    meta: dict[str, Any] = {"key": key, "leader": leader, "calls": calls, "planned": round(planned, 3)}
    if not (request.ignore_result or task.ignore_result):
        task.backend.store_result(task_id, meta, DEBOUNCED)
    delay_again(task, args, kwargs, countdown, key, **{HEADER_LEADER: leader})
    send_task_event(task.app, "task-debounced", request.hostname, uuid=task_id, **meta)


def on_due(task: Any, store: LeaseStore, key: str, deb: Debounce, args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | DebouncedRun:
    """The current message came due: the arguments to run with, a folded call's result, or
    (``Ignore``) re-sent for later. Redis errors propagate."""
    request = task.request
    task_id = request.id or ""
    leader = str(header(request, HEADER_LEADER) or "")
    token = uuid.uuid4().hex  # this execution's: a replay of the script carries it, a second delivery not
    sent = _sent(request)
    due = store.timing.due(key, task_id, leader, token, sent, _payload(args, kwargs), deb.keep, deb.wait)
    if due.kind == DueReply.RUN:
        payload = loads(due.payload)  # type: ignore[no-untyped-call]
        if not due.closed_here:
            # the broker delivered this run twice (acks_late after a crash, a visibility timeout):
            # it goes on as any redelivery does; the lease turns it away while the other runs
            log.warning("%s[%s] key=%r: another delivery of a debounced run", task.name, task_id, key)
        # re-sends of this run (rate limit, retry policy, self.retry()) skip the debounce
        request.headers = {**(request.headers or {}), HEADER_RAN: task_id}
        log.info("%s[%s] key=%r: runs for %s debounced calls", task.name, task_id, key, due.calls)
        return tuple(payload.get("args") or ()), dict(payload.get("kwargs") or {})
    if due.kind == DueReply.FOLDED:
        log.info("%s[%s] key=%r: debounced into %s", task.name, task_id, key, due.into)
        metrics.count("calls_folded", task.name)
        return {"singleflight": "debounced", "key": key, "into": due.into, "calls": due.calls}
    if due.kind == DueReply.WAIT:
        _resend(task, args, kwargs, due.wait, leader, key, due.calls, due.planned)
        raise Ignore()
    # not recorded yet (sent by name, or the record at send failed), or its burst was lost with the
    # Redis data (it names itself its leader): record it now; a burst recorded again waits a grace
    # longer, so that the other calls of the lost burst, which come that much later, join it
    again = leader == task_id
    leader, wait = record(store, key, task_id, deb, args, kwargs, None, sent,
                          deb.wait + constants.DEBOUNCE_GRACE if again else None)
    countdown = wait if leader == task_id else wait + constants.DEBOUNCE_GRACE
    _resend(task, args, kwargs, countdown, leader, key, 0, mod_time.time() + wait)
    raise Ignore()


class Debouncing(Stage):
    """The stage of a task with ``debounce``."""

    options = DebounceOptions
    acl_commands = ACL_COMMANDS

    def __init__(self, deb: Debounce) -> None:
        self.deb = deb

    @classmethod
    def define(cls, task_cls: type, signature: Any, name: str) -> Debounce | None:
        return parse_debounce(task_cls, f"task {name}", signature, name)

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return None if defined is None else cls(defined)

    def key_for(self, task: Any, args: Any, kwargs: Any) -> str:
        """The debounce key of a call: ``debounce_key`` rendered, else the lock key."""
        if self.deb.render is not None:
            return str(self.deb.render(tuple(args or ()), dict(kwargs or {})))
        return str(task.render_key(*(args or ()), **(kwargs or {})))

    def send(self, call: Send, proceed: Callable[[Send], Any]) -> Any:
        """Record the call in its burst (one round trip) and send it with the countdown to the
        burst's run; the debounce decides the time, so a countdown or eta given is replaced."""
        if call.task_id is not None or call.eager:
            return proceed(call)

        if HEADER_SENT not in call.headers():  # a re-sent call keeps the time it was first sent
            call.add_headers(**{HEADER_SENT: mod_time.time_ns()})

        def publish(new_id: str, countdown: float | None, headers: dict[str, Any]) -> Any:
            call.task_id = new_id
            if countdown is not None:
                call.options.pop("eta", None)
                call.options["countdown"] = countdown
            call.add_headers(**headers)
            return call.publish(call)

        key = call.key if self.deb.render is None else self.key_for(call.task, call.args, call.kwargs)
        new_id = str(uuid.uuid4())
        message = copy_message(call.task, new_id, call.args, call.kwargs, call.options)
        return send(call.task, call.task.store, key, self.deb, call.args, call.kwargs, new_id, publish,
                    message, _sent(call.headers()))

    def before_key(self, run: Run) -> Ended | None:
        if run.eager or header(run.request, HEADER_RAN):
            return None
        decided = on_due(run.task, run.task.store, self.error_key(run), self.deb, run.args, run.kwargs)
        if isinstance(decided, dict):
            return Ended(decided)  # folded into the burst's run
        run.args, run.kwargs = decided  # the burst's chosen arguments
        return None

    def error_key(self, run: Run) -> str:
        return self.key_for(run.task, run.args, run.kwargs)
