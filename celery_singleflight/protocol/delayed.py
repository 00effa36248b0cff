"""Delayed runs kept in Redis: a run the library delays (``debounce``, ``key_rate_limit``, the
``retry`` policy) is sent as a countdown message *and* copied into its key's ``delayed`` hash.

The countdown message is the fast path: the worker that fetched it starts it at its due time.
With the Redis broker that worker holds the message unacknowledged, so if it dies the message
comes back only after the visibility timeout (an hour by default). The copy is the guarantee:
a worker's sweeper finds a run whose message has not started :data:`~..constants.DELAYED_GRACE`
after its due time (the namespace's *delayed index*) and sends the copy (``RESEND``). Every
message of a delayed run carries a token; when one starts it *claims* the run (``CLAIM``), so of
the countdown message and the copies sent again, exactly one runs: a late one is stale.

Every copy that waits has an owner a sweeper can check: the worker that noted holding its
message (``TOUCH``), and once claimed, the claimant's worker. The claim keeps the copy until the
claimant says its run started (then it is watched as a started run: :mod:`.started`) or ended
(``CLAIM_DONE``); a claim whose worker is gone is taken back and the copy sent again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from .. import constants
from .context import Feature, due_ms, ms, text
from .journaled import JOURNALED
from .layout import Part, duration
from .lua import Replies, Script

__all__ = [
    "CLAIM", "CLAIM_DONE", "DELAY", "DELAYED", "DELAYED_DUE", "DELAYED_ENDS", "RESEND", "SCRIPTS", "TOUCH",
    "WORKERS",
    "Claim", "ClaimDoneReply", "ClaimReply", "DelayReply", "DelayedCalls", "ResendReply", "Resent",
    "TouchReply", "copy_waits",
]

DELAYED = Part("delayed", "hash: task id → JSON (token, due, message)",
               f"due + {duration(constants.DELAYED_KEEP)}",
               "runs the library delayed (time policies, `retry`): the copy a sweeper sends if their"
               " countdown message is lost with its worker")
DELAYED_DUE = Part("delays", "sorted set: `[key, task id]` → when to look (ms)", "none",
                   "delayed runs, due a grace after their due time, for the sweeper", index=True)
DELAYED_ENDS = Part("delayed_ends", "sorted set: task id → when its claimed entry may go (ms)",
                    f"{duration(constants.DELAYED_KEEP)} after its last change",
                    "claimed delayed runs that a late copy may still come for")
WORKERS = Part("workers", "sorted set: worker → when its sweeper last ran (ms)", "none",
               "which workers are alive: a delayed message a live worker holds is not lost", index=True)


class DelayReply(Replies):
    DELAYED = 1, "{DELAYED, due ms}: the copy is kept"
    NOT_CLAIMED = 2, ("{NOT_CLAIMED}: another copy owns the run now (the caller's claim was taken back, or"
                      " this call, sent again, found a copy that claimed it): nothing is kept")


class ClaimReply(Replies):
    GO = 1, "{GO}: this copy runs (also when no copy is known)"
    STALE = 2, "{STALE}: another copy runs or ran: drop this one"
    GO_LATE = 3, "{GO_LATE}: this copy runs; the run was sent again by a sweeper, late"


class ClaimDoneReply(Replies):
    DONE = 1, "{DONE}: the run goes on (its copy is no longer needed)"
    TAKEN_BACK = 2, "{TAKEN_BACK}: a sweeper took the claim back and sent the copy again: do not start"


class TouchReply(Replies):
    IGNORED = 0, "{IGNORED}: the run started already, or the token is not one of its copies"
    NOTED = 1, "{NOTED}: the worker that holds this copy is noted"


class ResendReply(Replies):
    GONE = 0, "{GONE}: it started (or is unknown): forget it"
    NOT_DUE = 1, "{NOT_DUE, ms}: not due, or a live worker holds a copy: look again then"
    RESEND = 2, ("{RESEND, message, headers (JSON) or '', lease token or ''}: send it again with the new"
                 " token (and the lease token of the claimant whose claim was taken back)")


_LIBS = ("shared/common.lua", "shared/journal.lua", "delayed/delayed.lua")
_LUA = dict(constants.LUA_CONSTANTS)
DELAY = Script("DELAY", "delayed/delay.lua", _LIBS, replies=(DelayReply,), constants=_LUA)
CLAIM = Script("CLAIM", "delayed/claim.lua", _LIBS, replies=(ClaimReply,), constants=_LUA)
CLAIM_DONE = Script("CLAIM_DONE", "delayed/done.lua", _LIBS, replies=(ClaimDoneReply,), constants=_LUA)
RESEND = Script("RESEND", "delayed/resend.lua", _LIBS, replies=(ResendReply,), constants=_LUA)
TOUCH = Script("TOUCH", "delayed/touch.lua", _LIBS, replies=(TouchReply,), constants=_LUA)
SCRIPTS = (DELAY, CLAIM, CLAIM_DONE, RESEND, TOUCH)


@dataclass(frozen=True)
class Claim:
    """A delayed run's copy claimed by this run (``token``: its message's) on ``key``, until the
    run says it started or ended (:meth:`DelayedCalls.done`)."""

    key: str
    task_id: str
    token: str


@dataclass(frozen=True)
class Resent:
    """A copy a sweeper is to send: its message, the headers it carries besides its token, and
    the lease token of the claimant whose claim was taken back ('' if none): if that claimant
    took its lease, the copy takes the lease over (``HEADER_EARLIER``)."""

    message: str
    headers: dict[str, Any]
    took: str


def copy_waits(raw: Any) -> bool:
    """Whether a run's entry (as HGET read it) still holds a copy that waits to start."""
    return raw is not None and "m" in json.loads(raw)


def _member(key: str, task_id: str) -> str:
    return json.dumps([key, task_id])


class DelayedCalls(Feature):
    """The calls of delayed runs."""

    __slots__ = ()

    def delay(self, key: str, task_id: str, token: str, message: str, countdown: float, *,
              restore: bool = False, mark: str = "", claimed: str = "") -> float | None:
        """Keep a copy of a run delayed by ``countdown`` seconds, whose countdown message carries
        ``token``, and enter it in the delayed index (one round trip). ``restore``: put back a
        copy Redis lost, only if the run has no entry now. ``mark``: its journal line's
        (:mod:`.journaled`). ``claimed``: the caller's claim of the run, which must still stand.
        None when another copy owns the run now (the claim was taken back, or this call's reply
        was lost and a copy claimed the run before it was sent again): the caller must not send
        its countdown message. Returns its due time (epoch seconds, the server's clock)."""
        args = [task_id, token, message, ms(countdown) if countdown > 0 else 0, "1" if restore else "", mark,
                claimed]
        keys = [*self.keys(key), self.ctx.layout.key(JOURNALED, key)]
        reply = self.with_index(DELAY, keys, args, key, task_id, countdown)
        if int(reply[0]) == DelayReply.NOT_CLAIMED:
            return None
        return int(reply[1]) / 1000.0

    def keys(self, key: str) -> list[str]:
        """The delayed runs of ``key`` and their ends: the keys of the scripts that write them."""
        return [self.ctx.layout.key(DELAYED, key), self.ctx.layout.key(DELAYED_ENDS, key)]

    def with_index(self, script: Script, keys: list[str], args: list[Any], key: str, task_id: str,
                   look_in: float) -> Any:
        """Run ``script``, which keeps a copy of a delayed run, and enter that run in the delayed
        index, to be looked at ``look_in`` seconds from now plus the grace (sooner is safe: a run
        not due yet is looked at again when it is): one round trip. Returns the script's reply."""
        look = due_ms(look_in + constants.DELAYED_GRACE)
        index, member = self.ctx.layout.index(DELAYED_DUE), _member(key, task_id)
        return self.ctx.pipelined(script, [(keys, args)], lambda pipe: pipe.zadd(index, {member: look}))[0]

    def claim(self, key: str, task_id: str, token: str, owner: str, lease_token: str) -> ClaimReply:
        """A delayed run's message starts: does this copy run (GO, GO_LATE: it was sent again
        late), or is it STALE (another copy runs or ran)? ``owner``: the claimant's worker
        (:func:`..run.owner.worker_instance`), which must say its run started or ended
        (:meth:`done`) before a sweeper's look, due :data:`~..constants.WORKER_GONE_AFTER` plus the
        grace from now, takes the claim back if that worker is gone. One round trip."""
        look = due_ms(constants.WORKER_GONE_AFTER + constants.DELAYED_GRACE)
        index, member = self.ctx.layout.index(DELAYED_DUE), _member(key, task_id)
        reply = self.ctx.pipelined(CLAIM, [(self.keys(key), [task_id, token, owner, lease_token])],
                                lambda pipe: pipe.zadd(index, {member: look}))[0]
        return ClaimReply(int(reply[0]))

    def done(self, claim: Claim, before: Callable[[Any], Any] | None = None) -> ClaimDoneReply:
        """The run of ``claim`` started or ended: its copy is no longer needed, unless a sweeper
        took the claim back (TAKEN_BACK: the run must not start). ``before(pipe)`` adds commands
        to the same round trip, ahead of the script (the started index's entry: a run is watched
        as started before its copy goes). The run leaves the delayed index only on DONE (in the
        script; on a Cluster, right after it)."""
        index, member = self.ctx.layout.index(DELAYED_DUE), _member(claim.key, claim.task_id)
        keys, args = self.keys(claim.key), [claim.task_id, claim.token, member]
        if self.ctx.cluster:  # the index is in another slot: dropped after a DONE
            if before is not None:
                before(self.ctx.client)
            reply = self.ctx.script(CLAIM_DONE)(keys=keys, args=args)
            if int(reply[0]) == ClaimDoneReply.DONE:
                self.ctx.client.zrem(index, member)
        else:
            called = self.ctx.script(CLAIM_DONE)
            keys.append(index)
            pipe = self.ctx.client.pipeline(transaction=False)
            if before is not None:
                before(pipe)
            pipe.evalsha(called.sha.decode(), len(keys), *keys, *args)
            *ahead, reply = pipe.execute(raise_on_error=False)
            for error in ahead:
                if isinstance(error, Exception):
                    raise error
            if isinstance(reply, redis.exceptions.NoScriptError):
                reply = called(keys=keys, args=args)  # loads it
            elif isinstance(reply, Exception):
                raise reply
        return ClaimDoneReply(int(reply[0]))

    def due(self, limit: int = 100) -> list[tuple[str, str]]:
        """``(key, task id)`` of the delayed runs to look at now."""
        raw: Any = self.ctx.client.zrangebyscore(self.ctx.layout.index(DELAYED_DUE), "-inf", due_ms(0),
                                                 start=0, num=limit)
        found: list[tuple[str, str]] = []
        for member in raw:
            key, task_id = json.loads(text(member))
            found.append((str(key), str(task_id)))
        return found

    def resend(self, key: str, task_id: str, token: str, alive: list[str]) -> Resent | None:
        """The copy to send again under ``token``, or None (it started; it is not due; or a worker
        in ``alive`` holds a copy or its claim: the index is updated either way)."""
        layout = self.ctx.layout
        reply = self.ctx.script(RESEND)(keys=[layout.key(DELAYED, key)], args=[task_id, token, *alive])
        code = int(reply[0])
        if code == ResendReply.RESEND:
            headers = text(reply[2])
            return Resent(text(reply[1]), json.loads(headers) if headers else {}, text(reply[3]))
        index, member = layout.index(DELAYED_DUE), _member(key, task_id)
        if code == ResendReply.GONE:
            self.ctx.client.zrem(index, member)
        else:
            self.ctx.client.zadd(index, {member: max(int(reply[1]), due_ms(0))})
        return None

    def look_again(self, key: str, task_id: str, seconds: float) -> None:
        """Look at the delayed run again in ``seconds`` (its copy could not be sent now)."""
        self.ctx.client.zadd(self.ctx.layout.index(DELAYED_DUE), {_member(key, task_id): due_ms(seconds)})

    def touch(self, received: list[tuple[str, str, str]], worker: str) -> None:
        """Note that ``worker`` holds these copies (``(key, task id, token)``): one round trip."""
        layout = self.ctx.layout
        self.ctx.pipelined(TOUCH, [([layout.key(DELAYED, key)], [task_id, token, worker])
                                for key, task_id, token in received])

    def alive(self, worker: str) -> list[str]:
        """``worker``'s sweeper runs: say so, and answer the workers alive now (one round trip on a
        standalone Redis). A worker gone for long is forgotten."""
        index = self.ctx.layout.index(WORKERS)
        now = due_ms(0)
        pipe = self.ctx.client.pipeline(transaction=False)
        pipe.zadd(index, {worker: now})
        pipe.zremrangebyscore(index, "-inf", now - ms(constants.DELAYED_KEEP))
        pipe.zrangebyscore(index, now - ms(constants.WORKER_GONE_AFTER), "+inf")
        return [text(w) for w in pipe.execute()[2]]

    def sent(self, key: str, task_id: str) -> None:
        """The copy was sent: look again a while later (the worker that receives it may die too;
        its start drops the run from the index)."""
        self.ctx.client.zadd(self.ctx.layout.index(DELAYED_DUE),
                             {_member(key, task_id): due_ms(constants.DELAYED_RECHECK)})

    def waiting(self, key: str, task_id: str) -> bool:
        """Whether a copy of the run still waits to start."""
        return copy_waits(self.ctx.client.hget(self.ctx.layout.key(DELAYED, key), task_id))
