"""A worker's part in keeping delayed runs (:mod:`..run.delay`): it notes which delayed messages it
holds, says each second that it is alive, and sends the copies whose messages a gone worker held.

A countdown message waits in the worker that received it until its time. If that worker is busy,
the message starts late but is not lost; if it died, the message is gone until the broker's
visibility timeout. So the main process notes, when it receives a delayed run's message
(Celery's ``task_received``), that it holds it (``TOUCH``, from a thread of its own, so the
consumer never waits on Redis), and the sweeper of every worker sends a copy only once no worker
that received one of the run's messages is alive.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import redis

from .. import constants
from ..protocol.delayed import Claim
from ..protocol.store import LeaseStore
from ..run.delay import delayed_token, send_copy
from ..run.guard import options_store
from ..run.owner import worker_instance
from ..run.stage import Sweep
from .registry import guarded_tasks, is_guarded

__all__ = ["SendCopies", "copy_sweeps", "forget_revoked", "note_received"]

log = logging.getLogger("celery_singleflight.queue")

_received: queue.SimpleQueue[tuple[LeaseStore, str, str, str, str]] = queue.SimpleQueue()
_noting: list[threading.Thread] = []
_lock = threading.Lock()


def note_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    """``task_received`` (main process): a delayed run's message arrived here; note it soon."""
    task = getattr(request, "task", None)
    if task is None or not is_guarded(task):
        return
    found = delayed_token(_HeadersOf(request))
    if found is None:
        return
    token, key = found
    worker = worker_instance(request.hostname)
    _received.put((options_store(task.options), key, str(request.id), token, worker))
    if not _noting:
        with _lock:
            if not _noting:
                thread = threading.Thread(target=_note_forever, name="singleflight-noter", daemon=True)
                _noting.append(thread)
                thread.start()


def forget_revoked(task: Any, request: Any) -> None:
    """A delayed run's message was revoked or expired (the worker drops it without running any
    code of the task): claim its copy with that message's token and say it ended, so that no
    copy of it runs."""
    found = delayed_token(_HeadersOf(request)) if is_guarded(task) else None
    if found is None:
        return
    token, key = found
    try:
        options_store(task.options).delayed.done(Claim(key, str(request.id), token))
    except redis.RedisError as exc:
        log.warning("could not drop the copy of revoked %s[%s] on key=%r: %s", task.name, request.id, key,
                    exc)


class _HeadersOf:
    """A received request's headers as :func:`..run.messages.header` reads them."""

    def __init__(self, request: Any) -> None:
        self.headers = getattr(request, "request_dict", None) or {}


def _note_forever() -> None:
    while True:
        batch = [_received.get()]
        while not _received.empty() and len(batch) < 500:
            batch.append(_received.get_nowait())
        by_store: dict[tuple[int, str], tuple[LeaseStore, list[tuple[str, str, str]]]] = {}
        for store, key, task_id, token, worker in batch:
            by_store.setdefault((id(store), worker), (store, []))[1].append((key, task_id, token))
        for (_, worker), (store, received) in by_store.items():
            try:
                store.delayed.touch(received, worker)
            except redis.RedisError as exc:  # its copy is then sent the unseen grace after it was due
                log.warning("could not note %d delayed message(s) this worker holds: %s", len(received), exc)


class SendCopies(Sweep):
    """Say this worker is alive; send the copies of delayed runs whose messages no live worker holds."""

    def __init__(self, app: Any, store: LeaseStore, worker: str) -> None:
        self.app, self.store, self.worker = app, store, worker

    def sweep_once(self) -> int:
        alive = self.store.delayed.alive(self.worker)
        sent = 0
        for key, task_id in self.store.delayed.due():
            try:
                sent += send_copy(self.app, self.store, key, task_id, alive)
            except redis.RedisError:
                raise
            except Exception:  # one copy that cannot be sent must not hold up the others
                log.exception("key=%r: the copy of delayed run %s cannot be sent; trying again later", key,
                              task_id)
                self.store.delayed.look_again(key, task_id, constants.DELAYED_RECHECK * 5)
        return sent


def copy_sweeps(app: Any, worker: str) -> list[Sweep]:
    """One :class:`SendCopies` per namespace of the app's guarded tasks (``worker``: the node name)."""
    found: dict[tuple[int, str], LeaseStore] = {}
    for task in guarded_tasks(app):
        store = options_store(task.options)
        found[(id(store.client), task.options.namespace)] = store
    return [SendCopies(app, store, worker_instance(worker)) for store in found.values()]
