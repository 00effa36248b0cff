"""Delayed runs kept in Redis: a run the library delays (``debounce``, ``key_rate_limit``, the
``retry`` policy) is sent as a countdown message *and* copied into its key's ``delayed`` hash.

The countdown message is the fast path: the worker that fetched it starts it at its due time.
With the Redis broker that worker holds the message unacknowledged, so if it dies the message
comes back only after the visibility timeout (an hour by default). The copy is the guarantee:
a worker's sweeper finds a run whose message has not started :data:`~..constants.DELAYED_GRACE`
after its due time (the namespace's *delayed index*) and sends the copy (``RESEND``). Every
message of a delayed run carries a token; when one starts it *claims* the run (``CLAIM``), so of
the countdown message and the copies sent again, exactly one runs: a late one is stale.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import redis

from .. import constants
from .context import Feature, due_ms, ms, text
from .layout import Part, duration
from .lua import Replies, Script

__all__ = [
    "CLAIM", "DELAY", "DELAYED", "DELAYED_DUE", "DELAYED_ENDS", "RESEND", "SCRIPTS", "TOUCH", "WORKERS",
    "ClaimReply", "DelayReply", "DelayedCalls", "ResendReply", "TouchReply", "copy_waits",
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


class ClaimReply(Replies):
    GO = 1, "{GO}: this copy runs (also when no copy is known)"
    STALE = 2, "{STALE}: another copy runs or ran: drop this one"
    GO_LATE = 3, "{GO_LATE}: this copy runs; the run was sent again by a sweeper, late"


class TouchReply(Replies):
    IGNORED = 0, "{IGNORED}: the run started already, or the token is not one of its copies"
    NOTED = 1, "{NOTED}: the worker that holds this copy is noted"


class ResendReply(Replies):
    GONE = 0, "{GONE}: it started (or is unknown): forget it"
    NOT_DUE = 1, "{NOT_DUE, ms}: not due, or a live worker holds a copy: look again then"
    RESEND = 2, "{RESEND, message, headers (JSON) or ''}: send it again with the new token"


_LIBS = ("shared/common.lua", "delayed/delayed.lua")
_LUA = dict(constants.LUA_CONSTANTS)
DELAY = Script("DELAY", "delayed/delay.lua", _LIBS, replies=(DelayReply,), constants=_LUA)
CLAIM = Script("CLAIM", "delayed/claim.lua", _LIBS, replies=(ClaimReply,), constants=_LUA)
RESEND = Script("RESEND", "delayed/resend.lua", _LIBS, replies=(ResendReply,), constants=_LUA)
TOUCH = Script("TOUCH", "delayed/touch.lua", _LIBS, replies=(TouchReply,), constants=_LUA)
SCRIPTS = (DELAY, CLAIM, RESEND, TOUCH)


def copy_waits(raw: Any) -> bool:
    """Whether a run's entry (as HGET read it) still holds a copy that waits to start."""
    return raw is not None and "m" in json.loads(raw)


def _member(key: str, task_id: str) -> str:
    return json.dumps([key, task_id])


class DelayedCalls(Feature):
    """The calls of delayed runs."""

    __slots__ = ()

    def delay(self, key: str, task_id: str, token: str, message: str, countdown: float, *,
              restore: bool = False) -> float:
        """Keep a copy of a run delayed by ``countdown`` seconds, whose countdown message carries
        ``token``, and enter it in the delayed index (one round trip). ``restore``: put back a
        copy Redis lost, only if the run has no entry now. Returns its due time (epoch seconds,
        the server's clock)."""
        args = [task_id, token, message, ms(countdown) if countdown > 0 else 0, "1" if restore else ""]
        reply = self.with_index(DELAY, self.keys(key), args, key, task_id, countdown)
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
        return self._pipelined(script, [(keys, args)], lambda pipe: pipe.zadd(index, {member: look}))[0]

    def _pipelined(self, script: Script, calls: list[tuple[list[str], list[Any]]],
                   then: Callable[[Any], Any] | None = None) -> list[Any]:
        """``script`` once per ``(keys, args)`` of ``calls``, then ``then(pipe)``, in one pipeline
        (one round trip; a script Redis does not know yet is loaded and run again, which is safe).
        A Cluster's pipelines refuse scripts: there each is one call. The scripts' replies."""
        called = self.ctx.script(script)
        if self.ctx.cluster:
            replies: list[Any] = [called(keys=keys, args=args) for keys, args in calls]
            if then is not None:
                then(self.ctx.client)
            return replies
        pipe = self.ctx.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(called.sha.decode(), len(keys), *keys, *args)
        if then is not None:
            then(pipe)
        replies = pipe.execute(raise_on_error=False)[: len(calls)]
        for i, ((keys, args), reply) in enumerate(zip(calls, replies, strict=True)):
            if isinstance(reply, redis.exceptions.NoScriptError):
                replies[i] = called(keys=keys, args=args)  # loads it
            elif isinstance(reply, Exception):
                raise reply
        return replies

    def claim(self, key: str, task_id: str, token: str) -> ClaimReply:
        """A delayed run's message starts: does this copy run (GO, GO_LATE: it was sent again
        late), or is it STALE (another copy runs or ran)?"""
        layout = self.ctx.layout
        reply = self.ctx.script(CLAIM)(keys=self.keys(key), args=[task_id, token])
        code = ClaimReply(int(reply[0]))
        if code != ClaimReply.STALE:
            self.ctx.client.zrem(layout.index(DELAYED_DUE), _member(key, task_id))
        return code

    def due(self, limit: int = 100) -> list[tuple[str, str]]:
        """``(key, task id)`` of the delayed runs to look at now."""
        raw: Any = self.ctx.client.zrangebyscore(self.ctx.layout.index(DELAYED_DUE), "-inf", due_ms(0),
                                                 start=0, num=limit)
        found: list[tuple[str, str]] = []
        for member in raw:
            key, task_id = json.loads(text(member))
            found.append((str(key), str(task_id)))
        return found

    def resend(self, key: str, task_id: str, token: str,
               alive: list[str]) -> tuple[str, dict[str, Any]] | None:
        """The message to send again under ``token`` and the headers it must carry besides, or
        None (it started; it is not due; or a worker in ``alive`` holds a copy: the index is
        updated either way)."""
        layout = self.ctx.layout
        reply = self.ctx.script(RESEND)(keys=[layout.key(DELAYED, key)], args=[task_id, token, *alive])
        code = int(reply[0])
        if code == ResendReply.RESEND:
            headers = text(reply[2])
            return text(reply[1]), (json.loads(headers) if headers else {})
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
        self._pipelined(TOUCH, [([layout.key(DELAYED, key)], [task_id, token, worker])
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
