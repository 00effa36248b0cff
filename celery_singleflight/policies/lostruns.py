"""A run lost with its worker ends terminal.

A run the library parked (``queue``), delayed (debounce, the rate limit), re-sent (``retry``,
``fail_closed``) or sent again after the lease Redis lost its data before it started has an
intermediate state in the result backend (``QUEUED``, ``DEBOUNCED``, ``RETRY``) that only its own
end replaces. A pool process killed alone is reported by the worker's main process
(``WorkerLostError``); a whole worker killed leaves nobody to report it, and the run would wait
forever.

So when such a run starts (under its lease, before its body), its state becomes ``STARTED``, as
with Celery's ``task_track_started`` (a recovered copy of it is then dropped: :mod:`.recovered`),
and it is entered in the namespace's started index (:mod:`..protocol.started`; one write to each;
a run that never waited pays nothing, nor does one whose task ignores results; one that
acknowledges late is not entered: its message is delivered again instead). Any worker's sweeper
looks at it once its lease would have run out: still held, it looks again later; ended by a
release, it forgets it; run out unreleased, it sets the run's result to ``FAILURE`` with
:class:`~..errors.RunLost` (unless the result is already ready: SUCCESS, FAILURE, REVOKED),
:data:`~..constants.LOST_RUN_GRACE` after the lease ran out, plus up to one sweep interval.

A worker that merely froze past its TTL is told its lease is gone, as always; if it later
finishes, its own result overwrites that FAILURE. The write sends no signal and calls no
errback: the lost run's request is gone with its worker.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import redis
from celery import states as celery_states
from celery.backends.base import DisabledBackend

from .. import constants
from ..protocol.started import StartedRun, Verdict, verdict_of
from ..protocol.store import LeaseStore
from ..run.guard import options_store
from ..run.journal import HEADER_RECOVERED
from ..run.lost import end_lost_run, watched
from ..run.messages import HEADER_ATTEMPT, HEADER_DELAYED, HEADER_FAIR_WAITED, HEADER_HANDOFF, header
from ..run.stage import Ended, Run, Stage, Sweep
from .delayed import started

__all__ = ["FailLostRuns", "LostRuns", "WAITED_HEADERS", "watch_take", "waited"]

log = logging.getLogger("celery_singleflight.release")

#: the headers of a run that waited in an intermediate state before it started: handed the key
#: after it parked (QUEUED); re-sent by ``retry`` or ``fail_closed`` (RETRY); delayed by the rate
#: limit (RETRY) or by debounce (DEBOUNCED: only a delayed call is ever in that state); sent again
#: after the lease Redis lost its data (still in the state it waited in); handed its fair slot (QUEUED)
WAITED_HEADERS = (HEADER_HANDOFF, HEADER_ATTEMPT, HEADER_DELAYED, HEADER_RECOVERED, HEADER_FAIR_WAITED)


def waited(run: Run) -> bool:
    """Whether ``run`` waited before it started (its headers say so) and keeps a result state that
    only its own end replaces, which a run lost with its worker would keep for ever."""
    request, task = run.request, run.task
    if run.eager or all(header(request, name) is None for name in WAITED_HEADERS):
        return False
    return not (request.ignore_result or task.ignore_result or isinstance(task.backend, DisabledBackend))


def _waited(run: Run) -> bool:
    """:func:`waited`, asked once per run."""
    known = run.notes.get(LostRuns)
    if known is None:
        known = run.notes[LostRuns] = waited(run)
    return bool(known)


def watch_take(run: Run, key: str, slots: int) -> None:
    """Before a run that waited takes ``key`` (of ``slots`` slots): enter it in the started index
    (a provisional member, due when the lease it takes would run out), so that a worker dying
    between the take and the run's start leaves it watched. One ``ZADD``; its start replaces it."""
    if not (_waited(run) and watched(run.task)):
        return
    entry = StartedRun.provisional(key, slots, run.task_id, str(run.request.hostname or ""), run.handoff)
    try:
        run.task.store.started.enter(entry, run.options.ttl + constants.LOST_RUN_GRACE)
    except redis.RedisError as exc:  # its take meets the same Redis: on_redis_error decides
        log.debug("could not enter %s[%s] on key=%r in the started index before its take: %s",
                  run.task.name, run.task_id, key, exc)
        return
    run.provisional.append(entry)


class LostRuns(Stage):
    """The stage of every guarded task: a run that waited is watched while it runs."""

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls()

    @classmethod
    def sweeps(cls, app: Any, tasks: list[Any]) -> list[Sweep]:
        """One :class:`FailLostRuns` per namespace of the tasks whose lost runs are ended."""
        found: dict[tuple[int, str], LeaseStore] = {}
        for task in tasks:
            if watched(task):
                store = options_store(task.options)
                found[(id(store.client), task.options.namespace)] = store
        return [FailLostRuns(app, store) for store in found.values()]

    def before_lease(self, run: Run) -> Ended | None:
        watch_take(run, run.key, run.options.max_concurrency)
        return None

    def on_start(self, run: Run) -> Ended | None:
        request, task = run.request, run.task
        if not _waited(run):
            if run.claim is not None:
                started(run)  # a delayed run's copy is done all the same
            return None
        if not task.track_started:  # else Celery wrote it; only the run's own end replaces it
            meta = {"pid": os.getpid(), "hostname": request.hostname, "key": run.key}
            try:
                task.backend.store_result(run.task_id, meta, celery_states.STARTED, request=request)
            except Exception as exc:  # noqa: BLE001 - any backend's error: the run goes on
                log.warning("could not mark %s[%s] on key=%r STARTED: %s", task.name, run.task_id, run.key,
                            exc)
        if not watched(task):
            started(run)
            return None
        guard, lease = run.guard, run.lease
        assert guard is not None and lease is not None
        entry = StartedRun(run.key, lease.slot, run.task_id, lease.fence, str(request.hostname or ""))
        look, provisional = lease.time_left + constants.LOST_RUN_GRACE, run.provisional
        try:
            # watched as started (its provisional members go), then its delayed copy (if any)
            # done: one round trip
            started(run, lambda pipe: guard.store.started.enter(entry, look, pipe, instead_of=provisional))
        except redis.RedisError as exc:  # the run goes on; only its loss would go unreported
            log.warning("could not enter %s[%s] on key=%r in the started index: %s", run.task.name,
                        run.task_id, run.key, exc)
        return None


class FailLostRuns(Sweep):
    """Set the result of the started runs of one namespace whose lease ran out unreleased to
    FAILURE with :class:`RunLost`. Safe to run twice and by several workers at once: each writes
    the same result, and dropping a member twice does nothing."""

    def __init__(self, app: Any, store: LeaseStore) -> None:
        self.app, self.store = app, store

    def sweep_once(self) -> int:
        started = self.store.started
        members = started.due()
        if not members:
            return 0
        entries: list[tuple[str, StartedRun]] = []
        for member in members:
            entry = StartedRun.parse(member)
            if entry is None:
                started.drop(member)
            else:
                entries.append((member, entry))
        wanted = [(entry.key, slot) for _, entry in entries for slot in entry.slots]
        snapshots = iter(self.store.reads.snapshots(wanted))
        for member, entry in entries:
            found = [next(snapshots) for _ in entry.slots]
            records = [record for record, _, _ in found]
            seen, left = verdict_of(records, found[0][2], entry)
            if seen is Verdict.ENDED and entry.slot < 0 and entry.handoff:
                # named by no record: if it adopted the key, its fence tells (one more read)
                seen, left = verdict_of(records, found[0][2], entry, started.adopted(entry))
            if seen is Verdict.LIVE:
                started.plan(member, left + constants.LOST_RUN_GRACE)
            elif seen is Verdict.ENDED or self.fail(entry):
                started.drop(member)
        return 0

    def fail(self, entry: StartedRun) -> bool:
        return end_lost_run(self.app, entry.key, entry.task_id, entry.worker)
