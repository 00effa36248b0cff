"""The worker side, wired in one place: checks at start, the queue sweeper, and the main
process releasing the keys of pool children that ended without running their own ``finally``.

Nothing here happens on import. A guarded task's binding to its app calls :func:`install`,
which adds :class:`SingleFlightStep` to the app's worker blueprint (so only a worker of that app
runs it) and connects two receivers once per process; ``base=SingleFlightTask`` stays enough.

- **Start** (the step's ``__init__``, main process, before the pool forks): refuse a green pool
  (gevent, eventlet: :mod:`.pools`), record whether the worker sends task events (``-E`` is not
  in ``app.conf``), check the app as a whole (``join`` needs a result backend) and run the start
  checks against each lease Redis (:mod:`.preflight`).
  A refusal stops the worker with one sentence.
- **Fair tasks**: the worker also consumes its own queue (``<node name>.dq2``), where a fair
  slot freed in this worker is handed on (:mod:`..run.ownqueue`).
- **Metrics** (``singleflight_metrics``): counting starts in the main process before the pool
  forks, so that every pool process counts into the same directory (:mod:`..metrics`).
- **Each process that runs tasks** (a prefork child as it starts, or the main process of a solo
  or threads pool) starts its inbox listener at once (:mod:`..run.inbox`).
- **Running**: the queue sweeper thread (:mod:`.sweeper`), with the copies of delayed runs
  (:mod:`.copies`: ``task_received`` notes the delayed messages this worker holds) and the
  recovery of this worker node's journal (:mod:`.recovery`), which need the node's name; stopped
  with the worker.
- **Ends that run no code in the child** (SIGKILL, hard time limit, ``revoke(terminate=True)``):
  the main process gets ``task_failure`` (``WorkerLostError``, ``TimeLimitExceeded``) or
  ``task_revoked(terminated=True)`` with the task's arguments, renders the key and releases it,
  checking the lease is that child's (task id, this host, a process that is gone), then settles
  what the release hands back like every other release.
- **Revoked or expired before it ran** (``task_revoked``, terminated or not): the enqueue marker
  of a task with enqueue-time dedup is cleared if it is still that task's, so later sends go out.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import redis
from billiard.exceptions import WorkerLostError
from celery import bootsteps, current_app
from celery import signals as celery_signals
from celery.backends.base import DisabledBackend
from celery.exceptions import TimeLimitExceeded

from ..errors import ConfigurationError, LeaseLost, SingleFlightError
from ..metrics.exporter import start_worker_metrics
from ..policies.fair import FairShare
from ..run.events import send_task_event, set_worker_sends_task_events
from ..run.guard import options_store
from ..run.heartbeat import heartbeat_for
from ..run.lease import process_alive
from ..run.ownqueue import consume_own_queue
from ..run.settle import Ending, answer_orphaned_joined, settle
from .copies import copy_sweeps, forget_revoked, note_received
from .pools import check_pool, pool_name
from .preflight import run_at_worker_start
from .recovery import recovery_sweeps
from .registry import guarded_tasks, is_guarded
from .sweeper import Sweeper, sweeps_for

__all__ = ["SingleFlightStep", "check_worker_app", "forget_enqueued", "install", "release_for_ended_child"]

log = logging.getLogger("celery_singleflight.release")

_installed: set[int] = set()
_install_lock = threading.Lock()


def install(app: Any) -> None:
    """Wire the worker side for ``app`` (idempotent; called when a guarded task is bound)."""
    with _install_lock:
        if id(app) in _installed:
            return
        _installed.add(id(app))
        app.steps["worker"].add(SingleFlightStep)
        celery_signals.task_failure.connect(_on_task_failure, weak=False, dispatch_uid="singleflight-failure")
        celery_signals.task_revoked.connect(_on_task_revoked, weak=False, dispatch_uid="singleflight-revoked")
        celery_signals.task_received.connect(note_received, weak=False, dispatch_uid="singleflight-received")
        celery_signals.worker_process_init.connect(_listen_in_child, weak=False,
                                                   dispatch_uid="singleflight-listen")


def _listen_in_child(sender: Any = None, **_: Any) -> None:
    """A prefork pool process starts: its inbox listens before its first task, so that the first
    lease it holds is told at once too (:mod:`..run.inbox`)."""
    listen_for(current_app)  # the worker's app, made current before its pool forks


def listen_for(app: Any) -> None:
    """Start this process's inbox for the lease Redis of each of ``app``'s guarded tasks."""
    seen: set[int] = set()
    for task in guarded_tasks(app):
        try:
            store = options_store(task.options)
        except Exception as exc:  # noqa: BLE001 - a bad option fails the task itself, with its error
            log.debug("no inbox for %s: %s", task.name, exc)
            continue
        if id(store) not in seen:
            seen.add(id(store))
            heartbeat_for(store).listen()


def check_worker_app(app: Any) -> None:
    """Checks that need the worker's app as a whole; raises ConfigurationError.

    ``join`` needs a result backend. Tasks are shared between apps by default, so this is checked
    for the app the worker runs, not when a task is bound to any app.
    """
    joins = [task.name for task in guarded_tasks(app) if task.options.on_duplicate == "join"]
    if joins and isinstance(app.backend, DisabledBackend):
        raise ConfigurationError(
            f"on_duplicate='join' hands the holder's result to its duplicates, so tasks {', '.join(joins)}"
            " need a result backend: set result_backend (for example to your Redis)"
        )


class SingleFlightStep(bootsteps.StartStopStep):  # type: ignore[misc]  # celery ships no types
    """The library's worker bootstep (see the module docstring)."""

    label = "singleflight"

    def __init__(self, parent: Any, **kwargs: Any) -> None:
        super().__init__(parent, **kwargs)
        self.sweeper: Sweeper | None = None
        app = parent.app
        set_worker_sends_task_events(bool(getattr(parent, "task_events", False)))
        try:
            check_pool(getattr(parent, "pool_cls", None))
            check_worker_app(app)
            run_at_worker_start(app, parent)  # raises only for a refusal (ConfigurationError)
            start_worker_metrics(app)  # before the pool forks: its processes count too
            if any(isinstance(task.pipeline.stage(FairShare), FairShare) for task in guarded_tasks(app)):
                consume_own_queue(app, parent.hostname)  # before the pool forks and the consumer starts
        except ConfigurationError as exc:
            logging.getLogger("celery_singleflight").critical("%s", exc)
            raise SystemExit(f"celery_singleflight: {exc}") from exc

    def start(self, parent: Any) -> None:
        if pool_name(getattr(parent, "pool_cls", None)) in ("solo", "threads"):
            listen_for(parent.app)  # tasks run in this process (prefork children listen on their own)
        node = getattr(parent, "hostname", "")
        jobs = [*sweeps_for(parent.app), *copy_sweeps(parent.app, node), *recovery_sweeps(parent.app, node)]
        if jobs:
            self.sweeper = Sweeper(parent.app, jobs).start()

    def stop(self, parent: Any) -> None:
        if self.sweeper is not None:
            self.sweeper.stop()
            self.sweeper = None

    shutdown = stop


def release_for_ended_child(
    task: Any, task_id: str, args: Any, kwargs: Any, reason: str, *, doomed: bool,
    error: BaseException | None = None,
) -> bool:
    """Free the key of ``task_id`` (and its fair gate's slot) if a pool child of this host held
    it and ended.

    ``doomed``: the main process is killing that child itself (hard time limit, terminate), so
    its lease is released without waiting for it to exit (the kill comes after this signal).
    Otherwise the holder's process must already be gone.
    """
    if not is_guarded(task) or not task_id:
        return False
    gate = task.pipeline.stage(FairShare)
    if isinstance(gate, FairShare):
        _release_slot(task, gate.gate, gate.opts.fair_concurrency or 1, task_id, reason, doomed=doomed)
    try:
        key = task.render_key(*(args or ()), **(kwargs or {}))
    except (SingleFlightError, TypeError, ValueError, KeyError) as exc:
        log.warning("could not release the key of %s[%s] after %s: %s", task.name, task_id, reason, exc)
        return False
    return _release_slot(task, key, task.options.max_concurrency, task_id, reason, doomed=doomed, error=error)


def _release_slot(
    task: Any, key: str, slots: int, task_id: str, reason: str, *, doomed: bool,
    error: BaseException | None = None,
) -> bool:
    """Release the slot of ``key`` that ``task_id`` holds from a pool child of this host that ended."""
    opts, store = task.options, task.store
    try:
        host = socket.gethostname()
        slot, record = 0, None
        for slot in range(slots):
            record, _ = store.reads.held(key, slot)
            if record is not None and record.task_id == task_id and record.host == host:
                break
        else:
            if reason == "revoked":
                # the child released on SIGTERM and could only say "terminated"
                store.lease.revise_outcome(key, task_id, "terminated", "revoked")
            elif slots == 1:
                _answer_orphaned_joined(task, store, key, task_id, error or LeaseLost(
                    key, f"the run it joined released the key, then ended ({reason}) before answering"))
            return False
        pid = record.pid or 0
        if pid == os.getpid() or (not doomed and process_alive(pid)):
            return False  # the run itself is alive (threads/solo pool) and releases on its own
        settlement = store.release(
            key, record.token, reason, opts.ttl, fence=record.fence, slot=slot, slots=slots,
            clear_marker=task.pipeline.clears_marker, task_id=task_id,
        )
    except (redis.RedisError, TypeError, ValueError, KeyError) as exc:
        log.warning("could not release the key of %s[%s] after %s: %s", task.name, task_id, reason, exc)
        return False
    if settlement:
        log.warning("released key=%r of %s[%s]: its pool process %s ended without releasing (%s)",
                    key, task.name, task_id, pid, reason)
    settle(task.app, settlement, Ending(
        key, task.name, task_id, reason, error=error or LeaseLost(key, f"the run it joined ended: {reason}"),
        signal=bool(settlement),
    ))
    return bool(settlement.ours)


def _answer_orphaned_joined(task: Any, store: Any, key: str, task_id: str, error: BaseException) -> int:
    """The joined runs a pool process took with its release and never answered (it was killed
    between the two): see :func:`~.settle.answer_orphaned_joined`. Only if the release named in
    the key's record was this task's."""
    record = store.record(key)
    if not record.rt or task_id not in (record.task_id, record.prev_task_id):
        return 0
    return answer_orphaned_joined(task.app, task.backend, store, key, record.rt, task_id, error)


def _on_task_failure(
    sender: Any = None, task_id: str = "", exception: BaseException | None = None,
    args: Any = None, kwargs: Any = None, **_: Any,
) -> None:
    if isinstance(exception, (WorkerLostError, TimeLimitExceeded)):
        doomed = isinstance(exception, TimeLimitExceeded)
        reason = "time-limit" if doomed else "worker-lost"
        release_for_ended_child(sender, task_id, args, kwargs, reason, doomed=doomed, error=exception)


def _on_task_revoked(
    sender: Any = None, request: Any = None, terminated: bool = False, signum: Any = None, **_: Any
) -> None:
    if request is None:
        return
    if terminated:
        release_for_ended_child(
            sender, getattr(request, "id", ""), getattr(request, "args", None),
            getattr(request, "kwargs", None), "revoked", doomed=True,
        )
        if is_guarded(sender):
            _announce_revoked_state(sender, request, signum)
    forget_enqueued(sender, request)
    forget_revoked(sender, request)


def forget_enqueued(task: Any, request: Any) -> bool:
    """Clear the enqueue marker of a run that was revoked or expired (``request``), if the
    marker is still that task's, so the next send of its key goes out. Such a run may never reach
    the task's code, so nothing else clears it. Owner-checked, so it is safe to run twice and
    never clears another task's marker. True if it cleared one."""
    task_id = getattr(request, "id", None)
    if not is_guarded(task) or not task_id or not task.pipeline.clears_marker:
        return False
    try:
        args, kwargs = getattr(request, "args", None) or (), getattr(request, "kwargs", None) or {}
        key = task.render_key(*args, **kwargs)
        cleared = bool(task.store.marks.clear_enqueued(key, task_id))
    except (redis.RedisError, SingleFlightError, TypeError, ValueError, KeyError) as exc:
        log.warning("could not clear the enqueue marker of revoked %s[%s]: %s", task.name, task_id, exc)
        return False
    if cleared:
        log.info("cleared the enqueue marker of key=%r: %s[%s] was revoked or expired before it ran",
                 key, task.name, task_id)
    return cleared


def _announce_revoked_state(task: Any, request: Any, signum: Any) -> None:
    """Make Flower show REVOKED for a run that reported progress.

    Celery's event state ranks an unknown state such as PROGRESS above REVOKED, so its own
    ``task-revoked`` event only merges fields into a task that is PROGRESS. Fields of an event
    are applied as they are, so the same event with an explicit ``state`` sets it.
    """
    send_task_event(task.app, "task-revoked", getattr(request, "hostname", None), uuid=request.id,
                    terminated=True, signum=signum, expired=False, state="REVOKED")
