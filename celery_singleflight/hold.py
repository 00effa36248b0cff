"""Hold a key outside tasks: management commands, cron scripts, maintenance windows.

::

    from celery_singleflight import hold

    with hold(app, "maintenance:db", ttl=30, wait=0) as lease:   # LockHeld if the key is taken
        write(batch, fence=lease.fence)                            # fencing token
        lease.progress("vacuum", current=1, total=3)               # watchable by key, like tasks
        lease.check()                                              # LeaseLost if the lease is gone

``key`` is the literal key a task's ``lock_key`` renders to (``'sync:42'``, ``'k:"x"'``), so a
hold and the tasks of that key exclude each other. The lease is the same as a task's: one Redis
round trip to take it, renewed by the process's heartbeat thread, released on exit with the
outcome ``succeeded``, ``failed`` (an exception left the block), ``terminated`` (KeyboardInterrupt,
SystemExit) or ``lost``. A lost lease does not raise at exit (as for tasks): code that must not
commit without the key calls ``check()`` first, or reads ``lease.lost`` after the block.
"""

from __future__ import annotations

import contextlib
import getpass
import logging
import math
import os
import random
import socket
import time as mod_time
import uuid
from types import TracebackType
from typing import Any

import redis

from . import signals
from .connection import UNREACHABLE
from .errors import ConfigurationError, LeaseLost, LockHeld, NotInsideRun, RedisUnavailable
from .heartbeat import Heartbeat, heartbeat_for
from .keys import stored_key
from .lease import Acquired, Held, Holder, Lease, LeaseStore
from .progress import ProgressReporter, ProgressUpdate, make_update
from .queueing import send_parked
from .settings import Options, resolve_options
from .task import store_for

__all__ = ["Hold", "HoldLease", "hold"]

log_acquire = logging.getLogger("celery_singleflight.acquire")
log_release = logging.getLogger("celery_singleflight.release")
log_duplicate = logging.getLogger("celery_singleflight.duplicate")

#: the sender of signals and the ``task_name`` recorded for holds
SENDER = "hold"
# waiting for a held key: jittered exponential backoff between these bounds (seconds)
_FIRST_DELAY = 0.05
_MAX_DELAY = 1.0
_MIN_DELAY = 0.02


def default_holder() -> str:
    """``hold:<user>@<host>:<pid>``: what ``status``/``LockHeld`` show, so people know who to ask."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (some containers)
        user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
    return f"hold:{user}@{socket.gethostname()}:{os.getpid()}"


class _HoldSettings:
    """Stands in for a task when resolving the app's settings, so ``ttl=`` overrides the TTL
    exactly as a task's ``lock_ttl`` would (the heartbeat interval then follows it)."""

    name = SENDER

    def __init__(self, ttl: float | None, progress_rate: float | None) -> None:
        self.lock_ttl = ttl
        self.progress_rate = progress_rate


def _check_number(name: str, value: Any, *, allow_zero: bool, unit: str = "seconds") -> None:
    """Reject a bad argument at the call, naming the argument the caller wrote."""
    if value is None:
        return
    bad = isinstance(value, bool) or not isinstance(value, (int, float))
    if bad or not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "more than zero"
        raise ConfigurationError(f"hold({name}=) must be {bound} {unit}, not {value!r}")


class HoldLease:
    """The handle a ``with hold(...)`` block gets: the lease plus ``progress()``.

    ``fence`` only grows per key: pass it to writes that must refuse a stale holder.
    """

    def __init__(self, lease: Lease, options: Options, beat: Heartbeat) -> None:
        self.lease = lease  # the underlying lease, for code written against task leases
        self._options = options
        self._beat = beat

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def fence(self) -> int:
        return self.lease.fence

    @property
    def holder(self) -> str:
        """The holder id recorded in Redis (what other runs see in ``LockHeld``)."""
        return self.lease.task_id

    @property
    def lost(self) -> bool:
        """True once a renewal or a progress write found the lease gone."""
        return self.lease.lost

    @property
    def time_left(self) -> float:
        """Seconds the lease is known to be good for (0 once lost or released)."""
        return self.lease.time_left

    def check(self) -> None:
        """Raise :class:`LeaseLost` if the key may now be held by someone else."""
        self.lease.check()

    def progress(
        self, state: str, current: float | None = None, total: float | None = None,
        message: str | None = None, **fields: Any,
    ) -> bool:
        """Report how far the hold is, by key, as a task's ``self.progress`` does.

        One owner-checked Redis round trip (status, history, live watchers), throttled to
        ``progress_rate`` writes a second; calls in between are coalesced and the last one is
        always written. Returns True if written now. Raises :class:`LeaseLost` once the lease is
        gone, :class:`NotInsideRun` after the block, :class:`ProgressError` for bad values.
        """
        lease = self.lease
        if lease.released:
            raise NotInsideRun(f"the hold on key {lease.key!r} has ended; progress() works inside it")
        lease.check()
        update = make_update(state, current, total, message, fields,
                             max_bytes=self._options.progress_max_bytes)
        reporter = lease.reporter
        if reporter is None:
            reporter = lease.reporter = ProgressReporter(
                self._options.progress_rate, _progress_writer(lease), self._beat.schedule_flush
            )
        return reporter.submit(update)

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("released" if self.lease.released else "held")
        return f"<HoldLease key={self.key!r} fence={self.fence} holder={self.holder!r} {state}>"


def _progress_writer(lease: Lease) -> Any:
    """The write of one update; it may run on the heartbeat thread (a throttled update)."""

    def write(update: ProgressUpdate) -> None:
        lease.write_progress(update)

    return write


class Hold:
    """The context manager :func:`hold` returns; each ``with`` takes and frees the key once."""

    def __init__(
        self, app: Any, key: str, *, ttl: float | None = None, wait: float = 0.0,
        holder: str | None = None, progress_rate: float | None = None,
    ) -> None:
        _check_number("ttl", ttl, allow_zero=False)
        _check_number("wait", wait, allow_zero=True)
        _check_number("progress_rate", progress_rate, allow_zero=False, unit="writes a second")
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"hold() needs a non-empty key string, not {key!r}")
        self.app = app
        # a long key is digested as a rendered lock_key is; a key already in digest form (from
        # render_key() or held()) is taken as it is, so both forms name the tasks' key
        self.key = stored_key(key)
        self.wait = float(wait)
        self.holder = holder or default_holder()
        self.options = resolve_options(_HoldSettings(ttl, progress_rate), app.conf)
        self._handle: HoldLease | None = None

    @property
    def store(self) -> LeaseStore:
        opts = self.options
        return store_for(opts.redis_url, opts.namespace, opts.status_retention, opts.history_length)

    def __enter__(self) -> HoldLease:
        if self._handle is not None:
            raise RuntimeError(f"hold on key {self.key!r} is already entered; use a new hold()")
        opts, store = self.options, self.store
        token = uuid.uuid4().hex
        got = self._acquire(store, token)
        lease = Lease(
            key=self.key, token=token, fence=got.fence, ttl=opts.ttl, interval=opts.heartbeat_interval,
            task_id=self.holder, task_name=SENDER, store=store, since=got.since,
        )
        beat = heartbeat_for(store)
        try:
            beat.add(lease)
        except BaseException:
            _release(self.app, lease, "failed")
            raise
        self._handle = HoldLease(lease, opts, beat)
        log_acquire.debug("acquired key=%r holder=%s fence=%s", self.key, self.holder, lease.fence)
        signals.lease_acquired.send(sender=SENDER, lease=lease)
        return self._handle

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        handle, self._handle = self._handle, None
        if handle is None:
            return
        lease = handle.lease
        handle._beat.discard(lease)
        if lease.reporter is not None and not lease.lost:
            with contextlib.suppress(LeaseLost):  # already reported by mark_lost
                lease.reporter.flush()
        if lease.lost:
            outcome = "lost"
        elif exc_type is None:
            outcome = "succeeded"
        else:
            outcome = "failed" if issubclass(exc_type, Exception) else "terminated"
        _release(self.app, lease, outcome)

    def _acquire(self, store: LeaseStore, token: str) -> Acquired:
        """Take the key, waiting up to ``wait`` seconds with jittered backoff while it is held."""
        opts = self.options
        who = Holder(self.holder, "", SENDER)
        started = mod_time.monotonic()
        deadline = started + self.wait
        attempt = 0
        while True:
            try:
                got = store.acquire(self.key, token, opts.ttl, who, opts.fence_retention)
            except UNREACHABLE as exc:
                raise RedisUnavailable(self.key, str(exc), mod_time.monotonic() - started) from exc
            if isinstance(got, Acquired):
                return got
            if got.handoff is not None:
                # the key was free but handed to the first parked task run: send it, then wait
                send_parked(self.app, got.handoff, self.key)
            left = deadline - mod_time.monotonic()
            if left <= 0:
                self._refused(store, got, mod_time.monotonic() - started)
            # never sleep past the deadline, nor (much) past the holder's lease time left
            cap = min(_FIRST_DELAY * 2**attempt, _MAX_DELAY, max(got.ttl_left, _MIN_DELAY), left)
            mod_time.sleep(random.uniform(cap / 2, cap))
            attempt += 1

    def _refused(self, store: LeaseStore, held: Held, waited: float) -> None:
        """Raise LockHeld, telling the holder's watchers (like a refused task duplicate)."""
        log_duplicate.info(
            "hold %s refused: key=%r held by %s (%.1fs left) after waiting %.1fs",
            self.holder, self.key, held.holder, held.ttl_left, waited,
        )
        signals.duplicate.send(
            sender=SENDER, key=self.key, task_id=self.holder, holder=held.holder,
            ttl_left=held.ttl_left, policy="raise", outcome="raised",
        )
        try:
            store.note_duplicate(self.key, self.holder, "raised")
        except redis.RedisError as exc:
            log_duplicate.debug("could not note the refused hold on key=%r: %s", self.key, exc)
        raise LockHeld(self.key, held.holder, held.ttl_left)


def _release(app: Any, lease: Lease, outcome: str) -> None:
    """Free the key and record the outcome; a Redis error is logged (the lease then expires)."""
    with lease._guard:
        if lease.released:
            return
        lease.released = True  # before the round trip: a late renewal must not report a loss
    try:
        ours = lease.store.release(lease.key, lease.token, outcome, lease.ttl, fence=lease.fence,
                                   clear_marker=False)
    except redis.RedisError as exc:
        log_release.warning(
            "could not release key=%r holder=%s; it frees when its lease expires in %.1fs: %s",
            lease.key, lease.task_id, lease.ttl, exc,
        )
        return
    if not ours:
        lease.mark_lost("the lease was gone when the hold ended", at_release=True)
        outcome = "lost"  # nothing was recorded: the lease had expired or was taken
    elif ours.handoff is not None:
        send_parked(app, ours.handoff, lease.key)  # the next parked task run (queue policy)
    log_release.debug("released key=%r holder=%s (%s)", lease.key, lease.task_id, outcome)
    signals.lease_released.send(sender=SENDER, lease=lease, reason=outcome)


def hold(
    app: Any, key: str, *, ttl: float | None = None, wait: float = 0.0, holder: str | None = None,
    progress_rate: float | None = None,
) -> Hold:
    """Hold ``key`` for a ``with`` block, excluding the tasks (and holds) that use that key.

    ``key`` is literal (what a task's ``lock_key`` renders to). ``ttl`` overrides the app's
    ``singleflight_ttl``; ``wait`` is how long to wait for a held key (0: raise
    :class:`LockHeld` at once); ``holder`` is the id others see (default
    ``hold:<user>@<host>:<pid>``); ``progress_rate`` overrides ``singleflight_progress_rate``.
    Raises :class:`RedisUnavailable` if Redis cannot be reached: no fail-open here, the
    caller decides.
    """
    return Hold(app, key, ttl=ttl, wait=wait, holder=holder, progress_rate=progress_rate)
