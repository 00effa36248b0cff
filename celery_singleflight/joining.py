"""The ``join`` policy: a duplicate does not run; it gets the holder's result (or error) as its own.

A joining run stores its own message in the key's ``joined`` list and frees its worker slot at
once (its state is ``JOINED`` meanwhile). When the holder's run ends, the release script hands the
list back to the releaser, which answers each joined run here: its result is stored under its
own task id (so ``AsyncResult.get()`` returns the holder's value, or raises its error), a
``task-succeeded`` / ``task-failed`` event is sent for Flower, and its callbacks and the rest of
its chain continue with that result, as if it had run. If the holder's pool process dies, the
worker's main process answers with the error; if the whole host dies, the queue sweeper does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from celery import states
from celery.app.task import Context
from celery.canvas import Signature

from .worker_setup import worker_sends_task_events

__all__ = ["answer_joined"]

log = logging.getLogger("celery_singleflight.join")


def answer_joined(
    app: Any, messages: Sequence[str], key: str, holder_id: str, *, result: Any = None,
    error: BaseException | None = None,
) -> None:
    """Give each joined run (``messages``) the holder's ``result``, or its ``error``."""
    for message in messages:
        try:
            _answer(app, json.loads(message), key, holder_id, result, error)
        except Exception:
            log.exception("could not answer a run joined to key=%r", key)


def _answer(
    app: Any, data: dict[str, Any], key: str, holder_id: str, result: Any, error: BaseException | None
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
        log.info("joined run %s[%s] on key=%r answered with the result of %s", name, task_id, key, holder_id)
        _event(app, "task-succeeded", task_id, result=repr(result)[:1024], runtime=0.0)
        for link in options.get("link") or ():
            Signature.from_dict(link, app=app).apply_async((result,))
        chain = options.get("chain")
        if chain:
            nxt = Signature.from_dict(chain[-1], app=app)
            nxt.apply_async((result,), chain=chain[:-1])
    else:
        backend.mark_as_failure(task_id, error, request=request, call_errbacks=True)
        log.info("joined run %s[%s] on key=%r answered with the error of %s: %r",
                 name, task_id, key, holder_id, error)
        _event(app, "task-failed", task_id, exception=repr(error), traceback="")


def _event(app: Any, type_: str, task_id: str, **fields: Any) -> None:
    if not worker_sends_task_events():
        return
    try:
        with app.events.default_dispatcher() as dispatcher:
            dispatcher.send(type_, uuid=task_id, state=states.SUCCESS if type_ == "task-succeeded"
                            else states.FAILURE, **fields)
    except Exception as exc:  # noqa: BLE001 - an event must never break the answer
        log.debug("could not send %s for %s: %s", type_, task_id, exc)
