"""Status and watch for asyncio apps (ASGI: Django async views, Starlette, FastAPI)::

    st = await astatus(app, "sync:42")             # KeyStatus, or None: as status()
    async for event in awatch(app, "sync:42"):     # as watch(): history, then live, then "end"
        ...

The same answers, events and end conditions as :func:`~.status.status` and
:func:`~.status.watch`: the decoding and the watch's plan (:func:`~.status.watch_steps`) are
theirs; only the Redis calls differ, made on the event loop with ``redis.asyncio``
(:mod:`..protocol.areads`), never in a thread. A thousand watchers of a key are a thousand
coroutines, not a thousand threads. Each loop has its own client (:mod:`..connection.aclients`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from .. import constants
from ..config.options import Options, app_options
from ..connection.aclients import async_client
from ..keys import stored_key
from ..protocol.areads import AsyncRunReads
from ..protocol.store import KeyLayout
from .keystatus import KeyStatus, WatchEvent
from .status import ask, first_held, next_step, slot_run, statuses, watch_steps

__all__ = ["AsyncStatusReader", "areader", "astatus", "awatch", "reader_for"]


class AsyncStatusReader:
    """Read and watch the keys of one namespace from a running event loop."""

    __slots__ = ("reads",)

    def __init__(self, reads: AsyncRunReads) -> None:
        self.reads = reads

    async def _read_many(self, runs: list[tuple[str, int]]) -> list[KeyStatus | None]:
        return statuses(runs, await self.reads.snapshots(runs))

    async def read(self, key: str, slot: int = 0) -> KeyStatus | None:
        """The status of one slot of ``key`` (as :meth:`~.status.StatusReader.read`)."""
        return (await self._read_many([slot_run(key, slot)]))[0]

    async def read_first(self, key: str, slots: int) -> KeyStatus | None:
        """The first held of the ``slots`` slots of ``key``, else its slot 0 (as
        :meth:`~.status.StatusReader.read_first`)."""
        key = stored_key(key)
        return first_held(await self._read_many([(key, slot) for slot in range(max(1, slots))]))

    async def watch(self, key: str, timeout: float | None = None, poll: float = constants.WATCH_POLL,
                    slot: int = 0) -> AsyncGenerator[WatchEvent, None]:
        """The run's events, history first, until its ``end`` (as :meth:`~.status.StatusReader.watch`)."""
        key, slot = slot_run(key, slot)
        steps, answer = watch_steps(timeout, poll), None
        while (step := next_step(steps, answer)) is not None:
            if isinstance(step, WatchEvent):
                yield step
                answer = None
            else:
                answer = await ask(step, self.read, self.reads, key, slot)


async def reader_for(opts: Options) -> AsyncStatusReader:
    """The reader of the running loop for the Redis and namespace of ``opts`` (a task's, an app's)."""
    client = await async_client(opts.redis)
    return AsyncStatusReader(AsyncRunReads(client, KeyLayout(opts.namespace)))


async def areader(app: Any, namespace: str | None = None) -> AsyncStatusReader:
    """The asyncio reader for ``app``'s Redis and namespace (or ``namespace``, a task's own
    ``lock_namespace``)."""
    return await reader_for(app_options(app, lock_namespace=namespace))


async def astatus(app: Any, key: str, slot: int = 0, *, namespace: str | None = None) -> KeyStatus | None:
    """:func:`~.status.status` for async code: who holds ``key`` (its slot 0, or ``slot``) and how
    far along it is, or None; read on the running event loop."""
    return await (await areader(app, namespace)).read(key, slot)


async def awatch(app: Any, key: str, timeout: float | None = None, slot: int = 0, *,
                 namespace: str | None = None) -> AsyncGenerator[WatchEvent, None]:
    """:func:`~.status.watch` for async code (``async for event in awatch(app, key)``): the run's
    history, then each event as it comes, ``end`` last; stops after ``timeout`` seconds if given.
    Waits on the event loop, so one process serves many watchers without a thread each."""
    reader = await areader(app, namespace)
    async with aclosing(reader.watch(key, timeout=timeout, slot=slot)) as events:
        async for event in events:
            yield event
