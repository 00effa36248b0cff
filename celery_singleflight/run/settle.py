"""Carry out what a release obliges: the one place every release path ends.

A release script frees the key, records the outcome and clears the enqueue marker atomically,
and answers with a :class:`~..protocol.replies.Settlement`: the parked run now handed the key (its message
must be sent), and the runs that joined the ended run (they must get its result or error).
:func:`settle` does both, then logs and signals the release. Every path calls it: a task's end,
a ``hold()``'s end, ``self.retry()``, the worker's main process for a dead child or a revoke, the
queue sweeper, a force-release, and an acquire that found the key free but handed it on.

Joined runs are answered as if they had run: the result (or error) is stored under their own
task id, so ``AsyncResult.get()`` returns the holder's value or raises its error, a
``task-succeeded`` / ``task-failed`` event is sent for Flower, and their callbacks and the rest
of their chain continue with that result.
"""

from __future__ import annotations

import json
import logging
import time as mod_time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery import states
from celery.app.task import Context
from celery.canvas import Signature

from .. import signals
from ..errors import LeaseLost
from ..metrics import hooks as metric_hooks
from ..metrics import record as metrics
from ..protocol.replies import Settlement
from .events import send_task_event
from .lost import end_dead_holder
from .messages import HEADER_HANDED, rejoined
from .ownqueue import own_queue

__all__ = ["NO_RESULT", "Ending", "answer_joined", "send_parked", "settle"]

log_release = logging.getLogger("celery_singleflight.release")
log_queue = logging.getLogger("celery_singleflight.queue")
log_join = logging.getLogger("celery_singleflight.join")

#: the ``result`` of an :class:`Ending` that has none (an error, or no value to hand on)
NO_RESULT: Any = object()


@dataclass(frozen=True)
class Ending:
    """How a run ended, as far as its release's duties need to know.

    ``sender``: the task name (``hold``, ``sweeper``, ``operator`` for the other paths), the sender
    of the ``lease_released`` signal. ``holder``: the ended run's task id. ``result`` is what the
    joined runs get when it is given; otherwise ``error`` (by default a :class:`LeaseLost` naming
    the outcome). ``signal``: False for a hand-on that released nothing (an acquire, a sweep).
    """

    key: str
    sender: str
    holder: str
    outcome: str
    result: Any = NO_RESULT
    error: BaseException | None = None
    lease: Any = None
    signal: bool = True
    rerun_joined: bool = False
    #: the handed-on run goes to this worker's own queue, if it has one (a fair slot freed here)
    here: bool = False

    def answer(self) -> tuple[Any, BaseException | None]:
        """(result, error) for the joined runs: the result only if the run succeeded with one.

        An ending that is not an error of the task (SystemExit when a revoke terminated it, a
        KeyboardInterrupt) is never handed on as such: a caller's ``.get()`` would raise it."""
        if self.error is None and self.result is not NO_RESULT and self.outcome == "succeeded":
            return self.result, None
        if isinstance(self.error, Exception):
            return None, self.error
        why = f"the run it joined ended as {self.outcome} without a result"
        return None, LeaseLost(self.key, why)


def settle(app: Any, settlement: Settlement, ending: Ending) -> None:
    """Send the handed-on parked run, answer the joined runs, end the dead holders whose slots
    were replaced, then log and signal the release."""
    for dead in settlement.dead:
        end_dead_holder(app, ending.key, dead.task_id, dead.worker, dead.task_name)
    if settlement.handoff is not None:
        send_parked(app, settlement.handoff, ending.key, here=ending.here)
    if settlement.joined and ending.rerun_joined:
        for message in settlement.joined:
            send_parked(app, rejoined(message), ending.key)
    elif settlement.joined:
        result, error = ending.answer()
        answer_joined(app, settlement.joined, ending.key, ending.holder, result=result, error=error)
    if ending.signal:
        log_release.debug("released key=%r %s[%s] (%s)", ending.key, ending.sender, ending.holder,
                          ending.outcome)
        signals.lease_released.send(sender=ending.sender, lease=ending.lease, reason=ending.outcome)
        if metrics.recording():
            metric_hooks.released(ending.sender, ending.lease)


def send_parked(app: Any, message: str, key: str, *, here: bool = False) -> None:
    """Send the message of a parked run that was just handed ``key``: to the task's queue, or
    with ``here`` to this worker's own queue if it has one (:mod:`.ownqueue`)."""
    try:
        data = json.loads(message)
        options = data.setdefault("options", {})
        options["headers"] = {**(options.get("headers") or {}), HEADER_HANDED: mod_time.time()}
        queue = own_queue() if here else None
        if queue is not None:
            # the route it came by would win over the queue's: only the queue routes it
            for name in ("exchange", "routing_key", "queue"):
                options.pop(name, None)
            options["queue"] = queue
        Signature.from_dict(data, app=app).apply_async()
    except Exception as exc:  # noqa: BLE001 - the reservation runs out and the sweeper hands it on again
        log_queue.error("could not send the next parked run for key=%r (it is handed on again once its"
                        " reservation runs out): %s", key, exc)
        return
    log_queue.debug("sent the next parked run for key=%r", key)


def answer_joined(
    app: Any, messages: Sequence[str], key: str, holder_id: str, *, result: Any = None,
    error: BaseException | None = None, label: str = "joined run",
) -> None:
    """Give each joined run (``messages``) the holder's ``result``, or its ``error``. (Also
    how the ``coalesce`` policy ends the runs it replaced: ``label`` names them in the log.)"""
    for message in messages:
        try:
            _answer(app, json.loads(message), key, holder_id, result, error, label)
        except Exception:
            log_join.exception("could not answer a %s of key=%r", label, key)


def _answer(
    app: Any, data: dict[str, Any], key: str, holder_id: str, result: Any, error: BaseException | None,
    label: str = "joined run",
) -> None:
    options = data.get("options") or {}
    task_id = options.get("task_id")
    name = data.get("task")
    if not task_id:
        return
    task = app.tasks.get(name)
    backend = task.backend if task is not None else app.backend
    request = Context({
        "id": task_id, "task": name, "chord": options.get("chord"), "group": options.get("group_id"),
        "group_index": options.get("group_index"), "args": data.get("args"), "kwargs": data.get("kwargs"),
        "reply_to": options.get("reply_to"), "root_id": options.get("root_id"),
        "parent_id": options.get("parent_id"),
        # as the tracer would: on an error Celery fails the rest of the chain and calls the
        # errbacks (in whichever signature style they are written)
        "chain": options.get("chain"), "errbacks": options.get("link_error"), "delivery_info": {},
    })
    if error is None:
        backend.mark_as_done(task_id, result, request=request)
        log_join.info("%s %s[%s] on key=%r answered with the result of %s",
                      label, name, task_id, key, holder_id)
        send_task_event(app, "task-succeeded", uuid=task_id, state=states.SUCCESS, result=repr(result)[:1024],
                        runtime=0.0)
        for link in options.get("link") or ():
            Signature.from_dict(link, app=app).apply_async((result,))
        chain = options.get("chain")
        if chain:
            nxt = Signature.from_dict(chain[-1], app=app)
            nxt.apply_async((result,), chain=chain[:-1])
    else:
        backend.mark_as_failure(task_id, error, request=request, call_errbacks=True)
        log_join.info("%s %s[%s] on key=%r answered with the error of %s: %r",
                      label, name, task_id, key, holder_id, error)
        send_task_event(app, "task-failed", uuid=task_id, state=states.FAILURE, exception=repr(error),
                        traceback="")


def answer_orphaned_joined(
    app: Any, backend: Any, store: Any, key: str, token: str, holder_id: str, error: BaseException
) -> int:
    """Answer the joined runs that the release of ``token`` took and nobody answered: its process
    was killed between the release and :func:`settle`. The release moved them out of the key's
    join list into the record of what it handed over, where no sweep looks. Only runs whose
    result is not ready are answered (a run the releaser did answer keeps its answer)."""
    waiting = []
    for message in store.handoff.settled_joined(key, token):
        joined_id = (json.loads(message).get("options") or {}).get("task_id")
        if joined_id and backend.get_task_meta(joined_id).get("status") not in states.READY_STATES:
            waiting.append(message)
    if waiting:
        log_join.warning("key=%r: %d run(s) joined to %s were not answered (its process ended after"
                         " releasing); answering them with %r", key, len(waiting), holder_id, error)
        answer_joined(app, waiting, key, holder_id, error=error)
    return len(waiting)
