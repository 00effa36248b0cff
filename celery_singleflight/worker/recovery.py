"""Recovery of the runs a worker left waiting in a lease Redis that lost its data: a job of the
sweeper in each worker's main process (see :mod:`..run.journal` for the journal it reads).

Every sweep (about once a second) looks at each namespace's epoch (:mod:`..protocol.epoch`) and
compares it with this worker's last look (at its first look: with the epoch this worker node's
journal was last settled against, kept beside it once settled). When Redis kept its data, the
journal is compacted every :data:`~..constants.JOURNAL_COMPACT` seconds: the lines of runs that
no longer wait there are dropped. When it lost data (a new life: restarted empty; a count not
larger: an older snapshot or replica), and at a first look with no epoch kept (for what an
earlier life of this worker node left), every journaled run that no longer waits in Redis and
whose result is still a waiting state is sent again at once, in journal order, with the header
:data:`~..run.journal.HEADER_RECOVERED` (its start drops it if it ran, runs or waits again
meanwhile: :mod:`..policies.recovered`) and the hand-off token it was parked with, if any (its
take marks that token adopted: a hand-off message still on its way is then dropped); a delayed
run gets its copy in Redis back instead, under its countdown message's token, so that of that
message and the copy one runs (journaled without the token, it is left to its message). A run
that cannot be sent again (its task is not registered here, its message is unreadable,
:data:`~..constants.RECOVER_ATTEMPTS` sends failed) ends FAILURE with :class:`~..errors.WaitingLost`.
"""

from __future__ import annotations

import json
import logging
import time as mod_time
import uuid
from collections.abc import Sequence
from typing import Any

import redis
from celery import states as celery_states
from celery.backends.base import DisabledBackend
from celery.canvas import Signature

from .. import constants
from ..config.options import app_options
from ..errors import WaitingLost
from ..protocol.store import LeaseStore
from ..run.guard import options_store
from ..run.journal import HEADER_RECOVERED, HEADER_RECOVERED_HANDOFF, Entry, Journal
from ..run.messages import HEADER_DELAYED, HEADER_HANDOFF, HEADER_SEQ
from ..run.settle import answer_joined
from ..run.stage import Sweep
from ..states import DELAYED_STATES, JOINED, QUEUED
from .registry import guarded_tasks

__all__ = ["WAITING", "Recovery", "recovery_sweeps"]

log = logging.getLogger("celery_singleflight.recovery")

_PENDING = celery_states.PENDING
#: per kind, the result states of a run that still waits as journaled: a lost one is sent again. A
#: run that waited one way and then another (its turn came, then it parked; it was delayed, then
#: parked) is journaled twice, maybe by two workers: only the line of its current wait matches its
#: state, so it is sent once. (PENDING: also a task with ``ignore_result``, which stores no state.)
WAITING = {
    "park": frozenset({QUEUED, _PENDING}),
    "pending": frozenset({QUEUED, _PENDING}),
    "join": frozenset({JOINED}),
    "order": frozenset({_PENDING}),
    "delay": DELAYED_STATES | {_PENDING},
}
#: what each kind of journaled run was (for :class:`WaitingLost`)
WHAT = {
    "park": "it was parked by on_duplicate='queue'",
    "join": "it had joined its key's holder",
    "pending": "it was its key's pending run",
    "order": "it waited for its turn in send order",
    "delay": "it was delayed",
}
#: headers a recovered run is sent without: it takes the key (or parks again) as a new arrival
_DROPPED_HEADERS = (HEADER_HANDOFF, HEADER_DELAYED)

# this worker's verdict on a namespace's data at a look
_FIRST, _INTACT, _LOST = "first", "intact", "lost"


class Recovery(Sweep):
    """The sweeper's job for one worker node's journal (see the module docstring)."""

    def __init__(self, app: Any, journal: Journal) -> None:
        self.app, self.journal = app, journal
        self.stores: dict[str, LeaseStore] = {}
        for task in guarded_tasks(app):
            self.stores.setdefault(task.options.namespace, options_store(task.options))
        #: namespace -> (life, count) at this worker's last look
        self.seen: dict[str, tuple[str, int]] = {}
        #: journal line -> failed sends, of the runs found lost and not yet sent again
        self.owed: dict[str, int] = {}
        #: namespaces whose data may be lost and whose journal is not settled yet (a loss seen
        #: once is acted on even if Redis cannot be read at that sweep)
        self.suspect: dict[str, str] = {}  # namespace -> its verdict (_FIRST, or _LOST once seen)
        self.compact_at = 0.0  # the first sweep reads the journal
        #: when this life of the worker began: what it journaled since was written against the
        #: Redis of its first look
        self.born = mod_time.time()
        #: namespace -> the epoch its journal was last settled against (kept across this worker
        #: node's restarts: a first look that finds the same life and a larger count means nothing
        #: was lost while it was down). Kept only once a loss seen is settled: a worker that stops
        #: before sees the loss again at its restart.
        self.kept = journal.epochs()

    def sweep_once(self) -> int:
        verdicts = {namespace: self.look(namespace) for namespace in list(self.stores)}
        for namespace, verdict in verdicts.items():
            if verdict in (_FIRST, _LOST):
                self._suspect(namespace, verdict)
        if mod_time.monotonic() < self.compact_at and not self.owed and not self.suspect:
            self.keep()
            return 0
        self.compact_at = mod_time.monotonic() + constants.JOURNAL_COMPACT
        by_namespace: dict[str, list[Entry]] = {}
        try:
            for entry in self.journal.entries():
                by_namespace.setdefault(entry.namespace, []).append(entry)
        except OSError as exc:
            log.warning("the journal %s cannot be read: %s", self.journal.path, exc)
            return 0
        for namespace in set(self.suspect) - set(by_namespace):  # nothing journaled there: nothing to recover
            del self.suspect[namespace]
        sent, done = 0, []
        for namespace, entries in by_namespace.items():
            if namespace not in self.stores:  # known only from the journal: the app's Redis
                self.stores[namespace] = options_store(app_options(self.app, lock_namespace=namespace))
                found = self.look(namespace)
                if found is not None:
                    self._suspect(namespace, _LOST if found == _INTACT else found)
            verdict = self.suspect.get(namespace) or verdicts.get(namespace, _INTACT)
            settled = self.settle(namespace, verdict, entries) if verdict is not None else None
            if settled is not None:
                self.suspect.pop(namespace, None)
                sent += settled[0]
                done += settled[1]
        try:
            self.journal.drop(done)
        except OSError as exc:  # the lines are looked at again (a run sent again is dropped at its start)
            log.warning("the journal %s cannot be rewritten: %s", self.journal.path, exc)
        self.keep()
        return sent

    def keep(self) -> None:
        """Keep the epoch last seen of each namespace whose journal is settled against it: no loss
        waits to be settled there, and no run found lost waits to be sent again."""
        owing = {entry.namespace for entry in map(Entry.parse, self.owed) if entry is not None}
        settled = {namespace: epoch for namespace, epoch in self.seen.items()
                   if namespace not in self.suspect and namespace not in owing}
        if all(self.kept.get(namespace) == epoch for namespace, epoch in settled.items()):
            return
        # flushed to the disk when a life is new (a mere larger count only makes the next look laxer)
        sync = any(self.kept.get(namespace, ("", 0))[0] != epoch[0] for namespace, epoch in settled.items())
        try:
            self.journal.keep_epochs({**self.kept, **settled}, sync=sync)
        except OSError as exc:  # kept at a later sweep; until then a restart looks at the older one
            log.warning("the journal %s cannot keep the epoch: %s", self.journal.path, exc)
            return
        self.kept.update(settled)

    def _suspect(self, namespace: str, verdict: str) -> None:
        """The namespace's journal is to be settled as ``verdict`` (a loss outweighs a first look)."""
        if self.suspect.get(namespace) != _LOST:
            self.suspect[namespace] = verdict

    def look(self, namespace: str) -> str | None:
        """This worker's verdict on the namespace's data (None: Redis cannot be reached)."""
        try:
            life, count = self.stores[namespace].epoch.look(uuid.uuid4().hex)
        except redis.RedisError as exc:
            log.debug("namespace %r: the epoch cannot be read: %s", namespace, exc)
            return None
        before = self.seen.get(namespace)
        self.seen[namespace] = (life, count)
        if before is None:
            # this worker's first look: compared with the epoch its journal was last settled
            # against, in an earlier life of this worker node (none: it never settled one)
            before = self.kept.get(namespace)
            if before is None:
                # its journal is compacted as usual: only lines older than this life are looked at
                # as lost
                return _FIRST
            if life != before[0] or count <= before[1]:
                log.warning("the lease Redis of namespace %r lost its data while this worker was down:"
                            " sending again the runs it left waiting there", namespace)
                return _LOST
            return _INTACT
        if life != before[0]:
            log.warning("the lease Redis of namespace %r lost its data (it came back empty): sending again"
                        " the runs this worker left waiting there", namespace)
            return _LOST
        if count <= before[1]:
            log.warning("the lease Redis of namespace %r lost its data (it came back with older data:"
                        " count %d after %d): sending again the runs this worker left waiting there",
                        namespace, count, before[1])
            return _LOST
        return _INTACT

    def settle(self, namespace: str, verdict: str, entries: list[Entry]) -> tuple[int, list[str]] | None:
        """Compact (intact) or recover (lost, first look) the namespace's entries: (runs sent
        again, lines done with); None if Redis could not be read."""
        store = self.stores[namespace]
        try:
            waits = self.waiting(store, entries)
            if verdict == _INTACT:  # the reads must come from intact data: look once more after them
                confirmed = self.look(namespace)
                if confirmed != _INTACT:
                    self._suspect(namespace, _LOST if confirmed is None else confirmed)
                    if confirmed is None:
                        return None
                    verdict, waits = confirmed, self.waiting(store, entries)
        except redis.RedisError as exc:
            log.debug("namespace %r: the journal is not settled now: %s", namespace, exc)
            return None
        placed = {entry.task_id for entry, (still, _) in zip(entries, waits, strict=True) if still}
        done: list[str] = []
        handed: list[tuple[str, str]] = []  # the marks of lines done with (their runs were handed on)
        lost: dict[str, list[Entry]] = {}  # task id -> its lines; in the order of each run's last line
        for entry, (waits_still, marked) in zip(entries, waits, strict=True):
            if waits_still:
                self.owed.pop(entry.line, None)
            elif entry.task_id not in placed and (entry.line in self.owed
                                                  or self._lost(verdict, entry, marked)):
                lost[entry.task_id] = [*lost.pop(entry.task_id, []), entry]
            else:  # it no longer waits, or an earlier wait of a run that waits again (its turn came)
                done.append(entry.line)
                if marked:
                    handed.append((entry.key, entry.mark))
        sent = failed = 0
        for lines in lost.values():  # a run journaled twice (its turn came, then it parked) is sent once
            outcome = self.recover(store, lines[-1])
            if outcome != "later":
                done += [entry.line for entry in lines]
            sent += outcome == "sent"
            failed += outcome == "failed"
        if sent or failed:
            log.warning("namespace %r: %d waiting run(s) sent again, %d ended FAILURE (WaitingLost)",
                        namespace, sent, failed)
        try:
            store.epoch.unmark(handed)
        except redis.RedisError as exc:  # they go with their key's TTL
            log.debug("namespace %r: the marks of settled journal lines stay: %s", namespace, exc)
        return sent, done

    def _lost(self, verdict: str, entry: Entry, marked: bool | None) -> bool:
        """Whether a journaled run that no longer waits was lost with Redis's data: its mark says
        so (gone with the data that had it waiting: a snapshot taken after this worker's last
        look, a Cluster master other than the epoch's), or, for a line without a mark, the epoch
        (a loss seen; at a first look, a line of an earlier life of this worker node)."""
        if marked is not None:
            if not marked:
                log.warning("%s[%s] on key=%r no longer waits in the lease Redis and its journal mark is"
                            " gone with it: Redis lost the data it waited in", entry.task, entry.task_id,
                            entry.key)
            return not marked
        return verdict == _LOST or (verdict == _FIRST and entry.at < self.born)

    def waiting(self, store: LeaseStore, entries: Sequence[Entry]) -> list[tuple[bool, bool | None]]:
        """Whether each entry still waits in Redis, and whether its mark is there (None: a line
        without one), in one round trip."""
        return store.epoch.waiting([(e.kind, e.key, e.task_id, e.message, e.seq, e.mark) for e in entries])

    def recover(self, store: LeaseStore, entry: Entry) -> str:
        """Send a lost run again if it still waits as journaled: "sent", "skipped" (it started,
        ended, or waits another way meanwhile), "failed" (it ended FAILURE: WaitingLost) or
        "later" (tried again at the next sweep)."""
        task = self.app.tasks.get(entry.task)
        backend = task.backend if task is not None else self.app.backend
        if isinstance(backend, DisabledBackend) or (task is not None and task.ignore_result):
            status = _PENDING  # no state is kept: it is sent again (its start drops it if it holds its key)
        else:
            try:
                status = backend.get_task_meta(entry.task_id).get("status")
            except Exception as exc:  # noqa: BLE001 - any backend's error: looked at again at the next sweep
                return self._later(entry, f"its state cannot be read: {exc}")
        if status not in WAITING.get(entry.kind, ()):
            self.owed.pop(entry.line, None)
            return "skipped"
        if task is None:
            return self._fail(entry, f"its task {entry.task!r} is not registered in this worker")
        try:
            data = json.loads(entry.message)
            options = data.setdefault("options", {})
            headers = dict(options.get("headers") or {})
            handoff = str(headers.get(HEADER_HANDOFF) or "")
            headers = {name: value for name, value in headers.items() if name not in _DROPPED_HEADERS}
        except (ValueError, AttributeError, TypeError):
            return self._fail(entry, "its message is unreadable")
        # sequence number 0: none, and none is taken at the send either; it goes on by arrival (the
        # order book that held its number is gone, and a number nobody passes would hold up the rest)
        headers.update({HEADER_SEQ: 0, HEADER_RECOVERED: entry.kind})
        if handoff:  # its hand-off message may be on its way: once this run takes its key, that one is a copy
            headers[HEADER_RECOVERED_HANDOFF] = handoff
        options["headers"] = headers
        if entry.kind == "delay" and not entry.token:
            # its countdown message (and any re-send of it) carries the run; a copy under another
            # token would make those stale
            self.owed.pop(entry.line, None)
            return "skipped"
        try:
            if entry.kind == "delay":
                # its copy again, under its countdown message's token: that message (or a re-send
                # of it) still claims it; if none starts, a sweeper sends the copy
                countdown = max(0.0, (entry.due or 0.0) - mod_time.time())
                store.delayed.delay(entry.key, entry.task_id, entry.token, json.dumps(data), countdown,
                                    restore=True)
            else:
                Signature.from_dict(data, app=self.app).apply_async()
        except Exception as exc:  # noqa: BLE001 - any broker's error: sent again at the next sweep
            return self._later(entry, f"sending it again failed: {exc}")
        self.owed.pop(entry.line, None)
        log.info("%s[%s] on key=%r sent again (%s)", entry.task, entry.task_id, entry.key,
                 WHAT.get(entry.kind))
        return "sent"

    def _later(self, entry: Entry, why: str) -> str:
        attempts = self.owed[entry.line] = self.owed.get(entry.line, 0) + 1
        if attempts >= constants.RECOVER_ATTEMPTS:
            return self._fail(entry, f"{why} ({attempts} attempts)")
        log.warning("%s[%s] on key=%r is not sent again yet: %s", entry.task, entry.task_id, entry.key, why)
        return "later"

    def _fail(self, entry: Entry, why: str) -> str:
        """End the run FAILURE with WaitingLost (its callbacks and chain as for a joined run);
        "later" if its result cannot be written now."""
        error = WaitingLost(entry.key, entry.task_id, f"{WHAT.get(entry.kind, 'it waited')}; {why}")
        task = self.app.tasks.get(entry.task)
        backend = task.backend if task is not None else self.app.backend
        message = entry.message
        try:
            json.loads(message)
        except ValueError:  # what the result needs: its task id and task name
            message = json.dumps({"task": entry.task, "options": {"task_id": entry.task_id}})
        answer_joined(self.app, [message], entry.key, "the recovery", error=error, label="lost waiting run")
        if isinstance(backend, DisabledBackend):
            log.error("%s[%s]: %s", entry.task, entry.task_id, error)
            self.owed.pop(entry.line, None)
            return "failed"
        try:
            written = backend.get_task_meta(entry.task_id).get("status") == celery_states.FAILURE
        except Exception:  # noqa: BLE001 - any backend's error: written at the next sweep
            written = False
        if not written:
            self.owed.setdefault(entry.line, constants.RECOVER_ATTEMPTS)
            return "later"
        self.owed.pop(entry.line, None)
        log.error("%s[%s]: %s", entry.task, entry.task_id, error)
        return "failed"


def recovery_sweeps(app: Any, node: str) -> list[Sweep]:
    """The recovery job of worker node ``node`` (Celery's hostname), if the app guards any task."""
    if not guarded_tasks(app) or not node:
        return []
    return [Recovery(app, Journal(app_options(app).journal_dir, node))]
