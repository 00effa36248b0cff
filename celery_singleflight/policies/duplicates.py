"""What a duplicate does: the ``raise``, ``skip``, ``retry``, ``queue`` and ``join`` policies,
one small function each, and the stage that picks the policy for a run.

A duplicate is a run that found every slot of its key held. The stage picks the policy that
applies (a direct or eager call always raises; a beat tick gets ``on_beat_duplicate``; a run
whose holder is its own task id is a redelivery), reports the duplicate once (log, signal, a
count on the holder's status) and calls the policy's function, from the table of every stage's
policies (``coalesce`` and ``supersede`` are :mod:`.newest`'s). A policy returns the run's
result, raises the error it ends with (``LockHeld``, ``Retry``, ``Ignore``), or returns
:data:`~..run.stage.AGAIN` when the key turned out to be free meanwhile.

Every outcome is terminal and truthful: ``skip`` ends SUCCESS with a result saying why, ``raise``
FAILURE with ``LockHeld``, ``retry`` RETRY then the state of its own run, ``queue`` QUEUED then
the state of its own run, ``join`` JOINED then the holder's result.
"""

from __future__ import annotations

import logging
import random
import time as mod_time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import redis
from celery.exceptions import Ignore

from .. import constants, signals, tracing
from ..config.option import Derived, Option, OptionGroup, Resolving, count, flag, seconds
from ..errors import ConfigurationError, KeyPaused, LockHeld, QueueFull
from ..protocol.controls import Paused
from ..protocol.delayed import Claim
from ..protocol.handoff import OWN_COPY
from ..protocol.replies import Held, Parked
from ..run.delay import resend_delayed
from ..run.guard import Guard
from ..run.journal import journal_waiting, new_mark
from ..run.messages import HEADER_HANDOFF, HEADER_PARKED_AT, header, message_of, wait_state
from ..run.stage import AGAIN, Run, Stage
from ..states import JOINED, QUEUED

__all__ = ["Duplicate", "DuplicateOptions", "DuplicatePolicies", "SkippedRun", "effective_policy",
           "is_skipped", "skipped"]

log = logging.getLogger("celery_singleflight.duplicate")


def _backoff(where: str, value: Any, ctx: Resolving) -> float:
    if value is None or value is False:
        return constants.RETRY_FIRST_WAIT
    if value is True:
        return 1.0
    return seconds()(where, value, ctx)  # type: ignore[no-any-return]


class DuplicateOptions(OptionGroup):
    """The duplicate policies: how long ``retry`` retries, how many ``queue`` parks."""

    __slots__ = ()
    title = "Duplicates"

    max_wait = Option[float](
        task="max_wait", default=60.0, check=seconds(allow_zero=True),
        meaning="The `retry` policy: how long from its first attempt a duplicate keeps being re-sent; then"
        " it fails with `LockHeld`, as `raise` would ([details](policies.md#retry)).",
        values="Seconds, zero or more (zero: give up at the first duplicate).",
    )
    retry_backoff = Option[float](
        task="retry_backoff", check=_backoff, default_text="0.1 s",
        meaning="The `retry` policy's first wait, doubling after it, never longer than the holder's lease"
        " time left ([policies](policies.md#retry)). A task that also uses `autoretry_for` shares it with"
        " Celery's option of that name.",
        values="Seconds, above zero; `True` for 1 s; `False` keeps every wait at 0.1 s.",
    )
    #: each wait of the ``retry`` policy doubles the one before (``retry_backoff`` is not False)
    retry_backoff_grows = Derived[bool](lambda ctx: ctx.raw["retry_backoff"] is not False)
    retry_backoff_max = Option["float | None"](
        task="retry_backoff_max", check=seconds(optional=True),
        default_text="none",
        meaning="The `retry` policy's longest wait. Unset: only the holder's lease time left and `max_wait`"
        " cap the waits.",
        values="Seconds, above zero.",
    )
    retry_jitter = Option[bool](
        task="retry_jitter", default=True, check=flag(),
        meaning="Whether the `retry` policy waits a random half to all of each wait, so that duplicates do"
        " not come back at once.",
        values="`True` or `False`.",
    )
    max_queued = Option["int | None"](
        task="max_queued", check=count(0, optional=True), default_text="no limit",
        meaning="The `queue` policy: how many runs may wait per key; one more fails with `QueueFull` (a"
        " `LockHeld`), logged at WARNING. Periodic tasks should set 1 ([beat](beat.md)).",
        values="A whole number, zero or more.",
    )

    @classmethod
    def validate(cls, ctx: Resolving) -> None:
        values = ctx.values
        if "join" in (values["on_duplicate"], values["on_beat_duplicate"]) and values["max_concurrency"] != 1:
            raise ConfigurationError(
                f"task {ctx.name}: on_duplicate='join' needs max_concurrency=1 (with several runs at once"
                " there is no single result to join)"
            )


class SkippedRun(TypedDict):
    """Result of a duplicate that did not run because ``key`` was held by ``holder``."""

    singleflight: str
    key: str
    holder: str
    ttl_left: float


def skipped(key: str, holder: str, ttl_left: float) -> SkippedRun:
    return {"singleflight": "skipped", "key": key, "holder": holder, "ttl_left": round(ttl_left, 3)}


def is_skipped(result: Any) -> bool:
    """True if ``result`` (e.g. ``AsyncResult.get()``) is the outcome of a skipped duplicate."""
    return isinstance(result, dict) and result.get("singleflight") == "skipped"


@dataclass
class Duplicate:
    """A run that found its key held, and what it needs to act: its task, guard and arguments."""

    task: Any
    guard: Guard
    held: Held
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    policy: str

    @property
    def key(self) -> str:
        return self.guard.key

    @property
    def task_id(self) -> str:
        return self.task.request.id or ""

    def report(self, outcome: str, detail: str, level: int) -> None:
        """Log, signal and count the duplicate. ``outcome`` is a stable code (skipped, raised,
        retry, queued, queue-full, joined, redelivery, ...); ``detail`` is for people."""
        task, held = self.task, self.held
        log.log(level, "duplicate %s[%s] key=%r held by %s (%.1fs left): %s",
                task.name, self.task_id, self.key, held.holder, held.ttl_left, detail)
        signals.duplicate.send(
            sender=task.name, key=self.key, task_id=self.task_id, holder=held.holder, ttl_left=held.ttl_left,
            policy=self.policy, outcome=outcome, detail=detail,
        )
        tracing.decided(self.policy, outcome)  # on the decision's span, when traced
        try:
            self.guard.store.marks.note_duplicate(self.key, self.task_id, outcome)
        except redis.RedisError as exc:
            log.debug("could not note the duplicate on key=%r: %s", self.key, exc)

    def clear_marker(self) -> None:
        """This run is turned away: the next enqueue of its key may send a new message."""
        if self.guard.clear_marker and self.task_id:
            try:
                self.guard.store.marks.clear_enqueued(self.key, self.task_id)
            except redis.RedisError as exc:
                log.debug("could not clear the enqueue marker of key=%r: %s", self.key, exc)

    def store_state(self, state: str, meta: dict[str, Any]) -> None:
        task = self.task
        if not (task.request.ignore_result or task.ignore_result):
            task.backend.store_result(self.task_id, meta, state)

    def message(self, handoff: str, **headers: Any) -> str:
        """The run's own message, re-sendable, carrying the ``handoff`` token it waits with."""
        return message_of(self.task, self.args, self.kwargs, **{HEADER_HANDOFF: handoff, **headers})


def refuse(dup: Duplicate) -> Any:
    """``raise``: fail with :class:`LockHeld` (key, holder, time left), logged at INFO."""
    dup.report("raised", "raised", logging.INFO)
    dup.clear_marker()
    raise LockHeld(dup.key, dup.held.holder, dup.held.ttl_left)


def skip(dup: Duplicate) -> Any:
    """``skip``: end SUCCESS without running, with a result that says why (``is_skipped()``)."""
    dup.report("skipped", "skipped", logging.INFO)
    dup.clear_marker()
    return skipped(dup.key, dup.held.holder, dup.held.ttl_left)


def retry_later(dup: Duplicate) -> Any:
    """``retry``: re-send after a backoff (``retry_backoff``: doubling from 0.1 s by default, at
    most ``retry_backoff_max``, never longer than the holder's lease time left; with
    ``retry_jitter``, a random wait between half and all of it), without spending
    ``max_retries``; after ``max_wait``, fail as ``raise``."""
    held, opts = dup.held, dup.task.options
    error = LockHeld(dup.key, held.holder, held.ttl_left)
    first_seen, attempt = wait_state(dup.task.request)
    waited = mod_time.time() - first_seen
    left = opts.max_wait - waited
    if left > 0:
        wait = opts.retry_backoff * (2 ** min(attempt, 30) if opts.retry_backoff_grows else 1)
        if opts.retry_backoff_max is not None:
            wait = min(wait, opts.retry_backoff_max)
        cap = min(wait, max(held.ttl_left, constants.RETRY_MIN_DELAY), left)
        delay = max(constants.RETRY_MIN_DELAY, random.uniform(cap / 2, cap) if opts.retry_jitter else cap)
        dup.report("retry", f"retry in {delay:.2f}s", logging.INFO)
        resend_delayed(dup.task, dup.args, dup.kwargs, delay, first_seen, attempt + 1, error, dup.key)
    dup.report("raised", f"gave up after {waited:.1f}s", logging.WARNING)
    dup.clear_marker()
    raise error


def park(dup: Duplicate) -> Any:
    """``queue``: wait in the key's FIFO in Redis (the worker slot is free at once); re-sent with
    the same task id the moment the key is handed to it. ``QUEUED`` meanwhile.

    The ``QUEUED`` state is stored before the run is parked: once parked, it can be handed the
    key, run and store its own result at any moment, which a later ``QUEUED`` would overwrite
    (and ``.get()`` would never return)."""
    opts = dup.task.options
    held = dup.held
    handoff = uuid.uuid4().hex
    dup.store_state(QUEUED, {"key": dup.key, "holder": held.holder})
    message = dup.message(handoff, **{HEADER_PARKED_AT: mod_time.time()})  # random already: the token
    mark = new_mark()
    parked = dup.guard.store.handoff.park(dup.key, dup.task_id, handoff, message, opts.max_queued,
                                          opts.max_concurrency, mark=mark)
    if parked is None:
        return AGAIN  # runs now: its own result replaces QUEUED
    if not isinstance(parked, Parked):
        dup.report("queue-full", f"queue full ({parked} waiting)", logging.WARNING)
        dup.clear_marker()
        raise QueueFull(dup.key, held.holder, held.ttl_left, parked)
    journal_waiting(dup.task, dup.key, message, "park", mark=mark)
    dup.report("queued", f"queued at position {parked.position}", logging.INFO)
    raise Ignore()


def join(dup: Duplicate) -> Any:
    """``join``: do not run; get the holder's result (or error) as its own. ``JOINED`` meanwhile.

    ``JOINED`` is stored before the run joins: once in the joined list, the holder may end and
    answer it at any moment, and a ``JOINED`` written after that answer would replace it for good
    (found by benchmarks/bench_contended.py: 1 to 8 of 2,000 duplicates stayed ``JOINED``)."""
    dup.task.backend.store_result(dup.task_id, {"key": dup.key, "holder": dup.held.holder}, JOINED)
    message = message_of(dup.task, dup.args, dup.kwargs)
    mark = new_mark()
    joined = dup.guard.store.handoff.join(dup.key, message, mark=mark)
    if joined is None:
        return AGAIN  # runs now: its own result replaces JOINED
    journal_waiting(dup.task, dup.key, message, "join", mark=mark)
    dup.report("joined", f"joined ({joined[0]} waiting for its result)", logging.INFO)
    dup.clear_marker()
    raise Ignore()


def turn_away_redelivery(dup: Duplicate) -> Any:
    """The broker delivered a running task again (visibility timeout): the first delivery is
    still running and will store the result; this one must not run.

    Acknowledging it (Ignore) can acknowledge the first delivery too: the Redis broker gives both
    the same delivery tag. So a copy of it is parked first, at the front of the key's queue: it
    is dropped when the first delivery releases, and sent by the sweeper if that run's lease ends
    without a release (its worker died), so the task still runs once more.
    """
    dup.report("redelivery", "redelivery of a running task, not run again", logging.WARNING)
    task = dup.task
    handoff = f"{OWN_COPY}{uuid.uuid4().hex}"  # the scripts recognise an own copy by this prefix
    try:
        parked = dup.guard.store.handoff.park(dup.key, dup.task_id, handoff, dup.message(handoff), None,
                                              task.options.max_concurrency)
    except redis.RedisError as exc:
        log.warning("could not keep a copy of redelivered %s[%s] key=%r (if the first delivery's worker"
                    " dies too, the task is not run again): %s", task.name, dup.task_id, dup.key, exc)
        raise Ignore() from None
    if parked is None:
        log.info("the first delivery of %s[%s] released key=%r meanwhile; this redelivery is not run",
                 task.name, dup.task_id, dup.key)
    raise Ignore()


def wait_for_own_attempt(dup: Duplicate, claim: Claim) -> Any:
    """A delayed run that claimed its copy finds its key held by its own task id: an earlier
    attempt of this very run whose claim a sweeper took back (its worker seemed gone, or it was
    slow) took the lease, and will not start. This run is the one that runs: it waits for that
    lease, delayed again by its time left (a copy in Redis, as every delay), whatever its policy;
    it is no redelivery to turn away (the earlier attempt's release would drop its copy)."""
    held = dup.held
    delay = max(held.ttl_left, constants.RETRY_MIN_DELAY)
    dup.report("own-attempt", f"its earlier attempt holds the key; delayed {delay:.2f}s", logging.INFO)
    first_seen, attempt = wait_state(dup.task.request)
    resend_delayed(dup.task, dup.args, dup.kwargs, delay, first_seen, attempt,
                   LockHeld(dup.key, held.holder, held.ttl_left), claim.key)


def wait_for_pause(dup: Duplicate, eager: bool) -> Any:
    """The key is paused (``pause``, or a run that raised ``RetryAfter``): the run parks in the
    key's queue as ``queue`` parks it (``QUEUED``), and the sweeper sends it when the pause ends,
    in order. A direct or eager call has no message to park: it fails with :class:`KeyPaused`."""
    if eager:
        dup.report("raised", "the key is paused", logging.INFO)
        raise KeyPaused(dup.key, dup.held.holder or None, dup.held.ttl_left)
    return park(dup)


def effective_policy(task: Any) -> str:
    """The policy for the current run: a direct or eager call has no message to re-send or park
    and no result to report, so it always raises; a beat tick gets ``on_beat_duplicate``
    (celery beat marks its messages, Celery 5.5+); any other run the task's ``on_duplicate``."""
    request, opts = task.request, task.options
    if request.called_directly or request.is_eager:
        return "raise"
    if header(request, "celery_beat_task"):
        return str(opts.on_beat_duplicate)
    return str(opts.on_duplicate)


class DuplicatePolicies(Stage):
    """The stage every guarded task has: a duplicate gets its policy."""

    options = DuplicateOptions
    throws = (LockHeld,)
    #: the policies of this module, by ``on_duplicate`` name
    POLICIES: dict[str, Callable[[Duplicate], Any]] = {
        "raise": refuse, "skip": skip, "retry": retry_later, "queue": park, "join": join,
    }
    outcomes = {"raise": ("raised",), "skip": ("skipped",), "retry": ("retry", "raised"),
                "queue": ("queued", "queue-full"), "join": ("joined",)}

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        joins = "join" in (opts.on_duplicate, opts.on_beat_duplicate)
        if joins and getattr(task_cls, "ignore_result", False):
            raise ConfigurationError(
                f"task {getattr(task_cls, 'name', task_cls)}: on_duplicate='join' hands the holder's result"
                " to its duplicates, so it needs ignore_result=False"
            )
        return cls()

    def policies(self) -> dict[str, Callable[..., Any]]:
        return dict(self.POLICIES)

    def on_duplicate(self, run: Run, held: Held) -> Any:
        task = run.task
        assert run.guard is not None
        if held.holder and held.holder == run.task_id and not run.request.called_directly:
            if run.claim is not None:  # this run claimed its delayed copy: the holder is a stale attempt
                return wait_for_own_attempt(Duplicate(task, run.guard, held, run.args, run.kwargs, "own"),
                                            run.claim)
            return turn_away_redelivery(Duplicate(task, run.guard, held, run.args, run.kwargs, "redelivery"))
        if isinstance(held, Paused):  # a paused key: every run waits in its queue, whatever its policy
            return wait_for_pause(Duplicate(task, run.guard, held, run.args, run.kwargs, "paused"), run.eager)
        policy = effective_policy(task)
        return run.pipeline.policies[policy](Duplicate(task, run.guard, held, run.args, run.kwargs, policy))
