"""The stage every guarded task has for runs the library delayed (:mod:`..run.delay`): a delayed
run claims its copy in Redis when it starts, so that of its countdown message and a copy a
sweeper sent again (:mod:`..worker.copies`), one runs.

The claim keeps the copy until the run says it started (under its lease, before its body: in the
same round trip as its entry in the started index, :mod:`.lostruns`) or ended before it started
(:meth:`DelayedCopies.finish`). A run whose claim a sweeper took back meanwhile (its worker was
seen gone, or it took too long) does not start: the copy sent again runs instead.
"""

from __future__ import annotations

import logging
from typing import Any

import redis
from celery.exceptions import Ignore

from ..run.delay import STALE, claim, claim_done, delayed_token
from ..run.messages import HEADER_EARLIER
from ..run.outage import retry_later
from ..run.stage import Ended, Run, Stage

__all__ = ["DelayedCopies", "started"]

log = logging.getLogger("celery_singleflight.queue")


class DelayedCopies(Stage):
    """Claims a delayed run's copy before anything else looks at the run."""

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls()

    def before_key(self, run: Run) -> Ended | None:
        if run.eager:
            return None
        got = claim(run.task.store, run.request, run.lease_token)
        if got == STALE:
            log.info("%s[%s]: another copy of this delayed run runs or ran; this one is dropped",
                     run.task.name, run.task_id)
            raise Ignore()
        run.claim = None if isinstance(got, str) else got
        return None

    def error_key(self, run: Run) -> str:
        found = delayed_token(run.request)
        return found[1] if found else run.key

    def finish(self, run: Run, outcome: str) -> None:
        """The run ended before it started (parked, delayed again, turned away, failed ...): its
        copy is no longer needed. Best effort: if Redis cannot be reached, a sweeper takes the
        claim back later, and the copy it sends finds the run's new state."""
        pending, run.claim = run.claim, None
        if pending is None:
            return
        try:
            claim_done(run.task.store, pending)
        except redis.RedisError as exc:
            log.warning("%s[%s]: could not say its delayed copy on key=%r is no longer needed: %s",
                        run.task.name, run.task_id, pending.key, exc)


def started(run: Run, before: Any = None) -> None:
    """The run starts (under its lease, before its body): its claimed copy is done, in one round
    trip with ``before(pipe)`` (its entry in the started index, which then watches it). Raises
    ``Ignore`` if a sweeper took the claim back (the copy sent again runs instead). If Redis could
    not be told, whether the claim is done is unknown: the run does not start, and is sent again
    as ``fail_closed`` sends it, whatever ``on_redis_error`` says (same message and token: of it and
    the copy a sweeper may send, one runs; it takes this lease over if it is still there).
    Without a claim, ``before`` runs alone and its Redis errors propagate."""
    pending, run.claim = run.claim, None
    if pending is None:
        if before is not None:
            before(run.task.store.client)
        return
    try:
        done = claim_done(run.task.store, pending, before)
    except redis.RedisError as exc:
        log.warning("%s[%s] on key=%r does not start: Redis could not be told it starts (%s)", run.task.name,
                    run.task_id, run.key, exc)
        retry_later(run.task, run.key, exc, run.args, run.kwargs, **{HEADER_EARLIER: run.lease_token})
    if not done:
        log.warning("%s[%s] on key=%r does not start: its claim on its delayed copy was taken back (its"
                    " worker was seen gone, or it took too long) and the copy sent again runs instead",
                    run.task.name, run.task_id, run.key)
        raise Ignore()
