"""The lease: who holds a key, until when, with which fencing token.

:class:`LeaseStore` talks to Redis (one script call per acquire, renewal batch and release);
:class:`Lease` is the handle a running task holds (``self.lease``).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time as mod_time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from . import scripts, signals
from .errors import LeaseLost
from .keys import KeyLayout
from .progress import ProgressReporter, ProgressUpdate

__all__ = ["Acquired", "Held", "Holder", "Lease", "LeaseStore", "Parked", "Released", "process_alive"]

log_acquire = logging.getLogger("celery_singleflight.acquire")
log_release = logging.getLogger("celery_singleflight.release")
log_renew = logging.getLogger("celery_singleflight.renew")


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _due_ms(seconds_from_now: float) -> int:
    return int((mod_time.time() + seconds_from_now) * 1000)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Released:
    """What a release did: ``ours`` (the lease was this run's), the message of the parked run
    that was handed the key (the caller must send it), and the messages of the runs that joined
    this one (the caller must give them its result). Truthy when ``ours``."""

    __slots__ = ("handoff", "joined", "ours")

    def __init__(self, ours: bool, handoff: str | None = None, joined: tuple[str, ...] = ()) -> None:
        self.ours = ours
        self.handoff = handoff
        self.joined = joined

    def __bool__(self) -> bool:
        return self.ours


_HOST = socket.gethostname()


def _pid() -> int:
    return _PID[0]


_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


@dataclass(frozen=True)
class Holder:
    """Who is asking for (or holds) a lease. Host and pid are read once per process."""

    task_id: str
    worker: str = ""
    task_name: str = ""
    host: str = _HOST
    pid: int = field(default_factory=_pid)


@dataclass(frozen=True)
class Acquired:
    """The lease is ours: its fencing token, when Redis granted it (epoch seconds), and which of
    the key's ``max_concurrency`` slots it is (0 for a plain one-at-a-time key)."""

    fence: int
    since: float
    slot: int = 0
    acquired = True


@dataclass(frozen=True)
class Held:
    """Someone else holds the key: their task id and the lease time they have left.

    ``handoff`` is set when the key was free but runs were parked: the first of them got the key
    and the caller must send this message (the parked run) to the broker.
    """

    holder: str
    ttl_left: float
    handoff: str | None = None
    acquired = False


@dataclass(frozen=True)
class Parked:
    """A duplicate parked in the key's queue: its place, and the holder's lease time left."""

    position: int
    holder_ttl_left: float


@dataclass(eq=False)
class Lease:
    """The lease of one running execution (``self.lease`` inside a task).

    ``fence`` only grows per key; pass it to writes that must refuse stale holders.
    ``lost`` turns true when a renewal finds the lease gone; ``check()`` then raises.
    """

    key: str
    token: str
    fence: int
    ttl: float
    interval: float
    task_id: str
    task_name: str
    store: LeaseStore
    since: float
    lost: bool = False
    lost_reason: str = ""
    released: bool = False
    confirmed_at: float = field(default_factory=mod_time.monotonic)
    slot: int = 0
    reporter: ProgressReporter | None = field(default=None, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def deadline(self) -> float:
        """Monotonic time after which this run must count its lease as lost.

        A margin before the TTL (10 %, at most 1 s) covers clock drift and the time between a
        check and the write it guards, so a holder learns of its loss before another run can
        take the key, not at the same instant.
        """
        return self.confirmed_at + self.ttl - min(1.0, 0.1 * self.ttl)

    @property
    def time_left(self) -> float:
        """Seconds the lease is known to be good for (0 once lost or released)."""
        if self.lost or self.released:
            return 0.0
        return max(0.0, self.confirmed_at + self.ttl - mod_time.monotonic())

    def check(self) -> None:
        """Raise :class:`LeaseLost` if this run no longer holds its key.

        Besides the heartbeat's verdict (``lost``), the lease's own clock counts: once the TTL
        has passed since the last renewal Redis confirmed, another run may hold the key, even
        if the heartbeat thread has not said so yet (a frozen process, a network partition).
        """
        if not self.lost and not self.released and mod_time.monotonic() >= self.deadline:
            self.mark_lost("no renewal was confirmed within the lease TTL; another run may hold the key")
        if self.lost:
            raise LeaseLost(self.key, self.lost_reason)

    def write_progress(self, update: ProgressUpdate) -> dict[str, Any]:
        """Record ``update`` on this lease's key (one owner-checked round trip); return the data.

        Raises :class:`LeaseLost` (and marks the lease lost) if the key is no longer this run's.
        A Redis error is logged, not raised: whether the lease survives is the heartbeat's call.
        """
        data = update.as_dict()
        try:
            ours = self.store.progress(self, json.dumps(data), update.status_fields())
        except redis.RedisError as exc:
            log_renew.warning("could not record progress of key=%r: %s", self.key, exc)
            return data
        if not ours:
            self.mark_lost("progress found the lease gone")
            raise LeaseLost(self.key, self.lost_reason)
        return data

    def mark_lost(self, reason: str, *, at_release: bool = False) -> None:
        """Record the loss once: flag, warning log and ``lease_lost`` signal.

        After the run released its lease, a late renewal reply must not report a loss, so only
        the release itself (``at_release``) may report one then.
        """
        with self._guard:
            if self.lost or (self.released and not at_release):
                return
            self.lost = True
            self.lost_reason = reason
        log_renew.warning(
            "lease lost: key=%r task=%s[%s] fence=%s: %s",
            self.key, self.task_name, self.task_id, self.fence, reason,
        )
        signals.lease_lost.send(sender=self.task_name, lease=self, reason=reason)


class LeaseStore:
    """Acquire, renew and release leases of one namespace on one Redis.

    ``status_retention`` (seconds) is how long a run's status and history outlive its lease;
    ``history_length`` caps the history stream of a key.
    """

    def __init__(
        self, client: redis.Redis, layout: KeyLayout, status_retention: float = 300.0,
        history_length: int = 100,
    ) -> None:
        self.client = client
        self.layout = layout
        self.status_retention = status_retention
        self.history_length = history_length
        self._acquire = client.register_script(scripts.ACQUIRE)
        self._renew_many = client.register_script(scripts.RENEW_MANY)
        self._release = client.register_script(scripts.RELEASE)
        self._force_release = client.register_script(scripts.FORCE_RELEASE)
        self._progress = client.register_script(scripts.PROGRESS)
        self._revise = client.register_script(scripts.REVISE_OUTCOME)
        self._note_duplicate = client.register_script(scripts.NOTE_DUPLICATE)
        self._park = client.register_script(scripts.PARK)
        self._resume = client.register_script(scripts.RESUME)
        self._join = client.register_script(scripts.JOIN)
        self._enqueue_mark = client.register_script(scripts.ENQUEUE_MARK)
        self._clear_mark = client.register_script(scripts.CLEAR_MARK)

    def lease_key(self, key: str, slot: int = 0) -> str:
        """The lease of ``key`` (of one of its slots, with ``max_concurrency`` > 1)."""
        return self.layout.redis_key(key, "lease" if slot == 0 else f"lease{slot}")

    def fence_key(self, key: str) -> str:
        return self.layout.redis_key(key, "fence")

    def status_key(self, key: str, slot: int = 0) -> str:
        """The status of the run holding ``key`` (its ``slot``), kept after it ends."""
        return self.layout.redis_key(key, "status" if slot == 0 else f"status{slot}")

    def history_key(self, key: str, slot: int = 0) -> str:
        """The progress history stream of that run."""
        return self.layout.redis_key(key, "history" if slot == 0 else f"history{slot}")

    def queue_key(self, key: str) -> str:
        return self.layout.redis_key(key, "queue")

    def parked_key(self, key: str) -> str:
        return self.layout.redis_key(key, "parked")

    def _run_keys(self, key: str, slot: int = 0) -> list[str]:
        """Lease, status and history of one run; each slot of a key has its own."""
        return [self.lease_key(key, slot), self.status_key(key, slot), self.history_key(key, slot)]

    def joined_key(self, key: str) -> str:
        return self.layout.redis_key(key, "joined")

    def marker_key(self, key: str) -> str:
        return self.layout.redis_key(key, "enqueued")

    def done_key(self, key: str) -> str:
        """The idempotency record of an idempotency key (its own hash tag, not a lock's)."""
        return self.layout.redis_key(key, "done")

    def mark_enqueued(self, key: str, task_id: str, ttl: float) -> str | None:
        """One round trip: claim ``key`` for ``task_id`` about to be sent, or return the task id
        already queued or running for it."""
        reply = self._enqueue_mark(keys=[self.marker_key(key)], args=[task_id, _ms(ttl)])
        return _str(reply) if reply else None

    def clear_enqueued(self, key: str, task_id: str) -> bool:
        return int(self._clear_mark(keys=[self.marker_key(key)], args=[task_id])) == 1

    def remembered(self, idem_key: str) -> str | None:
        raw = self.client.get(self.done_key(idem_key))
        return None if raw is None else _str(raw)

    def remember(self, idem_key: str, record: str, ttl: float) -> None:
        self.client.set(self.done_key(idem_key), record, px=_ms(ttl))

    def _queue_keys(self, key: str, slots: int = 1) -> list[str]:
        return [*(self.lease_key(key, i) for i in range(slots)), self.queue_key(key), self.parked_key(key),
                self.joined_key(key)]

    def acquire(
        self, key: str, token: str, ttl: float, holder: Holder, fence_retention: float = 86400.0,
        handoff: str = "", slots: int = 1,
    ) -> Acquired | Held:
        """One round trip: take the key, or learn who holds it and for how long.

        ``handoff``: the token a parked run was re-sent with; it adopts the lease reserved for it.
        A run that was never parked does not jump the queue: if runs are parked on a free key,
        the first of them gets it (see :attr:`Held.handoff`).
        """
        entry = f"{holder.task_id}|{handoff}" if handoff else ""
        reply = self._acquire(
            keys=[*(self.lease_key(key, i) for i in range(slots)), self.fence_key(key),
                  self.queue_key(key), self.parked_key(key)],
            args=[token, _ms(ttl), holder.task_id, holder.host, holder.pid, holder.worker,
                  _ms(fence_retention), holder.task_name, handoff, entry, slots],
        )
        if int(reply[0]) == 1:
            return Acquired(fence=int(reply[1]), since=int(reply[2]) / 1000.0, slot=int(reply[3]))
        message = _str(reply[3]) if int(reply[0]) == 2 else None
        return Held(holder=_str(reply[1]), ttl_left=max(0, int(reply[2])) / 1000.0, handoff=message)

    def waiting_index_key(self) -> str:
        """Per namespace: the keys that have parked runs, scored by when to check them (ms)."""
        return f"{self.layout.namespace}:waiting"

    def park(self, key: str, task_id: str, handoff: str, message: str, max_queued: int | None,
             grace: float, slots: int = 1) -> Parked | int | None:
        """Park a duplicate in the key's FIFO: :class:`Parked`, or the queue length if it is full,
        or None if the key is free now (acquire again).

        The key is also entered in the namespace's waiting index, due when the holder's lease
        would run out, so that a queue whose holder died is resumed by a worker's sweeper.

        A ``handoff`` token starting with :data:`~celery_singleflight.scripts.OWN_COPY` parks an
        *own copy*: the broker delivered the holder's own run again. Its message waits at the
        front, beyond ``max_queued``, and is dropped when that run releases; it runs only if the
        run's lease ends without a release (its worker died), because with the Redis broker
        acknowledging the redelivery also acknowledged the first delivery's message.
        """
        reply = self._park(
            keys=self._queue_keys(key, slots)[:-1],
            args=[f"{task_id}|{handoff}", message, -1 if max_queued is None else max_queued, slots],
        )
        code = int(reply[0])
        if code == -1:
            return None
        if code == -2:
            return int(reply[1])
        ttl_left = int(reply[1]) / 1000.0
        self.client.zadd(self.waiting_index_key(), {key: _due_ms(ttl_left + grace)}, lt=True)
        return Parked(position=code, holder_ttl_left=ttl_left)

    def resume(self, key: str, ttl: float, grace: float, slots: int = 1) -> Released | None:
        """Check one waiting key. If it is free (its holder died without releasing), hand it to
        the first parked run and take the runs joined to the dead holder (see :class:`Released`);
        plan the next check, or drop the key from the index when nothing waits."""
        reply = self._resume(keys=self._queue_keys(key, slots), args=[_ms(ttl), slots])
        code = int(reply[0])
        index = self.waiting_index_key()
        if code == 0:
            self.client.zrem(index, key)
            if self.client.llen(self.queue_key(key)) or self.client.llen(self.joined_key(key)):
                self.client.zadd(index, {key: _due_ms(grace)}, lt=True)  # arrived meanwhile
            return None
        self.client.zadd(index, {key: _due_ms(int(reply[1]) / 1000.0 + grace)})
        if code != 2:
            return None
        return Released(False, _str(reply[2]) or None, tuple(_str(m) for m in reply[3:]))

    def due_waiting(self, limit: int = 100) -> list[str]:
        """Keys of this namespace whose queue check is due."""
        raw: list[Any] = self.client.zrangebyscore(
            self.waiting_index_key(), "-inf", _due_ms(0), start=0, num=limit
        )
        return [_str(k) for k in raw]

    def queued(self, key: str) -> int:
        return int(self.client.llen(self.queue_key(key)))

    def renew(self, leases: Sequence[Lease]) -> list[bool]:
        """One round trip for any number of leases; True where the lease is still ours."""
        if not leases:
            return []
        keys: list[str] = []
        args: list[Any] = []
        for lease in leases:
            keys += lease.store._run_keys(lease.key, lease.slot)
            args += [lease.token, _ms(lease.ttl)]
        args.append(_ms(self.status_retention))
        reply = self._renew_many(keys=keys, args=args)
        return [int(x) == 1 for x in reply]

    def release(
        self, key: str, token: str, outcome: str = "succeeded", ttl: float = 30.0, answer_joined: bool = True,
        fence: int | None = None, slot: int = 0, clear_marker: bool = True, task_id: str = "",
        slots: int = 1,
    ) -> Released:
        """One round trip: free the key if the lease is ours, record the run's outcome, hand the
        key to the first parked run and take the runs joined to this one (see :class:`Released`).

        ``answer_joined=False`` (a run that is retried) leaves joined runs waiting for the next run.
        ``clear_marker=False`` (tasks without ``dedup_enqueue``, ``hold()``) skips the enqueue-time
        dedup marker: only a task that dedups at enqueue sets one for its own task id.
        ``task_id``: the run's task id, so that a copy its redelivery parked is dropped even when
        the lease was already gone (the run ended; only a copy already handed the key stays).
        """
        retention = _ms(self.status_retention) if self.status_retention > 0 else 0
        reply = self._release(
            keys=[*self._run_keys(key, slot), self.queue_key(key), self.parked_key(key), self.joined_key(key),
                  self.marker_key(key)],
            args=[token, outcome, retention, self.history_length, _ms(ttl), "1" if answer_joined else "0",
                  "" if fence is None else fence, "1" if clear_marker else "0", task_id, slots],
        )
        if int(reply[0]) != 1:
            return Released(False)
        handoff = _str(reply[1]) or None
        return Released(True, handoff, tuple(_str(m) for m in reply[2:]))

    def join(self, key: str, message: str, grace: float) -> tuple[int, str] | None:
        """Join the holder's run (it will answer with its result): (joined count, holder id),
        or None if the key is free now (acquire again)."""
        reply = self._join(keys=[self.lease_key(key), self.joined_key(key)], args=[message])
        if int(reply[0]) == -1:
            return None
        ttl_left = max(0, int(self.client.pttl(self.lease_key(key)))) / 1000.0
        self.client.zadd(self.waiting_index_key(), {key: _due_ms(ttl_left + grace)}, lt=True)
        return int(reply[0]), _str(reply[1])

    def force_release(
        self, key: str, by: str, expected_holder: str = "", slot: int = 0
    ) -> tuple[str, int] | None:
        """Free ``key`` (one ``slot`` of it) whoever holds it (an operator's decision); None if it
        was not held.

        With ``expected_holder``, only that task's lease is released (what the operator saw).
        """
        reply = self._force_release(
            keys=self._run_keys(key, slot),
            args=[by, _ms(self.status_retention), self.history_length, expected_holder],
        )
        if not reply:
            return None
        task_id = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
        return task_id, int(reply[1])

    def note_duplicate(self, key: str, task_id: str, outcome: str) -> bool:
        """Count a duplicate on the holder's status and tell live watchers what happened to it."""
        reply = self._note_duplicate(keys=self._run_keys(key), args=[task_id, outcome, self.history_length])
        return int(reply) == 1

    def revise_outcome(self, key: str, task_id: str, recorded: str, known: str) -> bool:
        """Correct the recorded outcome of ``task_id``'s run (e.g. terminated -> revoked)."""
        reply = self._revise(keys=self._run_keys(key)[1:], args=[task_id, recorded, known])
        return int(reply) == 1

    def progress(self, lease: Lease, update_json: str, fields: Sequence[Any]) -> bool:
        """One round trip: owner-checked status update plus a history entry (wakes watchers)."""
        ttl = _ms(lease.time_left + self.status_retention)
        reply = self._progress(
            keys=self._run_keys(lease.key, lease.slot),
            args=[lease.token, ttl, self.history_length, update_json, *fields],
        )
        return bool(reply)

    def holder_record(self, key: str, slot: int = 0) -> dict[str, str]:
        """The stored holder fields of ``key`` (of one slot; empty if free)."""
        raw: dict[Any, Any] = self.client.hgetall(self.lease_key(key, slot))
        return {k.decode(): v.decode() for k, v in raw.items()}


def process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
