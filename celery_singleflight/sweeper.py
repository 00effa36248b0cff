"""The queue sweeper: hands on keys whose holder ended without handing them on.

A parked run is normally sent by the release that frees its key. A key whose holder died without
releasing (a lost host), or whose hand-off message was never sent, is resumed here: a thread in
each worker's main process looks at the namespace's *waiting index* (a sorted set of keys with
parked or joined runs, scored by when the holder's lease runs out) about once a second. Only keys
with waiting runs are ever looked at. A delayed (ETA) message would not do: with the Redis broker
it is reserved by the worker that fetched it and dies with that worker until the visibility
timeout.

It also skips the sequence numbers of ``ordered=True`` keys whose message never arrived
(:mod:`.ordering`), once ``order_timeout`` has passed.

The same thread revokes superseded runs (``on_duplicate="supersede"``) whose grace has run out:
the namespace's *superseding index* holds their keys, due when the grace ends; it is filled by the
newcomer and, should that process die first, by the superseded run's own heartbeat. Any worker
of the app revokes, so the revoke happens even when the newcomer's worker is gone.
"""

from __future__ import annotations

import logging
import threading
import time as mod_time
from typing import Any

import redis

from .errors import LeaseLost
from .guard import options_store
from .hold import SENDER as HOLD_SENDER
from .ordering import sweep_order
from .policies import RESUME_GRACE
from .registry import guarded_tasks
from .settle import Ending, answer_orphaned_joined, settle
from .store import LeaseStore

__all__ = ["REVOKE_AGAIN", "SWEEP_INTERVAL", "QueueSweeper", "ordering_stores", "superseding_stores",
           "sweeper_stores"]

log = logging.getLogger("celery_singleflight.queue")
SWEEP_INTERVAL = 1.0
#: after a revoke, when to look again (and revoke again if the run still holds its key: the
#: broadcast may have been missed)
REVOKE_AGAIN = 5.0


class QueueSweeper:
    """Resumes queues whose holder ended without handing the key on (see the module docstring)."""

    def __init__(
        self, app: Any, stores: list[tuple[LeaseStore, float, int]], interval: float = SWEEP_INTERVAL,
        superseding: list[LeaseStore] | None = None, ordering: list[tuple[LeaseStore, float]] | None = None,
    ):
        self.app = app
        self.stores = stores  # (store, lease TTL for a handoff reservation, slots per key)
        # namespaces with a supersede task (only those read their superseding index: the others'
        # Redis users need no access to it)
        self.superseding = superseding_stores(app) if superseding is None else superseding
        # namespaces with an ordered=True task, with their order_timeout
        self.ordering = ordering_stores(app) if ordering is None else ordering
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="singleflight-queue-sweeper", daemon=True)

    def start(self) -> QueueSweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sweep_once(self) -> int:
        """Check every due key once; return how many parked runs were sent."""
        sent = 0
        for store, ttl, slots in self.stores:
            for key in store.due_waiting():
                found = store.resume(key, ttl, RESUME_GRACE, slots)
                if found is None:
                    continue
                if found.handoff is not None:
                    log.warning("key=%r was free with runs parked (its holder ended without handing"
                                " it on); sending the next one", key)
                    sent += 1
                settle(self.app, found, Ending(
                    key, "sweeper", "<gone>", "lost", signal=False,
                    error=LeaseLost(key, "the run it joined ended without a result (its worker was lost)"),
                ))
                if found.handoff is not None:
                    self._orphans(store, key)
        for store in self.superseding:
            for key in store.due_superseding():
                self.revoke_superseded(store, key)
        for store, timeout in self.ordering:
            for key in store.due_ordering():
                sent += sweep_order(self.app, store, key, timeout)
        return sent

    def revoke_superseded(self, store: LeaseStore, key: str) -> bool:
        """Revoke (``terminate=True``) the superseded holder of ``key`` if its grace is over;
        plan the next look. True if a revoke was sent."""
        record = store.holder_record(key)
        if not record or not record.get("sup_by"):
            store.plan_superseding(key, None)  # released (or never superseded): nothing to do
            return False
        if record.get("reserved") or record.get("task_name") == HOLD_SENDER:
            # on its way to a run that starts superseded and stops at once; or a hold(), which
            # has no task to revoke and stops by itself (its lease says it was superseded)
            store.plan_superseding(key, REVOKE_AGAIN)
            return False
        left = int(record.get("sup_due") or 0) / 1000.0 - mod_time.time()
        if left > 0:
            store.plan_superseding(key, left)
            return False
        task_id, signame = record.get("task_id") or "", record.get("sup_sig") or "SIGTERM"
        log.warning("revoking %s[%s] on key=%r: superseded by %s and still running after its grace",
                    record.get("task_name"), task_id, key, record.get("sup_by"))
        self.app.control.revoke(task_id, terminate=True, signal=signame)
        store.plan_superseding(key, REVOKE_AGAIN)
        return True

    def _orphans(self, store: LeaseStore, key: str) -> None:
        """A handoff nobody sent can mean that the releasing run's process died right after its
        release, with the joined runs it took unanswered (its whole worker was killed, so no
        main process answered them either): answer those still waiting."""
        record = store.record(key)
        if record.get("rt"):
            answer_orphaned_joined(self.app, self.app.backend, store, key, record["rt"],
                                   record.get("prev_task_id") or record.get("task_id") or "<gone>",
                                   LeaseLost(key, "the run it joined released the key, then its worker was"
                                                  " lost before it answered"))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except redis.RedisError as exc:
                log.warning("queue sweep failed, retrying: %s", exc)
            except Exception:
                log.exception("queue sweep failed")


def sweeper_stores(app: Any) -> list[tuple[LeaseStore, float, int]]:
    """Every namespace of the app's guarded tasks, whatever their policies: besides queue and
    join, a turned-away redelivery waits in the queue of its own run. A namespace's keys are
    checked with its largest TTL and slot count (extra slots are free)."""
    found: dict[tuple[int, str], tuple[LeaseStore, float, int]] = {}
    for task in guarded_tasks(app):
        opts = task.options
        store = options_store(opts)
        key = (id(store.client), opts.namespace)
        _, ttl, slots = found.get(key, (store, 0.0, 1))
        found[key] = (store, max(opts.ttl, ttl), max(opts.max_concurrency, slots))
    return list(found.values())


def superseding_stores(app: Any) -> list[LeaseStore]:
    """The stores of the namespaces where a guarded task uses ``on_duplicate="supersede"``."""
    found: dict[tuple[int, str], LeaseStore] = {}
    for task in guarded_tasks(app):
        opts = task.options
        if "supersede" in (opts.on_duplicate, opts.on_beat_duplicate):
            store = options_store(opts)
            found[(id(store.client), opts.namespace)] = store
    return list(found.values())


def ordering_stores(app: Any) -> list[tuple[LeaseStore, float]]:
    """The stores of the namespaces with an ``ordered=True`` task, each with the shortest
    ``order_timeout`` of those tasks."""
    found: dict[tuple[int, str], tuple[LeaseStore, float]] = {}
    for task in guarded_tasks(app):
        opts = task.options
        if opts.ordered:
            store = options_store(opts)
            key = (id(store.client), opts.namespace)
            timeout = min(found[key][1], opts.order_timeout) if key in found else opts.order_timeout
            found[key] = (store, timeout)
    return list(found.values())
