"""The time policies' Redis side: debounce bursts (``debounce``) and the per-key rate limit
(``key_rate_limit``), and how any process reads a key's state of both.

**A burst** of calls on a debounce key is one hash: its leader (the first call), when it is due,
how many calls it folded, and the payload its run gets. ``DEBOUNCE_CALL`` records a call at
send; ``DEBOUNCE_DUE`` decides, when a call's message comes due, whether it runs, waits or was
folded; the run's decision renames the burst to the key's *last closed burst*, which answers
replays and late messages for a while. **The rate limit** is GCRA: one number per key, the
theoretical arrival time; ``RATE`` grants a call its cell (now, or the next free one) and
remembers it by call id, so a re-sent run gets its own cell again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .. import constants
from .context import Feature, ms, text
from .controls import LIMITS
from .delayed import DelayedCalls
from .layout import Part, duration
from .lua import Replies, Script

__all__ = [
    "ACL_COMMANDS", "BURST", "CLOSED_BURST", "DEBOUNCE_CALL", "DEBOUNCE_DUE", "PARTS", "PLANNED", "RATE",
    "RATE_STATE", "SCRIPTS",
    "DebounceState", "DelayedCopy", "Due", "DueReply", "RateState", "TimeCalls", "parse_burst",
    "parse_rate_state",
]

RATE_STATE = Part("rate", "string: `<TAT> <interval> <tolerance>` (µs)", "until the TAT",
                  "`key_rate_limit`: the GCRA state")
PLANNED = Part("planned", "sorted set: task id:retries → planned start (µs; `.25` once taken again, late)",
               f"{duration(constants.RATE_GRANT_KEEP)} after the last planned start",
               "`key_rate_limit`: the cells granted, so a re-sent run or a replay gets its own again")
BURST = Part("debounce", "hash: leader, first, last, due, count, payload, `c:<task id>`",
             f"until due + {duration(constants.DEBOUNCE_CLOSED_KEEP)}",
             "`debounce`: the open burst (keyed by the debounce key)")
CLOSED_BURST = Part("debounced", "hash: the last closed burst, with `ran`",
                    duration(constants.DEBOUNCE_CLOSED_KEEP),
                    "`debounce`: who ran the last burst, for replays and late calls")
PARTS = (RATE_STATE, PLANNED, BURST, CLOSED_BURST)
#: the Redis commands the time policies use besides the library's own (an ACL rule must allow
#: them): a burst is read with HMGET, joined again with HSETNX and HINCRBY (after Redis lost it),
#: closed with RENAME (within its key's hash slot); the state's readers count the planned cells
ACL_COMMANDS: tuple[str, ...] = ("hmget", "hsetnx", "hincrby", "rename", "zcount")


class DueReply(Replies):
    RUN = 1, ("{RUN, payload, calls, first call ms, 1 if this execution closed the burst (also on a replay) "
              "else 0}: this run goes ahead with the payload")
    WAIT = 2, "{WAIT, ms left, calls, due ms}: the burst is still open; come back then"
    FOLDED = 3, "{FOLDED, the run's task id, calls}: the burst was run by another call"
    UNKNOWN = 4, "{UNKNOWN}: no burst of that leader is known (record the call now)"


_LUA = dict(constants.LUA_CONSTANTS)
DEBOUNCE_CALL = Script("DEBOUNCE_CALL", "time/debounce_call.lua",
                       ("shared/common.lua", "time/time.lua", "delayed/delayed.lua"), constants=_LUA)
DEBOUNCE_DUE = Script("DEBOUNCE_DUE", "time/debounce_due.lua", ("time/time.lua",), replies=(DueReply,),
                      constants=_LUA)
RATE = Script("RATE", "time/rate.lua", constants=_LUA)
SCRIPTS = (DEBOUNCE_CALL, DEBOUNCE_DUE, RATE)


class DebounceState(NamedTuple):
    """A key's open burst, for ``status()`` and the CLI."""

    leader: str
    calls: int
    first: float  # epoch seconds
    planned: float  # when its run is due, epoch seconds


@dataclass(frozen=True)
class RateState:
    """A key's rate state for ``status()`` and the CLI."""

    next_free: float  # epoch seconds: when a new run would start
    planned: int  # runs with a cell planned in the future (throttled, waiting)
    per_second: float  # the limit, in runs a second


@dataclass(frozen=True)
class DelayedCopy:
    """The copy of a debounced call's message to keep (:mod:`.delayed`): the token its countdown
    message carries, the message, and the header that names its burst's leader."""

    token: str
    message: str
    header: str


@dataclass(frozen=True)
class Due:
    """What ``DEBOUNCE_DUE`` decided for a call whose message came due."""

    kind: DueReply
    payload: str = ""  # RUN: the burst's arguments (JSON)
    calls: int = 0
    closed_here: bool = True  # RUN: False when another delivery of this task id closed the burst
    wait: float = 0.0  # WAIT: seconds until the call should come back
    planned: float = 0.0  # WAIT: when the burst is due, epoch seconds
    into: str = ""  # FOLDED: the task id of the run that stands for this call


def parse_burst(fields: list[Any]) -> DebounceState | None:
    """A :class:`DebounceState` from the burst hash's leader, count, first and due (None: none)."""
    leader, count, first, due = fields
    if leader is None:
        return None
    return DebounceState(text(leader), int(count or 0), int(first or 0) / 1000, int(due or 0) / 1000)


def parse_rate_state(raw: bytes | str, waiting: int, now_us: int) -> RateState:
    """A :class:`RateState` from the rate key's value (``"<tat> <interval> <tolerance>"``)."""
    tat, interval, tolerance = (int(x) for x in text(raw).split())
    return RateState(max(now_us, tat - tolerance) / 1_000_000, waiting, 1_000_000 / interval)


class TimeCalls(Feature):
    """The calls of the time policies."""

    __slots__ = ()

    def record_call(self, key: str, task_id: str, wait: float, max_wait: float | None, keep: str,
                    payload: str, copy: DelayedCopy | None = None,
                    sent: float | None = None) -> tuple[str, float]:
        """Record a call in its burst: (the burst's leader, seconds until the burst's run is due).
        With ``copy``, also keep a copy of the call's message (protocol/delayed.py), due when
        its countdown message is, in the same round trip. ``sent``: when the call was sent
        (epoch seconds), if known."""
        layout = self.ctx.layout
        keys = [layout.key(BURST, key), layout.key(CLOSED_BURST, key)]
        stamp = "" if sent is None else int(sent * 1000)
        args: list[Any] = [task_id, ms(wait), ms(max_wait) if max_wait else 0, keep, payload]
        if copy is None:
            reply = self.ctx.script(DEBOUNCE_CALL)(keys=keys, args=[*args, "", "", "", stamp])
        else:
            delayed = DelayedCalls(self.ctx)
            reply = delayed.with_index(
                DEBOUNCE_CALL, [*keys, *delayed.keys(key)],
                [*args, copy.token, copy.message, copy.header, stamp], key, task_id,
                0.0 if max_wait else wait)
        leader, wait_ms, _count = reply
        return text(leader), int(wait_ms) / 1000

    def due(self, key: str, task_id: str, leader: str, token: str, sent: float | None = None,
            payload: str = "", keep: str = "last", wait: float = 0.0) -> Due:
        """A call's message came due: decide (``token`` is this execution's, so a replay of the
        same call is told from another delivery of the task id; ``sent``: when the call was sent,
        epoch seconds, if known; ``payload``, ``keep``: its arguments and ``debounce_keep``, for
        a burst recorded again that does not know it, or to open again for its leader, due in
        ``wait`` seconds; '': it is not recorded)."""
        layout = self.ctx.layout
        stamp = "" if sent is None else int(sent * 1000)
        reply = self.ctx.script(DEBOUNCE_DUE)(keys=[layout.key(BURST, key), layout.key(CLOSED_BURST, key)],
                                              args=[task_id, leader, token, stamp, payload, keep, ms(wait)])
        kind = DueReply(int(reply[0]))
        if kind == DueReply.RUN:
            return Due(kind, text(reply[1]), int(reply[2]), closed_here=bool(int(reply[4])))
        if kind == DueReply.WAIT:
            return Due(kind, calls=int(reply[2]), wait=int(reply[1]) / 1000, planned=int(reply[3]) / 1000)
        if kind == DueReply.FOLDED:
            return Due(kind, calls=int(reply[2]), into=text(reply[1]))
        return Due(kind)

    def reserve(self, key: str, interval_us: int, tolerance_us: int, call_id: str) -> tuple[int, int, bool]:
        """The rate-limit cell of ``call_id`` on ``key`` (taken now, or found from before):
        (planned start, now, granted by this call), microseconds of the server clock. A rate set
        for the key at run time (:mod:`.controls`) replaces ``interval_us`` and ``tolerance_us``."""
        layout = self.ctx.layout
        keys = [layout.key(RATE_STATE, key), layout.key(PLANNED, key), layout.key(LIMITS, key)]
        planned, now, fresh = self.ctx.script(RATE)(keys=keys, args=[interval_us, tolerance_us, call_id])
        return int(planned), int(now), bool(fresh)

    def state(
        self, key: str, debounce_key: str, now_us: int
    ) -> tuple[DebounceState | None, RateState | None]:
        """The open burst of ``debounce_key`` and the rate state of ``key`` (one round trip)."""
        layout = self.ctx.layout
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.hmget(layout.key(BURST, debounce_key), "leader", "count", "first", "due")
        pipe.get(layout.key(RATE_STATE, key))
        pipe.zcount(layout.key(PLANNED, key), now_us, "+inf")
        burst, rate_raw, waiting = pipe.execute()
        rate = None if rate_raw is None else parse_rate_state(rate_raw, int(waiting), now_us)
        return parse_burst(burst), rate
