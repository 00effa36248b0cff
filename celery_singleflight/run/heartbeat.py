"""One renewer thread per process renews every lease the process holds, in one round trip.

The thread starts lazily with the first lease, so a prefork child gets its own after the fork.
It ticks every ``min(interval)`` of the held leases; a tick renews all of them with one script
call. A renewal that finds a lease gone marks it lost; a Redis error is retried about every
second until the lease's own time is up, and then the lease is marked lost too: never silently.
Any other exception in one pass is logged with its traceback and the thread goes on renewing:
one broken lease or flush must not leave every other lease of the process to expire.
Beside it, the process's :class:`~.inbox.Inbox` hears at once what a renewal would find later.
"""

from __future__ import annotations

import logging
import os
import threading
import time as mod_time
import weakref

import redis

from .. import constants
from ..connection.clients import last_attempt_sent
from ..metrics import record as metrics
from ..protocol.lease import RenewReply
from ..protocol.replicas import renew_confirmed
from ..protocol.store import LeaseStore
from .inbox import Inbox
from .lease import Lease

__all__ = ["Heartbeat", "heartbeat_for"]

log = logging.getLogger("celery_singleflight.renew")


class Heartbeat:
    """The renewer of one process for one Redis."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self._leases: weakref.WeakSet[Lease] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = float("inf")
        self._flush_at = float("inf")
        #: when the thread will next look at the leases (monotonic); +inf while it is busy, so
        #: that a lease added meanwhile is always seen
        self._planned = float("inf")
        #: the push listener: a holder told at once, between renewals
        self.inbox = Inbox(store.client, self.held)
        self._namespaces = {store.layout.namespace}
        self.rounds = 0  # renewal round trips made; read by tests and benchmarks
        self.wakeups = 0  # times the thread woke up before its planned look (an add, a flush)

    def add(self, lease: Lease) -> None:
        """Renew ``lease`` from now on. The thread is woken only if its next look at the leases
        comes later than this lease's first renewal is due: a stream of short runs does not cost
        a thread wake-up each."""
        with self._lock:
            self._leases.add(lease)
            # the tick is known from the first lease on, even if that lease is gone before the
            # thread looks: else every short run would find the thread unplanned and wake it
            self._tick = min(self._tick, lease.interval)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="singleflight-heartbeat", daemon=True
                )
                self._thread.start()
                self.inbox.listen(self.store.layout)
            if lease.store is not self.store and lease.layout.namespace not in self._namespaces:
                self._namespaces.add(lease.layout.namespace)
                self.inbox.listen(lease.layout)
            if mod_time.monotonic() + lease.interval < self._planned:
                self._wake.set()

    def listen(self) -> None:
        """Start the inbox now, before the first lease (a worker's pool process as it starts)."""
        self.inbox.listen(self.store.layout)

    def schedule_flush(self, when: float) -> None:
        """Wake at monotonic time ``when`` to write pending progress updates."""
        with self._lock:
            if when < self._flush_at:
                self._flush_at = when
                self._wake.set()

    def discard(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def held(self) -> list[Lease]:
        with self._lock:
            return [lease for lease in self._leases if not lease.lost_known and not lease.released]

    def stop(self) -> None:
        self.inbox.stop()
        self._stop.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._loop()
            except Exception:
                log.exception("heartbeat pass failed; renewing on")
                self._stop.wait(constants.HEARTBEAT_ERROR_RETRY)

    def _loop(self) -> None:
        inf = float("inf")
        next_renew = inf
        while not self._stop.is_set():
            with self._lock:
                self._planned = min(next_renew, self._flush_at)
            wait = self._planned - mod_time.monotonic()
            if wait > 0 and self._wake.wait(None if wait == inf else wait):
                self.wakeups += 1
            with self._lock:
                self._planned = inf
            self._wake.clear()
            if self._stop.is_set():
                return
            leases = self.held()
            now = mod_time.monotonic()
            if leases:
                tick = min(lease.interval for lease in leases)
                if next_renew == inf or now + tick < next_renew:
                    # the first lease, or one with a shorter interval: re-plan the tick
                    next_renew = now + tick
                self._tick = tick
            elif next_renew == inf and self._tick != inf:
                # no lease now, but there were: keep ticking (an empty tick costs no round trip),
                # so a new lease is covered by the planned look and needs no wake-up
                next_renew = now + self._tick
            if now >= self._flush_at:
                self._flush_due(leases)
            if mod_time.monotonic() >= next_renew:
                wait_next = self.renew_once(leases)
                next_renew = mod_time.monotonic() + (self._tick if wait_next == inf else wait_next)

    def _flush_due(self, leases: list[Lease]) -> None:
        """Write the pending progress of every lease whose turn has come."""
        with self._lock:
            self._flush_at = float("inf")
        now = mod_time.monotonic()
        later = float("inf")
        for lease in leases:
            reporter = lease.reporter
            due = None if reporter is None else reporter.due
            if reporter is None or due is None:
                continue
            if due > now:
                later = min(later, due)
                continue
            try:
                reporter.flush()
            except Exception as exc:  # noqa: BLE001 - a failed flush must not stop renewals
                log.warning("could not write pending progress for key=%r: %s", lease.key, exc)
        if later != float("inf"):
            self.schedule_flush(later)

    def renew_once(self, leases: list[Lease]) -> float:
        """Renew ``leases`` in one round trip; return the wait before the next tick."""
        if not leases:
            return float("inf")
        sent = mod_time.monotonic()
        try:
            # with min_replicas, a renewal too few replicas confirmed does not move the lease's clock
            results, confirmed = renew_confirmed(self.store, leases)
        except Exception as exc:
            if isinstance(exc, redis.RedisError):
                log.warning("could not renew %d lease(s), retrying: %s", len(leases), exc)
                why = f"Redis unreachable until the lease expired ({exc})"
            else:
                log.exception("could not renew %d lease(s), retrying", len(leases))
                why = f"renewals failed until the lease expired ({exc!r})"
            for lease in leases:
                if mod_time.monotonic() >= lease.deadline:
                    lease.mark_lost(why)
            return min(constants.HEARTBEAT_ERROR_RETRY, self._tick)
        finally:
            self.rounds += 1
            metrics.count("renewal_round_trips")
        metrics.count("renewals", amount=len(leases))
        sent = last_attempt_sent(sent)  # a renewal sent again after a lost reply renews from then
        for lease, code, counts in zip(leases, results, confirmed, strict=True):
            lease.renewed(code, sent if counts else lease.confirmed_at)
            if code == RenewReply.GONE:
                self.discard(lease)
        return self._tick


_heartbeats: dict[tuple[int, int], Heartbeat] = {}
_lock = threading.Lock()


def heartbeat_for(store: LeaseStore) -> Heartbeat:
    """The renewer of this process for ``store``'s Redis client."""
    key = (os.getpid(), id(store.client))
    with _lock:
        beat = _heartbeats.get(key)
        if beat is None:
            beat = _heartbeats[key] = Heartbeat(store)
        return beat


def _forget_after_fork() -> None:
    global _lock
    _heartbeats.clear()
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_after_fork)
