"""The sweeper: a thread in each worker's main process that hands on what waits in Redis.

A parked run is normally sent by the release that frees its key. A key whose holder died without
releasing (a lost host), or whose hand-off message was never sent, is resumed here
(:class:`HandOn`): the sweeper looks at the namespace's *waiting index* (a sorted set of keys
with parked or joined runs, scored by when the holder's lease runs out) about once a second.
Only keys with waiting runs are ever looked at. A delayed (ETA) message would not do: with the
Redis broker it is reserved by the worker that fetched it and dies with that worker until the
visibility timeout.

The stages add their own jobs (:meth:`~..run.stage.Stage.sweeps`): revoking superseded runs
whose grace is over, skipping the sequence numbers of ``ordered=True`` keys whose message never
arrived. Any worker of the app does each job, so nothing waits on one worker's life.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

from .. import constants
from ..errors import LeaseLost, ProtocolMismatch
from ..policies import STAGES
from ..protocol.fair import gate_key
from ..protocol.store import LeaseStore
from ..run.guard import options_store
from ..run.settle import Ending, answer_orphaned_joined, settle
from ..run.stage import Sweep
from .registry import guarded_tasks, is_guarded

__all__ = ["HandOn", "Sweeper", "hand_on_sweeps", "sweeps_for"]

#: how many releases a sweeper remembers having looked at (a few kB)
_ANSWERED_KEPT = 4096

log = logging.getLogger("celery_singleflight.queue")


class Sweeper:
    """Runs its jobs about every ``interval`` seconds on a daemon thread (see the module docstring)."""

    def __init__(self, app: Any, jobs: list[Sweep], interval: float = constants.SWEEP_INTERVAL) -> None:
        self.app = app
        self.jobs = jobs
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="singleflight-queue-sweeper", daemon=True)

    def start(self) -> Sweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def sweep_once(self) -> int:
        """Run every job once; return how many waiting runs were sent."""
        return sum(job.sweep_once() for job in self.jobs)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except redis.RedisError as exc:
                log.warning("queue sweep failed, retrying: %s", exc)
            except Exception:
                log.exception("queue sweep failed")


#: how many keys' slot counts a sweeper remembers
_SLOTS_KEPT = 4096


class HandOn(Sweep):
    """Resume the keys of one namespace whose holder ended without handing them on (``ttl``:
    the reservation made for a parked run; ``slots``: the most slots a key of it has; ``gates``:
    the fair gates of its tasks, with their slots)."""

    def __init__(self, app: Any, store: LeaseStore, ttl: float, slots: int,
                 gates: dict[str, int] | None = None) -> None:
        self.app, self.store, self.ttl, self.slots = app, store, ttl, slots
        self.gates = gates or {}
        #: key -> the slots of the task whose runs wait there (read from its queue once)
        self.known_slots: dict[str, int] = {}
        #: (key, release token) whose joined runs this sweeper made sure were answered
        self.answered: set[tuple[str, str]] = set()

    def sweep_once(self) -> int:
        sent = 0
        for key in self.store.handoff.due_waiting():
            slots = self.slots_of(key)
            for _ in range(slots):  # each look hands on one free slot: as many looks as are free
                try:
                    found = self.store.handoff.resume(key, self.ttl, slots)
                except ProtocolMismatch as exc:
                    log.error("key=%r is not handed on: %s", key, exc)
                    break
                if found is None:
                    break
                if found.handoff is not None:
                    log.warning("key=%r was free with runs parked (its holder ended without handing it on);"
                                " sending the next one", key)
                    sent += 1
                # the dead holders RESUME names are ended by settle(), as on every path
                settle(self.app, found, Ending(
                    key, "sweeper", "<gone>", "lost", signal=False,
                    error=LeaseLost(key, "the run it joined ended without a result (its worker was lost)"),
                ))
                if found.handoff is None:
                    break
                self._orphans(key)
            self._unanswered(key)  # after RESUME: a key with nothing waiting left the index
        return sent

    def slots_of(self, key: str) -> int:
        """The slots of ``key``: a fair gate's ``fair_concurrency``; else the ``max_concurrency``
        of the task whose run waits first in the key's queue (read once per key), or the
        namespace's largest if no run waits there or its task is not known here. A look must
        never name a slot the key does not have: RESUME would find it free and hand it on, and
        the run's message would be sent a second time when a real slot frees."""
        if key in self.gates:
            return self.gates[key]
        known = self.known_slots.get(key)
        if known is not None:
            return known
        task = self.app.tasks.get(self.store.handoff.first_task(key) or "")
        if task is None or not is_guarded(task):
            return self.slots
        if len(self.known_slots) >= _SLOTS_KEPT:
            self.known_slots.clear()
        slots = self.known_slots[key] = int(task.options.max_concurrency)
        return slots

    def _unanswered(self, key: str) -> None:
        """A release took the runs joined to its run, then its whole worker was lost before it
        answered them, with nothing parked (no hand-off to reveal it). The key is in the waiting
        index since they joined: at its look, those still waiting
        :data:`~..constants.ANSWER_GRACE` after the release are answered (a live releaser does in
        milliseconds); until then the key is looked at again. Each release is looked at once."""
        later: list[float] = []
        taken, now_ms = self.store.handoff.taken_joined(key)
        for token, taken_at in taken.items():
            if (key, token) in self.answered:
                continue
            waited = (now_ms - taken_at) / 1000.0
            if waited < constants.ANSWER_GRACE:
                later.append(constants.ANSWER_GRACE - waited)
                continue
            answer_orphaned_joined(self.app, self.app.backend, self.store, key, token, "<gone>",
                                   LeaseLost(key, "the run it joined released the key, then its worker was"
                                                  " lost before it answered"))
            if len(self.answered) >= _ANSWERED_KEPT:
                self.answered.clear()  # looked at again: only runs still waiting are answered
            self.answered.add((key, token))
        if later:
            self.store.handoff.look_again(key, min(later))

    def _orphans(self, key: str) -> None:
        """A handoff nobody sent can mean that the releasing run's process died right after its
        release, with the joined runs it took unanswered (its whole worker was killed, so no
        main process answered them either): answer those still waiting."""
        record = self.store.record(key)
        if record.rt:
            answer_orphaned_joined(self.app, self.app.backend, self.store, key, record.rt,
                                   record.prev_task_id or record.task_id or "<gone>",
                                   LeaseLost(key, "the run it joined released the key, then its worker was"
                                                  " lost before it answered"))


def hand_on_sweeps(app: Any, tasks: list[Any]) -> list[Sweep]:
    """One :class:`HandOn` per namespace of the app's guarded tasks, whatever their policies
    (besides queue and join, a turned-away redelivery waits in the queue of its own run, and a
    fair task's runs at its gate), with the namespace's largest TTL and slot count (for a key
    whose waiting run's task is not known here) and its fair gates' slots."""
    found: dict[tuple[int, str], tuple[LeaseStore, float, int, dict[str, int]]] = {}
    for task in tasks:
        opts = task.options
        store = options_store(opts)
        key = (id(store.client), opts.namespace)
        _, ttl, slots, gates = found.get(key, (store, 0.0, 1, {}))
        if opts.fair_concurrency:
            gates[gate_key(task.name)] = int(opts.fair_concurrency)
        found[key] = (store, max(opts.ttl, ttl), max(opts.max_concurrency, opts.fair_concurrency or 1, slots),
                      gates)
    return [HandOn(app, store, ttl, slots, gates) for store, ttl, slots, gates in found.values()]


def sweeps_for(app: Any) -> list[Sweep]:
    """Every job of the app's sweeper: the hand-on's, then each stage's."""
    tasks = guarded_tasks(app)
    return [*hand_on_sweeps(app, tasks), *(job for stage in STAGES for job in stage.sweeps(app, tasks))]
