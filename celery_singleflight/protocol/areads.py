"""The reads of :mod:`.reads` that a status or a watch needs, on a ``redis.asyncio`` client: an
ASGI app follows many runs at once on one event loop, without a thread per watcher.

The same commands and replies as the blocking reads: a slot's record read with the clock of the
server that wrote its deadline (``TIME`` in the same pipeline; on a Cluster, the clock of the
key's node), the history stream with ``XRANGE``, then ``XREAD BLOCK`` after the last entry seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster

from .layout import Layout
from .reads import Snapshot, ask_snapshots, clock_ms, snapshots_of, stream_entries

__all__ = ["AsyncRunReads"]


class AsyncRunReads:
    """The run reads of one namespace (``layout``) on an asyncio ``client``."""

    __slots__ = ("client", "cluster", "layout")

    def __init__(self, client: Any, layout: Layout) -> None:
        self.client = client
        self.layout = layout
        self.cluster = isinstance(client, RedisCluster)

    async def snapshots(self, runs: Sequence[tuple[str, int]]) -> list[Snapshot]:
        """The record of each (key, slot), its key's queue length and the server's clock, in one
        pipeline (a Cluster: then one ``TIME`` per node that holds them)."""
        layout, client = self.layout, self.client
        pipe = client.pipeline(transaction=False)
        ask_snapshots(pipe, layout, runs, clock=not self.cluster)
        replies = list(await pipe.execute())
        if self.cluster:  # each lease against the clock of its own node
            clocks = await self._node_clocks([layout.run(key, slot) for key, slot in runs])
        else:
            clocks = [clock_ms(replies.pop(0))] * len(runs)
        return snapshots_of(replies, clocks)

    async def _node_clocks(self, names: Sequence[str]) -> list[int]:
        nodes = [self.client.get_node_from_key(name) for name in names]
        by_node: dict[str, int] = {}
        for node in nodes:
            if node.name not in by_node:
                by_node[node.name] = clock_ms(await self.client.time(target_nodes=node))
        return [by_node[node.name] for node in nodes]

    async def history(self, key: str, slot: int) -> list[Any]:
        """Every entry of the run's history stream."""
        found: Any = await self.client.xrange(self.layout.history(key, slot), min="-", max="+")
        return list(found)

    async def follow(self, key: str, slot: int, after: str, block: float) -> list[Any]:
        """The history entries after ``after``, waiting up to ``block`` seconds for one."""
        stream = self.layout.history(key, slot)
        reply: Any = await self.client.xread({stream: after}, block=max(1, int(block * 1000)), count=100)
        return stream_entries(reply)
