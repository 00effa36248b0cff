"""Hold a key outside tasks: management commands, cron scripts, maintenance windows.

::

    from celery_singleflight import hold

    with hold(app, "maintenance:db", ttl=30, wait=0) as lease:   # LockHeld if the key is taken
        write(batch, fence=lease.fence)                            # fencing token
        lease.progress("vacuum", current=1, total=3)               # watchable by key, like tasks
        lease.check()                                              # LeaseLost if the lease is gone

``key`` is the literal key a task's ``lock_key`` renders to (``'sync:42'``, ``'k:"x"'``; build it
with ``task.render_key(...)``), so a hold and the tasks of that key exclude each other. A hold is
one run of the key, with the same lifecycle as a task's run (:class:`~.guard.Guard`): one Redis
round trip to take it, renewed by the process's heartbeat thread, released on exit with the
outcome ``succeeded``, ``failed`` (an exception left the block), ``terminated`` (KeyboardInterrupt,
SystemExit) or ``lost``, and whatever the release hands back carried out at once: the next
parked run is sent, and tasks that chose ``join`` while the hold was on (a hold computes no
result to give them) are sent to run themselves: the first runs, the others join it. A lost
lease does not raise at exit (as for tasks): code that must not commit without the key calls
``check()`` first, or reads ``lease.lost`` after the block.

With ``max_concurrency=N`` tasks on the key, a hold is one of the N runs: by default it takes
the key's first slot (so for the usual N=1 it excludes every run of the key), and the tasks run
on the other N-1 slots beside it; with ``slots=N`` it takes whichever slot is free and waits
(``wait=``) only when all N are held.
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import random
import socket
import time as mod_time
from types import TracebackType
from typing import Any

import redis

from . import constants, signals
from .config.options import Options, app_options
from .connection.clients import is_unavailable
from .errors import ConfigurationError, LockHeld, NotInsideRun, RedisUnavailable
from .keys import stored_key
from .protocol.replies import Acquired, Held, Holder
from .run.guard import HOLD_SENDER as SENDER
from .run.guard import Guard
from .run.lease import Lease
from .run.progress import make_update

__all__ = ["SENDER", "Hold", "HoldLease", "hold"]

log_duplicate = logging.getLogger("celery_singleflight.duplicate")

def default_holder() -> str:
    """``hold:<user>@<host>:<pid>``: what ``status``/``LockHeld`` show, so people know who to ask."""
    pid = os.getpid()
    known = _default_holder.get(pid)
    if known is None:
        try:
            user = getpass.getuser()
        except (OSError, KeyError):  # no login name and no passwd entry (some containers)
            user = str(os.getuid()) if hasattr(os, "getuid") else "unknown"
        known = _default_holder[pid] = f"hold:{user}@{socket.gethostname()}:{pid}"
    return known


_default_holder: dict[int, str] = {}


def _holder(holder_id: str) -> Holder:
    """The :class:`Holder` of a hold, made (and its JSON fields encoded) once per holder id and
    process: a script that takes one key a thousand times names the same holder each time."""
    key = (holder_id, os.getpid())
    found = _holders.get(key)
    if found is None:
        if len(_holders) >= 256:  # ids made per call stay bounded
            _holders.clear()
        found = _holders[key] = Holder(holder_id, "", SENDER)
    return found


_holders: dict[tuple[str, int], Holder] = {}


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

    def __init__(self, guard: Guard) -> None:
        assert guard.lease is not None
        self.lease: Lease = guard.lease  # the underlying lease, for code written against task leases
        self._guard = guard

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
                             max_bytes=self._guard.options.progress_max_bytes)
        return self._guard.progress(update)

    def __repr__(self) -> str:
        state = "lost" if self.lost else ("released" if self.lease.released else "held")
        return f"<HoldLease key={self.key!r} fence={self.fence} holder={self.holder!r} {state}>"


class Hold:
    """The context manager :func:`hold` returns; each ``with`` takes and frees the key once."""

    def __init__(
        self, app: Any, key: str, *, ttl: float | None = None, wait: float = 0.0,
        holder: str | None = None, progress_rate: float | None = None, slots: int | None = None,
        namespace: str | None = None,
    ) -> None:
        _check_number("ttl", ttl, allow_zero=False)
        _check_number("wait", wait, allow_zero=True)
        _check_number("progress_rate", progress_rate, allow_zero=False, unit="writes a second")
        if slots is not None and (isinstance(slots, bool) or not isinstance(slots, int) or slots < 1):
            raise ConfigurationError(f"hold(slots=) must be a whole number of at least 1, not {slots!r}")
        if not isinstance(key, str) or not key:
            raise ConfigurationError(f"hold() needs a non-empty key string, not {key!r}")
        self.app = app
        # a long key is digested as a rendered lock_key is; a key already in digest form (from
        # render_key() or held()) is taken as it is, so both forms name the tasks' key
        self.key = stored_key(key)
        self.wait = float(wait)
        self.holder = holder or default_holder()
        self.options: Options = app_options(app, lock_ttl=ttl, progress_rate=progress_rate,
                                            max_concurrency=slots or 1, lock_namespace=namespace)
        self._guard: Guard | None = None

    def __enter__(self) -> HoldLease:
        if self._guard is not None:
            raise RuntimeError(f"hold on key {self.key!r} is already entered; use a new hold()")
        guard = Guard(self.app, self.key, self.options, _holder(self.holder), sender=SENDER,
                      computes_result=False)
        got = self._acquire(guard)
        guard.begin(got)
        self._guard = guard
        return HoldLease(guard)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        guard, self._guard = self._guard, None
        if guard is None:
            return
        if exc_type is None:
            outcome = "succeeded"
        else:
            outcome = "failed" if issubclass(exc_type, Exception) else "terminated"
        guard.end(outcome, error=exc)

    def _acquire(self, guard: Guard) -> Acquired:
        """Take the key, waiting up to ``wait`` seconds with jittered backoff while it is held."""
        started = mod_time.monotonic()
        deadline = started + self.wait
        attempt = 0
        while True:
            try:
                got = guard.take()
            except redis.RedisError as exc:
                if not is_unavailable(exc):
                    raise
                guard.forget_attempt("failed")
                raise RedisUnavailable(self.key, str(exc) or type(exc).__name__,
                                       mod_time.monotonic() - started) from exc
            if isinstance(got, Acquired):
                return got
            left = deadline - mod_time.monotonic()
            if left <= 0:
                self._refused(guard, got, mod_time.monotonic() - started)
            # never sleep past the deadline, nor (much) past the holder's lease time left
            cap = min(constants.HOLD_FIRST_DELAY * 2**attempt, constants.HOLD_MAX_DELAY,
                      max(got.ttl_left, constants.HOLD_MIN_DELAY), left)
            mod_time.sleep(random.uniform(cap / 2, cap))
            attempt += 1

    def _refused(self, guard: Guard, held: Held, waited: float) -> None:
        """Raise LockHeld, telling the holder's watchers (like a refused task duplicate)."""
        log_duplicate.info(
            "hold %s refused: key=%r held by %s (%.1fs left) after waiting %.1fs",
            self.holder, self.key, held.holder, held.ttl_left, waited,
        )
        signals.duplicate.send(
            sender=SENDER, key=self.key, task_id=self.holder, holder=held.holder,
            ttl_left=held.ttl_left, policy="raise", outcome="raised", detail=f"refused after {waited:.1f}s",
        )
        try:
            guard.store.marks.note_duplicate(self.key, self.holder, "raised")
        except redis.RedisError as exc:
            log_duplicate.debug("could not note the refused hold on key=%r: %s", self.key, exc)
        raise LockHeld(self.key, held.holder, held.ttl_left)


def hold(
    app: Any, key: str, *, ttl: float | None = None, wait: float = 0.0, holder: str | None = None,
    progress_rate: float | None = None, slots: int | None = None, namespace: str | None = None,
) -> Hold:
    """Hold ``key`` for a ``with`` block, excluding the tasks (and holds) that use that key.

    ``key`` is literal (what a task's ``lock_key`` renders to: ``task.render_key(...)``). ``ttl``
    overrides the app's ``singleflight_ttl``; ``wait`` is how long to wait for a held key (0:
    raise :class:`LockHeld` at once); ``holder`` is the id others see (default
    ``hold:<user>@<host>:<pid>``); ``progress_rate`` overrides ``singleflight_progress_rate``;
    ``slots``: the key's ``max_concurrency``, to take any free slot of it (default: its first slot);
    ``namespace``: the ``lock_namespace`` of tasks that have their own (default: the app's).
    Raises :class:`RedisUnavailable` if Redis cannot serve the key: no fail-open here, the
    caller decides. The app's ``singleflight_min_replicas`` applies: a grant fewer replicas
    confirmed is released and raises :class:`RedisUnavailable` (its cause:
    :class:`ReplicasUnavailable`), and renewals they do not confirm run the lease's clock out.
    """
    return Hold(app, key, ttl=ttl, wait=wait, holder=holder, progress_rate=progress_rate, slots=slots,
                namespace=namespace)
