"""The worker's main process parks the runs of a fair task that must wait, as their messages
arrive: a waiting run holds no pool process, and the broker's backlog drains into the fair
gate's queue at the speed of one Redis round trip per message, not at the speed of the runs.

Celery's main process sees every message first: a task's *strategy* turns a message into a
request for the pool. A fair task's strategy (:func:`strategy`, Celery's ``Task.Strategy``)
enters the run at its task's gate first (:mod:`..protocol.fair`). A run that may start goes on to
the pool as usual, its slot reserved for it; a run that must wait is parked in Redis, its state
``QUEUED`` with its position and ETA, and its message acknowledged. Nothing is lost if this
process dies in between: an unacknowledged message comes again and finds itself parked.

A countdown message, an old protocol's, or one this process cannot read is left to the pool
process, whose stage (:mod:`..policies.fair`) parks it the same way. A Redis error here too: the
pool process then follows ``on_redis_error``, and this process leaves the next
:data:`LOOK_AGAIN_AFTER` seconds of messages to the pool, so that its event loop (which also
serves the broker and the pool) is not held up by a Redis that does not answer.
"""

from __future__ import annotations

import logging
import time as mod_time
from collections.abc import Callable
from typing import Any

from celery.app.task import Context
from celery.worker.strategy import default

from ..policies.fair import RESENT_HEADERS, FairShare
from ..protocol.fair import Waiting, fair_token
from ..run.messages import HEADER_FAIR_WAITED, message_of
from .registry import is_guarded

__all__ = ["LOOK_AGAIN_AFTER", "strategy"]

log = logging.getLogger("celery_singleflight.queue")

#: after a Redis error, how long the main process leaves the gate to the pool processes (seconds)
LOOK_AGAIN_AFTER = 5.0


def strategy(task: Any, app: Any, consumer: Any, **kwargs: Any) -> Callable[..., Any]:
    """Celery's strategy for ``task``, and for a fair task, its main process's look first."""
    handler: Callable[..., Any] = default(task, app, consumer, **kwargs)
    stage = task.pipeline.stage(FairShare) if is_guarded(task) else None
    if not isinstance(stage, FairShare):
        return handler
    errors = consumer.connection_errors
    resting_until = 0.0

    def fair_handler(message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **rest: Any) -> Any:
        nonlocal resting_until
        parked = False
        if mod_time.monotonic() >= resting_until:
            try:
                parked = park(task, stage, message, consumer.hostname)
            except Exception as exc:  # noqa: BLE001 - the pool process decides: it parks, or follows on_redis_error
                log.warning("%s: the worker's main process could not look at the fair gate (its pool"
                            " processes do for %.0fs): %s", task.name, LOOK_AGAIN_AFTER, exc)
                resting_until = mod_time.monotonic() + LOOK_AGAIN_AFTER
        if parked:
            # at once, not through Celery's ack promise: that one waits for the event loop's next
            # turn, which a worker with nothing else to do takes only at its poll timeout, so the
            # broker, held to the prefetch count, would send the next message that much later
            message.ack_log_error(log, errors)
            return None
        return handler(message, body, ack, reject, callbacks, **rest)

    return fair_handler


def park(task: Any, stage: FairShare, message: Any, node: str) -> bool:
    """Enter the run of ``message`` at its gate (worker ``node``'s main process): True if it was
    parked (acknowledge it)."""
    headers = message.headers or {}
    if "id" not in headers or headers.get("eta") or headers.get(HEADER_FAIR_WAITED):
        # protocol 1, or a countdown: the pool process looks when it is due; a run that waited
        # here is sent again when a release handed it a slot: its pool process adopts it
        return False
    args, kwargs, embed = message.decode()
    task_id = str(headers["id"])
    marks = [headers.get(name) for name in RESENT_HEADERS]
    token = fair_token(task_id, int(headers.get("retries") or 0), marks)
    keeps_result = not (headers.get("ignore_result") or task.ignore_result)

    def body() -> str:
        request = _request(message, headers, args, kwargs, embed)
        parked_at = repr(mod_time.time())
        return message_of(task, tuple(args), dict(kwargs), request, **{HEADER_FAIR_WAITED: parked_at})

    fair = stage.fair_key(args, kwargs)
    found = stage.wait(task, task_id, token, fair, keeps_result, body, str(node or ""))
    return isinstance(found, Waiting)


def _request(message: Any, headers: dict[str, Any], args: Any, kwargs: Any, embed: Any) -> Any:
    """The request a pool process would see for ``message`` (what re-sending it needs)."""
    properties = message.properties or {}
    delivery = message.delivery_info or {}
    data = {
        **headers,
        "properties": properties,
        "reply_to": properties.get("reply_to"),
        "correlation_id": properties.get("correlation_id"),
        "delivery_info": {"exchange": delivery.get("exchange"), "routing_key": delivery.get("routing_key"),
                          "priority": properties.get("priority")},
        **(embed or {}),
    }
    return Context(data, args=args, called_directly=False, kwargs=kwargs)
