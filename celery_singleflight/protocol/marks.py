"""Marks: the enqueue-time dedup marker, the idempotency window, and duplicates noted on the
holder's status.

The *enqueue marker* (``dedup_enqueue``) holds the task id queued or running for a key: a send
that finds one returns that task instead of sending again. A marker whose run is over (its
record ended, or its lease ran out unreleased) no longer counts, and the run's release clears
its own. The *idempotency window* (``idempotency_key``) remembers a finished run's result under
its idempotency key. A duplicate turned away is *noted* on the holder's record (a count, and an
entry for its watchers).
"""

from __future__ import annotations

from typing import Any

from .. import constants
from .context import Feature, ms, text
from .fields import NUMBER, TEXT, Field, RecordBase
from .layout import Part
from .lua import Replies, Script

__all__ = [
    "CLEAR_MARK", "DONE", "ENQUEUED", "ENQUEUE_MARK", "NOTE_DUPLICATE", "PARTS", "SCRIPTS", "ClearReply",
    "DuplicateFields", "MarkCalls", "NoteReply",
]

ENQUEUED = Part("enqueued", "string: task id", "`dedup_ttl`", "the enqueue-time dedup marker")
DONE = Part("done", "string: JSON `{task_id, result}`", "`idempotency_ttl`",
            "the idempotency window (keyed by the idempotency key)")
PARTS = (ENQUEUED, DONE)


class DuplicateFields(RecordBase):
    """The run record's fields of the duplicates noted on it."""

    __slots__ = ()

    duplicates = Field(NUMBER, "how many duplicates arrived while this run held the key",
                       writers=("NOTE_DUPLICATE",), readers=("ops.keystatus",))
    dup_last = Field(TEXT, "the last duplicate noted (task id and outcome): a replay notes nothing more",
                     writers=("NOTE_DUPLICATE",), readers=())


class ClearReply(Replies):
    NOT_MARKED = 0, "the marker is another task's, or gone"
    CLEARED = 1, "the marker was this task's and is cleared"


class NoteReply(Replies):
    KEY_FREE = 0, "the key is free: nobody to note it on"
    NOTED = 1, "noted on the holder's run (once per duplicate and outcome)"


_LIBS = ("shared/common.lua",)
_LUA = dict(constants.LUA_CONSTANTS)

ENQUEUE_MARK = Script("ENQUEUE_MARK", "marks/enqueue_mark.lua", _LIBS, constants=_LUA)
CLEAR_MARK = Script("CLEAR_MARK", "marks/clear_mark.lua", replies=(ClearReply,))
NOTE_DUPLICATE = Script("NOTE_DUPLICATE", "marks/note_duplicate.lua", _LIBS, replies=(NoteReply,),
                        constants=_LUA)
SCRIPTS = (ENQUEUE_MARK, CLEAR_MARK, NOTE_DUPLICATE)


class MarkCalls(Feature):
    """The marks' calls."""

    __slots__ = ()

    def mark_enqueued(self, key: str, task_id: str, ttl: float, slots: int = 1) -> str | None:
        """Claim ``key`` for ``task_id`` about to be sent, or return the task id already queued
        or running for it (a marker whose run is over does not count)."""
        layout = self.ctx.layout
        reply = self.ctx.script(ENQUEUE_MARK)(keys=[layout.key(ENQUEUED, key), *layout.runs(key, slots)],
                                              args=[task_id, ms(ttl)])
        return text(reply) if reply else None

    def clear_enqueued(self, key: str, task_id: str) -> bool:
        """Forget the marker of ``key`` if it is ``task_id``'s."""
        reply = self.ctx.script(CLEAR_MARK)(keys=[self.ctx.layout.key(ENQUEUED, key)], args=[task_id])
        return int(reply) == ClearReply.CLEARED

    def enqueued(self, key: str) -> tuple[str | None, float | None]:
        """The task id marked for ``key`` and the marker's seconds left, read as stored (a
        marker whose run is over is still answered); ``(None, None)`` when there is none."""
        name = self.ctx.layout.key(ENQUEUED, key)
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.get(name)
        pipe.pttl(name)
        raw, left = pipe.execute()
        if raw is None:
            return None, None
        return text(raw), (int(left) / 1000 if int(left) >= 0 else None)

    def note_duplicate(self, key: str, task_id: str, outcome: str) -> bool:
        """Count a duplicate on the holder's status and tell live watchers what happened to it."""
        layout = self.ctx.layout
        reply = self.ctx.script(NOTE_DUPLICATE)(keys=[layout.run(key), layout.history(key)],
                                                args=[task_id, outcome, self.ctx.history_length])
        return int(reply) == NoteReply.NOTED

    def remembered(self, idempotency_key: str) -> str | None:
        """The record of the run remembered under ``idempotency_key``, if its window is open."""
        raw: Any = self.ctx.client.get(self.ctx.layout.key(DONE, idempotency_key))
        return None if raw is None else text(raw)

    def remember(self, idempotency_key: str, record: str, ttl: float) -> None:
        """Remember a finished run's ``record`` under ``idempotency_key`` for ``ttl`` seconds."""
        self.ctx.client.set(self.ctx.layout.key(DONE, idempotency_key), record, px=ms(ttl))
