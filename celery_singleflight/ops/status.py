"""Who holds a key and how far along it is, readable from any process.

    from celery_singleflight import status, watch, held

    st = status(app, "sync:42")          # KeyStatus, or None if nothing is known of the key
    for event in watch(app, "sync:42"):  # replays the run's history, then follows it live
        print(event.state, event.percent)
    for st in held(app, prefix="sync:"):  # every held run of the app's namespace
        ...
    for st in status_all(app, "sync:42"):  # every held slot of a max_concurrency > 1 key
        ...

A read is one round trip (a pipeline of the server's ``TIME``, the slot's run record and the
queue's length). Watching replays the run's history stream and then blocks on it with ``XREAD``
from the last entry seen, so nothing between "read" and "subscribe" is missed; it ends with the
run. What a watch decides is :func:`watch_steps`, which makes no call itself: the blocking
:meth:`StatusReader.watch` and the asyncio ``awatch`` (:mod:`.astatus`) answer its requests.
Listing uses ``SCAN`` over the namespace's run records, never ``KEYS`` (see docs/status.md for
why not an index).

A key with ``max_concurrency=N`` > 1 has one run record per slot (``run``, ``run1`` ...
``run{N-1}``), each with its own history. ``held()`` lists one :class:`KeyStatus` per held slot
(``slot`` says which); ``read(key)`` reads slot 0 (``read(key, slot=2)`` another),
``read_all(key)`` every held slot.
"""

from __future__ import annotations

import logging
import re
import time as mod_time
from collections.abc import Generator, Iterator, Sequence
from typing import Any, NamedTuple

from .. import constants, signals
from ..config.options import app_options
from ..errors import LeaseLost
from ..keys import stored_key
from ..protocol.reads import Snapshot
from ..protocol.store import LeaseStore, store_for
from ..run.settle import Ending, settle
from ..worker.registry import known_slots
from .keystatus import KeyStatus, WatchEvent, combine, glob_escape, run_events

__all__ = [
    "HISTORY",
    "READ",
    "Follow",
    "KeyStatus",
    "StatusReader",
    "WatchEvent",
    "ask",
    "first_held",
    "force_release",
    "held",
    "next_step",
    "reader",
    "slot_run",
    "status",
    "status_all",
    "statuses",
    "watch",
    "watch_steps",
]

log = logging.getLogger("celery_singleflight.release")
#: the part of a run record's Redis key: ``run`` (slot 0) or ``run<slot>`` (slot >= 1, no leading 0)
_RUN_PART = re.compile(r"run(?:[1-9][0-9]*)?")

#: what :func:`watch_steps` asks for: the watched slot's status (a ``KeyStatus`` or None), the
#: run's whole history stream (its entries), or the entries after a cursor (:class:`Follow`)
READ, HISTORY = "read", "history"


class Follow(NamedTuple):
    """Ask for the history entries after ``after``, waiting up to ``block`` seconds for one."""

    after: str
    block: float


def slot_run(key: str, slot: int) -> tuple[str, int]:
    """The (stored key, slot) a read of ``key`` asks for; a negative slot is refused."""
    if slot < 0:
        raise ValueError(f"slot must be 0 or more, not {slot}")
    return stored_key(key), slot


def statuses(runs: Sequence[tuple[str, int]], snapshots: Sequence[Snapshot]) -> list[KeyStatus | None]:
    """The status of each (key, slot) from its snapshot (None where nothing is known)."""
    return [combine(key, record, now_ms, queued, slot)
            for (key, slot), (record, queued, now_ms) in zip(runs, snapshots, strict=True)]


def first_held(found: Sequence[KeyStatus | None]) -> KeyStatus | None:
    """What a task's ``status(*args)`` answers from its key's slots (read in slot order): the first
    held slot, else slot 0 (how its last run ended, or None)."""
    return next((st for st in found if st is not None and st.held), found[0])


def next_step(steps: Generator[WatchEvent | str | Follow, Any, None], answer: Any
              ) -> WatchEvent | str | Follow | None:
    """The next thing :func:`watch_steps` yields, sent ``answer``; None once it has ended."""
    try:
        return steps.send(answer)
    except StopIteration:
        return None


def ask(step: str | Follow, read: Any, reads: Any, key: str, slot: int) -> Any:
    """Answer a request of :func:`watch_steps` with a reader's ``read`` and its run ``reads``
    (an asyncio reader's answer is a coroutine, to await)."""
    if isinstance(step, Follow):
        return reads.follow(key, slot, step.after, step.block)
    return reads.history(key, slot) if step == HISTORY else read(key, slot)


def watch_steps(timeout: float | None, poll: float) -> Generator[WatchEvent | str | Follow, Any, None]:
    """A watch of one slot without I/O: yields :data:`READ`, :data:`HISTORY` or a :class:`Follow`
    and is sent the answer, or yields the next event (and is sent None). One plan for the blocking
    and the asyncio watch, so both end on the same conditions with the same last event."""
    snapshot: KeyStatus | None = yield READ
    if snapshot is None:
        return
    fence = snapshot.fence
    deadline = None if timeout is None else mod_time.monotonic() + timeout
    cursor = ["0-0"]
    for event in run_events((yield HISTORY), fence, cursor):
        yield event
        if event.final:
            return
    if not snapshot.held:
        by = {"by": snapshot.released_by} if snapshot.released_by else {}
        yield WatchEvent(kind="end", state=snapshot.outcome or snapshot.state, fence=fence,
                         ts=snapshot.ended, fields=by)
        return
    while deadline is None or mod_time.monotonic() < deadline:
        block = poll if deadline is None else max(0.001, min(poll, deadline - mod_time.monotonic()))
        entries = yield Follow(cursor[0], block)
        for event in run_events(entries, fence, cursor):
            yield event
            if event.final:
                return
        if not entries:
            now: KeyStatus | None = yield READ
            if now is None or not now.held or now.fence != fence:
                # ended without a history entry (it never reported progress, or expired)
                ended = now if now is not None and now.fence == fence else None
                state = ended.outcome or ended.state if ended is not None else "expired"
                by = {"by": ended.released_by} if ended is not None and ended.released_by else {}
                yield WatchEvent(kind="end", state=state, fence=fence, fields=by,
                                 ts=ended.ended if ended is not None else mod_time.time())
                return


class StatusReader:
    """Read, list, watch and force-release the keys of one namespace."""

    def __init__(self, store: LeaseStore, app: Any = None) -> None:
        self.store = store
        self.app = app  # to send what a force-release hands on; without it the sweeper does

    def _run_slot(self, name: str) -> tuple[str, int] | None:
        """(user key, slot) of a run record's Redis key name of this namespace, else None.

        Only names the layout itself would produce for that user key and slot are accepted
        (``<ns>:{<escaped key>}:run`` or ``...:run<slot>``), so a user key containing ``}:run1``
        (escaped in the name) or a foreign name such as ``...:run01`` is never taken for a slot.
        """
        layout = self.store.layout
        user_key = layout.user_key(name)
        if user_key is None:
            return None
        part = name.rpartition("}:")[2]
        if not _RUN_PART.fullmatch(part):
            return None
        slot = int(part[len("run"):] or 0)
        return (user_key, slot) if layout.run(user_key, slot) == name else None

    def _scan_runs(self, pattern: str, count: int) -> set[tuple[str, int]]:
        found: set[tuple[str, int]] = set()
        for name in self.store.reads.scan(pattern, count):
            parsed = self._run_slot(name)
            if parsed is not None:
                found.add(parsed)
        return found

    def _read_many(self, runs: list[tuple[str, int]]) -> list[KeyStatus | None]:
        """The status of each (key, slot), pipelined in batches (one round trip per batch)."""
        return statuses(runs, self.store.reads.snapshots(runs))

    def read(self, key: str, slot: int = 0) -> KeyStatus | None:
        """The status of ``key`` in one round trip; None if nothing is known about it.

        Reads slot 0, the only one of a key with ``max_concurrency=1``; ``slot`` reads another
        slot of a ``max_concurrency`` > 1 key (see :meth:`read_all` for every held one).
        """
        return self._read_many([slot_run(key, slot)])[0]

    def read_first(self, key: str, slots: int) -> KeyStatus | None:
        """The first held of the ``slots`` slots of ``key``, else its slot 0, in one round trip
        (what ``task.status(*args)`` answers)."""
        key = stored_key(key)
        return first_held(self._read_many([(key, slot) for slot in range(max(1, slots))]))

    def read_all(self, key: str, slots: int | None = None, count: int = 1000) -> list[KeyStatus]:
        """The status of every held slot of ``key``, by slot; empty if no slot is held.

        Without ``slots``, the key's run records are found with SCAN (never KEYS; like
        :meth:`held`, its cost grows with the size of the keyspace), then read in one round trip.
        With ``slots=N`` (the key's ``max_concurrency``, when the caller knows it), slots 0 to
        N-1 are read in one round trip, without SCAN.
        """
        key = stored_key(key)
        if slots is None:
            pattern = glob_escape(self.store.layout.run(key)) + "*"
            wanted = sorted(slot for found, slot in self._scan_runs(pattern, count) if found == key)
        else:
            if slots < 1:
                raise ValueError(f"slots must be 1 or more, not {slots}")
            wanted = list(range(slots))
        return [st for st in self._read_many([(key, slot) for slot in wanted]) if st is not None and st.held]

    def held(self, prefix: str = "", count: int = 1000) -> list[KeyStatus]:
        """Every held run whose user key starts with ``prefix``, found with SCAN (never KEYS).

        One :class:`KeyStatus` per held slot (a ``max_concurrency=3`` key with three runs is
        listed three times, with ``slot`` 0, 1 and 2), sorted by key, then slot.
        """
        escaped = self.store.layout.run(prefix)
        head = escaped[: -len("}:run")]
        pattern = glob_escape(head) + "*}:run*"  # run and run<slot>; parsed exactly below
        runs = sorted(run for run in self._scan_runs(pattern, count) if run[0].startswith(prefix))
        return [st for st in self._read_many(runs) if st is not None and st.held]

    def watch(
        self, key: str, timeout: float | None = None, poll: float = constants.WATCH_POLL, slot: int = 0
    ) -> Iterator[WatchEvent]:
        """Yield the run's updates as they happen (history first), ending with its ``end`` event.

        Follows the run that holds ``key`` now (or the last one, if it already ended): the run
        of slot 0, or of ``slot`` for a ``max_concurrency`` > 1 key (one run per watch). Stops
        after ``timeout`` seconds if given. Yields nothing if nothing is known about the key.
        """
        key, slot = slot_run(key, slot)
        steps, answer = watch_steps(timeout, poll), None
        while (step := next_step(steps, answer)) is not None:
            if isinstance(step, WatchEvent):
                yield step
                answer = None
            else:
                answer = ask(step, self.read, self.store.reads, key, slot)

    def force_release(self, key: str, by: str, expected_holder: str = "", slot: int = 0,
                      slots: int | None = None, ttl: float = 30.0) -> str | None:
        """Free ``key`` whoever holds it; returns the released task id (None if not held).

        Frees slot 0, or ``slot`` of a ``max_concurrency`` > 1 key (find the slot of a run with
        :meth:`read_all`; ``slots``: the key's slot count, so that the key can be handed to a
        parked run at once). With ``expected_holder``, only that task's lease is released.
        Logged at WARNING with who asked, and signalled (``lease_force_released``). The holder's
        process is told at once by a push (at its next renewal if the push is lost): its lease is
        lost, and its next ``check()`` raises. With the reader's app (``reader(app)``,
        ``force_release(app, ...)``, the CLI) a parked run is sent at once and runs that joined the
        released run get a :class:`LeaseLost` error; a reader without one leaves both to the
        queue sweeper of a worker.
        """
        if slot < 0:
            raise ValueError(f"slot must be 0 or more, not {slot}")
        key = stored_key(key)
        released = self.store.handoff.force_release(key, by, expected_holder, slot, max(slots or 1, slot + 1),
                                                    ttl, hand_on=self.app is not None)
        if released is None:
            return None
        task_id, fence, settlement = released
        where = f" slot {slot}" if slot else ""
        log.warning("force-released key=%r%s held by task %s (fence %s), by %s",
                    key, where, task_id, fence, by)
        if self.app is not None:
            settle(self.app, settlement, Ending(
                key, "operator", task_id, "force-released", signal=False,
                error=LeaseLost(key, f"the run it joined was force-released by {by}"),
            ))
        signals.lease_force_released.send(sender=None, key=key, task_id=task_id, fence=fence, by=by)
        return task_id


_readers: dict[tuple[int, int], StatusReader] = {}


def reader(app: Any, namespace: str | None = None) -> StatusReader:
    """The status reader for ``app``'s Redis and namespace (``namespace``: a task's own
    ``lock_namespace`` instead of the app's ``singleflight_namespace``)."""
    opts = app_options(app, lock_namespace=namespace)
    store = store_for(opts.redis, opts.namespace, opts.status_retention, opts.history_length)
    cache_key = (id(app), id(store))
    found = _readers.get(cache_key)
    if found is None or found.store is not store:
        found = _readers[cache_key] = StatusReader(store, app)
    return found


def status(app: Any, key: str, slot: int = 0, *, namespace: str | None = None) -> KeyStatus | None:
    """Who holds ``key`` (its slot 0, or ``slot``) and how far along it is (None if nothing is
    known about it). ``namespace``: for a task with its own ``lock_namespace``."""
    return reader(app, namespace).read(key, slot)


def status_all(app: Any, key: str, slots: int | None = None, *, namespace: str | None = None
               ) -> list[KeyStatus]:
    """Every held slot of ``key``, by slot (a ``max_concurrency`` > 1 key has one per running
    run); empty if none is held. ``slots``: the key's ``max_concurrency`` when known (one round
    trip); without it the key's slots are found with ``SCAN``."""
    return reader(app, namespace).read_all(key, slots)


def held(app: Any, prefix: str = "", *, namespace: str | None = None) -> list[KeyStatus]:
    """The held runs of ``app``'s namespace (or ``namespace``) whose key starts with ``prefix``,
    one per held slot."""
    return reader(app, namespace).held(prefix)


def watch(app: Any, key: str, timeout: float | None = None, slot: int = 0, *,
          namespace: str | None = None) -> Iterator[WatchEvent]:
    """Follow the run on ``key`` (its slot 0, or ``slot``) live until it ends: its history first,
    then each event as it comes (``progress``, ``duplicate``, and ``end`` last); stops after
    ``timeout`` seconds if given."""
    return reader(app, namespace).watch(key, timeout=timeout, slot=slot)


def force_release(app: Any, key: str, by: str, expected_holder: str = "", slot: int = 0, *,
                  namespace: str | None = None) -> str | None:
    """Free ``key`` (its slot 0, or ``slot``) whoever holds it, recording ``by``; returns the
    released task id or None. A parked run is handed the key at once."""
    opts = app_options(app, lock_namespace=namespace)
    return reader(app, namespace).force_release(key, by, expected_holder, slot, slots=known_slots(app),
                                                ttl=opts.ttl)
