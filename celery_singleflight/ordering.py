"""Strict send order for the ``queue`` policy (``ordered=True``).

``apply_async`` takes a per-key sequence number (one round trip, :meth:`~.store.LeaseStore.order_take`)
and carries it in the message (:data:`~.messages.HEADER_SEQ`). Before a run takes its lease it
passes the key's *order gate*: it goes on when every smaller number has gone on (or was skipped),
otherwise it waits, its message kept in the key's order book. The next number's turn comes only
once the admitted run has taken the lease or entered the queue (:meth:`Gate.done`, which also
sends the next run's message if it waits), so runs enter the lease's FIFO in sequence order and
the queue's hand-off keeps that order.

A number whose message never arrives (its publish failed, it was purged or revoked) holds up
the rest for at most ``order_timeout`` seconds: then a worker's sweeper skips it, with a WARNING
and the :data:`~.signals.order_gap_skipped` signal. Runs sent by name (``send_task``, beat) carry
no number and go through by arrival. A run re-sent by the library (a parked run's hand-off,
``fail_closed``) has passed the gate already, or runs by arrival.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from celery.exceptions import Ignore

from . import signals
from .messages import HEADER_EARLIER, HEADER_HANDOFF, HEADER_SEQ, header, message_of
from .settle import send_parked
from .store import LeaseStore

__all__ = ["Gate", "pass_gate", "pass_turn", "sweep_order", "take_sequence"]

log = logging.getLogger("celery_singleflight.order")


def take_sequence(store: LeaseStore, key: str, task_id: str) -> int | None:
    """The sequence number of a send, or None when Redis cannot give one (the run then goes by
    arrival: sending never blocks on ordering)."""
    try:
        return store.order_take(key, task_id)
    except redis.RedisError as exc:
        log.warning("could not take a sequence number for key=%r (sent unordered): %s", key, exc)
        return None


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
            successor = self.store.order_advance(self.key, seq, self.delivery)
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
    code = store.order_gate(key, int(seq), delivery, message_of(task, args, kwargs),
                            task.options.order_timeout)
    if code == 1:
        return Gate(task.app, store, key, int(seq), delivery)
    if code == 2:
        log.info("%s[%s] #%s waits for its turn on key=%r", task.name, request.id, seq, key)
        raise Ignore()
    if code == 3:
        log.warning("%s[%s] #%s came after its turn on key=%r was skipped; it runs by arrival", task.name,
                    request.id, seq, key)
        return Gate(task.app, store, key)
    log.info("%s[%s] #%s on key=%r already went through (another delivery): not run", task.name,
             request.id, seq, key)
    raise Ignore()


def pass_turn(task: Any, store: LeaseStore, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """An ordered run that ends before taking the lease (its result was remembered under its
    idempotency key) still takes its turn, so its number is no gap for the runs after it. If its
    turn has not come, its message waits and runs (and returns the remembered result) then."""
    try:
        pass_gate(task, store, key, args, kwargs).done()
    except (Ignore, redis.RedisError) as exc:
        log.debug("%s[%s] on key=%r ends before its turn: %r", task.name, task.request.id, key, exc)


def sweep_order(app: Any, store: LeaseStore, key: str, timeout: float) -> bool:
    """The sweeper's look at a key whose runs wait for their turn; True if a message was sent."""
    message, first, last = store.order_sweep(key, timeout)
    if first is not None and last is not None:
        sequences = list(range(first, last + 1))
        log.warning("key=%r: sequence number(s) %s never arrived within order_timeout (%.1fs); skipped",
                    key, f"{first}..{last}" if last > first else first, timeout)
        signals.order_gap_skipped.send(sender=key, key=key, sequences=sequences, waited=timeout)
    if not message:
        return False
    try:
        json.loads(message)
    except ValueError:
        log.error("key=%r: a waiting run's message is unreadable; skipped", key)
        return False
    send_parked(app, message, key)
    return True
