"""Newest wins: one pending run per key with the latest arguments (``coalesce``), and the
newcomer that takes over from the running holder (``supersede``).

``COALESCE`` makes a duplicate the key's one pending run (it waits in the queue as a parked run
does, and is handed the key by the release); a duplicate sent later replaces it, and the runs it
replaced are kept in the key's *newest book* until their callers have ended them. With
``supersede`` the same call also marks every held record superseded (``sup_by``, ``sup_at``,
``sup_due``, ``sup_sig``): the lease's own scripts then tell the holder (RENEW and PROGRESS
answer :class:`RenewNotice` and :class:`ProgressNotice`, and ACQUIRE carries the mark to a run
adopting a reservation that was superseded on its way), RELEASE records its end as
``superseded``, and the namespace's *superseding index* lets any worker's sweeper revoke it
once its grace is over.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import constants
from .context import Feature, due_ms, ms, text
from .fields import MS, TEXT, Field, RecordBase, json_member, member
from .handoff import ADOPTED, OWN_COPY, PARKED, QUEUE, WAITING
from .inbox import INBOX_CONSTANTS
from .journaled import JOURNALED
from .layout import Part, duration
from .lua import Replies, Script, Template

__all__ = [
    "BOOK", "COALESCE", "NEWEST_PATTERNS", "NEWEST_START", "NEWEST_TEMPLATES", "PARTS", "SCRIPTS",
    "SUPERSEDING", "TOLD_SUPERSEDED", "CoalesceReply", "NewestCalls", "NewestFields", "Notice",
    "ProgressNotice", "RenewNotice", "StartReply", "Started",
]

BOOK = Part("coalesce", "hash: `s:<id>` → send stamp, `o:<id>` → messages, `latest`",
            f"{duration(constants.NEWEST_KEEP)} after its last change",
            "`coalesce`, `supersede`: the pending run's send stamp; the runs it replaced, until answered;"
            " the last-sent run pending or started (an older one never runs after it)")
SUPERSEDING = Part("superseding", "sorted set: key → when to revoke (ms)",
                   "none",
                   "keys whose holder was superseded, for the sweeper's revoke",
                   index=True)
PARTS = (BOOK,)


class NewestFields(RecordBase):
    """The run record's fields of ``supersede``."""

    __slots__ = ()

    sup_by = Field(TEXT, "the run that superseded this one: the holder must stop",
                   writers=("ACQUIRE", "COALESCE"),
                   readers=("RELEASE", "RENEW", "PROGRESS", "ops.keystatus", "policies.newest",
                            "protocol.newest"))
    sup_at = Field(MS, "when the run was first superseded", writers=("ACQUIRE", "COALESCE"),
                   readers=("protocol.newest",))
    sup_due = Field(MS, "when the superseded run is revoked unless it has ended",
                    writers=("ACQUIRE", "COALESCE"),
                    readers=("policies.newest", "protocol.newest"))
    sup_sig = Field(TEXT, "the revoke's signal", writers=("ACQUIRE", "COALESCE"),
                    readers=("policies.newest",))


#: SUPERSEDED_FIELDS(sup_by, sup_at, sup_due, sup_sig): the fields ACQUIRE carries over to a run
#: that adopts a reservation superseded on its way (``sup_by`` and ``sup_sig`` as JSON literals)
NEWEST_TEMPLATES = {
    "SUPERSEDED_FIELDS": Template(("," + json_member("sup_by"), "," + member("sup_at"),
                                   '",' + member("sup_due"), '",' + json_member("sup_sig"), "")),
}
#: SUPERSEDED_MARK: a record's text holds it once a newer run superseded the run
NEWEST_PATTERNS = {"SUPERSEDED_MARK": json_member("sup_by")}


#: the kind of the push that tells a holder's process it was superseded (:mod:`.inbox`); its
#: fields: by whom (task id), when, and when it is revoked unless it ended (epoch ms)
TOLD_SUPERSEDED = "superseded"


class RenewNotice(Replies):
    """What RENEW answers for a lease a newer run superseded."""

    RENEWED_SUPERSEDED = 2, "renewed, but a newer run superseded it: the holder must stop"


class ProgressNotice(Replies):
    """What PROGRESS answers for a run a newer one superseded."""

    WRITTEN_SUPERSEDED = 2, "{WRITTEN_SUPERSEDED, task id}: written, but that run superseded this one"


class CoalesceReply(Replies):
    FREE = -1, "{FREE}: a slot is free (acquire again)"
    PENDING = 1, ("{PENDING, ms until the first holder's lease runs out, sup_due ms or '', messages of the "
                  "runs it replaced...}: this run is the pending one")
    GIVES_WAY = 2, "{GIVES_WAY, pending task id}: this run gives way to the pending run (it does not run)"


class StartReply(Replies):
    STALE = 0, ("{STALE, the newer run's task id, messages of the runs this one replaced or ''}: a run sent"
                " after this one is pending or started: this one must not run")
    STARTED = 1, "{STARTED, messages of the runs this one replaced or '', its record or ''}"


COALESCE = Script("COALESCE", "newest/coalesce.lua",
                  ("shared/common.lua", "shared/journal.lua", "handoff/handoff.lua", "newest/newest.lua",
                   "inbox/inbox.lua"),
                  replies=(CoalesceReply,),
                  constants={**constants.LUA_CONSTANTS, **INBOX_CONSTANTS, "OWN_COPY": OWN_COPY,
                             "TOLD_SUPERSEDED": TOLD_SUPERSEDED},
                  templates=NEWEST_TEMPLATES)
NEWEST_START = Script("NEWEST_START", "newest/start.lua", ("newest/newest.lua",), replies=(StartReply,),
                      constants=constants.LUA_CONSTANTS, templates=NEWEST_TEMPLATES)
SCRIPTS = (COALESCE, NEWEST_START)


@dataclass(frozen=True)
class Started:
    """What a starting run learns: the runs it replaced still to be ended, who superseded it on
    its way, and the newer run it gives way to (None: it runs)."""

    owed: tuple[str, ...]
    notice: Notice | None
    newer: str | None


@dataclass(frozen=True)
class Notice:
    """Who superseded a run, when (epoch seconds), and when it is revoked unless it ended."""

    by: str
    at: float | None
    revoke_at: float | None


class NewestCalls(Feature):
    """The calls of ``coalesce`` and ``supersede``."""

    __slots__ = ()

    def coalesce(self, key: str, task_id: str, handoff: str, message: str, keep: str, stamp: str,
                 slots: int = 1, *, supersede_grace: float = 0.0,
                 supersede_signal: str = "SIGTERM", mark: str = "") -> tuple[str, ...] | str | None:
        """Make this run the key's one pending run (``keep`` "last" or "first"; "supersede"
        also marks the holders superseded): the messages of the runs it replaced (to be ended,
        then :meth:`answered`); or the task id of the pending run this one gives way to (it does
        not run); or None if a slot is free now (acquire again). The key is entered in the
        waiting index for the sweeper, and a superseded key in the superseding index, due when
        its holder is to be revoked. ``mark``: its journal line's (:mod:`.journaled`)."""
        layout = self.ctx.layout
        reply = self.ctx.script(COALESCE)(
            keys=[*layout.runs(key, slots), layout.key(QUEUE, key), layout.key(PARKED, key),
                  layout.key(BOOK, key), layout.key(ADOPTED, key), layout.key(JOURNALED, key)],
            args=[f"{task_id}|{handoff}", message, keep, slots, stamp, ms(supersede_grace), supersede_signal,
                  mark],
        )
        code = int(reply[0])
        if code == CoalesceReply.FREE:
            return None
        if code == CoalesceReply.GIVES_WAY:
            return text(reply[1])
        pipe = self.ctx.client.pipeline(transaction=False)
        due = due_ms(int(reply[1]) / 1000.0 + constants.RESUME_GRACE)
        pipe.zadd(layout.index(WAITING), {key: due}, lt=True)
        if text(reply[2]):
            pipe.zadd(layout.index(SUPERSEDING), {key: int(text(reply[2]))}, nx=True)
        pipe.execute()
        return tuple(text(m) for m in reply[3:])

    def answered(self, key: str, task_id: str) -> None:
        """The runs replaced by ``task_id`` have been ended: forget them."""
        self.ctx.client.hdel(self.ctx.layout.key(BOOK, key), f"o:{task_id}")

    def started(self, key: str, task_id: str, slot: int, stamp: str) -> Started:
        """A run starts (one round trip): the runs it replaced that its caller may not have ended
        (it died first), to end again (ending twice writes the same result); who superseded it
        on its way, if anyone did; and, if a run sent after it (``stamp``) is pending or started
        already, that run's task id: this one must not run. Its send stamp is forgotten: it is
        no longer pending."""
        layout = self.ctx.layout
        reply = self.ctx.script(NEWEST_START)(keys=[layout.key(BOOK, key), layout.run(key, slot)],
                                              args=[task_id, stamp])
        raw = text(reply[2]) if int(reply[0]) == StartReply.STALE else text(reply[1])
        owed = tuple(json.loads(raw)) if raw else ()
        if int(reply[0]) == StartReply.STALE:
            return Started(owed, None, text(reply[1]))
        record = text(reply[2]) or None
        return Started(owed, _notice(NewestFields.decode(record)), None)

    def notice(self, key: str, slot: int) -> Notice | None:
        """Who superseded the run on ``slot`` of ``key`` (one round trip), making sure the key is
        in the superseding index: the run is revoked after its grace even if the newcomer's
        process died before entering it."""
        record = NewestFields.decode(self.ctx.client.get(self.ctx.layout.run(key, slot)))
        if record.sup_due:
            self.mark_superseding(key, record.sup_due)
        return _notice(record)

    def mark_superseding(self, key: str, due: int) -> None:
        """Enter ``key`` in the superseding index, due at ``due`` (epoch ms), unless it is."""
        self.ctx.client.zadd(self.ctx.layout.index(SUPERSEDING), {key: due}, nx=True)

    def due_superseding(self, limit: int = 100) -> list[str]:
        """Keys whose superseded holder's grace has run out (or is to be looked at again)."""
        raw: Any = self.ctx.client.zrangebyscore(self.ctx.layout.index(SUPERSEDING), "-inf", due_ms(0),
                                                 start=0, num=limit)
        return [text(k) for k in raw]

    def plan_superseding(self, key: str, seconds: float | None) -> None:
        """Look at ``key`` again in ``seconds``, or (None) forget it."""
        index = self.ctx.layout.index(SUPERSEDING)
        if seconds is None:
            self.ctx.client.zrem(index, key)
        else:
            self.ctx.client.zadd(index, {key: due_ms(seconds)})


def _notice(record: NewestFields) -> Notice | None:
    if not record.sup_by:
        return None
    at, due = record.sup_at, record.sup_due
    return Notice(record.sup_by, at / 1000.0 if at else None, due / 1000.0 if due else None)
