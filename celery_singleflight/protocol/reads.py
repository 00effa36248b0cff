"""Reading runs: a slot's record with the server's clock, many records at once, the listing of a
namespace's records (``SCAN``, never ``KEYS``) and a run's history stream.

A record is read together with the clock of the server that wrote its deadline (``TIME`` in the
same pipeline; on a Cluster, the clock of the key's node), so "held" and "time left" are the
server's view, not this process's.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..connection.cluster import clocks_ms
from .context import Feature
from .handoff import QUEUE
from .record import RunRecord

__all__ = ["RunReads", "Snapshot", "ask_snapshots", "clock_ms", "snapshots_of", "stream_entries"]

#: how many records one pipelined read asks for
_BATCH = 200

#: (the record, runs waiting in the key's queue, the server's clock in ms)
Snapshot = tuple[RunRecord, int, int]


def clock_ms(reply: Any) -> int:
    """A ``TIME`` reply (seconds, microseconds) as milliseconds."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def stream_entries(reply: Any) -> list[Any]:
    """The entries of an ``XREAD`` reply, whichever protocol answered (RESP3: a dict; RESP2: pairs)."""
    streams = reply.items() if isinstance(reply, dict) else (reply or [])
    return [entry for _, entries in streams for entry in entries]


def ask_snapshots(pipe: Any, layout: Any, runs: Sequence[tuple[str, int]], clock: bool) -> None:
    """Queue on ``pipe`` (blocking or asyncio) the reads of each (key, slot): its record and its
    key's queue length, after ``TIME`` if ``clock`` (not on a Cluster: each node has its own)."""
    if clock:
        pipe.time()
    for key, slot in runs:
        pipe.get(layout.run(key, slot))
        pipe.llen(layout.key(QUEUE, key))


def snapshots_of(replies: Sequence[Any], clocks: Sequence[int]) -> list[Snapshot]:
    """The snapshots from the replies of :func:`ask_snapshots` (without ``TIME``'s) and each
    run's server clock."""
    return [(RunRecord.decode(replies[2 * i]), int(replies[2 * i + 1]), clock)
            for i, clock in enumerate(clocks)]


class RunReads(Feature):
    """The reads of run records and histories."""

    __slots__ = ()

    def record(self, key: str, slot: int = 0) -> RunRecord:
        """The stored run record of one slot of ``key`` (empty if nothing is known)."""
        return RunRecord.decode(self.ctx.client.get(self.ctx.layout.run(key, slot)))

    def held(self, key: str, slot: int = 0) -> tuple[RunRecord | None, float]:
        """The record of the run holding one slot of ``key`` and its seconds left, by the
        server's clock; (None, 0) when the slot is free, ended or ran out."""
        run = self.ctx.layout.run(key, slot)
        client = self.ctx.client
        if self.ctx.cluster:
            raw = client.get(run)
            now_ms = clocks_ms(client, [run])[0]
        else:
            pipe = client.pipeline(transaction=False)
            pipe.time()
            pipe.get(run)
            time_reply, raw = pipe.execute()
            now_ms = clock_ms(time_reply)
        record = RunRecord.decode(raw)
        if not record.token or record.deadline is None or record.deadline <= now_ms:
            return None, 0.0
        return record, (record.deadline - now_ms) / 1000.0

    def snapshots(self, runs: Sequence[tuple[str, int]]) -> list[Snapshot]:
        """The record of each (key, slot), its key's queue length and the server clock,
        pipelined in batches (one round trip per batch)."""
        out: list[Snapshot] = []
        layout, client = self.ctx.layout, self.ctx.client
        for start in range(0, len(runs), _BATCH):
            batch = runs[start : start + _BATCH]
            pipe = client.pipeline(transaction=False)
            ask_snapshots(pipe, layout, batch, clock=not self.ctx.cluster)
            replies = pipe.execute()
            if self.ctx.cluster:  # each lease against the clock of its own node
                clocks = clocks_ms(client, [layout.run(key, slot) for key, slot in batch])
            else:
                clocks = [clock_ms(replies.pop(0))] * len(batch)
            out.extend(snapshots_of(replies, clocks))
        return out

    def scan(self, pattern: str, count: int) -> Iterator[str]:
        """The names of string keys matching ``pattern`` (``SCAN ... TYPE string``)."""
        for raw in self.ctx.client.scan_iter(match=pattern, count=count, _type="string"):
            yield raw.decode() if isinstance(raw, bytes) else str(raw)

    def history(self, key: str, slot: int) -> list[Any]:
        """Every entry of the run's history stream."""
        found: Any = self.ctx.client.xrange(self.ctx.layout.history(key, slot), min="-", max="+")
        return list(found)

    def follow(self, key: str, slot: int, after: str, block: float) -> list[Any]:
        """The history entries after ``after``, waiting up to ``block`` seconds for one."""
        stream = self.ctx.layout.history(key, slot)
        reply: Any = self.ctx.client.xread({stream: after}, block=max(1, int(block * 1000)), count=100)
        return stream_entries(reply)
