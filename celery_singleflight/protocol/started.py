"""Runs that waited, then started: the namespace's *started index*, so that a run lost with its
whole worker does not keep the state it waited in.

A run the library parked, delayed or re-sent before it started has an intermediate state in the
result backend (``QUEUED``, ``DEBOUNCED``, ``RETRY``) that only its own end replaces. Such a run
is entered here in the round trip of its take, before it may hold the key (a *provisional*
member: the key, its slots, the task id, the worker, and the handoff token of a parked run
handed the key; slot ``-n``, fence 0), and once it starts
(:meth:`StartedCalls.enter`, one ``ZADD``) by a member naming the key, the slot, the task id, the
fence and the worker, scored by when its lease runs out plus :data:`~..constants.LOST_RUN_GRACE`;
the provisional one then goes. So a run whose worker dies between its take and its start is
watched too. A sweeper takes the due members, reads each slot's run
record and asks :func:`verdict` what became of the run: it still holds its lease (look again
when it would run out), it ended by a release (forget it), or it was lost (its lease ran out
unreleased). Every call is safe to run twice, and by several sweepers at once: the member is the
same JSON text, ``ZADD XX`` only moves a member still there, ``ZREM`` of a gone one does nothing.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .context import Feature, due_ms, text
from .handoff import ADOPTED
from .layout import Part
from .record import RunRecord

__all__ = ["STARTED", "StartedCalls", "StartedRun", "Verdict", "verdict", "verdict_of"]

STARTED = Part("started",
               "sorted set: JSON `[key, slot, task id, fence, worker(, handoff)]` → when to look (ms)",
               "none", "runs that waited (parked, delayed, re-sent) and started, for the sweeper's lost-run"
               " check", index=True)


@dataclass(frozen=True)
class StartedRun:
    """One started run as its member names it (``slot`` 0-based, ``worker`` Celery's hostname;
    ``handoff``: a provisional member's handoff token, if the key was handed to its run)."""

    key: str
    slot: int
    task_id: str
    fence: int
    worker: str
    handoff: str = ""

    def member(self) -> str:
        """The member's text: the same for the same run, so a re-sent ``ZADD`` adds nothing."""
        fields = [self.key, self.slot, self.task_id, str(self.fence), self.worker]
        return json.dumps([*fields, self.handoff] if self.handoff else fields, separators=(",", ":"))

    @classmethod
    def provisional(cls, key: str, slots: int, task_id: str, worker: str, handoff: str = "") -> StartedRun:
        """The member of a run about to take ``key`` (of ``slots`` slots): which slot and fence it
        gets is not known yet (slot ``-slots``). A run handed the key names its ``handoff`` token:
        its adoption is remembered with its fence (the key's ``adopted`` set), which tells of its
        end once later runs' records no longer name it."""
        return cls(key, -max(1, slots), task_id, 0, worker, handoff)

    @property
    def slots(self) -> list[int]:
        """The slots whose records tell what became of the run."""
        return list(range(-self.slot)) if self.slot < 0 else [self.slot]

    @classmethod
    def parse(cls, member: str) -> StartedRun | None:
        """The run a member names, or None for a member that is not one."""
        try:
            key, slot, task_id, fence, worker, *rest = json.loads(member)
            handoff = str(rest[0]) if rest else ""
            return cls(str(key), int(slot), str(task_id), int(fence), str(worker), handoff)
        except (ValueError, TypeError, IndexError):
            return None


class Verdict(enum.Enum):
    """What became of a started run, as its slot's record tells."""

    LIVE = "it still holds its lease"
    ENDED = "it ended by a release (its own, the main process's, or an operator's)"
    LOST = "its lease ran out unreleased"


def verdict_of(records: list[RunRecord], now_ms: int, run: StartedRun,
               adopted: int | None = None) -> tuple[Verdict, float]:
    """What became of ``run`` by the records of its slots (:attr:`StartedRun.slots`), read at
    ``now_ms``. A provisional member's run is found by its task id on any slot: holding it (or a
    reservation for it), ended, or run out. One named by no record any more, but whose adoption
    of the key is remembered with its fence (``adopted``), is judged by that fence as a started
    run is (later records remember lost fences): its worker died between its take and its start,
    and runs on the key went on. A run that took no slot ended before it held the key (it waits
    again, or was turned away: its wait has its own owner)."""
    if run.slot >= 0:
        return verdict(records[0], now_ms, run)
    for record in records:
        if record.task_id == run.task_id and record.token:
            left = (record.deadline or 0) - now_ms
            if left > 0:
                return Verdict.LIVE, left / 1000.0
            return (Verdict.ENDED, 0.0) if record.reserved else (Verdict.LOST, 0.0)
    for record in records:
        if record.task_id == run.task_id:
            return Verdict.ENDED, 0.0
        if record.prev_task_id == run.task_id and record.prev_outcome:
            return (Verdict.LOST if record.prev_outcome == "expired" else Verdict.ENDED), 0.0
    if adopted is None:
        return Verdict.ENDED, 0.0
    # the records of its slot's later runs (an older record is another slot's, and tells nothing)
    told = [verdict(record, now_ms, replace(run, slot=slot, fence=adopted))
            for slot, record in enumerate(records) if record.fence is not None and record.fence >= adopted]
    for seen in (Verdict.LIVE, Verdict.LOST):
        found = [left for kind, left in told if kind is seen]
        if found:
            return seen, max(found)
    return (Verdict.ENDED, 0.0) if told else (Verdict.LOST, 0.0)  # no record left: Redis lost them


def verdict(record: RunRecord, now_ms: int, run: StartedRun) -> tuple[Verdict, float]:
    """What became of ``run`` by the record of its slot, read at ``now_ms`` (the server's clock);
    and, while it is live, the seconds its lease has left.

    The record is the run's own while it has the run's fence and task id (a reservation for the
    next parked run keeps the fence, but is not the run's). Once a later record replaced it, the
    later one says who ran before it and how that ended (``prev_task_id``, ``prev_outcome``:
    ``expired`` is a lease that ran out); further on, only ``lost`` remembers the fences of
    recent runs whose lease ran out (or was force-released). A record that is gone, or older than
    the run (Redis lost data), tells nothing of an end: the run counts as lost.
    """
    fence = record.fence
    if fence is None or fence < run.fence:
        return Verdict.LOST, 0.0
    if fence > run.fence and record.task_id == run.task_id and record.token and not record.reserved:
        # a later attempt of the same run holds the slot (a copy that took its lease over)
        left = (record.deadline or 0) - now_ms
        if left > 0:
            return Verdict.LIVE, left / 1000.0
    if fence == run.fence and not record.reserved and record.task_id == run.task_id:
        if not record.token:
            return Verdict.ENDED, 0.0
        left = (record.deadline or 0) - now_ms
        return (Verdict.LIVE, left / 1000.0) if left > 0 else (Verdict.LOST, 0.0)
    if record.prev_task_id == run.task_id and record.prev_outcome:
        return (Verdict.LOST if record.prev_outcome == "expired" else Verdict.ENDED), 0.0
    return (Verdict.LOST if str(run.fence) in record.lost.split(",") else Verdict.ENDED), 0.0


class StartedCalls(Feature):
    """The calls of the started index."""

    __slots__ = ()

    def enter(self, run: StartedRun, seconds: float, pipe: Any = None, *,
              instead_of: Sequence[StartedRun] = ()) -> None:
        """Enter ``run``, due in ``seconds``, and drop the members ``instead_of`` (its provisional
        ones), through ``pipe`` (a pipeline), if given."""
        index, target = self.ctx.layout.index(STARTED), pipe or self.ctx.client
        target.zadd(index, {run.member(): due_ms(seconds)})
        if instead_of:
            target.zrem(index, *(gone.member() for gone in instead_of))

    def due(self, limit: int = 100) -> list[str]:
        """The members whose look is due, oldest first."""
        raw: list[Any] = self.ctx.client.zrangebyscore(self.ctx.layout.index(STARTED), "-inf", due_ms(0),
                                                       start=0, num=limit)
        return [text(member) for member in raw]

    def plan(self, member: str, seconds: float) -> None:
        """Look at ``member`` again in ``seconds``, if it is still there (another sweeper may
        have dropped it meanwhile)."""
        self.ctx.client.zadd(self.ctx.layout.index(STARTED), {member: due_ms(seconds)}, xx=True)

    def adopted(self, run: StartedRun) -> int | None:
        """The fence with which a provisional member's run adopted its key (handed to it), if it
        did and the key still remembers it."""
        if not run.handoff:
            return None
        found: Any = self.ctx.client.zscore(self.ctx.layout.key(ADOPTED, run.key), run.handoff)
        return None if found is None else int(found)

    def drop(self, member: str) -> None:
        """Forget ``member``."""
        self.ctx.client.zrem(self.ctx.layout.index(STARTED), member)
