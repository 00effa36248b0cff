"""Strict send order for the ``queue`` policy (``ordered=True``).

``apply_async`` takes a per-key sequence number (one round trip) and carries it in the message
(:data:`~..run.messages.HEADER_SEQ`). Before a run takes its lease it passes the key's *order
gate*: it goes on when every smaller number has gone on (or was skipped), otherwise it waits,
its message kept in the key's order book. The next number's turn comes only once the admitted
run has taken the lease or entered the queue (:meth:`Gate.done`, which also sends the next
run's message if it waits), so runs enter the lease's FIFO in sequence order and the queue's
hand-off keeps that order.

A number whose message never arrives (its publish failed, it was purged or revoked) holds up
the rest for at most ``order_timeout`` seconds: then a worker's sweeper skips it, with a WARNING
and the :data:`~..signals.order_gap_skipped` signal. Runs sent by name (``send_task``, beat) carry
no number and go through by arrival. A run re-sent by the library (a parked run's hand-off,
``fail_closed``) has passed the gate already, or runs by arrival.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis
from celery.exceptions import Ignore

from .. import signals
from ..config.option import Option, OptionGroup, Resolving, flag, seconds
from ..errors import ConfigurationError
from ..protocol.order import GateReply
from ..protocol.store import LeaseStore
from ..run.guard import options_store
from ..run.journal import journal_waiting, new_mark
from ..run.messages import HEADER_EARLIER, HEADER_HANDOFF, HEADER_SEQ, header, message_of
from ..run.settle import send_parked
from ..run.stage import Ended, Run, Send, Stage, Sweep

__all__ = ["Gate", "OrderOptions", "Ordering", "SkipGaps", "pass_gate"]

log = logging.getLogger("celery_singleflight.order")


class OrderOptions(OptionGroup):
    """Strict send order for the ``queue`` policy."""

    __slots__ = ()
    title = "Send order"

    ordered = Option[bool](
        task="ordered", default=False, check=flag(),
        meaning="The `queue` policy: runs of a key start in send order, also in a burst and across workers."
        " `apply_async` takes a per-key sequence number (one round trip); a run whose predecessors have not"
        " all started parks ([policies](policies.md#ordered-queue)). Sends by name (`send_task`, beat) carry"
        " no number and are ordered by arrival.",
        values="`True` or `False`; needs `on_duplicate=\"queue\"` and `max_concurrency=1`.",
    )
    order_timeout = Option[float](
        task="order_timeout", default=60.0, check=seconds(),
        meaning="`ordered=True`: how long runs wait for a sequence number whose message never arrives"
        " (publish failed, purged, revoked) before it is skipped, with a WARNING and the `order_gap_skipped`"
        " signal.",
        values="Seconds, above zero.",
    )

    @classmethod
    def validate(cls, ctx: Resolving) -> None:
        values = ctx.values
        if values["ordered"] and (values["on_duplicate"] != "queue" or values["max_concurrency"] != 1):
            raise ConfigurationError(
                f"task {ctx.name}: ordered=True orders the runs of the queue policy, so it needs"
                f" on_duplicate='queue' and max_concurrency=1; this task has"
                f" on_duplicate={values['on_duplicate']!r} and max_concurrency={values['max_concurrency']!r}"
            )


class Gate:
    """A run let through the gate: :meth:`done`, once it holds the lease or waits in the queue
    (so that it is ahead of the next one), lets the next number through and sends its message if
    it waits."""

    def __init__(self, app: Any, store: LeaseStore, key: str, seq: int = 0, delivery: str = "") -> None:
        self.app, self.store, self.key, self.seq, self.delivery = app, store, key, seq, delivery

    def done(self) -> None:
        if not self.seq:
            return
        seq, self.seq = self.seq, 0
        try:
            successor = self.store.order.advance(self.key, seq, self.delivery)
        except redis.RedisError as exc:  # the sweeper lets the next one through after order_timeout
            log.warning("could not let the run after #%s on key=%r through: %s", seq, self.key, exc)
            return
        if successor:
            send_parked(self.app, successor, self.key)


def pass_gate(task: Any, store: LeaseStore, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Gate:
    """Let the current run through the key's order gate, or end it (``Ignore``) while it waits
    for its turn (its message is kept and sent when the turn comes; its state stays PENDING) or
    when another delivery of it went through."""
    request = task.request
    seq = header(request, HEADER_SEQ)
    if not seq or header(request, HEADER_HANDOFF) or header(request, HEADER_EARLIER):
        return Gate(task.app, store, key)
    tag = (request.delivery_info or {}).get("delivery_tag") or ""
    delivery = f"{request.id or ''}|{tag}"
    message = message_of(task, args, kwargs)
    mark = new_mark()
    code = store.order.gate(key, int(seq), delivery, message, task.options.order_timeout, mark=mark)
    if code == GateReply.GO:
        return Gate(task.app, store, key, int(seq), delivery)
    if code == GateReply.WAIT:
        journal_waiting(task, key, message, "order", mark=mark)
        log.info("%s[%s] #%s waits for its turn on key=%r", task.name, request.id, seq, key)
        raise Ignore()
    if code == GateReply.LATE:
        log.warning("%s[%s] #%s came after its turn on key=%r was skipped; it runs by arrival", task.name,
                    request.id, seq, key)
        return Gate(task.app, store, key)
    log.info("%s[%s] #%s on key=%r already went through (another delivery): not run", task.name,
             request.id, seq, key)
    raise Ignore()


class Ordering(Stage):
    """The stage of an ``ordered=True`` task."""

    options = OrderOptions

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls() if opts.ordered else None

    @classmethod
    def sweeps(cls, app: Any, tasks: list[Any]) -> list[Sweep]:
        """Skip the numbers that never came, in the namespaces with an ``ordered=True`` task
        (each with the shortest ``order_timeout`` of those tasks)."""
        found: dict[tuple[int, str], tuple[LeaseStore, float]] = {}
        for task in tasks:
            opts = task.options
            if opts.ordered:
                store = options_store(opts)
                key = (id(store.client), opts.namespace)
                timeout = min(found[key][1], opts.order_timeout) if key in found else opts.order_timeout
                found[key] = (store, timeout)
        return [SkipGaps(app, store, timeout) for store, timeout in found.values()]

    def send(self, call: Send, proceed: Callable[[Send], Any]) -> Any:
        if not call.eager and HEADER_SEQ not in call.headers():
            call.task_id = call.task_id or str(uuid.uuid4())
            try:
                seq = call.task.store.order.take(call.key, call.task_id)
            except redis.RedisError as exc:  # sending never blocks on ordering: it goes by arrival
                log.warning("could not take a sequence number for key=%r (sent unordered): %s", call.key, exc)
            else:
                call.add_headers(**{HEADER_SEQ: seq})
        return proceed(call)

    def before_lease(self, run: Run) -> Ended | None:
        # wait for this run's turn; the next run is let through once this one holds the key or
        # waits in its queue (after_take)
        run.notes[Ordering] = pass_gate(run.task, run.task.store, run.key, run.args, run.kwargs)
        return None

    def after_take(self, run: Run) -> None:
        gate = run.notes.pop(Ordering, None)
        if gate is not None:
            gate.done()

    def skipped(self, run: Run) -> None:
        """A run that ends before taking the lease (its result was remembered under its
        idempotency key) still takes its turn, so its number is no gap for the runs after it. If
        its turn has not come, its message waits and runs (and returns the remembered result) then."""
        try:
            pass_gate(run.task, run.task.store, run.key, run.args, run.kwargs).done()
        except (Ignore, redis.RedisError) as exc:
            log.debug("%s[%s] on key=%r ends before its turn: %r", run.task.name, run.task_id, run.key, exc)


class SkipGaps(Sweep):
    """The sweeper's look at the keys whose runs wait for their turn."""

    def __init__(self, app: Any, store: LeaseStore, timeout: float) -> None:
        self.app, self.store, self.timeout = app, store, timeout

    def sweep_once(self) -> int:
        return sum(self.sweep(key) for key in self.store.order.due())

    def sweep(self, key: str) -> bool:
        """Look at ``key``; True if a waiting run's message was sent."""
        message, first, last = self.store.order.sweep(key, self.timeout)
        if first is not None and last is not None:
            sequences = list(range(first, last + 1))
            log.warning("key=%r: sequence number(s) %s never arrived within order_timeout (%.1fs); skipped",
                        key, f"{first}..{last}" if last > first else first, self.timeout)
            signals.order_gap_skipped.send(sender=key, key=key, sequences=sequences, waited=self.timeout)
        if not message:
            return False
        try:
            json.loads(message)
        except ValueError:
            log.error("key=%r: a waiting run's message is unreadable; skipped", key)
            return False
        send_parked(self.app, message, key)
        return True
