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

from . import signals
from .errors import LeaseLost, Superseded
from .progress import ProgressReporter, ProgressUpdate
from .store import LeaseStore

__all__ = ["Lease", "learn_superseded", "process_alive"]

log_renew = logging.getLogger("celery_singleflight.renew")


@dataclass(eq=False)
class Lease:
    """The lease of one running execution.

    ``fence`` only grows per key; pass it to writes that must refuse stale holders.
    ``lost`` turns true when a renewal finds the lease gone; ``check()`` then raises.
    ``superseded`` turns true when a renewal finds that a newer run superseded this one;
    ``check()`` then raises :class:`Superseded`.
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
    lost: bool = False
    lost_reason: str = ""
    released: bool = False
    confirmed_at: float = field(default_factory=mod_time.monotonic)
    slot: int = 0
    #: a newer run superseded this one (``on_duplicate="supersede"``): stop; ``check()`` raises
    superseded: bool = False
    superseded_by: str = ""
    superseded_at: float | None = None  # epoch seconds
    revoke_at: float | None = None  # epoch seconds: when the run is revoked unless it has ended
    reporter: ProgressReporter | None = field(default=None, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _progress_seq: int = field(default=0, repr=False)

    @property
    def deadline(self) -> float:
        """Monotonic time after which this run must count its lease as lost.

        A margin before the TTL (10 %, at most 1 s) covers clock drift and the time between a
        check and the write it guards, so a holder learns of its loss before another run can
        take the key, not at the same instant.
        """
        return self.confirmed_at + self.ttl - min(1.0, 0.1 * self.ttl)

    @property
    def time_left(self) -> float:
        """Seconds the lease is known to be good for (0 once lost or released)."""
        if self.lost or self.released:
            return 0.0
        return max(0.0, self.confirmed_at + self.ttl - mod_time.monotonic())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this run no longer holds its key.

        Besides the heartbeat's verdict (``lost``), the lease's own clock counts: once the TTL
        has passed since the last renewal Redis confirmed, another run may hold the key, even
        if the heartbeat thread has not said so yet (a frozen process, a network partition).
        """
        if not self.lost and not self.released and mod_time.monotonic() >= self.deadline:
            self.mark_lost("no renewal was confirmed within the lease TTL; another run may hold the key")
        if self.lost:
            raise LeaseLost(self.key, self.lost_reason)
        if self.superseded:
            left = None if self.revoke_at is None else self.revoke_at - mod_time.time()
            raise Superseded(self.key, self.superseded_by, self.superseded_at, left)

    def mark_superseded(self, by: str, at: float | None = None, revoke_at: float | None = None) -> None:
        """Record once that run ``by`` superseded this one: flag, warning log and
        ``lease_superseded`` signal. The lease stays held until the run ends (or is revoked)."""
        with self._guard:
            if self.superseded or self.released:
                return
            self.superseded_by, self.superseded_at, self.revoke_at = by, at, revoke_at
            self.superseded = True
        log_renew.warning("lease superseded: key=%r task=%s[%s] fence=%s by %s", self.key, self.task_name,
                          self.task_id, self.fence, by)
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
            ours = self.store.progress(self.key, self.slot, self.token, json.dumps(data), update.state, seq,
                                       update.args or "")
        except redis.RedisError as exc:
            log_renew.warning("could not record progress of key=%r: %s", self.key, exc)
            return data
        if not ours:
            self.mark_lost("progress found the lease gone")
            raise LeaseLost(self.key, self.lost_reason)
        if isinstance(ours, str) and not self.superseded:  # before the heartbeat could say so
            learn_superseded(self)
            self.check()
        return data

    def mark_lost(self, reason: str, *, at_release: bool = False) -> None:
        """Record the loss once: flag, warning log and ``lease_lost`` signal.

        After the run released its lease, a late renewal reply must not report a loss, so only
        the release itself (``at_release``) may report one then.
        """
        with self._guard:
            if self.lost or (self.released and not at_release):
                return
            self.lost = True
            self.lost_reason = reason
        log_renew.warning(
            "lease lost: key=%r task=%s[%s] fence=%s: %s",
            self.key, self.task_name, self.task_id, self.fence, reason,
        )
        signals.lease_lost.send(sender=self.task_name, lease=self, reason=reason)


def learn_superseded(lease: Lease) -> None:
    """A renewal found ``lease`` superseded: read by whom and when (one round trip), flag it,
    and make sure the key is in the superseding index, so the run is revoked after the grace
    even if the newcomer's process died before entering it."""
    try:
        record = lease.store.record(lease.key, lease.slot)
        due = int(record.get("sup_due") or 0)
        if due:
            lease.store.mark_superseding(lease.key, due)
    except (redis.RedisError, ValueError) as exc:
        log_renew.warning("could not read who superseded key=%r: %s", lease.key, exc)
        record, due = {}, 0
    at = int(record.get("sup_at") or 0)
    lease.mark_superseded(str(record.get("sup_by") or ""), at / 1000.0 if at else None,
                          due / 1000.0 if due else None)


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
