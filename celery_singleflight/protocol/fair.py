"""Fair share: at most ``fair_concurrency`` runs of a task at once, and the freed slots handed
round robin across its fair keys (tenants), by weight.

A fair task has a *gate*: a key of its own (:func:`gate_key`) with ``fair_concurrency`` slots,
held like any lease (heartbeat, release, the sweeper's hand-on of a dead holder's slot). A run
enters the gate before it takes its lock key. ``FAIR_ENTER`` reserves a free slot for it when
nobody waits; otherwise it parks the run in the gate's queue, the same queue and messages the
``queue`` policy uses (:mod:`.handoff`), so every release hands the next slot to the queue's
first run and the sweeper's guarantees cover it. Only the order differs: the queue is kept
sorted by a virtual tag (start-time fair queueing). Each fair key's runs get tags ``1 / weight``
apart, and a newcomer's first run starts at the tag of the queue's head, so a tenant that sends
20 runs behind another's 2,000 is served in turn with it, not after it.

The worker's main process enters each message as it arrives (:mod:`..worker.fairpark`), so a
waiting run holds no pool process and the broker's backlog drains into the gate at parking
speed. A run carries a token derived from its message (:func:`fair_token`): the main process
and the pool process compute the same one, so the run adopts the slot reserved for it, and a
second copy of a message that already ran is recognised (``adopted``).
"""

from __future__ import annotations

import hashlib
import time as mod_time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from .. import constants
from .context import Feature, due_ms, ms, text
from .fields import PATTERNS
from .handoff import ADOPTED, PARKED, QUEUE, WAITING
from .journaled import JOURNALED
from .layout import Part, duration
from .lua import Replies, Script
from .reads import RunReads
from .record import RunRecord
from .replies import DeadHolder

__all__ = ["FAIR_ENTER", "FAIR_SINCE", "FAIR_STATE", "FAIR_TAGS", "FAIR_TIMED_OUT", "FAIR_TIMEOUT",
           "FAIR_TIMES", "FAIR_WEIGHTS", "PARTS", "SCRIPTS",
           "Admitted", "FairCalls", "FairReply", "Waiter", "Waiting", "eta", "fair_token", "gate_key"]

FAIR_TAGS = Part("fair_tags", "sorted set: `task id\\|token` → virtual tag", duration(constants.FAIR_KEEP),
                 "a fair gate's waiting runs in fair order (the queue is kept sorted by it)")
FAIR_STATE = Part("fair_state", "hash: `last:<fair key>` → its last tag, `of:<entry>` → fair key",
                  duration(constants.FAIR_KEEP), "a fair gate's tenants: where each one's next run goes")
FAIR_WEIGHTS = Part("fair_weights", "hash: fair key → weight", "none",
                    "weights set at run time (`celery singleflight limit --weight`)")
FAIR_TIMES = Part("fair_times", f"list of the last {constants.FAIR_TIMES_KEPT} run times (ms)", "none",
                  "a fair gate's recent run times, for a waiter's ETA")
FAIR_SINCE = Part("fair_since", "sorted set: `task id\\|token` → when it parked (ms)",
                  duration(constants.FAIR_KEEP), "a fair gate's waiting runs by age, for `queue_timeout`")
FAIR_TIMED_OUT = Part("fair_timed_out", "hash: task id → `ms waited\\|fair key`", "none",
                      "runs taken out of a fair gate's queue for `queue_timeout`, until a sweeper ended them")
PARTS = (FAIR_TAGS, FAIR_STATE, FAIR_WEIGHTS, FAIR_TIMES, FAIR_SINCE, FAIR_TIMED_OUT)

#: the prefix of a fair task's gate key (then the task name)
GATE_PREFIX = "fair:"

#: (waiting index, gate) -> (due ms, monotonic time) of this process's last entry of the gate
_INDEXED: dict[tuple[str, str], tuple[int, float]] = {}
_INDEXED_KEPT = 1000
#: how much later than wanted (ms) a gate's look in the waiting index may be (the sweeper looks
#: about once a second)
_DUE_SLACK = 100


class FairReply(Replies):
    ADMITTED = 1, ("{ADMITTED, slot, dead task id, its worker, its task name}: a slot is reserved for it (-1:"
                   " it took one before), in place of a run whose lease ran out unreleased, if named")
    PARKED = 2, "{PARKED, position, n, mean run ms, ms until a lease runs out, holders' elapsed ms...}"
    WOULD_PARK = 3, "{WOULD_PARK, position, ...}: as PARKED, but nothing was written"


_LUA = {**constants.LUA_CONSTANTS, **PATTERNS, "FAIR_BY": "fair", "FAIR_LAST": "last:", "FAIR_OF": "of:"}
FAIR_ENTER = Script("FAIR_ENTER", "fair/enter.lua",
                    ("shared/common.lua", "shared/journal.lua", "shared/dead.lua", "fair/fair.lua"),
                    replies=(FairReply,), constants=_LUA)
FAIR_TIMEOUT = Script("FAIR_TIMEOUT", "fair/timeout.lua", ("shared/common.lua", "fair/fair.lua"),
                      constants=_LUA)
SCRIPTS = (FAIR_ENTER, FAIR_TIMEOUT)


def gate_key(task_name: str) -> str:
    """The key of a fair task's gate (its slots, its queue)."""
    return f"{GATE_PREFIX}{task_name}"


def fair_token(task_id: str, retries: int, marks: Sequence[Any]) -> str:
    """The token a run enters the gate with: the same for every copy of one message (the main
    process and the pool process agree on it; a copy of a message that ran is recognised), new
    for each re-send the library makes (``marks``: the headers that differ then, and ``retries``)."""
    text = "|".join(str(mark or "") for mark in marks)
    return "fair-" + hashlib.sha1(f"{task_id}|{retries}|{text}".encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Waiter:
    """A run waiting for a key: its task id, fair key ('' outside a gate), position (1: next)
    and ETA in seconds (None while no run time is known)."""

    task_id: str
    fair_key: str
    position: int
    eta: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Admitted:
    """The run may start: a slot of the gate is reserved for it (``slot`` -1: it took one before);
    ``dead``: the run whose lease ran out unreleased on that slot (the caller ends it)."""

    slot: int
    dead: DeadHolder | None = None


@dataclass(frozen=True)
class Waiting:
    """The run waits (or would wait) at ``position`` (1: next) of a gate of ``slots``; ``eta``:
    seconds until it is expected to start, from the gate's recent run times (None: none known)."""

    position: int
    slots: int
    eta: float | None
    parked: bool


def eta(position: int, slots: int, mean: float, elapsed: list[float]) -> float | None:
    """Seconds until the run at ``position`` starts, if each run takes ``mean`` seconds and the
    holders have run ``elapsed`` seconds: the slots free in turn, each every ``mean`` seconds."""
    if mean <= 0:
        return None
    frees = sorted(max(mean - e, 0.0) for e in elapsed)
    frees += [0.0] * (slots - len(frees))
    rounds, index = divmod(position - 1, slots)
    return round(frees[index] + rounds * mean, 3)


class FairCalls(Feature):
    """The calls of fair share (on a gate key)."""

    __slots__ = ()

    def keys(self, gate: str, slots: int) -> list[str]:
        layout = self.ctx.layout
        return [*layout.runs(gate, slots), layout.key(QUEUE, gate), layout.key(PARKED, gate),
                layout.key(ADOPTED, gate), layout.key(FAIR_TAGS, gate), layout.key(FAIR_STATE, gate),
                layout.key(FAIR_WEIGHTS, gate), layout.key(FAIR_TIMES, gate), layout.key(FAIR_SINCE, gate)]

    def enter(self, gate: str, slots: int, task_id: str, token: str, message: str, fair: str, weight: float,
              ttl: float, *, dry: bool = False, mark: str = "") -> Admitted | Waiting:
        """Enter the gate: :class:`Admitted`, or :class:`Waiting` (parked unless ``dry``, which
        only says where it would wait). A parked gate is entered in the waiting index, due when
        its first lease would run out, so that the sweeper hands on a dead holder's slot
        (:meth:`_index`). ``mark``: the journal line's of the run if it parks (:mod:`.journaled`)."""
        reply = self.ctx.script(FAIR_ENTER)(
            keys=[*self.keys(gate, slots), self.ctx.layout.key(JOURNALED, gate)],
            args=[f"{task_id}|{token}", message, slots, ms(ttl), self.ctx.keep_ms, fair, weight,
                  "1" if dry else "", mark],
        )
        code = int(reply[0])
        if code == FairReply.ADMITTED:
            named = len(reply) >= 5 and text(reply[2])
            dead = DeadHolder(*(text(p) for p in reply[2:5])) if named else None
            return Admitted(int(reply[1]), dead)
        waiting = _waiting(reply, parked=code == FairReply.PARKED)
        if code == FairReply.PARKED:
            left = int(reply[4])
            all_held = left >= 0 and len(reply) - 5 >= slots
            look = left / 1000.0 if all_held else constants.RESUME_GRACE
            behind_others = all_held and waiting.position > 1
            self._index(gate, due_ms(look + constants.RESUME_GRACE), behind_others=behind_others)
        return waiting

    def _index(self, gate: str, due: int, *, behind_others: bool) -> None:
        """Enter ``gate`` in the waiting index, due at ``due`` (ms) or sooner. A run parked
        ``behind_others`` found the queue not empty, so the gate is in the index already (the
        park that made the queue not empty entered it, and the sweeper keeps a gate there while
        its queue is not): this process does not enter it again for
        :data:`~..constants.FAIR_INDEXED_FRESH` after it did, as soon or sooner (within
        :data:`_DUE_SLACK`: ``due`` is the holder's deadline seen from this process's clock, which
        moves by the round trip's jitter between two parks of one burst)."""
        index, now = self.ctx.layout.index(WAITING), mod_time.monotonic()
        known = _INDEXED.get((index, gate))
        fresh = (known is not None and known[0] <= due + _DUE_SLACK
                 and now - known[1] < constants.FAIR_INDEXED_FRESH)
        if behind_others and fresh:
            return
        self.ctx.client.zadd(index, {gate: due}, lt=True)
        if len(_INDEXED) >= _INDEXED_KEPT:
            _INDEXED.clear()
        _INDEXED[(index, gate)] = (due, now)

    def timed_out(self, gate: str, slots: int, timeout: float,
                  limit: int = 100) -> list[tuple[str, float, str]]:
        """Take the runs that waited at the gate longer than ``timeout`` seconds out of its queue:
        (task id, seconds waited, fair key) of each, and of any taken out before and not yet
        ended. The caller ends each one, then calls :meth:`ended_timeout`."""
        layout = self.ctx.layout
        keys = [*layout.runs(gate, slots), layout.key(QUEUE, gate), layout.key(PARKED, gate),
                layout.key(FAIR_TAGS, gate), layout.key(FAIR_STATE, gate), layout.key(FAIR_SINCE, gate),
                layout.key(FAIR_TIMED_OUT, gate)]
        reply = self.ctx.script(FAIR_TIMEOUT)(keys=keys, args=[slots, ms(timeout), limit])
        found = []
        for i in range(0, len(reply), 2):
            waited, _, fair = text(reply[i + 1]).partition("|")
            found.append((text(reply[i]), int(waited) / 1000.0, fair))
        return found

    def ended_timeout(self, gate: str, task_id: str) -> None:
        """A run taken out for its ``queue_timeout`` is ended (its FAILURE stored)."""
        self.ctx.client.hdel(self.ctx.layout.key(FAIR_TIMED_OUT, gate), task_id)

    def note_run(self, gate: str, seconds: float) -> None:
        """Keep a run's time among the gate's recent ones (a re-sent call adds it twice: a mean
        barely moves)."""
        name = self.ctx.layout.key(FAIR_TIMES, gate)
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.lpush(name, ms(seconds))
        pipe.ltrim(name, 0, constants.FAIR_TIMES_KEPT - 1)
        pipe.execute()

    def set_weight(self, gate: str, fair: str, weight: float | None) -> None:
        """Give ``fair`` the ``weight`` at this gate until cleared (None: the task's own)."""
        name = self.ctx.layout.key(FAIR_WEIGHTS, gate)
        if weight is None:
            self.ctx.client.hdel(name, fair)
        else:
            self.ctx.client.hset(name, fair, repr(float(weight)))

    def weights(self, gate: str) -> dict[str, float]:
        """The weights set at run time at this gate."""
        raw = self.ctx.client.hgetall(self.ctx.layout.key(FAIR_WEIGHTS, gate))
        return {text(k): float(text(v)) for k, v in raw.items()}

    def waiters(self, key: str, slots: int, limit: int = 100) -> list[Waiter]:
        """The first ``limit`` runs waiting for ``key`` (a gate, or a ``queue`` key), in order."""
        layout, client = self.ctx.layout, self.ctx.client
        entries = [text(e) for e in client.lrange(layout.key(QUEUE, key), 0, limit - 1)] if limit > 0 else []
        if not entries:
            return []
        pipe = client.pipeline(transaction=False)
        pipe.lrange(layout.key(FAIR_TIMES, key), 0, -1)
        for entry in entries:
            pipe.hget(layout.key(FAIR_STATE, key), f"of:{entry}")
        raw_times, *owners = pipe.execute()
        times = [int(t) / 1000.0 for t in raw_times]
        mean = sum(times) / len(times) if times else 0.0
        elapsed = self._elapsed(key, slots) if mean else []
        return [Waiter(entry.split("|", 1)[0], text(owner) if owner is not None else "", i + 1,
                       eta(i + 1, slots, mean, elapsed))
                for i, (entry, owner) in enumerate(zip(entries, owners, strict=True))]

    def _elapsed(self, gate: str, slots: int) -> list[float]:
        """How long each run holding a slot of the gate has run (seconds)."""
        found = RunReads(self.ctx).snapshots([(gate, slot) for slot in range(slots)])
        ran = [_ran_for(snapshot[0], snapshot[2]) for snapshot in found]
        return [seconds for seconds in ran if seconds is not None]


def _ran_for(record: RunRecord, now: int) -> float | None:
    """How long the run holding a slot has run (seconds); None for a slot not held by a run."""
    if not record.token or record.reserved or (record.deadline or 0) <= now:
        return None
    return (now - (record.since or now)) / 1000.0


def _waiting(reply: Any, *, parked: bool) -> Waiting:
    slots, mean = int(reply[2]), int(reply[3]) / 1000.0
    elapsed = [int(e) / 1000.0 for e in reply[5:]]
    position = int(reply[1])
    return Waiting(position, slots, eta(position, slots, mean, elapsed), parked)
