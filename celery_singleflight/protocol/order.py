"""Strict send order (``ordered=True``): a per-key sequence number taken at send, a gate each run
passes in number order, and the sweeper's skip of a number whose message never came.

The key's *order book* holds the last number sent, the next one to go on, the admitted run and
the messages of runs waiting for their turn; its *waiting numbers* are a sorted set. A run whose
turn has not come parks its message in the book and ends; the run before it sends that message
when it has taken the lease or entered the queue (``ORDER_ADVANCE``). The namespace's *ordering
index* brings a key to a worker's sweeper when a wait has lasted ``order_timeout``.
"""

from __future__ import annotations

import uuid
from typing import Any

from .. import constants
from .context import Feature, due_ms, ms, text
from .journaled import JOURNALED
from .layout import Part, duration
from .lua import Replies, Script

__all__ = [
    "ADVANCE", "BOOK", "GATE", "ORDERING", "PARTS", "SCRIPTS", "SWEEP", "TAKE", "WAITING_NUMBERS",
    "GateReply", "OrderCalls", "SweepReply",
]

BOOK = Part("order", "hash: `sent`, `next`, `w:<seq>` → message, ...",
            f"{duration(constants.ORDER_KEEP)} after its last change",
            "`ordered=True`: the last number sent, the next to start, waiting and skipped runs")
WAITING_NUMBERS = Part("orderq", "sorted set: sequence numbers", "as `order`",
                       "`ordered=True`: the waiting numbers, smallest first")
ORDERING = Part("ordering", "sorted set: key → when to look (ms)", "none",
                "`ordered=True` keys with waiting runs, for the sweeper's gap skip",
                index=True)
PARTS = (BOOK, WAITING_NUMBERS)


class GateReply(Replies):
    GO = 1, "{GO}: this run goes on now"
    WAIT = 2, "{WAIT, ms until its predecessor counts as missing}: it waits for its turn (its message kept)"
    LATE = 3, "{LATE}: its turn was skipped (it came too late); it goes on by arrival"
    ANOTHER_DELIVERY = 4, "{ANOTHER_DELIVERY}: another delivery of this run went on; this one does not run"


class SweepReply(Replies):
    NOTHING_WAITS = 0, "{NOTHING_WAITS}"
    NOT_YET = 1, "{NOT_YET, ms until the next look}: the timeout has not passed"
    SEND = 2, "{SEND, message to send, first skipped number or '', last skipped number or ''}"


_LIBS = ("shared/common.lua", "shared/journal.lua", "order/order.lua")
_LUA = dict(constants.LUA_CONSTANTS)

TAKE = Script("ORDER_TAKE", "order/take.lua", constants=_LUA)
GATE = Script("ORDER_GATE", "order/gate.lua", _LIBS, replies=(GateReply,), constants=_LUA)
ADVANCE = Script("ORDER_ADVANCE", "order/advance.lua", _LIBS, constants=_LUA)
SWEEP = Script("ORDER_SWEEP", "order/sweep.lua", _LIBS, replies=(SweepReply,), constants=_LUA)
SCRIPTS = (TAKE, GATE, ADVANCE, SWEEP)


class OrderCalls(Feature):
    """The calls of strict send order."""

    __slots__ = ()

    def _keys(self, key: str) -> list[str]:
        layout = self.ctx.layout
        return [layout.key(BOOK, key), layout.key(WAITING_NUMBERS, key)]

    def take(self, key: str, task_id: str) -> int:
        """At send: the next sequence number of ``key`` for ``task_id``."""
        return int(self.ctx.script(TAKE)(keys=[self.ctx.layout.key(BOOK, key)], args=[task_id]))

    def gate(self, key: str, seq: int, delivery: str, message: str, timeout: float, *,
             mark: str = "") -> GateReply:
        """May run ``seq`` (``delivery``: "task id|delivery tag") go on? After GO, :meth:`advance`
        once it holds the lease or waits in the queue; WAIT enters the key in the ordering index,
        due when its predecessor counts as missing. ``mark``: the journal line's of the run if it
        waits (:mod:`.journaled`)."""
        reply = self.ctx.script(GATE)(keys=[*self._keys(key), self.ctx.layout.key(JOURNALED, key)],
                                      args=[seq, delivery, message, ms(timeout), mark])
        code = GateReply(int(reply[0]))
        if code == GateReply.WAIT:
            due = due_ms(int(reply[1]) / 1000.0)
            self.ctx.client.zadd(self.ctx.layout.index(ORDERING), {key: due}, lt=True)
        return code

    def advance(self, key: str, seq: int, delivery: str) -> str:
        """The admitted run ``seq`` holds the lease or waits in the queue: the next number's turn
        comes. The next run's message if it waits (to be sent), else ""."""
        return text(self.ctx.script(ADVANCE)(keys=self._keys(key), args=[seq, delivery]))

    def due(self, limit: int = 100) -> list[str]:
        """Keys with runs waiting for their turn whose look is due."""
        raw: Any = self.ctx.client.zrangebyscore(self.ctx.layout.index(ORDERING), "-inf", due_ms(0), start=0,
                                                 num=limit)
        return [text(k) for k in raw]

    def sweep(self, key: str, timeout: float) -> tuple[str, int | None, int | None]:
        """Look at a key whose runs wait for their turn: (message to send or "", first and last
        sequence number skipped, or None). Plans the next look, or drops the key from the index."""
        client, index = self.ctx.client, self.ctx.layout.index(ORDERING)
        reply = self.ctx.script(SWEEP)(keys=self._keys(key), args=[ms(timeout), uuid.uuid4().hex])
        code = int(reply[0])
        if code == SweepReply.NOTHING_WAITS:
            client.zrem(index, key)
            waiting = self.ctx.layout.key(WAITING_NUMBERS, key)
            if client.zrangebyscore(waiting, "-inf", "+inf", start=0, num=1):
                client.zadd(index, {key: due_ms(timeout)}, lt=True)  # one parked meanwhile
            return "", None, None
        if code == SweepReply.NOT_YET:
            client.zadd(index, {key: due_ms(int(reply[1]) / 1000.0)})
            return "", None, None
        client.zadd(index, {key: due_ms(timeout)}, lt=True)
        first, last = text(reply[2]), text(reply[3])
        return text(reply[1]), (int(first) if first else None), (int(last) if last else None)
