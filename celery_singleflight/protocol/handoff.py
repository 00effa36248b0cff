"""The hand-off: duplicates that wait (``queue``, ``join``), the sweeper's resume of a key whose
holder ended without handing it on, and an operator's force-release.

A parked run waits in the key's FIFO with its re-sendable message; every held record is flagged
``waiting``, so the holder's release reserves the slot for the first parked run (``reserved``,
``by``) and hands its message back to be sent. The entry stays in the queue until the run adopts
the slot, so a crash before the message is sent loses nothing: the key is also in the
namespace's *waiting index*, due when the holder's lease would run out, and a worker's sweeper
hands it on (``RESUME``). A joined run waits in the key's ``joined`` list for the holder's
result; the release hands those messages back too (kept under the releasing token in
``settled`` for a replay).

A parked entry whose token starts with :data:`OWN_COPY` is an *own copy*: the broker delivered
the holder's own run again (a visibility timeout). It waits at the front, beyond ``max_queued``,
and is dropped when that run releases; it runs only if the run's lease ends without a release.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from .. import constants
from ..connection.cluster import clocks_ms
from .context import Feature, due_ms, ms, text
from .controls import CONTROL_CONSTANTS, LIMITS, PAUSED, remember_slots, slots_for
from .fields import FLAG, PATTERNS, TEXT, Field, RecordBase, VersionReply, refuse_foreign
from .inbox import INBOX_CONSTANTS
from .journaled import JOURNALED
from .layout import Part, duration
from .lua import Replies, Script
from .marks import ENQUEUED
from .replies import DeadHolder, Parked, Settlement

__all__ = [
    "ADOPTED", "FORCE_RELEASE", "JOIN", "JOINED", "OWN_COPY", "PARK", "PARKED", "PARTS", "QUEUE", "RESUME",
    "ANSWERED", "TAKEN",
    "SCRIPTS", "SETTLED", "WAITING", "ForceReleaseReply", "HandoffCalls", "HandoffFields", "JoinReply",
    "ParkReply", "ResumeReply",
]

#: handoff token prefix of the copy a turned-away redelivery parks behind its own run
OWN_COPY = "own-"
#: in ``settled``, the field that says when each release took joined runs (JSON: token -> ms)
TAKEN = "taken"
#: in ``settled``, the prefix of a field per joined message a release took (its SHA-1 -> token)
ANSWERED = "m:"

QUEUE = Part("queue", "list of `task id\\|handoff token`", "none",
             "the `queue` policy's FIFO (an entry leaves when its run adopts the key); a turned-away"
             " redelivery's copy (token `own-…`, at the front)")
PARKED = Part("parked", "hash: task id → message", "none",
              "the re-sendable messages of parked runs")
JOINED = Part("joined", "list of messages", "none",
              "the `join` policy: runs waiting for the holder's result")
SETTLED = Part("settled", "hash: token → joined messages, `taken`, `m:<sha1>`",
               duration(constants.SETTLE_KEEP),
               "joined runs handed to a release, for its replay")
ADOPTED = Part("adopted", "sorted set: handoff token → when its run took its slot (ms)",
               f"{duration(constants.ADOPTED_KEEP)} after its last change",
               "parked runs that took their slot: another copy of such a run's message is dropped")
WAITING = Part("waiting", "sorted set: key → when to look (ms)", "none",
               "keys with parked or joined runs, for the sweeper", index=True)
PARTS = (QUEUE, PARKED, JOINED, SETTLED, ADOPTED)


class HandoffFields(RecordBase):
    """The run record's fields of the hand-off."""

    __slots__ = ()

    reserved = Field(FLAG, "the slot waits for the parked run named by ``token``/``task_id``",
                     writers=("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER"),
                     readers=("PARK", "COALESCE", "ops.keystatus", "policies.newest",
                              "protocol.started", "protocol.fair"))
    by = Field(TEXT, "who reserved the slot (a releasing token, a sweep's call id): a replay answers"
               " the same",
               writers=("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER"), readers=())
    waiting = Field(FLAG, "runs wait in the key's queue: the release hands the key on",
                    writers=("ACQUIRE", "RELEASE", "PARK", "RESUME", "FORCE_RELEASE", "COALESCE",
                             "FAIR_ENTER"),
                    readers=())
    joined = Field(FLAG, "runs joined this run: its release hands their messages back",
                   writers=("ACQUIRE", "RELEASE", "JOIN", "RESUME", "FORCE_RELEASE"),
                   readers=())
    prev_worker = Field(TEXT, "on a record (a reservation, or a lease) that replaced a holder whose lease ran"
                        " out unreleased: that holder's worker, so that a re-sent call names it again (its"
                        " caller ends that run)",
                        writers=("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER"),
                        readers=("ACQUIRE", "RESUME", "FAIR_ENTER"))
    prev_task_name = Field(TEXT, "and its task name",
                           writers=("ACQUIRE", "RELEASE", "RESUME", "FORCE_RELEASE", "FAIR_ENTER"),
                           readers=("ACQUIRE", "RESUME", "FAIR_ENTER"))
    released_by = Field(TEXT, "who force-released the run", writers=("FORCE_RELEASE",),
                        readers=("ops.keystatus",))


class ParkReply(Replies):
    FREE = -1, "{FREE}: a slot is free (acquire again)"
    QUEUE_FULL = -2, "{QUEUE_FULL, length}: ``max_queued`` runs wait already"
    PARKED = 1, "{PARKED, position, ms until the first holder's lease runs out}"


class JoinReply(Replies):
    FREE = -1, "{FREE}: the key is free (acquire again)"
    JOINED = 1, "{JOINED, runs joined, holder task id, ms until its lease runs out (0: it ended)}"


class ResumeReply(Replies):
    NOTHING_WAITS = 0, ("{NOTHING_WAITS, ms until a live lease runs out or -1, k, k x (dead task id, its"
                        " worker, its task name)}: no run is parked or joined; the holders that died on"
                        " the key are named (they end as lost); look again then if a lease is live")
    ALL_HELD = 1, "{ALL_HELD, ms until a lease runs out}: look again then"
    HANDED_ON = 2, ("{HANDED_ON, reservation ms, message or '', k, k x (dead task id, its worker, its task"
                    " name), orphaned joined runs...}")
    MORE_SLOTS = 3, "{MORE_SLOTS, slots}: the key's limits allow more slots than were named: call again so"


class ForceReleaseReply(Replies):
    NOT_HELD = 0, "{NOT_HELD}: the slot was free (or held by another run than the one named)"
    FORCE_RELEASED = 1, "{FORCE_RELEASED, released task id, its fence, message or '', joined runs...}"


_LIBS = ("shared/common.lua", "shared/journal.lua", "shared/dead.lua", "handoff/handoff.lua")
_LUA = {**constants.LUA_CONSTANTS, **PATTERNS, **CONTROL_CONSTANTS, "OWN_COPY": OWN_COPY, "TAKEN": TAKEN,
        "ANSWERED": ANSWERED}
_WITH_CONTROLS = (*_LIBS, "controls/controls.lua")

PARK = Script("PARK", "handoff/park.lua", _WITH_CONTROLS, replies=(ParkReply,), constants=_LUA)
JOIN = Script("JOIN", "handoff/join.lua", _LIBS, replies=(JoinReply,), constants=_LUA)
RESUME = Script("RESUME", "handoff/resume.lua", _WITH_CONTROLS, replies=(ResumeReply, VersionReply),
                constants=_LUA)
FORCE_RELEASE = Script("FORCE_RELEASE", "handoff/force_release.lua",
                       (*_LIBS, "lease/lease.lua", "inbox/inbox.lua"),
                       replies=(ForceReleaseReply, VersionReply), constants={**_LUA, **INBOX_CONSTANTS})
SCRIPTS = (PARK, JOIN, RESUME, FORCE_RELEASE)


def _dead_of(parts: Any, named: int) -> tuple[DeadHolder, ...]:
    """The ``named`` dead holders at the start of ``parts`` (task id, worker, task name each)."""
    return tuple(DeadHolder(*(text(part) for part in parts[i:i + 3])) for i in range(0, 3 * named, 3))


def _settlement(reply: Any, first: int) -> Settlement:
    return Settlement(True, text(reply[first]) or None, tuple(text(m) for m in reply[first + 1 :]))


class HandoffCalls(Feature):
    """The hand-off's calls."""

    __slots__ = ()

    def _waiting_due(self, key: str, seconds: float, *, earlier_only: bool = True) -> None:
        """Enter ``key`` in the waiting index, due in ``seconds`` (only sooner than it is)."""
        self.ctx.client.zadd(self.ctx.layout.index(WAITING), {key: due_ms(seconds)}, lt=earlier_only)

    def park(self, key: str, task_id: str, handoff: str, message: str, max_queued: int | None,
             slots: int = 1, *, mark: str = "") -> Parked | int | None:
        """Park a duplicate in the key's FIFO: :class:`Parked`, or the queue length if it is
        full, or None if a slot is free now (acquire again). The key is entered in the waiting
        index, due when the holder's lease would run out (or its pause ends: a paused key parks
        the run even when a slot is free). ``mark``: its journal line's (:mod:`.journaled`)."""
        layout = self.ctx.layout
        reply = self.ctx.script(PARK)(
            keys=[*layout.runs(key, slots), layout.key(QUEUE, key), layout.key(PARKED, key),
                  layout.key(ADOPTED, key), layout.key(PAUSED, key), layout.key(JOURNALED, key)],
            args=[f"{task_id}|{handoff}", message, -1 if max_queued is None else max_queued, slots, mark],
        )
        code = int(reply[0])
        if code == ParkReply.FREE:
            return None
        if code == ParkReply.QUEUE_FULL:
            return int(reply[1])
        ttl_left = int(reply[2]) / 1000.0
        self._waiting_due(key, ttl_left + constants.RESUME_GRACE)
        return Parked(position=int(reply[1]), holder_ttl_left=ttl_left)

    def join(self, key: str, message: str, *, mark: str = "") -> tuple[int, str] | None:
        """Join the holder's run (it will answer with its result): (joined count, holder id),
        or None if the key is free now (acquire again). The key is entered in the waiting index,
        so a holder that dies leaves its joined runs to the sweeper. ``mark``: its journal
        line's (:mod:`.journaled`)."""
        layout = self.ctx.layout
        keys = [layout.run(key), layout.key(JOINED, key), layout.key(SETTLED, key),
                layout.key(JOURNALED, key)]
        reply = self.ctx.script(JOIN)(keys=keys, args=[message, mark])
        if int(reply[0]) == JoinReply.FREE:
            return None
        self._waiting_due(key, max(0, int(reply[3])) / 1000.0 + constants.RESUME_GRACE)
        return int(reply[1]), text(reply[2])

    def settled_joined(self, key: str, token: str) -> list[str]:
        """The joined runs' messages that the release of ``token`` took (kept for a while, so that
        a re-sent release answers the same; empty once that record is gone)."""
        raw = self.ctx.client.hget(self.ctx.layout.key(SETTLED, key), token)
        return [] if raw is None else [text(m) for m in json.loads(raw)]

    def resume(self, key: str, ttl: float, slots: int = 1) -> Settlement | None:
        """Look at one waiting key. If a slot is free (its holder ended without handing it on),
        hand it to the first parked run and take the runs joined to a gone holder (the
        settlement); name the holders that died on it (also once nothing waits: they end lost);
        plan the next look, or drop the key from the index when nothing waits and no lease is
        live. A paused key is looked at again when its pause ends; a key whose limits allow more
        slots is looked at with them (the slots this process's acquires learnt)."""
        layout = self.ctx.layout
        slots, call = slots_for(layout.namespace, key, slots), uuid.uuid4().hex
        while True:
            reply = self.ctx.script(RESUME)(
                keys=[*layout.runs(key, slots), layout.key(QUEUE, key), layout.key(PARKED, key),
                      layout.key(JOINED, key), layout.key(SETTLED, key), layout.key(ENQUEUED, key),
                      layout.key(PAUSED, key), layout.key(LIMITS, key)],
                args=[ms(ttl), slots, call, self.ctx.keep_ms],
            )
            if int(reply[0]) != ResumeReply.MORE_SLOTS:
                break
            slots = remember_slots(layout.namespace, key, int(reply[1]))
        refuse_foreign(key, reply)
        code = int(reply[0])
        client, index = self.ctx.client, layout.index(WAITING)
        if code == ResumeReply.NOTHING_WAITS:
            # runs waited here: a holder that dies after they went on is named once its lease ran
            # out, so the key is looked at again while a lease is live, and leaves the index after
            left, named = int(reply[1]), int(reply[2])
            if left >= 0:
                self._waiting_due(key, left / 1000.0 + constants.RESUME_GRACE, earlier_only=False)
            else:
                client.zrem(index, key)
                if client.llen(layout.key(QUEUE, key)) or client.llen(layout.key(JOINED, key)):
                    self._waiting_due(key, constants.RESUME_GRACE)  # arrived meanwhile
            return Settlement(True, None, (), _dead_of(reply[3:], named)) if named else None
        self._waiting_due(key, int(reply[1]) / 1000.0 + constants.RESUME_GRACE, earlier_only=False)
        if code != ResumeReply.HANDED_ON:
            return None
        named, rest = int(reply[3]), reply[4:]
        return Settlement(True, text(reply[2]) or None, tuple(text(m) for m in rest[3 * named:]),
                          _dead_of(rest, named))

    def taken_joined(self, key: str) -> tuple[dict[str, int], int]:
        """The recent releases of ``key`` that took joined runs (release token -> when, server ms),
        and the server's clock now (ms): one round trip."""
        name = self.ctx.layout.key(SETTLED, key)
        if self.ctx.cluster:  # the clock of the key's node, which stamped them
            raw, now = self.ctx.client.hget(name, TAKEN), clocks_ms(self.ctx.client, [name])[0]
        else:
            pipe = self.ctx.client.pipeline(transaction=False)
            pipe.hget(name, TAKEN)
            pipe.time()
            raw, (seconds, micros) = pipe.execute()
            now = int(seconds) * 1000 + int(micros) // 1000
        taken = {} if raw is None else {str(token): int(at) for token, at in json.loads(raw).items()}
        return taken, now

    def look_again(self, key: str, seconds: float) -> None:
        """Have the sweeper look at ``key`` again in ``seconds`` (or sooner)."""
        self._waiting_due(key, seconds)

    def first_task(self, key: str) -> str | None:
        """The task name of the run that waits first in ``key``'s queue (None: none waits, or its
        message is unreadable)."""
        layout = self.ctx.layout
        first = self.ctx.client.lrange(layout.key(QUEUE, key), 0, 0)
        if not first:
            return None
        raw = self.ctx.client.hget(layout.key(PARKED, key), text(first[0]).split("|", 1)[0])
        try:
            name = json.loads(raw).get("task") if raw is not None else None
        except (ValueError, AttributeError):
            return None
        return str(name) if name else None

    def due_waiting(self, limit: int = 100) -> list[str]:
        """Keys of this namespace whose look is due."""
        raw: list[Any] = self.ctx.client.zrangebyscore(self.ctx.layout.index(WAITING), "-inf", due_ms(0),
                                                       start=0, num=limit)
        return [text(k) for k in raw]

    def mark_adopted(self, key: str, handoff: str, fence: int) -> None:
        """A run sent again after Redis lost its data took ``key`` with ``fence``: its earlier
        hand-off message (token ``handoff``), if still on its way, is then a copy (ACQUIRE answers
        ADOPTED) and does not run it again."""
        name = self.ctx.layout.key(ADOPTED, key)
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.zadd(name, {handoff: fence})
        pipe.pexpire(name, ms(constants.ADOPTED_KEEP))
        pipe.execute()

    def queued(self, key: str) -> int:
        """How many runs wait in the key's queue."""
        return int(self.ctx.client.llen(self.ctx.layout.key(QUEUE, key)))

    def force_release(
        self, key: str, by: str, expected_holder: str = "", slot: int = 0, slots: int = 1, ttl: float = 30.0,
        hand_on: bool = True,
    ) -> tuple[str, int, Settlement] | None:
        """Free one ``slot`` of ``key`` whoever holds it (an operator's decision): the released
        task id, its fence and what the release hands on (a parked run to send, joined runs to
        answer), which the caller must settle. ``hand_on=False`` (a caller without the app to
        send messages) leaves both to the sweeper. None if it was not held (or, with
        ``expected_holder``, held by another)."""
        layout = self.ctx.layout
        reply = self.ctx.script(FORCE_RELEASE)(
            keys=[*layout.runs(key, slots), layout.history(key, slot), layout.key(QUEUE, key),
                  layout.key(PARKED, key), layout.key(JOINED, key), layout.key(SETTLED, key)],
            args=[by, self.ctx.keep_ms, self.ctx.history_length, expected_holder, slot + 1, slots, ms(ttl),
                  "1" if hand_on else "0", uuid.uuid4().hex],
        )
        refuse_foreign(key, reply)
        if int(reply[0]) == ForceReleaseReply.NOT_HELD:
            return None
        return text(reply[1]), int(reply[2]), _settlement(reply, 3)

