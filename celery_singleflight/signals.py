"""Celery signals sent by celery_singleflight. Connect like any Celery signal.

Senders are task names (strings), so receivers can filter with ``sender="proj.tasks.sync"``.
``duplicate``'s ``outcome`` is a stable code (skipped, raised, retry, queued, queue-full, joined,
redelivery, remembered, coalesced, superseding, superseded); its ``detail`` is a sentence for
people. ``lease_superseded`` is sent in the superseded run's process when it learns a newer run
(``by``) took over; ``order_gap_skipped`` in a worker's main process (sender: the key) when
sequence numbers of an ``ordered=True`` key that never arrived are skipped.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "duplicate",
    "lease_acquired",
    "lease_force_released",
    "lease_lost",
    "lease_released",
    "lease_superseded",
    "order_gap_skipped",
    "queue_timeout",
    "unguarded_run",
]

lease_acquired = Signal(name="singleflight_lease_acquired", providing_args={"lease"})
lease_released = Signal(name="singleflight_lease_released", providing_args={"lease", "reason"})
lease_lost = Signal(name="singleflight_lease_lost", providing_args={"lease", "reason"})
duplicate = Signal(
    name="singleflight_duplicate",
    providing_args={"key", "task_id", "holder", "ttl_left", "policy", "outcome", "detail"},
)
unguarded_run = Signal(name="singleflight_unguarded_run", providing_args={"key", "task_id", "error"})
lease_force_released = Signal(
    name="singleflight_lease_force_released", providing_args={"key", "task_id", "fence", "by"}
)
lease_superseded = Signal(name="singleflight_lease_superseded", providing_args={"lease", "by"})
order_gap_skipped = Signal(
    name="singleflight_order_gap_skipped", providing_args={"key", "sequences", "waited"}
)
#: a run waited longer than its ``queue_timeout`` to start: it ends FAILURE with QueueTimeout
queue_timeout = Signal(
    name="singleflight_queue_timeout", providing_args={"key", "task_id", "waited", "timeout"}
)
