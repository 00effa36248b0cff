"""The ``queue`` policy: duplicates wait in a per-key FIFO in Redis and run when it is their turn.

A duplicate parks itself (its own message, re-sendable, plus an entry ``task id|handoff token``)
and its worker slot is free at once: nothing sleeps, nothing polls. When the holder releases, the
same script reserves the lease for the first parked run and returns its message, which the
releaser sends to the broker; the parked run adopts the reservation when it starts. Its entry
leaves the queue only then, so a crash between the release and the send loses nothing.

A queue whose holder died without releasing (a lost host), or whose handoff message was never
sent, is resumed by :class:`QueueSweeper`: a thread in each worker's main process that checks the
namespace's *waiting index* (a sorted set of keys that have parked runs, scored by when the
holder's lease runs out) about once a second. Only keys with waiting runs are ever looked at. A
delayed (ETA) message would not do: with the Redis broker it is reserved by the worker that
fetched it and dies with that worker until the visibility timeout.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import redis
from celery import signals as celery_signals
from celery.canvas import Signature

from .lease import LeaseStore

__all__ = ["RESUME_GRACE", "QueueSweeper", "send_parked"]

log = logging.getLogger("celery_singleflight.queue")
#: how long after a holder's lease would run out its queue is checked
RESUME_GRACE = 0.5
SWEEP_INTERVAL = 1.0


def send_parked(app: Any, message: str, key: str) -> None:
    """Send the message of a parked run that was just handed ``key``."""
    try:
        Signature.from_dict(json.loads(message), app=app).apply_async()
    except Exception as exc:  # noqa: BLE001 - the reservation expires and the sweeper hands it on again
        log.error("could not send the next parked run for key=%r (it is handed on again once its"
                  " reservation expires): %s", key, exc)
        return
    log.debug("sent the next parked run for key=%r", key)


class QueueSweeper:
    """Resumes queues whose holder ended without handing the key on (see the module docstring)."""

    def __init__(
        self, app: Any, stores: list[tuple[LeaseStore, float, int]], interval: float = SWEEP_INTERVAL
    ):
        self.app = app
        self.stores = stores  # (store, lease TTL for a handoff reservation, slots per key)
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="singleflight-queue-sweeper", daemon=True)

    def start(self) -> QueueSweeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def sweep_once(self) -> int:
        """Check every due key once; return how many parked runs were sent."""
        sent = 0
        for store, ttl, slots in self.stores:
            for key in store.due_waiting():
                found = store.resume(key, ttl, RESUME_GRACE, slots)
                if found is None:
                    continue
                if found.handoff is not None:
                    log.warning("key=%r was free with runs parked (its holder ended without handing"
                                " it on); sending the next one", key)
                    send_parked(self.app, found.handoff, key)
                    sent += 1
                if found.joined:
                    from .errors import LeaseLost
                    from .joining import answer_joined

                    answer_joined(self.app, found.joined, key, "<gone>", error=LeaseLost(
                        key, "the run it joined ended without a result (its worker was lost)"))
        return sent

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sweep_once()
            except redis.RedisError as exc:
                log.warning("queue sweep failed, retrying: %s", exc)
            except Exception:
                log.exception("queue sweep failed")


_sweepers: list[QueueSweeper] = []


def _queue_stores(app: Any) -> list[tuple[LeaseStore, float, int]]:
    from .task import _options_store, guarded_tasks

    # every namespace, whatever its policies: besides queue and join, a turned-away redelivery
    # waits in the queue of its own run (SingleFlightTask._sf_park_redelivery)
    found: dict[tuple[int, str], tuple[LeaseStore, float, int]] = {}
    for task in guarded_tasks(app):
        opts = task.options
        store = _options_store(opts)
        key = (id(store.client), opts.namespace)
        _, ttl, slots = found.get(key, (store, 0.0, 1))
        # a namespace's keys are checked with its largest slot count (extra slots are free)
        found[key] = (store, max(opts.ttl, ttl), max(opts.max_concurrency, slots))
    return list(found.values())


def _on_worker_ready(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is None:
        return
    stores = _queue_stores(app)
    if stores:
        _sweepers.append(QueueSweeper(app, stores).start())


def _on_worker_shutdown(**_: Any) -> None:
    while _sweepers:
        _sweepers.pop().stop()


celery_signals.worker_ready.connect(_on_worker_ready, weak=False)
celery_signals.worker_shutdown.connect(_on_worker_shutdown, weak=False)
