"""One run's life on one key: take the lease, keep it, report progress, release it, settle.

:class:`Guard` is the single lifecycle behind both doors, a task's run (:mod:`.pipeline`) and
:func:`~.hold.hold`::

    guard = Guard(app, key, options, holder, sender=task.name)
    got = guard.take()              # one round trip: Acquired, or Held (a free key handed on is settled)
    lease = guard.begin(got)        # heartbeat, signal, log
    guard.progress(update)          # throttled, owner-checked, one round trip per write
    guard.end("succeeded", result=value)   # flush progress, release, settle (always, once)

What a release hands back (a parked run to send, joined runs to answer) is carried out by
:func:`~.settle.settle`, the same function every other release path calls. The take and the
release are spans when the run is traced (:mod:`..tracing`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time as mod_time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from .. import constants, signals, tracing
from ..config.core import CoreOptions
from ..connection.clients import last_attempt_sent
from ..errors import LeaseLost, NotInsideRun, RetryAfter
from ..metrics import hooks as metric_hooks
from ..metrics import record as metrics
from ..protocol.replies import Acquired, Held, Holder, Settlement
from ..protocol.store import LeaseStore, store_for
from .heartbeat import Heartbeat, heartbeat_for
from .lease import Lease
from .messages import HEADER_HANDOFF, message_of
from .progress import ProgressReporter, ProgressUpdate
from .settle import NO_RESULT, Ending, settle

__all__ = ["HOLD_SENDER", "Guard", "options_store"]

#: the sender of signals and the ``task_name`` recorded for holds (``hold()``)
HOLD_SENDER = "hold"

log_acquire = logging.getLogger("celery_singleflight.acquire")
log_release = logging.getLogger("celery_singleflight.release")

#: called after each progress write with the data written (the task adds Celery meta and events)
ProgressHook = Callable[[Lease, dict[str, Any]], None]


def options_store(opts: CoreOptions) -> LeaseStore:
    """The lease store of this process for a task's (or hold's) options (looked up once per
    options object and process: every run asks)."""
    known = _stores.get(id(opts))
    pid = os.getpid()
    if known is not None and known[0] is opts and known[1] == pid:
        return known[2]
    store = store_for(opts.redis, opts.namespace, opts.status_retention, opts.history_length,
                      opts.min_replicas, opts.min_replicas_timeout)
    if len(_stores) >= 256:  # options made per call stay bounded
        _stores.clear()
    _stores[id(opts)] = (opts, pid, store)
    return store


_stores: dict[int, tuple[CoreOptions, int, LeaseStore]] = {}


class Guard:
    """The lease of one run on one key, from take to settle (see the module docstring).

    ``sender``: the name on signals and logs (the task name, or ``hold``). ``clear_marker``: the
    run's task dedups at enqueue, so its release clears the enqueue marker of its task id.
    ``computes_result=False`` (a hold): runs that joined it are sent to run themselves at its end.
    ``request``: the run's task request (for the metrics: whether the run waited). ``token``:
    the lease's token, if the run drew it before (a delayed run's claim names it).
    """

    def __init__(
        self, app: Any, key: str, options: CoreOptions, holder: Holder, *, sender: str,
        clear_marker: bool = False, on_progress: ProgressHook | None = None, store: LeaseStore | None = None,
        computes_result: bool = True, request: Any = None, token: str | None = None,
    ) -> None:
        self.app = app
        self.key = key
        self.options = options
        self.holder = holder
        self.sender = sender
        self.clear_marker = clear_marker
        self.on_progress = on_progress
        self.computes_result = computes_result
        self.request = request  # the task's request (None for a hold): its headers say if it waited
        self.store = store or options_store(options)
        self.token = token or os.urandom(16).hex()  # unique to this execution
        self.lease: Lease | None = None
        self._beat: Heartbeat | None = None  # the renewer the lease was added to (begin)
        self._asked = 0.0  # when the last acquire was sent: the lease counts from then, not from the reply

    # -- take --------------------------------------------------------------------------------

    def take(self, *, handoff: str = "", earlier: str = "") -> Acquired | Held:
        """One round trip: the key, or who holds it. If the key was free but handed to the first
        parked run, that run's message is sent here (the result is then :class:`Held`)."""
        opts = self.options
        with tracing.acquire(opts, self.key) as span:  # None unless traced
            asked = mod_time.monotonic()
            got = self.store.acquire(self.key, self.token, opts.ttl, self.holder, handoff=handoff,
                                     earlier=earlier, slots=opts.max_concurrency,
                                     trace=span.holder_context if span is not None else "")
            # the lease counts from the send of the attempt that answered (a lost reply is sent
            # again, and the second run renews the lease: see protocol/lua/lease/acquire.lua)
            self._asked = last_attempt_sent(asked)
            if span is not None:
                span.took(got)
            dead = (got.dead,) if got.dead is not None else ()  # a holder died on the slot replaced
            if isinstance(got, Held) and got.handoff is not None:
                # the next take is a call of its own: with this token, ACQUIRE would read it as this
                # one sent again and answer the same hand-on (the message sent twice, a free slot unseen)
                self.token = os.urandom(16).hex()
                settle(self.app, Settlement(True, got.handoff, dead=dead),
                       Ending(self.key, self.sender, self.holder.task_id, "handed-on", signal=False))
            elif dead:
                settle(self.app, Settlement(True, dead=dead),
                       Ending(self.key, self.sender, self.holder.task_id, "took-over", signal=False))
        return got

    def begin(self, got: Acquired, *, announce: bool = True) -> Lease:
        """Start holding: the heartbeat renews the lease from now on. ``announce=False``: no
        ``lease_acquired`` signal nor log (a fair gate's slot, which is not the run's key)."""
        opts = self.options
        lease = Lease(
            key=self.key, token=self.token, fence=got.fence, ttl=opts.ttl, interval=opts.heartbeat_interval,
            task_id=self.holder.task_id, task_name=self.sender, store=self.store, since=got.since,
            slot=got.slot, confirmed_at=self._asked,
        )
        self.lease = lease
        try:
            self._beat = heartbeat_for(self.store)
            self._beat.add(lease)
        except BaseException:
            self.end("failed")
            raise
        if announce:
            log_acquire.debug("acquired key=%r %s[%s] fence=%s", self.key, self.sender, lease.task_id,
                              lease.fence)
            signals.lease_acquired.send(sender=self.sender, lease=lease)
            if metrics.recording():
                metric_hooks.acquired(self.sender, self.request)
        return lease

    def retry_not_sent(self) -> None:
        """The run released as ``retried``, but no retry was sent (``max_retries`` reached, the
        publish failed): record ``failed`` instead, and free the enqueue marker it kept for the
        retry. Both steps are owner-checked, so safe to run twice; best effort (without Redis the
        marker's TTL ends it)."""
        lease = self.lease
        if lease is None:
            return
        with contextlib.suppress(redis.RedisError):
            self.store.lease.revise_outcome(self.key, lease.task_id, "retried", "failed", lease.slot)
            if self.clear_marker:
                self.store.marks.clear_enqueued(self.key, lease.task_id)

    def forget_attempt(self, outcome: str = "retried") -> bool:
        """Release what an acquire that failed (no reply came, or too few replicas confirmed its
        grant) may have taken; best effort: if Redis still cannot be reached, the next attempt
        adopts it (``take(earlier=token)``). True if it had taken the key and is released now
        (a parked run's slot too: the run is no longer parked, and must not be sent as such)."""
        try:
            settlement = self.store.release(self.key, self.token, outcome, self.options.ttl,
                                            slots=self.options.max_concurrency)
        except redis.RedisError:
            return False
        if settlement.duties:
            ending = Ending(self.key, self.sender, self.holder.task_id, outcome, signal=False)
            settle(self.app, settlement, ending)
        return bool(settlement)

    # -- progress ----------------------------------------------------------------------------

    def progress(self, update: ProgressUpdate) -> bool:
        """Submit ``update`` (throttled to ``progress_rate`` writes a second; the last one always
        lands). True if written now. Raises :class:`LeaseLost` once the lease is gone."""
        lease = self._held()
        lease.check()
        reporter = lease.reporter
        if reporter is None:
            reporter = lease.reporter = ProgressReporter(
                self.options.progress_rate, self._write_progress, self._renewer().schedule_flush,
            )
        return reporter.submit(update)

    def _write_progress(self, update: ProgressUpdate) -> None:
        lease = self._held()
        data = lease.write_progress(update)
        if self.on_progress is not None:
            self.on_progress(lease, data)

    def _renewer(self) -> Heartbeat:
        return self._beat or heartbeat_for(self.store)

    def _held(self) -> Lease:
        lease = self.lease
        if lease is None or lease.released:
            raise NotInsideRun(f"{self.sender}: the lease on key {self.key!r} is not held here")
        return lease

    # -- release -----------------------------------------------------------------------------

    def _retry_after(self, outcome: str, lease: Lease,
                     exc: BaseException | None) -> tuple[float, str, str] | None:
        """The run ends raising :class:`RetryAfter` (``exc``: its body raised it): the pause, the
        run's queue entry and its own message, for its release to park it at the front of the
        queue. The sweeper is told to look when the pause ends first (before the release: if this
        process dies between the two, a key looked at early is looked at again)."""
        task = self.app.current_task
        if (outcome != "retried" or not isinstance(exc, RetryAfter) or task is None
                or not self.computes_result or task.request.called_directly or task.request.is_eager):
            return None
        exc.key = exc.key or self.key
        handoff, request = uuid.uuid4().hex, task.request
        message = message_of(task, tuple(request.args or ()), dict(request.kwargs or {}),
                             **{HEADER_HANDOFF: handoff})
        self.store.handoff.look_again(self.key, exc.seconds + constants.RESUME_GRACE)
        return exc.seconds, f"{lease.task_id}|{handoff}", message

    def end(self, outcome: str, *, result: Any = NO_RESULT, error: BaseException | None = None,
            answer_joined: bool = True, here: bool = False) -> Settlement | None:
        """Release once (later calls do nothing) and settle what the release hands back.

        ``outcome``: succeeded, failed, retried, ignored, rejected, terminated, ...; ``lost`` is
        recorded instead when the lease was found gone. ``result``/``error`` go to joined runs (a
        retry's ``error``, its ``Retry``: a :class:`RetryAfter` pauses the key and parks the run);
        ``answer_joined=False`` (a retry) leaves them for the next run; ``here``: a run handed the
        freed slot is sent to this worker's own queue (:mod:`.ownqueue`). A Redis error is logged
        (the key then frees when its lease runs out); None is returned then.
        """
        lease = self.lease
        if lease is None:
            return None
        self._renewer().discard(lease)
        if lease.reporter is not None and not lease.lost_known and not lease.released:
            with contextlib.suppress(LeaseLost):  # already reported by mark_lost
                lease.reporter.flush()
        with lease._guard:
            if lease.released:
                return None
            lease.released = True  # before the round trip: a late renewal must not report a loss
        if lease.lost_known:
            outcome = "lost"
        opts = self.options
        with tracing.release(opts, self.key) as span:  # None unless traced
            try:
                settlement = self.store.release(
                    self.key, lease.token, outcome, opts.ttl, fence=lease.fence, slot=lease.slot,
                    slots=opts.max_concurrency, answer_joined=answer_joined,
                    # a run that ends to retry keeps its enqueue marker: the retry keeps its task id
                    clear_marker=self.clear_marker and outcome != "retried",
                    task_id=lease.task_id, retry_after=self._retry_after(outcome, lease, error),
                )
            except redis.RedisError as exc:
                log_release.warning(
                    "could not release key=%r %s[%s]; it frees when its lease expires in %.1fs: %s",
                    self.key, self.sender, lease.task_id, lease.time_left or opts.ttl, exc,
                )
                if span is not None:
                    span.failed(exc)
                return None
            if not settlement:
                lease.mark_lost("the lease was gone when the run ended", at_release=True)
                outcome = "lost"
            if span is not None:
                span.released(outcome, lease.fence, settlement)
            settle(self.app, settlement, Ending(self.key, self.sender, lease.task_id, outcome, result=result,
                                                error=error, lease=lease,
                                                rerun_joined=not self.computes_result, here=here))
        return settlement
