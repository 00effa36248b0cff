"""Fair share (``fair_key="<tenant_id>"``, ``fair_concurrency=N``): at most N runs of the task at
once across all workers, the freed slots handed round robin across fair keys, by weight.

The gate and its fair queue are :mod:`..protocol.fair`'s. The worker's main process parks a
run that must wait as its message arrives (:mod:`..worker.fairpark`); this stage is the pool
process's side: it takes the gate before the lock key (adopting the slot reserved for the run),
parks a run that came without the main process's look (a countdown message, a lost race), ends
a run that waited longer than ``queue_timeout`` as ``FAILURE`` with :class:`~..errors.QueueTimeout`,
and releases the gate when the run ends, whatever the end. The lock key still excludes; the fair
key only shares.
"""

from __future__ import annotations

import logging
import math
import time as mod_time
from collections.abc import Callable
from typing import Any

import redis
from celery import states as celery_states
from celery.exceptions import Ignore

from .. import constants, signals
from ..config.option import Option, OptionGroup, Resolving, anything, count, seconds
from ..errors import ConfigurationError, LockHeld, QueueTimeout
from ..keys import KeyFunction, compile_key
from ..protocol.fair import Admitted, Waiting, fair_token, gate_key
from ..protocol.replies import Acquired, Holder, Settlement
from ..run.guard import Guard
from ..run.journal import journal_waiting, new_mark
from ..run.messages import (
    HEADER_ATTEMPT,
    HEADER_DELAYED,
    HEADER_FAIR_WAITED,
    HEADER_HANDOFF,
    HEADER_REJOIN,
    header,
    message_of,
)
from ..run.settle import Ending, settle
from ..run.stage import Ended, Run, Stage, Sweep
from ..states import QUEUED
from .lostruns import watch_take

__all__ = ["RESENT_HEADERS", "FairOptions", "FairShare", "QueueTimeouts", "queued_meta", "report_timeout",
           "weight_of"]

log = logging.getLogger("celery_singleflight.queue")


#: the headers that make a message the library sent again a new one (its token at the gate differs)
RESENT_HEADERS = (HEADER_HANDOFF, HEADER_DELAYED, HEADER_ATTEMPT, HEADER_REJOIN)


def _weights(where: str, value: Any, ctx: Resolving) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w > 0
            for w in value.values()):
        raise ConfigurationError(f"{where} must be a dict of fair key -> weight above zero, not {value!r}")
    return {str(k): float(w) for k, w in value.items()}


class FairOptions(OptionGroup):
    """Fair share across tenants, and how long a run may wait to start."""

    __slots__ = ()
    title = "Fair share"

    fair_key = Option[Any](
        setting=False, task="fair_key", check=anything, default_text="none: one share for all runs",
        meaning="Who a run's slot is shared by: a template like `lock_key` (`\"<tenant_id>\"`). Freed slots"
        " go to the fair keys in turn ([fair share](fair-share.md)).",
        values="A template or a callable, as `lock_key`; needs `fair_concurrency`.",
    )
    fair_concurrency = Option["int | None"](
        setting=False, task="fair_concurrency", check=count(1, optional=True), default_text="none: off",
        meaning="How many runs of the task may run at once across all workers; the others wait in Redis,"
        " parked by the worker's main process, served round robin by fair key.",
        values="A whole number, at least 1.",
    )
    fair_weights = Option["dict[str, float]"](
        setting=False, task="fair_weights", check=_weights, default_text="each fair key 1",
        meaning="A fair key's share of the slots relative to the others (weight 2: twice as many);"
        " `celery singleflight limit` changes one at run time.",
        values="A dict of fair key to a number above zero.",
    )
    queue_timeout = Option["float | None"](
        task="queue_timeout", check=seconds(optional=True), default_text="none: wait as long as it takes",
        meaning="A run that waited longer than this for its fair slot ends `FAILURE` with `QueueTimeout`"
        " (key and wait in it), logged at WARNING, with the `queue_timeout` signal.",
        values="Seconds, above zero.",
    )

    @classmethod
    def validate(cls, ctx: Resolving) -> None:
        values = ctx.values
        if values["fair_concurrency"] is None and (values["fair_key"] is not None or values["fair_weights"]):
            raise ConfigurationError(f"task {ctx.name}: fair_key and fair_weights need fair_concurrency=N")


def weight_of(opts: Any, fair: str) -> float:
    """The task's own weight for ``fair`` (a weight set at run time wins, in the script)."""
    return float(opts.fair_weights.get(fair, 1.0))


def queued_meta(gate: str, fair: str, waiting: Waiting) -> dict[str, Any]:
    """The ``QUEUED`` meta of a run waiting at a gate: where, behind how many, and when."""
    return {"key": gate, "fair_key": fair, "position": waiting.position, "eta": waiting.eta,
            "parked_at": round(mod_time.time(), 3)}


def wait_of(request: Any) -> float:
    """How long the run waited at the gate (0 if it did not)."""
    parked = header(request, HEADER_FAIR_WAITED)
    return max(0.0, mod_time.time() - float(parked)) if parked else 0.0


class FairShare(Stage):
    """The stage of a task with ``fair_concurrency``."""

    options = FairOptions
    throws = (QueueTimeout, LockHeld)

    def __init__(self, render: KeyFunction | None, task_cls: type, opts: Any) -> None:
        self.render = render
        self.gate = gate_key(str(getattr(task_cls, "name", "")))
        self.opts = opts
        #: the gate's options: the task's, with the gate's slots
        self.gate_opts = opts.replace(max_concurrency=opts.fair_concurrency)

    @classmethod
    def define(cls, task_cls: type, signature: Any, name: str) -> KeyFunction | None:
        spec = getattr(task_cls, "fair_key", None)
        return None if spec is None else compile_key(spec, signature, name)

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return None if opts.fair_concurrency is None else cls(defined, task_cls, opts)

    @classmethod
    def sweeps(cls, app: Any, tasks: list[Any]) -> list[Sweep]:
        jobs: list[Sweep] = []
        for task in tasks:
            stage = task.pipeline.stage(cls)
            if isinstance(stage, cls) and stage.opts.queue_timeout is not None:
                jobs.append(QueueTimeouts(task, stage))
        return jobs

    def fair_key(self, args: Any, kwargs: Any) -> str:
        return "" if self.render is None else self.render(tuple(args or ()), dict(kwargs or {}))

    def token(self, request: Any) -> str:
        """The run's token at the gate (the main process computed the same from its message)."""
        return fair_token(str(request.id or ""), int(request.retries or 0),
                          [header(request, name) for name in RESENT_HEADERS])

    def before_lease(self, run: Run) -> Ended | None:
        if run.eager:
            return None
        task, request = run.task, run.request
        token = self.token(request)
        holder = Holder(run.task_id, request.hostname or "", task.name)
        guard = Guard(task.app, self.gate, self.gate_opts, holder, sender=task.name)
        keeps_result = not (request.ignore_result or task.ignore_result)
        fair = self.fair_key(run.args, run.kwargs)

        def message() -> str:
            parked_at = header(request, HEADER_FAIR_WAITED) or repr(mod_time.time())
            return message_of(task, run.args, run.kwargs, **{HEADER_FAIR_WAITED: parked_at})

        watch_take(run, self.gate, int(self.opts.fair_concurrency))  # a run that waited, until it starts
        for _ in range(constants.ACQUIRE_ATTEMPTS):
            got = guard.take(handoff=token)
            if isinstance(got, Acquired):
                break
            if got.copy:
                log.info("%s[%s]: this run took its fair slot before; this copy of its message is dropped",
                         task.name, run.task_id)
                raise Ignore()
            # a countdown message, or a slot taken meanwhile: it waits (a free slot: take again)
            node = str(request.hostname or "")
            found = self.wait(task, run.task_id, token, fair, keeps_result, message, node)
            if isinstance(found, Waiting):
                raise Ignore()
            if found.slot < 0:
                # this message's run took its slot and still holds it (ACQUIRE answers a copy only
                # once that lease is gone): a second copy of the message, sent while it runs, ends
                # here, not in LockHeld stored over the running run's result
                log.info("%s[%s]: this run holds its fair slot; this copy of its message is dropped",
                         task.name, run.task_id)
                raise Ignore()
        else:
            raise LockHeld(self.gate, None, None)  # as a lock key that keeps changing hands
        guard.begin(got, announce=False)
        run.notes[FairShare] = guard
        waited = wait_of(request)
        timeout = self.opts.queue_timeout
        if timeout is not None and waited > timeout:
            error = QueueTimeout(run.key, self.gate, waited, timeout, fair)
            report_timeout(task, run.task_id, error)
            raise error
        return None

    def wait(self, task: Any, task_id: str, token: str, fair: str, keeps_result: bool,
             message: Callable[[], str], node: str) -> Waiting | Admitted:
        """Park a run at the gate, from the main process or the pool process of worker ``node``:
        :class:`Waiting` once parked (or parked before); :class:`Admitted` if a slot was free and
        is now reserved for it (take it), or slot -1 if its token took a slot before. A run parked
        now is journaled (:mod:`..run.journal`): if the lease Redis loses it, it is sent again.

        ``QUEUED`` is stored before the run is parked: once parked it may be handed a slot, run
        and store its result at once. So a run whose result is kept asks first (``dry``), and
        ``message`` (the run's own, to send when its turn comes) is built only to park it."""
        store, opts = task.store, self.opts
        found: Waiting | Admitted
        call = (self.gate, opts.fair_concurrency, task_id, token)
        weight = weight_of(opts, fair)
        if keeps_result:
            found = store.fair.enter(*call, "", fair, weight, opts.ttl, dry=True)
            if not isinstance(found, Waiting) or found.parked:
                return self._admitted(task, task_id, found)
            task.backend.store_result(task_id, queued_meta(self.gate, fair, found), QUEUED)
        body, mark = message(), new_mark()
        found = store.fair.enter(*call, body, fair, weight, opts.ttl, mark=mark)
        if not isinstance(found, Waiting):
            if keeps_result:  # a slot freed meanwhile: it did not wait after all (nor is it watched)
                task.backend.store_result(task_id, None, celery_states.PENDING)
            return self._admitted(task, task_id, found)
        journal_waiting(task, self.gate, body, "park", mark=mark, task_id=task_id, node=node)
        log.debug("%s[%s] waits for a fair slot at position %d (fair key %r)", task.name, task_id,
                  found.position, fair)
        return found

    def _admitted(self, task: Any, task_id: str, found: Waiting | Admitted) -> Waiting | Admitted:
        """``found`` as it is; a run that died holding the slot reserved for this one is ended."""
        if isinstance(found, Admitted) and found.dead is not None:
            settle(task.app, Settlement(True, dead=(found.dead,)),
                   Ending(self.gate, task.name, task_id, "took-over", signal=False))
        return found

    def finish(self, run: Run, outcome: str) -> None:
        guard = run.notes.pop(FairShare, None)
        if guard is None or guard.lease is None:
            return
        lease = guard.lease
        # the run handed this slot goes to this worker's own queue: the pool process that ran
        # this one is free for it, and the task's queue may hold a backlog still being parked
        settlement = guard.end(outcome if outcome != "retried" else "ended", here=True)
        if settlement is None or settlement.handoff is None:
            return  # nobody waits: no ETA to give (and one round trip saved)
        try:
            run.task.store.fair.note_run(self.gate, max(0.0, mod_time.time() - lease.since / 1000.0))
        except redis.RedisError as exc:
            log.debug("could not note the run time at %r: %s", self.gate, exc)


def report_timeout(task: Any, task_id: str, error: QueueTimeout) -> None:
    """A run waited past its ``queue_timeout``: log it (WARNING) and send the signal."""
    log.warning("%s[%s] waited %.1fs for its fair slot at %r (queue_timeout %.1fs): it ends FAILURE without"
                " running", task.name, task_id, error.waited, error.gate, error.timeout)
    signals.queue_timeout.send(sender=task.name, key=error.key, task_id=task_id, waited=error.waited,
                               timeout=error.timeout)


class QueueTimeouts(Sweep):
    """A worker's sweeper takes the runs that waited longer than ``queue_timeout`` out of a fair
    task's gate and ends each as FAILURE (:class:`QueueTimeout`), without waiting for its turn."""

    def __init__(self, task: Any, stage: FairShare) -> None:
        self.task, self.stage = task, stage

    def sweep_once(self) -> int:
        task, stage = self.task, self.stage
        opts, store = stage.opts, task.store
        ended, timeout = 0, opts.queue_timeout
        for task_id, waited, fair in store.fair.timed_out(stage.gate, opts.fair_concurrency, timeout):
            error = QueueTimeout("", stage.gate, waited, timeout, fair)
            try:
                ready = task.app.AsyncResult(task_id).state in celery_states.READY_STATES
                if not (task.ignore_result or ready):
                    task.backend.store_result(task_id, error, celery_states.FAILURE)
            except Exception as exc:  # noqa: BLE001 - any backend's error: it stays for the next sweep
                log.warning("could not end %s[%s] after its queue_timeout: %s", task.name, task_id, exc)
                continue
            report_timeout(task, task_id, error)
            store.fair.ended_timeout(stage.gate, task_id)
            ended += 1
        return ended
