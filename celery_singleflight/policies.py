"""What a duplicate does: one small function per ``on_duplicate`` policy, in one table.

A duplicate is a run that found every slot of its key held. :func:`handle_duplicate` picks the
policy that applies (beat ticks and direct or eager calls get another than the task's own),
reports the duplicate once (log, signal, a count on the holder's status) and calls the policy's
function from :data:`POLICIES`. A policy returns the run's result, raises the error it ends
with (``LockHeld``, ``Retry``, ``Ignore``), or returns :data:`ACQUIRE_AGAIN` when the key turned
out to be free meanwhile. A new policy is one function and one row.

Every outcome is terminal and truthful: ``skip`` ends SUCCESS with a result saying why, ``raise``
FAILURE with ``LockHeld``, ``retry`` RETRY then the state of its own run, ``queue`` QUEUED then
the state of its own run, ``join`` JOINED then the holder's result, ``coalesce`` QUEUED then the
state of its own run, or SUCCESS with a "coalesced into <id>" result (``is_coalesced()``) for a
run that another one replaced or that was dropped in favour of the pending one.
"""

from __future__ import annotations

import logging
import random
import time as mod_time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery.exceptions import Ignore

from . import signals
from .errors import LockHeld, QueueFull, Superseded
from .guard import Guard
from .messages import HEADER_HANDOFF, HEADER_SENT, header, message_of, resend, wait_state
from .outcome import coalesced, skipped
from .replies import Held, Parked
from .scripts import OWN_COPY
from .settle import answer_joined
from .states import JOINED, QUEUED
from .store import LeaseStore

__all__ = ["ACQUIRE_AGAIN", "POLICIES", "RESUME_GRACE", "Duplicate", "coalesce_started", "effective_policy",
           "handle_duplicate"]

log = logging.getLogger("celery_singleflight.duplicate")

#: returned by a policy that found the key free again: try to take it
ACQUIRE_AGAIN: Any = object()
#: how long after a holder's lease would run out the sweeper looks at its key
RESUME_GRACE = 0.5
# the retry policy's waits are never shorter (a jittered wait of a tiny backoff)
_MIN_DELAY = 0.05


@dataclass
class Duplicate:
    """A run that found its key held, and what it needs to act: its task, guard and arguments."""

    task: Any  # the SingleFlightTask (not imported: it imports this module)
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
        retry, queued, queue-full, joined, redelivery); ``detail`` is for people."""
        task, held = self.task, self.held
        log.log(level, "duplicate %s[%s] key=%r held by %s (%.1fs left): %s",
                task.name, self.task_id, self.key, held.holder, held.ttl_left, detail)
        signals.duplicate.send(
            sender=task.name, key=self.key, task_id=self.task_id, holder=held.holder, ttl_left=held.ttl_left,
            policy=self.policy, outcome=outcome, detail=detail,
        )
        try:
            self.guard.store.note_duplicate(self.key, self.task_id, outcome)
        except redis.RedisError as exc:
            log.debug("could not note the duplicate on key=%r: %s", self.key, exc)

    def clear_marker(self) -> None:
        """This run is turned away: the next enqueue of its key may send a new message."""
        if self.guard.clear_marker and self.task_id:
            try:
                self.guard.store.clear_enqueued(self.key, self.task_id)
            except redis.RedisError as exc:
                log.debug("could not clear the enqueue marker of key=%r: %s", self.key, exc)

    def store_state(self, state: str, meta: dict[str, Any]) -> None:
        task = self.task
        if not (task.request.ignore_result or task.ignore_result):
            task.backend.store_result(self.task_id, meta, state)


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
    held, opts = dup.held, dup.guard.options
    error = LockHeld(dup.key, held.holder, held.ttl_left)
    first_seen, attempt = wait_state(dup.task.request)
    waited = mod_time.time() - first_seen
    left = opts.max_wait - waited
    if left > 0:
        wait = opts.retry_backoff * (2 ** min(attempt, 30) if opts.retry_backoff_grows else 1)
        if opts.retry_backoff_max is not None:
            wait = min(wait, opts.retry_backoff_max)
        cap = min(wait, max(held.ttl_left, _MIN_DELAY), left)
        delay = max(_MIN_DELAY, random.uniform(cap / 2, cap) if opts.retry_jitter else cap)
        dup.report("retry", f"retry in {delay:.2f}s", logging.INFO)
        resend(dup.task, dup.args, dup.kwargs, delay, first_seen, attempt + 1, error)
    dup.report("raised", f"gave up after {waited:.1f}s", logging.WARNING)
    dup.clear_marker()
    raise error


def park(dup: Duplicate) -> Any:
    """``queue``: wait in the key's FIFO in Redis (the worker slot is free at once); re-sent with
    the same task id the moment the key is handed to it. ``QUEUED`` meanwhile.

    The ``QUEUED`` state is stored before the run is parked: once parked, it can be handed the
    key, run and store its own result at any moment, which a later ``QUEUED`` would overwrite
    (and ``.get()`` would never return)."""
    opts = dup.guard.options
    held = dup.held
    handoff = uuid.uuid4().hex
    message = message_of(dup.task, dup.args, dup.kwargs, **{HEADER_HANDOFF: handoff})
    dup.store_state(QUEUED, {"key": dup.key, "holder": held.holder})
    parked = dup.guard.store.park(dup.key, dup.task_id, handoff, message, opts.max_queued, RESUME_GRACE,
                                  opts.max_concurrency)
    if parked is None:
        return ACQUIRE_AGAIN  # runs now: its own result replaces QUEUED
    if not isinstance(parked, Parked):
        dup.report("queue-full", f"queue full ({parked} waiting)", logging.WARNING)
        dup.clear_marker()
        raise QueueFull(dup.key, held.holder, held.ttl_left, parked)
    dup.report("queued", f"queued at position {parked.position}", logging.INFO)
    raise Ignore()


def join(dup: Duplicate) -> Any:
    """``join``: do not run; get the holder's result (or error) as its own. ``JOINED`` meanwhile.

    ``JOINED`` is stored before the run joins: once in the joined list, the holder may end and
    answer it at any moment, and a ``JOINED`` written after that answer would replace it for good
    (found by benchmarks/bench_contended.py: 1 to 8 of 2,000 duplicates stayed ``JOINED``)."""
    dup.task.backend.store_result(dup.task_id, {"key": dup.key, "holder": dup.held.holder}, JOINED)
    joined = dup.guard.store.join(dup.key, message_of(dup.task, dup.args, dup.kwargs), RESUME_GRACE)
    if joined is None:
        return ACQUIRE_AGAIN  # runs now: its own result replaces JOINED
    dup.report("joined", f"joined ({joined[0]} waiting for its result)", logging.INFO)
    dup.clear_marker()
    raise Ignore()


def coalesce(dup: Duplicate) -> Any:
    """``coalesce``: at most one run pending per key, besides the one running. The first
    duplicate parks as ``queue`` does (``QUEUED``; handed the key by the holder's release, no
    polling). A later-sent duplicate replaces it (``coalesce_keep="last"``): the replaced run ends
    SUCCESS with a ``coalesced`` result naming the newcomer, and the newcomer waits in its place;
    with ``"first"`` (or when it was sent before the pending one) the newcomer ends that way
    instead, naming the pending run. "Later-sent": by the ``apply_async`` stamp; runs sent by
    name carry none and count as the newest (arrival order)."""
    opts, task = dup.guard.options, dup.task
    store = dup.guard.store
    handoff = uuid.uuid4().hex
    message = message_of(task, dup.args, dup.kwargs, **{HEADER_HANDOFF: handoff})
    dup.store_state(QUEUED, {"key": dup.key, "holder": dup.held.holder})
    stamp = str(header(task.request, HEADER_SENT) or "")
    got = store.coalesce(dup.key, dup.task_id, handoff, message, opts.coalesce_keep, stamp, RESUME_GRACE,
                         opts.max_concurrency)
    if got is None:
        return ACQUIRE_AGAIN  # runs now: its own result replaces QUEUED
    if isinstance(got, str):
        dup.report("coalesced", f"coalesced into pending {got}", logging.INFO)
        dup.clear_marker()
        return coalesced(dup.key, got)
    if got:
        _end_replaced(task, store, dup.key, dup.task_id, got)
    dup.report("queued", f"pending (replaced {len(got)})", logging.INFO)
    raise Ignore()


def supersede(dup: Duplicate) -> Any:
    """``supersede``: newest wins. The newcomer becomes the key's one pending run (``QUEUED``, as
    ``coalesce`` with "last") and marks the holder superseded (by whom, when), atomically. The
    holder learns it at its next renewal (``self.lease.superseded``; ``check()`` and
    ``progress()`` raise :class:`Superseded`); a worker's sweeper revokes it with ``terminate=True``
    once ``supersede_grace`` has passed. The newcomer starts when the key is released, with a
    larger fence. A pending newcomer replaced by a newer one ends FAILURE with ``Superseded``."""
    opts, task = dup.guard.options, dup.task
    store = dup.guard.store
    handoff = uuid.uuid4().hex
    message = message_of(task, dup.args, dup.kwargs, **{HEADER_HANDOFF: handoff})
    dup.store_state(QUEUED, {"key": dup.key, "holder": dup.held.holder})
    stamp = str(header(task.request, HEADER_SENT) or "")
    got = store.coalesce(dup.key, dup.task_id, handoff, message, "supersede", stamp, RESUME_GRACE, 1,
                         supersede_grace=opts.supersede_grace, supersede_signal=opts.supersede_signal)
    if got is None:
        return ACQUIRE_AGAIN  # runs now: its own result replaces QUEUED
    if isinstance(got, str):
        dup.report("superseded", f"superseded by pending {got}, sent after it", logging.INFO)
        dup.clear_marker()
        raise Superseded(dup.key, got)
    if got:
        _end_replaced(task, store, dup.key, dup.task_id, got, supersede=True)
    dup.report("superseding", f"supersedes {dup.held.holder}", logging.INFO)
    raise Ignore()


def _end_replaced(task: Any, store: LeaseStore, key: str, into: str, messages: tuple[str, ...], *,
                  supersede: bool = False) -> None:
    """End the runs ``into`` replaced: SUCCESS with a coalesced result, or (``supersede``)
    FAILURE with :class:`Superseded`; their callbacks and chains go on as for joined runs. Then
    forget them."""
    if supersede:
        answer_joined(task.app, messages, key, into, error=Superseded(key, into), label="superseded run")
    else:
        answer_joined(task.app, messages, key, into, result=coalesced(key, into), label="coalesced run")
    try:
        store.coalesce_answered(key, into)
    except redis.RedisError as exc:  # they are ended again (the same result) when ``into`` starts
        log.debug("could not clear the replaced runs of key=%r: %s", key, exc)


def coalesce_started(task: Any, guard: Guard) -> None:
    """A pending ``coalesce`` or ``supersede`` run starts: end the runs it replaced whose ending
    its caller may not have written (it died right after replacing them). One round trip, then
    nothing more in the usual case."""
    try:
        owed = guard.store.coalesce_owed(guard.key, task.request.id or "")
    except redis.RedisError as exc:
        log.debug("could not read the replaced runs of key=%r: %s", guard.key, exc)
        return
    if owed:
        _end_replaced(task, guard.store, guard.key, task.request.id or "", owed,
                      supersede=effective_policy(task) == "supersede")


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
    message = message_of(task, dup.args, dup.kwargs, **{HEADER_HANDOFF: handoff})
    try:
        parked = dup.guard.store.park(dup.key, dup.task_id, handoff, message, None, RESUME_GRACE,
                                      dup.guard.options.max_concurrency)
    except redis.RedisError as exc:
        log.warning("could not keep a copy of redelivered %s[%s] key=%r (if the first delivery's worker"
                    " dies too, the task is not run again): %s", task.name, dup.task_id, dup.key, exc)
        raise Ignore() from None
    if parked is None:
        log.info("the first delivery of %s[%s] released key=%r meanwhile; this redelivery is not run",
                 task.name, dup.task_id, dup.key)
    raise Ignore()


#: ``on_duplicate`` -> what the duplicate does
POLICIES: dict[str, Callable[[Duplicate], Any]] = {
    "raise": refuse,
    "skip": skip,
    "retry": retry_later,
    "queue": park,
    "join": join,
    "coalesce": coalesce,
    "supersede": supersede,
}


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


def handle_duplicate(
    task: Any, guard: Guard, held: Held, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Apply the duplicate policy to the current run of ``task`` (see the module docstring)."""
    request = task.request
    task_id = request.id or ""
    if held.holder and held.holder == task_id and not request.called_directly:
        return turn_away_redelivery(Duplicate(task, guard, held, args, kwargs, "redelivery"))
    policy = effective_policy(task)
    return POLICIES[policy](Duplicate(task, guard, held, args, kwargs, policy))
