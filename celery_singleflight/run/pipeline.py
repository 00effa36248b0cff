"""A guarded task's run, as a pipeline of stages: the one place a run's steps are ordered.

``SingleFlightTask.__call__`` hands its run to :meth:`Pipeline.run`, and ``apply_async`` its send
to :meth:`Pipeline.send`. Between the stages' hooks (:mod:`.stage`) the pipeline does what every
run does: render the key, take the lease (one round trip; a duplicate goes to the duplicate
policy), begin holding it, run the body, and end it (release and settle, always, once, through
the :class:`~.guard.Guard`). A Redis outage before the lease follows ``on_redis_error``
(:mod:`.outage`).

Only the hooks a stage overrides are called, so a task without debounce, idempotency, rate
limit or order pays for none of them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import redis
from celery.exceptions import Ignore, Reject, Retry

from .. import constants, tracing
from ..connection.clients import is_unavailable
from ..errors import LockHeld, ProtocolMismatch
from ..protocol.replies import Acquired, Holder
from .guard import Guard
from .messages import HEADER_EARLIER, header
from .outage import redis_unavailable, refuse_foreign
from .settle import NO_RESULT
from .stage import AGAIN, Ended, Run, Send, Stage, overrides

__all__ = ["REQUEST_ATTR", "Pipeline"]

log_duplicate = logging.getLogger("celery_singleflight.duplicate")

#: the request attribute that holds the guard of the current run (``self.lease``, ``self.progress``)
REQUEST_ATTR = "singleflight_guard"

_HOOKS = ("send", "before_key", "before_lease", "skipped", "on_duplicate", "after_take", "on_start",
          "after_body", "finish")


def _with_key(exc: BaseException, key: str) -> None:
    """Name the key on a Redis error that is not an outage (a refused command, a script error)."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"celery_singleflight: Redis refused a command for key {key!r}; if it is NOPERM, the"
                     " Redis user's ACL lacks a command or key pattern the library needs (docs/isolation.md)")


class Pipeline:
    """The stages of one task, in run order, and the hooks each one overrides."""

    def __init__(self, stages: Sequence[Stage]) -> None:
        self.stages = tuple(stages)
        self.hooks: dict[str, tuple[Stage, ...]] = {
            hook: tuple(stage for stage in self.stages if overrides(stage, hook)) for hook in _HOOKS
        }
        self.clears_marker = any(stage.clears_marker for stage in self.stages)
        #: the errors the stages end a run with that are expected (the task's ``throws``)
        self.throws = tuple(error for stage in self.stages for error in stage.throws)
        self.policies: dict[str, Callable[..., Any]] = {}
        for stage in self.stages:
            self.policies.update(stage.policies())

    def stage(self, kind: type[Stage]) -> Stage | None:
        """The task's stage of class ``kind``, if it has one."""
        return next((stage for stage in self.stages if isinstance(stage, kind)), None)

    # -- apply_async ----------------------------------------------------------------------

    def send(self, call: Send) -> Any:
        """Publish ``call`` through every stage's ``send`` hook, in order."""
        senders = self.hooks["send"]

        def step(i: int, current: Send) -> Any:
            if i == len(senders):
                return current.publish(current)
            return senders[i].send(current, lambda nxt: step(i + 1, nxt))

        return step(0, call)

    # -- the run --------------------------------------------------------------------------

    def run(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], body: Callable[..., Any]) -> Any:
        """Run ``body`` under the lease of its key, through the stages (see the module docstring)."""
        run = Run(task, args, kwargs, self)
        try:
            ended = self._before_key(run, body)
            if ended is not None:
                run.outcome = "ended"
                return ended.result
            return self._under_lease(run, body)
        finally:
            for stage in self.hooks["finish"]:
                stage.finish(run, run.outcome)

    def _under_lease(self, run: Run, body: Callable[..., Any]) -> Any:
        """Take the key and run ``body`` under its lease (``run.outcome`` says how it ended)."""
        task, request, opts = run.task, run.request, run.options
        holder = Holder(run.task_id, request.hostname or "", task.name)
        guard = run.guard = Guard(task.app, run.key, opts, holder, sender=task.name,
                                  clear_marker=self.clears_marker, request=request, token=run.lease_token)
        try:
            ended = self._before_lease(run)
            if ended is not None:
                run.outcome = "ended"
                return ended.result
        except ProtocolMismatch as exc:  # nothing was taken
            return refuse_foreign(task, exc, run.args, run.kwargs)
        except redis.RedisError as exc:
            if not is_unavailable(exc):
                _with_key(exc, run.key)
                raise
            released = guard.forget_attempt()
            return redis_unavailable(task, run.key, exc, run.args, run.kwargs, guard.token, body, released)
        assert run.got is not None
        run.lease = guard.begin(run.got)
        setattr(request, REQUEST_ATTR, guard)
        result, error = NO_RESULT, None
        try:
            for stage in self.hooks["on_start"]:
                ended = stage.on_start(run)
                if ended is not None:
                    run.outcome, result = "succeeded", ended.result
                    return result
            result = body(*run.args, **run.kwargs)
            run.outcome = "succeeded"
            for stage in self.hooks["after_body"]:
                stage.after_body(run, result)
            return result
        except Retry as exc:  # a RetryAfter too: its release pauses the key and parks the run
            run.outcome, error = "retried", exc
            raise
        except Ignore:
            run.outcome = "ignored"
            raise
        except Reject:
            run.outcome = "rejected"
            raise
        except BaseException as exc:
            # SystemExit: the pool child was told to stop (revoke with terminate, shutdown)
            run.outcome = "failed" if isinstance(exc, Exception) else "terminated"
            error = exc
            raise
        finally:
            setattr(request, REQUEST_ATTR, None)
            guard.end(run.outcome, result=result, error=error, answer_joined=run.outcome != "retried")

    def _before_key(self, run: Run, body: Callable[..., Any]) -> Ended | None:
        """The stages before the key (debounce): an outage is reported for the stage's own key."""
        stages = self.hooks["before_key"]
        for stage in stages:
            try:
                ended = stage.before_key(run)
            except redis.RedisError as exc:
                key = stage.error_key(run)
                if not is_unavailable(exc):
                    _with_key(exc, key)
                    raise
                return Ended(redis_unavailable(run.task, key, exc, run.args, run.kwargs, "", body))
            if ended is not None:
                self._skip(run, stage)
                return ended
        return None

    def _before_lease(self, run: Run) -> Ended | None:
        """The stages before the lease, then the take (the duplicate policy when every slot is
        held); ``after_take`` hooks run whatever happened. ``run.got`` is the lease, or the
        duplicate policy's result."""
        try:
            for stage in self.hooks["before_lease"]:
                ended = stage.before_lease(run)
                if ended is not None:
                    self._skip(run, stage)
                    return ended
            return self._take(run)
        finally:
            for stage in self.hooks["after_take"]:
                stage.after_take(run)

    def _take(self, run: Run) -> Ended | None:
        """Take the key (``run.got``), or end the run as the duplicate policy decided."""
        guard = run.guard
        assert guard is not None
        earlier = str(header(run.request, HEADER_EARLIER) or "")
        for _ in range(constants.ACQUIRE_ATTEMPTS):
            got = guard.take(handoff=run.handoff, earlier=earlier)
            if isinstance(got, Acquired):
                run.got = got
                return None
            if got.copy:
                log_duplicate.info("%s[%s] on key=%r: this run was handed the key before; this copy of its"
                                   " message is dropped", run.task.name, run.task_id, run.key)
                raise Ignore()
            if run.handoff and got.holder != run.task_id:
                # a parked run whose turn has not come: its entry is still in the queue
                log_duplicate.info("%s[%s] stays parked on key=%r behind %s", run.task.name, run.task_id,
                                   run.key, got.holder)
                raise Ignore()
            # the decision's span links to the holder's (its trace context came with ``got``)
            with tracing.duplicate(run.options, run.key, got, self.throws) as span:
                for stage in self.hooks["on_duplicate"]:
                    decided = stage.on_duplicate(run, got)
                    if decided is not AGAIN:
                        return Ended(decided)
                if span is not None:
                    span.outcome("again")  # the key was free meanwhile: take it again
        raise LockHeld(run.key, None, None)

    def _skip(self, run: Run, ending: Stage) -> None:
        """``ending`` ended the run before the lease: tell the stages after it."""
        after = self.stages[self.stages.index(ending) + 1:]
        for stage in self.hooks["skipped"]:
            if stage in after:
                stage.skipped(run)
