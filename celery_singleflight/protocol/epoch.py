"""Whether the lease Redis kept its data: the namespace's *epoch*, each journaled run's *mark*,
and the reads that tell which journaled runs still wait there (:mod:`..run.journal`,
:mod:`..worker.recovery`).

The epoch is a life id and a count. Each worker's sweeper counts once per look (``EPOCH``) and
keeps the answer; the next answer has the same life and a larger count while Redis keeps its
data. A missing key (restarted empty) gets a new life; a restore from an older snapshot, an AOF
that lost its last second or a failover to a lagging replica brings back a count no larger than
the one last seen. Each worker compares with its own last look, so every worker sees the loss,
not only the first to look. A restart that kept the data changes neither.

The epoch is one key: it cannot see a snapshot taken after a worker's last look (runs parked
since are gone, and the count still grows), nor, on a Cluster, a master other than its own
losing data. So every run that begins to wait also leaves a *mark* beside it, in the same script
and under its key's hash tag (``JOURNALED``: its journal line's mark): a journaled run that no
longer waits is handed on if its mark is there (the data that had it waiting is there too), and
lost with the data if its mark is gone, whatever the epoch says. A worker drops a mark with its
journal line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .context import Feature, text
from .delayed import DELAYED, copy_waits
from .handoff import JOINED, PARKED
from .journaled import JOURNALED
from .layout import Part
from .lua import Script
from .order import BOOK

__all__ = ["EPOCH", "EPOCH_KEY", "JOURNALED", "SCRIPTS", "EpochCalls", "Waiting"]

EPOCH_KEY = Part("epoch", "string: `<life> <count>`", "none",
                 "counted by every worker's sweeper: a new life or a smaller count says Redis lost data",
                 index=True)

EPOCH = Script("EPOCH", "epoch/epoch.lua")
SCRIPTS = (EPOCH,)

#: (kind, key, task id, message, sequence number, mark) of a journaled run
Waiting = tuple[str, str, str, str, int, str]


def _waits(kind: str, value: Any) -> bool:
    if kind == "join":
        return value is not None
    if kind == "delay":
        return copy_waits(value)
    return bool(value)


class EpochCalls(Feature):
    """The epoch, and where a journaled run waits."""

    __slots__ = ()

    def look(self, new_life: str) -> tuple[str, int]:
        """Count one more look: (life, count). ``new_life`` is taken if the epoch is missing."""
        reply = self.ctx.script(EPOCH)(keys=[self.ctx.layout.index(EPOCH_KEY)], args=[new_life])
        return text(reply[0]), int(reply[1])

    def waiting(self, runs: Sequence[Waiting]) -> list[tuple[bool, bool | None]]:
        """For each journaled run, whether it still waits in Redis, and whether its mark is there
        (None for a run journaled without one), in one round trip. It waits parked or pending in
        its key's queue (``park``, ``pending``), in its key's joined list (``join``), in its key's
        order book for its turn (``order``), or delayed with its copy not done (``delay``)."""
        if not runs:
            return []
        layout = self.ctx.layout
        pipe = self.ctx.client.pipeline(transaction=False)
        for kind, key, task_id, message, seq, mark in runs:
            if kind == "join":
                pipe.lpos(layout.key(JOINED, key), message)
            elif kind == "order":
                pipe.hexists(layout.key(BOOK, key), f"w:{seq}")
            elif kind == "delay":
                pipe.hget(layout.key(DELAYED, key), task_id)
            else:
                pipe.hexists(layout.key(PARKED, key), task_id)
            if mark:
                pipe.zscore(layout.key(JOURNALED, key), mark)
        found: list[Any] = pipe.execute()
        # LPOS answers the position (0 is the front) or nil; HEXISTS 0 or 1; HGET a delayed entry
        out: list[tuple[bool, bool | None]] = []
        for run in runs:
            waits = _waits(run[0], found.pop(0))
            out.append((waits, found.pop(0) is not None if run[5] else None))
        return out

    def unmark(self, runs: Sequence[tuple[str, str]]) -> None:
        """Drop the marks ``(key, mark)`` of journal lines that are dropped (one round trip)."""
        if not runs:
            return
        pipe = self.ctx.client.pipeline(transaction=False)
        for key, mark in runs:
            pipe.zrem(self.ctx.layout.key(JOURNALED, key), mark)
        pipe.execute()

    def parked(self, key: str, task_id: str) -> bool:
        """Whether ``task_id`` waits in the queue of ``key`` (parked or pending)."""
        return bool(self.ctx.client.hexists(self.ctx.layout.key(PARKED, key), task_id))
