"""A worker's own queue: where a fair slot freed in this worker is handed on.

When a run of a fair task ends, its release hands the gate's slot to the first waiting run,
whose message must be sent again. Sent to the task's queue, it would wait behind whatever the
broker holds there: after a burst, the whole backlog the main processes are still parking, so
the slot would sit reserved and idle for as long as that takes. Sent to this worker's own
queue (Celery's ``worker_direct`` queue, ``<node name>.dq2``, which only this worker consumes),
it reaches this worker's main process at once, and a free pool process of this worker runs it.

The worker's bootstep (main process, before the pool forks) adds that queue to the ones the
worker consumes when the worker has a fair task, and records it here, so the pool processes
know it. Nothing is lost if the message is: the slot stays reserved for the run until its lease
would run out, and a sweeper then hands it on again through the task's queue
(:mod:`..protocol.handoff`).
"""

from __future__ import annotations

from typing import Any

from celery.utils.nodenames import worker_direct
from kombu.entity import Queue

__all__ = ["consume_own_queue", "own_queue"]

#: this worker's own queue, once its bootstep consumes it (None elsewhere: the task's queue)
_own: Queue | None = None


def consume_own_queue(app: Any, node: str) -> Queue:
    """Consume worker ``node``'s own queue (before the consumer starts) and remember it for the
    processes this one forks."""
    global _own
    queue: Queue = worker_direct(node)
    app.amqp.queues.select_add(queue)
    _own = queue
    return queue


def own_queue() -> Queue | None:
    """This worker's own queue, or None outside a worker that consumes it."""
    return _own
