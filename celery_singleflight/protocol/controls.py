"""A key's run-time controls: a pause, and limits that override the task's ``max_concurrency``
and ``key_rate_limit`` for that key until cleared.

**A pause** (``<ns>:{<key>}:paused``) holds when it ends (server ms; 0: until resumed). While it
lasts ``ACQUIRE`` grants the key to nobody: it answers ``PAUSED`` and the run parks in the key's
queue whatever its ``on_duplicate`` (``PARK`` parks it even on a free key), a release hands
nothing on, and the sweeper's ``RESUME`` looks again when the pause ends. Over, it stays a
while (:data:`PAUSE_TAIL`) as the time it ended, so that a newcomer's ``ACQUIRE`` hands the key
to the runs parked during the pause instead of taking it before them. A run that raises
:class:`~..errors.RetryAfter` pauses its key and parks itself at the front of the queue in its
own ``RELEASE`` (one script: no crash between the two can lose it).

**Limits** (``<ns>:{<key>}:limits``): ``c=<concurrency> p=<peak> i=<interval µs> t=<tolerance µs>
r=<rate>``. ``ACQUIRE`` reads them with the record (one ``MGET``), grants a slot only below the
concurrency, and answers ``MORE_SLOTS`` when a call named fewer slots than a run may hold: the
caller remembers that count for the key and calls again (one more round trip, after a change
only). ``RATE`` reads the interval and tolerance instead of the task's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .context import Feature, ms, text
from .layout import Part, duration
from .lua import Replies, Script
from .replies import Held

__all__ = ["CONTROL_CONSTANTS", "LIMITS", "LIMITS_SCRIPT", "PAUSE", "PAUSED", "PAUSE_LOOK", "PAUSE_TAIL",
           "PARTS", "SCRIPTS", "ControlCalls", "Limits", "LimitsReply", "PauseReply", "Paused",
           "parse_limits", "remember_slots", "slots_for"]

#: how long an ended pause keeps the runs parked during it ahead of newcomers (seconds)
PAUSE_TAIL = 60.0
#: how often the sweeper looks at a key paused until resumed (a resume makes it look at once)
PAUSE_LOOK = 60.0

PAUSED = Part("paused", "string: when the pause ends (ms; `0`: until resumed)",
              f"the pause + {duration(PAUSE_TAIL)}; none until resumed",
              "a paused key: no run takes it, its runs park in its queue (`pause`, `RetryAfter`)")
LIMITS = Part("limits", "string: `c=<concurrency> p=<peak> i=<interval µs> t=<tolerance µs> r=<rate>`",
              "none (until cleared)",
              "limits set at run time: the key's `max_concurrency` and `key_rate_limit`")
PARTS = (PAUSED, LIMITS)

#: per (namespace, key): the slots its limits made a script ask for (MORE_SLOTS), this process
_SLOTS: dict[tuple[str, str], int] = {}
_SLOTS_KEPT = 2048


def remember_slots(namespace: str, key: str, slots: int) -> int:
    """A script answered that ``key``'s limits allow ``slots`` slots: this process's later calls
    name that many (a bounded cache: forgotten, the next call learns it again)."""
    if len(_SLOTS) >= _SLOTS_KEPT:
        _SLOTS.clear()
    _SLOTS[(namespace, key)] = slots
    return slots


def slots_for(namespace: str, key: str, slots: int) -> int:
    """The slots a call on ``key`` names: ``slots`` (the task's), or more if its limits asked."""
    return max(slots, _SLOTS.get((namespace, key), 0)) if _SLOTS else slots

#: the controls' constants in every script that reads them
CONTROL_CONSTANTS: dict[str, int | str] = {"PAUSE_TAIL_MS": ms(PAUSE_TAIL), "PAUSE_LOOK_MS": ms(PAUSE_LOOK),
                                           "UNTIL_RESUMED": -1}


class PauseReply(Replies):
    NOT_PAUSED = 0, "{NOT_PAUSED}: the key was not paused"
    PAUSED_UNTIL = 1, "{PAUSED_UNTIL, until ms (0: until resumed)}: the key is paused"
    RESUMED = 2, "{RESUMED}: the pause is over"


class LimitsReply(Replies):
    LIMITS_SET = 1, "{LIMITS_SET, the limits}: set"
    LIMITS_CLEARED = 2, "{LIMITS_CLEARED, the limits before}: cleared"


PAUSE = Script("PAUSE", "controls/pause.lua", replies=(PauseReply,), constants=CONTROL_CONSTANTS)
LIMITS_SCRIPT = Script("LIMITS", "controls/limits.lua", replies=(LimitsReply,))
SCRIPTS = (PAUSE, LIMITS_SCRIPT)


@dataclass(frozen=True)
class Paused(Held):
    """The key is paused: no run takes it until the pause ends (``ttl_left``: seconds left, -1
    until resumed). The run parks in the key's queue, whatever its ``on_duplicate``."""


@dataclass(frozen=True)
class Limits:
    """A key's limits set at run time (None: the task's own)."""

    concurrency: int | None = None
    peak: int = 0  #: the largest concurrency set since the limits were (slots a run may hold)
    interval_us: int | None = None
    tolerance_us: int = 0
    rate: str | None = None

    @property
    def slots(self) -> int:
        """The slots a call must name (at least): every one a run may hold."""
        return max(self.concurrency or 0, self.peak)


def parse_limits(raw: Any) -> Limits | None:
    """:class:`Limits` from the stored value (None: none set)."""
    if raw is None:
        return None
    parts = dict(item.split("=", 1) for item in text(raw).split() if "=" in item)
    return Limits(
        concurrency=int(parts["c"]) if "c" in parts else None, peak=int(parts.get("p", 0)),
        interval_us=int(parts["i"]) if "i" in parts else None, tolerance_us=int(parts.get("t", 0)),
        rate=parts.get("r"),
    )


class ControlCalls(Feature):
    """The controls' calls (one round trip each)."""

    __slots__ = ()

    def pause(self, key: str, seconds: float | None = None) -> float | None:
        """Pause ``key`` for ``seconds`` (None: until :meth:`resume`): when it ends (epoch seconds
        of the server's clock), or None."""
        reply = self.ctx.script(PAUSE)(keys=[self.ctx.layout.key(PAUSED, key)],
                                       args=[0 if seconds is None else ms(seconds)])
        until = int(reply[1])
        return until / 1000.0 if until else None

    def resume(self, key: str) -> bool:
        """End the pause of ``key``: whether it was paused. The caller has the sweeper look at
        the key at once."""
        reply = self.ctx.script(PAUSE)(keys=[self.ctx.layout.key(PAUSED, key)], args=[-1])
        return int(reply[0]) == PauseReply.RESUMED

    def set_limits(self, key: str, concurrency: int | None = None, interval_us: int | None = None,
                   tolerance_us: int | None = None, rate: str | None = None) -> Limits | None:
        """Override the key's limits (None keeps a part as it is): the limits now."""
        def arg(value: object) -> str:
            return "" if value is None else str(value)

        reply = self.ctx.script(LIMITS_SCRIPT)(
            keys=[self.ctx.layout.key(LIMITS, key)],
            args=["set", arg(concurrency), arg(interval_us), arg(tolerance_us), arg(rate)],
        )
        return parse_limits(reply[1])

    def clear_limits(self, key: str) -> Limits | None:
        """Back to the task's own limits: the limits cleared (None if there were none)."""
        reply = self.ctx.script(LIMITS_SCRIPT)(keys=[self.ctx.layout.key(LIMITS, key)], args=["clear"])
        return parse_limits(reply[1]) if text(reply[1]) else None

    def read(self, key: str) -> tuple[float | None, bool, Limits | None]:
        """(when the pause ends, epoch seconds, or None; whether the key is paused now; its
        limits), by the server's clock, in one round trip."""
        layout = self.ctx.layout
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.time()
        pipe.get(layout.key(PAUSED, key))
        pipe.get(layout.key(LIMITS, key))
        (secs, micros), paused, limits = pipe.execute()
        now = int(secs) * 1000 + int(micros) // 1000
        until = None if paused is None else int(text(paused))
        active = until is not None and (until == 0 or until > now)
        return (until / 1000.0 if until else None) if active else None, active, parse_limits(limits)
