"""The handle of one held lease: ``self.lease`` inside a task, ``lease.lease`` inside ``hold()``.

It knows its key, token, fence and time; it learns of its loss from the heartbeat, from a
progress write, or from its own clock (:meth:`Lease.check`). Redis calls go through its store.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time as mod_time
from dataclasses import dataclass, field
from typing import Any

import redis

from .. import constants, signals
from ..errors import LeaseLost, Superseded
from ..metrics import record as metrics
from ..protocol.inbox import RELEASED, Told
from ..protocol.layout import Layout
from ..protocol.lease import ProgressReply, RenewReply
from ..protocol.newest import TOLD_SUPERSEDED, Notice, ProgressNotice, RenewNotice
from ..protocol.store import LeaseStore
from .progress import ProgressReporter, ProgressUpdate

__all__ = ["Lease", "process_alive"]

log_renew = logging.getLogger("celery_singleflight.renew")


@dataclass(eq=False)
class Lease:
    """The lease of one running execution.

    ``fence`` only grows per key; pass it to writes that must refuse stale holders.
    ``lost`` turns true when a renewal or a progress write finds the lease gone, or when the
    lease's own clock passes its TTL without a confirmed renewal; ``check()`` then raises.
    ``superseded`` turns true when a push to the process (:mod:`.inbox`) or a renewal says that a
    newer run superseded this one; ``check()`` then raises :class:`Superseded`, and
    ``wait_superseded()`` returns.
    """

    key: str
    token: str
    fence: int
    ttl: float
    interval: float
    task_id: str
    task_name: str
    store: LeaseStore
    since: float
    #: a renewal, a progress write or the release found the lease gone (``lost`` also counts the clock)
    lost_known: bool = False
    lost_reason: str = ""
    released: bool = False
    confirmed_at: float = field(default_factory=mod_time.monotonic)
    #: when this process took the lease (monotonic): the hold time's start
    taken_at: float = field(default_factory=mod_time.monotonic)
    slot: int = 0
    #: a newer run superseded this one (``on_duplicate="supersede"``): stop; ``check()`` raises
    superseded: bool = False
    superseded_by: str = ""
    superseded_at: float | None = None  # epoch seconds
    revoke_at: float | None = None  # epoch seconds: when the run is revoked unless it has ended
    reporter: ProgressReporter | None = field(default=None, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _progress_seq: int = field(default=0, repr=False)
    #: set when the run must stop (superseded or lost); made by the first wait_superseded() only
    _stopping: threading.Event | None = field(default=None, repr=False)

    @property
    def deadline(self) -> float:
        """Monotonic time after which this run must count its lease as lost.

        A margin before the TTL (10 %, at most 1 s) covers clock drift and the time between a
        check and the write it guards, so a holder learns of its loss before another run can
        take the key, not at the same instant.
        """
        margin = min(constants.LEASE_MARGIN, constants.LEASE_MARGIN_SHARE * self.ttl)
        return self.confirmed_at + self.ttl - margin

    @property
    def lost(self) -> bool:
        """True once this run must count its lease as lost: a renewal, a progress write or the
        release found it gone, or the TTL has passed since the last renewal Redis confirmed (a
        frozen process, a partition: another run may hold the key, even if the heartbeat thread
        has not said so yet). The first time the clock says so, the loss is recorded as the
        heartbeat would record it (a WARNING and the ``lease_lost`` signal)."""
        if not self.lost_known and not self.released and mod_time.monotonic() >= self.deadline:
            self.mark_lost("no renewal was confirmed within the lease TTL; another run may hold the key")
        return self.lost_known

    @property
    def time_left(self) -> float:
        """Seconds the lease is known to be good for (0 once lost or released)."""
        if self.lost or self.released:
            return 0.0
        return max(0.0, self.confirmed_at + self.ttl - mod_time.monotonic())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this run no longer holds its key.

        Besides the heartbeat's verdict, the lease's own clock counts (see :attr:`lost`).
        """
        if self.lost:
            raise LeaseLost(self.key, self.lost_reason)
        if self.superseded:
            left = None if self.revoke_at is None else self.revoke_at - mod_time.time()
            raise Superseded(self.key, self.superseded_by, self.superseded_at, left)

    def wait_superseded(self, timeout: float | None = None) -> bool:
        """Block until this run must stop (superseded, or its lease lost) or ``timeout`` seconds
        pass; True if it must stop. For a body that waits on something else (a queue, a socket,
        a subprocess): wait here in a thread, or poll it between blocking calls. It wakes within
        milliseconds of a push (:mod:`.inbox`), at the latest at the next renewal, and on its own
        when the lease's clock runs out."""
        with self._guard:
            if self._stopping is None:
                self._stopping = threading.Event()
            stopping = self._stopping
        end = None if timeout is None else mod_time.monotonic() + timeout
        while True:
            if self.superseded or self.lost:
                return True
            now = mod_time.monotonic()
            if self.released or (end is not None and now >= end):
                return False
            wait = max(0.0, self.deadline - now)
            stopping.wait(wait if end is None else min(wait, end - now))

    def _stop_waiters(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    def mark_superseded(self, by: str, at: float | None = None, revoke_at: float | None = None) -> None:
        """Record once that run ``by`` superseded this one: flag, warning log and
        ``lease_superseded`` signal. The lease stays held until the run ends (or is revoked)."""
        with self._guard:
            if self.superseded or self.released:
                return
            self.superseded_by, self.superseded_at, self.revoke_at = by, at, revoke_at
            self.superseded = True
        self._stop_waiters()
        log_renew.warning("lease superseded: key=%r task=%s[%s] fence=%s by %s", self.key, self.task_name,
                          self.task_id, self.fence, by)
        metrics.count("leases_taken_over", self.task_name)
        signals.lease_superseded.send(sender=self.task_name, lease=self, by=by)

    def write_progress(self, update: ProgressUpdate) -> dict[str, Any]:
        """Record ``update`` on this lease's key (one owner-checked round trip); return the data.

        Raises :class:`LeaseLost` (and marks the lease lost) if the key is no longer this run's.
        A Redis error is logged, not raised: whether the lease survives is the heartbeat's call.
        """
        data = update.as_dict()
        with self._guard:
            self._progress_seq += 1
            seq = self._progress_seq
        try:
            code, _ = self.store.lease.progress(self.key, self.slot, self.token, json.dumps(data),
                                                update.state, seq, update.args or "")
        except redis.RedisError as exc:
            log_renew.warning("could not record progress of key=%r: %s", self.key, exc)
            return data
        if code == ProgressReply.NOT_OURS:
            self.mark_lost("progress found the lease gone")
            raise LeaseLost(self.key, self.lost_reason)
        if code == ProgressNotice.WRITTEN_SUPERSEDED and not self.superseded:  # before the heartbeat said so
            self.learn_superseded()
            self.check()
        return data

    @property
    def layout(self) -> Layout:
        """Where the lease's keys live (its store's namespace): what a renewal names."""
        return self.store.layout

    def renewed(self, code: int, confirmed_at: float) -> None:
        """What a renewal sent at ``confirmed_at`` (monotonic) answered for this lease."""
        if code == RenewReply.GONE:
            if not self.released:
                self.mark_lost("the lease expired or was released by someone else")
            return
        self.confirmed_at = confirmed_at
        if code == RenewNotice.RENEWED_SUPERSEDED and not self.superseded:
            self.learn_superseded()

    def learn_superseded(self, notice: Notice | None = None) -> None:
        """A newer run superseded this one: learn by whom and when (one round trip, unless
        ``notice`` says it), and flag it (the key is entered in the superseding index, so the
        run is revoked after the grace even if the newcomer's process died before entering it)."""
        if notice is None:
            try:
                notice = self.store.newest.notice(self.key, self.slot)
            except redis.RedisError as exc:
                log_renew.warning("could not read who superseded key=%r: %s", self.key, exc)
        if notice is None:
            self.mark_superseded("")
        else:
            self.mark_superseded(notice.by, notice.at, notice.revoke_at)

    def hear(self, told: Told) -> bool:
        """A push to this process (:mod:`.inbox`) says what a renewal would find later: a newer
        run superseded this one, or an operator force-released it. False for an unknown kind."""
        if told.kind == TOLD_SUPERSEDED:
            due = told.field(2)
            self.mark_superseded(told.field(0), told.ms(1), told.ms(2))
            if due.isdigit():  # revoked after its grace even if the newcomer died before indexing it
                try:
                    self.store.newest.mark_superseding(self.key, int(due))
                except redis.RedisError as exc:
                    log_renew.debug("could not index superseded key=%r: %s", self.key, exc)
            return True
        if told.kind == RELEASED:
            self.mark_lost(f"force-released by {told.field(0)}")
            return True
        return False

    def mark_lost(self, reason: str, *, at_release: bool = False) -> None:
        """Record the loss once: flag, warning log and ``lease_lost`` signal.

        After the run released its lease, a late renewal reply must not report a loss, so only
        the release itself (``at_release``) may report one then.
        """
        with self._guard:
            if self.lost_known or (self.released and not at_release):
                return
            self.lost_known = True
            self.lost_reason = reason
        self._stop_waiters()
        log_renew.warning(
            "lease lost: key=%r task=%s[%s] fence=%s: %s",
            self.key, self.task_name, self.task_id, self.fence, reason,
        )
        signals.lease_lost.send(sender=self.task_name, lease=self, reason=reason)


def process_alive(pid: int) -> bool:
    """True if a process with ``pid`` exists (a zombie counts; another user's process too)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
