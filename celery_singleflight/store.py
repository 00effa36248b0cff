"""The lease store: every Redis call of the library for one namespace on one Redis.

Each method is one round trip (one script, or one plain command) and answers with plain data
(:mod:`.replies`). Every script is safe to run twice (see :mod:`.scripts`), so a reply lost and
re-sent by redis-py changes nothing: the caller gets the answer the first run gave.
"""

from __future__ import annotations

import json
import time as mod_time
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

import redis
from redis.crc import key_slot
from redis.sentinel import SentinelConnectionPool

from . import scripts
from .clients import RedisTarget, is_cluster
from .cluster import clocks_ms, renew_by_slot
from .connection import UNREACHABLE, kept_connection, redis_client
from .layout import KeyLayout
from .replies import Acquired, Held, Holder, Parked, Settlement

__all__ = ["REPLAY_WINDOW", "LeaseStore", "RenewedLease", "store_for"]

#: the shortest time a run record outlives its run (seconds): longer than redis-py takes to send
#: a command again after a lost reply, so a re-sent release still finds the proof of the first
REPLAY_WINDOW = 30.0


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _due_ms(seconds_from_now: float) -> int:
    return int((mod_time.time() + seconds_from_now) * 1000)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _settlement(reply: Sequence[Any], first: int = 1) -> Settlement:
    handoff = _str(reply[first]) or None
    return Settlement(True, handoff, tuple(_str(m) for m in reply[first + 1 :]))


#: a release that hands nothing on (the script answers a bare 1: the cheapest reply to read)
_RELEASED = Settlement(True)

#: errors of a call on a Cluster node's own connection that send it again through the cluster client
_THROUGH_THE_CLUSTER: tuple[type[Exception], ...] = (
    redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
    redis.exceptions.NoScriptError, redis.exceptions.ClusterDownError, *UNREACHABLE,
)


class _Script:
    """One lease script, called the shortest way: on a connection the calling thread keeps
    (:func:`~.connection.kept_connection`), under the client's own retry policy (a second run of
    a script is safe), so each call skips the layers of ``Redis.execute_command`` and of the
    pool that a lease does not need (about 55 % of redis-py's cost per call). Other clients (a
    cluster, a pipeline-bound or single-connection client) go through redis-py's ``Script`` as
    usual. A server that lost the script gets it again."""

    __slots__ = ("client", "cluster", "direct", "script", "send", "sha")

    def __init__(self, client: redis.Redis, source: str) -> None:
        self.client = client
        self.script = client.register_script(source)
        self.sha = self.script.sha.encode()
        self.direct = type(client) is redis.Redis and client.connection is None
        self.cluster = is_cluster(client)
        # a Sentinel connection finds the current master only in connect()
        sentinel = isinstance(getattr(client, "connection_pool", None), SentinelConnectionPool)
        self.send = _send_connecting if sentinel else _send

    def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        if not self.direct:
            if self.cluster:
                return self._on_node(keys, args)
            return self.script(keys=keys, args=args)
        try:
            return self._evalsha(keys, args)
        except redis.exceptions.NoScriptError:
            self.client.script_load(self.script.script)
            return self._evalsha(keys, args)

    def _on_node(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """A Cluster: the same short way, on a connection to the node that owns the keys' slot
        (all keys of one lock share it). A redirection (the slot moved: ``MOVED``/``ASK``), a
        node without the script, or a connection trouble goes through the cluster client, which
        follows redirections, refreshes its slot map and reloads scripts; a script that may
        have run already is safe to run again."""
        first = keys[0]
        cluster: Any = self.client
        node = cluster.nodes_manager.get_node_from_slot(
            key_slot(first if isinstance(first, bytes) else str(first).encode())
        )
        node_client = node.redis_connection
        conn = None if node_client is None else kept_connection(node_client)
        if conn is None:
            return self.script(keys=keys, args=args)
        try:
            return _send(conn, _pack([b"EVALSHA", self.sha, b"%d" % len(keys), *keys, *args]))
        except _THROUGH_THE_CLUSTER:
            return self.script(keys=keys, args=args)

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = _pack([b"EVALSHA", self.sha, b"%d" % len(keys), *keys, *args])
        conn = kept_connection(self.client)
        if conn is not None:
            return self.send(conn, packed)
        pool = self.client.connection_pool
        conn = pool.get_connection()
        try:
            return self.send(conn, packed)
        finally:
            pool.release(conn)


def _send(conn: Any, packed: bytes) -> Any:
    """Send one packed command on ``conn`` and read its reply, under the connection's retry
    policy (a lost reply sends it again: every lease script is safe to run twice)."""

    def send() -> Any:
        conn.send_packed_command([packed])
        return conn.read_response()

    try:
        return conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
    except redis.exceptions.ResponseError:
        raise  # the reply was read: the connection is in step
    except BaseException:
        # stopped between send and reply (a soft time limit, a signal): the reply may still
        # come, and must not be read as the next command's
        conn.disconnect()
        raise


def _send_connecting(conn: Any, packed: bytes) -> Any:
    """:func:`_send` for a Sentinel-managed connection: a closed one is opened with ``connect()``,
    which asks the sentinels for the master (``send_packed_command`` would reconnect to the
    address it had: the old master, after a failover). A copy, not a flag in :func:`_send`:
    that one is the standalone hot path, measured in client instructions per pair."""

    def send() -> Any:
        if conn._sock is None:
            conn.connect()
        conn.send_packed_command([packed])
        return conn.read_response()

    try:
        return conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
    except redis.exceptions.ResponseError:
        raise
    except BaseException:
        conn.disconnect()
        raise


def _pack(items: list[Any]) -> bytes:
    """One command in the Redis protocol: the arguments of a lease script are bytes, str or int
    (redis-py's general packer spends more on checks than on the bytes)."""
    out = [b"*%d\r\n" % len(items)]
    for item in items:
        if type(item) is not bytes:
            item = item.encode() if isinstance(item, str) else b"%d" % item
        out += (b"$%d\r\n" % len(item), item, b"\r\n")
    return b"".join(out)


class _Names:
    """The Redis key names of one lock, encoded once (see :meth:`LeaseStore._names`)."""

    __slots__ = ("enqueued", "histories", "joined", "parked", "queue", "runs", "settled")

    def __init__(self, layout: KeyLayout, key: str, slots: int) -> None:
        tag = layout.redis_key(key, "").encode()  # b"<ns>:{<key>}:", then each part's name
        self.runs = [tag + (b"run%d" % slot if slot else b"run") for slot in range(slots)]
        self.histories = [tag + (b"history%d" % slot if slot else b"history") for slot in range(slots)]
        self.queue = tag + b"queue"
        self.parked = tag + b"parked"
        self.joined = tag + b"joined"
        self.enqueued = tag + b"enqueued"
        self.settled = tag + b"settled"


#: how many locks' key names a store keeps encoded (the hot keys of a worker; a dict of at most a
#: few MB)
_NAMES_KEPT = 2048


class RenewedLease(Protocol):
    """What a renewal needs of a lease (its store: leases of several namespaces may share one
    Redis client, and so one heartbeat)."""

    key: str
    token: str
    slot: int
    ttl: float
    store: LeaseStore


class LeaseStore:
    """Acquire, renew and release leases of one namespace on one Redis.

    ``status_retention`` (seconds) is how long a run's record (its outcome, its fence, the proof
    of its release) outlives it, at least :data:`REPLAY_WINDOW`; ``history_length`` caps the
    history stream of a key.
    """

    def __init__(
        self, client: redis.Redis, layout: KeyLayout, status_retention: float = 300.0,
        history_length: int = 100,
    ) -> None:
        self.client = client
        self.layout = layout
        self.status_retention = status_retention
        self.history_length = history_length
        self.keep_ms = _ms(max(status_retention, REPLAY_WINDOW))
        self._keep, self._cap = b"%d" % self.keep_ms, b"%d" % history_length  # encoded once
        self._known: dict[tuple[str, int], _Names] = {}
        self.cluster = is_cluster(client)
        self.renew_round_trips = 0  # on a Cluster: batches sent by renew() (one per node), for benchmarks
        self._acquire = _Script(client, scripts.ACQUIRE)
        self._renew_many = _Script(client, scripts.RENEW_MANY)
        self._release = _Script(client, scripts.RELEASE)
        self._force_release = _Script(client, scripts.FORCE_RELEASE)
        self._progress = _Script(client, scripts.PROGRESS)
        self._revise = _Script(client, scripts.REVISE_OUTCOME)
        self._note_duplicate = _Script(client, scripts.NOTE_DUPLICATE)
        self._park = _Script(client, scripts.PARK)
        self._resume = _Script(client, scripts.RESUME)
        self._join = _Script(client, scripts.JOIN)
        self._enqueue_mark = _Script(client, scripts.ENQUEUE_MARK)
        self._clear_mark = _Script(client, scripts.CLEAR_MARK)
        self._coalesce = _Script(client, scripts.COALESCE)
        self._order_take = _Script(client, scripts.ORDER_TAKE)
        self._order_gate = _Script(client, scripts.ORDER_GATE)
        self._order_advance = _Script(client, scripts.ORDER_ADVANCE)
        self._order_sweep = _Script(client, scripts.ORDER_SWEEP)

    def _names(self, key: str, slots: int) -> _Names:
        """The key names of ``key`` with ``slots`` slots; worked out once per lock, since every
        acquire and release names seven of them."""
        found = self._known.get((key, slots))
        if found is None:
            if len(self._known) >= _NAMES_KEPT:
                self._known.clear()
            found = self._known[(key, slots)] = _Names(self.layout, key, slots)
        return found

    # -- the lease --------------------------------------------------------------------------

    def acquire(
        self, key: str, token: str, ttl: float, holder: Holder, *, handoff: str = "", earlier: str = "",
        slots: int = 1,
    ) -> Acquired | Held:
        """One round trip: take a free slot of the key, or learn who holds it and for how long.

        ``handoff``: the token a parked run was re-sent with; it adopts the slot reserved for it.
        A run that was never parked does not jump the queue: if runs are parked on a free key,
        the first of them gets it (:attr:`Held.handoff`). ``earlier``: the token of an earlier
        attempt of this run whose reply never came; if that attempt got the key, this one takes
        it over.
        """
        names = self._names(key, slots)
        ttl_ms = _ms(ttl)
        call = (f"{token}\x1f{ttl_ms}\x1f{self.keep_ms}\x1f{ttl_ms + self.keep_ms}\x1f{handoff}\x1f{earlier}"
                f"\x1f{holder.task_id}")
        reply = self._acquire(keys=[*names.runs, names.queue, names.parked, names.enqueued],
                              args=[call, holder.fields])
        if not isinstance(reply, list):  # acquired: one string, 'fence:since:slot:superseded by'
            fence, since, slot, superseded_by = _str(reply).split(":", 3)
            return Acquired(fence=int(fence), since=int(since) / 1000.0, slot=int(slot),
                            superseded_by=superseded_by)
        code = int(reply[0])
        message = (_str(reply[3]) or None) if code == 2 else None
        return Held(holder=_str(reply[1]), ttl_left=max(0, int(reply[2])) / 1000.0, handoff=message)

    def renew(self, leases: Sequence[RenewedLease]) -> list[int]:
        """One round trip for any number of leases: per lease 1 where it is still ours, 2 where
        it is still ours but a newer run superseded it (``supersede``), 0 where it is gone.

        On a Redis Cluster a script may touch the keys of one hash slot only, so the leases are
        grouped by slot (one script call each) and the calls pipelined, which redis-py sends
        as one batch per node: one round trip per node (see :func:`.cluster.renew_by_slot`)."""
        if not leases:
            return []
        if self.cluster:
            results, round_trips = renew_by_slot(self.client, self._renew_many.script, leases, self.keep_ms)
            self.renew_round_trips += round_trips
            return results
        keys: list[str] = []
        args: list[Any] = []
        for lease in leases:
            layout = lease.store.layout
            keys += [layout.run(lease.key, lease.slot), layout.history(lease.key, lease.slot)]
            args += [lease.token, _ms(lease.ttl)]
        args.append(self.keep_ms)
        reply = self._renew_many(keys=keys, args=args)
        return [int(x) for x in reply]

    def release(
        self, key: str, token: str, outcome: str = "succeeded", ttl: float = 30.0, *,
        fence: int | None = None, slot: int = 0, slots: int = 1, answer_joined: bool = True,
        clear_marker: bool = False, task_id: str = "",
    ) -> Settlement:
        """One round trip: free the slot if the lease is ours, record the run's outcome, hand the
        key to the first parked run and take the runs joined to this one (see :class:`Settlement`).

        ``answer_joined=False`` (a run that is retried) leaves joined runs waiting for the next run.
        ``clear_marker`` (tasks with ``dedup_enqueue``) removes the enqueue-time marker of this
        task id. ``task_id``: the run's task id, so that a copy its redelivery parked is dropped
        even when the lease was already gone. ``ttl``: the reservation made for a parked run.
        ``fence`` None: an attempt that may or may not have taken the key (nothing is recorded if
        it did not).
        """
        names = self._names(key, max(slots, slot + 1))
        call = (f"{token}\x1f{outcome}\x1f{'' if fence is None else fence}\x1f{slot + 1}"
                f"\x1f{_ms(ttl)}\x1f{1 if answer_joined else 0}\x1f{1 if clear_marker else 0}\x1f{task_id}")
        reply = self._release(
            keys=[*names.runs, names.histories[slot], names.queue, names.parked, names.joined, names.enqueued,
                  names.settled],
            args=[call, self._keep, self._cap],
        )
        if reply == 1:
            return _RELEASED
        if int(reply[0]) != 1:
            return Settlement(False)
        return _settlement(reply)

    def progress(self, key: str, slot: int, token: str, update_json: str, state: str, seq: int,
                 args_json: str = "") -> bool | str:
        """One round trip: owner-checked status update plus a history entry (wakes watchers).
        True if written, False if the lease is not this run's, or the task id of the run that
        superseded this one (written all the same).

        ``seq`` numbers the run's updates, so a re-sent update is written once.
        """
        reply = self._progress(
            keys=[self.layout.run(key, slot), self.layout.history(key, slot)],
            args=[token, self.history_length, update_json, state, seq, args_json, self.keep_ms],
        )
        text = _str(reply) if reply else ""
        return text[4:] if text.startswith("sup|") else bool(reply)

    # -- duplicates: queue, join, notes -------------------------------------------------------

    def park(self, key: str, task_id: str, handoff: str, message: str, max_queued: int | None,
             grace: float, slots: int = 1) -> Parked | int | None:
        """Park a duplicate in the key's FIFO: :class:`Parked`, or the queue length if it is full,
        or None if a slot is free now (acquire again).

        The key is also entered in the namespace's waiting index, due when the holder's lease
        would run out, so that a queue whose holder died is resumed by a worker's sweeper.

        A ``handoff`` token starting with :data:`~celery_singleflight.scripts.OWN_COPY` parks an
        *own copy*: the broker delivered the holder's own run again. Its message waits at the
        front, beyond ``max_queued``, and is dropped when that run releases; it runs only if the
        run's lease ends without a release (its worker died), because with the Redis broker
        acknowledging the redelivery also acknowledged the first delivery's message.
        """
        layout = self.layout
        reply = self._park(
            keys=[*layout.runs(key, slots), layout.queue(key), layout.parked(key)],
            args=[f"{task_id}|{handoff}", message, -1 if max_queued is None else max_queued, slots],
        )
        code = int(reply[0])
        if code == -1:
            return None
        if code == -2:
            return int(reply[1])
        ttl_left = int(reply[1]) / 1000.0
        self.client.zadd(layout.waiting(), {key: _due_ms(ttl_left + grace)}, lt=True)
        return Parked(position=code, holder_ttl_left=ttl_left)

    def coalesce(self, key: str, task_id: str, handoff: str, message: str, keep: str, stamp: str,
                 grace: float, slots: int = 1, *, supersede_grace: float = 0.0,
                 supersede_signal: str = "SIGTERM") -> tuple[str, ...] | str | None:
        """Make this run the key's one pending run (``coalesce``, and ``supersede`` with ``keep``
        = "supersede"): the messages of the runs it replaced (to be ended, then
        :meth:`coalesce_answered`); or the task id of the pending run this one gives way to (it
        does not run); or None if a slot is free now (acquire again). Parked like ``queue`` (the
        release hands the key on), and the key is entered in the waiting index for the sweeper;
        a superseded key also in the superseding index, due when its holder is to be revoked."""
        layout = self.layout
        reply = self._coalesce(
            keys=[*layout.runs(key, slots), layout.queue(key), layout.parked(key), layout.coalesce(key)],
            args=[f"{task_id}|{handoff}", message, keep, slots, stamp, _ms(supersede_grace),
                  supersede_signal],
        )
        code = int(reply[0])
        if code == -1:
            return None
        if code == 2:
            return _str(reply[1])
        pipe = self.client.pipeline(transaction=False)
        pipe.zadd(layout.waiting(), {key: _due_ms(int(reply[1]) / 1000.0 + grace)}, lt=True)
        if _str(reply[2]):
            pipe.zadd(layout.superseding(), {key: int(_str(reply[2]))}, nx=True)
        pipe.execute()
        return tuple(_str(m) for m in reply[3:])

    def mark_superseding(self, key: str, due_ms: int) -> None:
        """Enter ``key`` in the superseding index, due at ``due_ms`` (epoch ms), unless it is."""
        self.client.zadd(self.layout.superseding(), {key: due_ms}, nx=True)

    def due_superseding(self, limit: int = 100) -> list[str]:
        """Keys whose superseded holder's grace has run out (or is to be looked at again)."""
        raw: list[Any] = self.client.zrangebyscore(self.layout.superseding(), "-inf", _due_ms(0), start=0,
                                                   num=limit)
        return [_str(k) for k in raw]

    def plan_superseding(self, key: str, seconds: float | None) -> None:
        """Look at ``key`` again in ``seconds``, or (None) forget it."""
        if seconds is None:
            self.client.zrem(self.layout.superseding(), key)
        else:
            self.client.zadd(self.layout.superseding(), {key: _due_ms(seconds)})

    def coalesce_answered(self, key: str, task_id: str) -> None:
        """The runs replaced by ``task_id`` have been ended: forget them."""
        self.client.hdel(self.layout.coalesce(key), f"o:{task_id}")

    def coalesce_owed(self, key: str, task_id: str) -> tuple[str, ...]:
        """At the start of a pending run: the runs it replaced that its caller may not have
        ended (it died first), to end again (ending twice writes the same result). Its send
        stamp is forgotten: it is no longer pending."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hget(self.layout.coalesce(key), f"o:{task_id}")
        pipe.hdel(self.layout.coalesce(key), f"s:{task_id}")
        raw, _ = pipe.execute()
        return () if raw is None else tuple(json.loads(raw))

    # -- ordered=True: the per-key sequence ----------------------------------------------------

    def order_take(self, key: str, task_id: str) -> int:
        """One round trip at send: the next sequence number of ``key`` for ``task_id``."""
        return int(self._order_take(keys=[self.layout.order(key)], args=[task_id, scripts.ORDER_KEEP_MS]))

    def order_gate(self, key: str, seq: int, delivery: str, message: str, timeout: float) -> int:
        """May run ``seq`` (``delivery``: "task id|delivery tag") go on? 1 yes (then
        :meth:`order_advance` once it holds the lease or waits in the queue); 2 it waits for its
        turn (its message is kept; the key is entered in the ordering index, due when its
        predecessor counts as missing); 3 its turn was skipped, it goes on by arrival; 4 another
        delivery of it went on, this one must not run."""
        layout = self.layout
        reply = self._order_gate(keys=[layout.order(key), layout.orderq(key)],
                                 args=[seq, delivery, message, _ms(timeout), scripts.ORDER_KEEP_MS])
        code = int(reply[0])
        if code == 2:
            self.client.zadd(layout.ordering(), {key: _due_ms(int(reply[1]) / 1000.0)}, lt=True)
        return code

    def order_advance(self, key: str, seq: int, delivery: str) -> str:
        """The admitted run ``seq`` holds the lease or waits in the queue: the next number's turn
        comes. The next run's message if it waits (to be sent), else ""."""
        layout = self.layout
        return _str(self._order_advance(keys=[layout.order(key), layout.orderq(key)],
                                        args=[seq, delivery, scripts.ORDER_KEEP_MS]))

    def due_ordering(self, limit: int = 100) -> list[str]:
        """Keys with runs waiting for their turn whose look is due."""
        raw: list[Any] = self.client.zrangebyscore(self.layout.ordering(), "-inf", _due_ms(0), start=0,
                                                   num=limit)
        return [_str(k) for k in raw]

    def order_sweep(self, key: str, timeout: float) -> tuple[str, int | None, int | None]:
        """Look at a key whose runs wait for their turn: (message to send or "", first and last
        sequence number skipped, or None). Plans the next look, or drops the key from the index."""
        layout = self.layout
        reply = self._order_sweep(keys=[layout.order(key), layout.orderq(key)],
                                  args=[_ms(timeout), scripts.ORDER_KEEP_MS, uuid.uuid4().hex])
        code = int(reply[0])
        if code == 0:
            self.client.zrem(layout.ordering(), key)
            if self.client.zrangebyscore(layout.orderq(key), "-inf", "+inf", start=0, num=1):
                # one parked meanwhile
                self.client.zadd(layout.ordering(), {key: _due_ms(timeout)}, lt=True)
            return "", None, None
        if code == 1:
            self.client.zadd(layout.ordering(), {key: _due_ms(int(reply[1]) / 1000.0)})
            return "", None, None
        self.client.zadd(layout.ordering(), {key: _due_ms(timeout)}, lt=True)
        first, last = _str(reply[2]), _str(reply[3])
        return _str(reply[1]), (int(first) if first else None), (int(last) if last else None)

    def join(self, key: str, message: str, grace: float) -> tuple[int, str] | None:
        """Join the holder's run (it will answer with its result): (joined count, holder id),
        or None if the key is free now (acquire again)."""
        layout = self.layout
        reply = self._join(keys=[layout.run(key), layout.joined(key)], args=[message])
        if int(reply[0]) == -1:
            return None
        record = self.record(key)
        deadline = int(record.get("deadline", "0") or 0) / 1000.0 if record else 0.0
        due = max(0.0, deadline - mod_time.time())
        self.client.zadd(layout.waiting(), {key: _due_ms(due + grace)}, lt=True)
        return int(reply[0]), _str(reply[1])

    def settled_joined(self, key: str, token: str) -> list[str]:
        """The joined runs' messages that the release of ``token`` took (kept for a while, so that
        a re-sent release answers the same; empty once that record is gone)."""
        raw = self.client.hget(self.layout.settled(key), token)
        return [] if raw is None else [str(m) for m in json.loads(raw)]

    def note_duplicate(self, key: str, task_id: str, outcome: str) -> bool:
        """Count a duplicate on the holder's status and tell live watchers what happened to it."""
        reply = self._note_duplicate(
            keys=[self.layout.run(key), self.layout.history(key)],
            args=[task_id, outcome, self.history_length],
        )
        return int(reply) == 1

    # -- the sweeper --------------------------------------------------------------------------

    def resume(self, key: str, ttl: float, grace: float, slots: int = 1) -> Settlement | None:
        """Check one waiting key. If a slot is free (its holder ended without handing it on), hand
        it to the first parked run and take the runs joined to a gone holder (the settlement);
        plan the next check, or drop the key from the index when nothing waits."""
        layout = self.layout
        reply = self._resume(
            keys=[*layout.runs(key, slots), layout.queue(key), layout.parked(key), layout.joined(key),
                  layout.settled(key), layout.enqueued(key)],
            args=[_ms(ttl), slots, uuid.uuid4().hex, self.keep_ms],
        )
        code = int(reply[0])
        index = layout.waiting()
        if code == 0:
            self.client.zrem(index, key)
            if self.client.llen(layout.queue(key)) or self.client.llen(layout.joined(key)):
                self.client.zadd(index, {key: _due_ms(grace)}, lt=True)  # arrived meanwhile
            return None
        self.client.zadd(index, {key: _due_ms(int(reply[1]) / 1000.0 + grace)})
        if code != 2:
            return None
        return _settlement(reply, first=2)

    def due_waiting(self, limit: int = 100) -> list[str]:
        """Keys of this namespace whose queue check is due."""
        raw: list[Any] = self.client.zrangebyscore(
            self.layout.waiting(), "-inf", _due_ms(0), start=0, num=limit
        )
        return [_str(k) for k in raw]

    def queued(self, key: str) -> int:
        return int(self.client.llen(self.layout.queue(key)))

    # -- operators and the worker's main process --------------------------------------------

    def force_release(
        self, key: str, by: str, expected_holder: str = "", slot: int = 0, slots: int = 1, ttl: float = 30.0,
        hand_on: bool = True,
    ) -> tuple[str, int, Settlement] | None:
        """Free one ``slot`` of ``key`` whoever holds it (an operator's decision): the released
        task id, its fence and what the release hands on (a parked run to send, joined runs to
        answer), which the caller must settle. ``hand_on=False`` (a caller without the app to
        send messages) leaves both to the queue sweeper. None if it was not held (or, with
        ``expected_holder``, held by another)."""
        layout = self.layout
        reply = self._force_release(
            keys=[*layout.runs(key, slots), layout.history(key, slot), layout.queue(key), layout.parked(key),
                  layout.joined(key), layout.settled(key)],
            args=[by, self.keep_ms, self.history_length, expected_holder, slot + 1, slots, _ms(ttl),
                  "1" if hand_on else "0"],
        )
        if not reply:
            return None
        return _str(reply[0]), int(reply[1]), _settlement(reply, first=2)

    def revise_outcome(self, key: str, task_id: str, recorded: str, known: str) -> bool:
        """Correct the recorded outcome of ``task_id``'s run (e.g. terminated -> revoked)."""
        return int(self._revise(keys=[self.layout.run(key)], args=[task_id, recorded, known])) == 1

    def record(self, key: str, slot: int = 0) -> dict[str, str]:
        """The stored run record of one slot of ``key`` (empty if nothing is known)."""
        raw = self.client.get(self.layout.run(key, slot))
        return {} if raw is None else dict(json.loads(raw))

    def _held_record(self, key: str, slot: int) -> tuple[dict[str, str], float]:
        """(the slot's record if a lease in it has time left, else {}; seconds left)."""
        run = self.layout.run(key, slot)
        if self.cluster:
            raw = self.client.get(run)
            now_ms = clocks_ms(self.client, [run])[0]
        else:
            pipe = self.client.pipeline(transaction=False)
            pipe.time()
            pipe.get(run)
            (seconds, micros), raw = pipe.execute()
            now_ms = int(seconds) * 1000 + int(micros) // 1000
        record = json.loads(raw) if raw else {}
        if not record.get("token"):
            return {}, 0.0
        left = int(record["deadline"]) - now_ms
        return (dict(record), left / 1000.0) if left > 0 else ({}, 0.0)

    def time_left(self, key: str, slot: int = 0) -> float | None:
        """Seconds left on the lease holding one slot of ``key``, by the server's clock (None if
        the slot is not held)."""
        record, left = self._held_record(key, slot)
        return left if record else None

    def holder_record(self, key: str, slot: int = 0) -> dict[str, str]:
        """The record of the run holding one slot of ``key`` (empty if free, ended or run out)."""
        return self._held_record(key, slot)[0]

    # -- enqueue-time dedup and the idempotency window ---------------------------------------

    def mark_enqueued(self, key: str, task_id: str, ttl: float, slots: int = 1) -> str | None:
        """One round trip: claim ``key`` for ``task_id`` about to be sent, or return the task id
        already queued or running for it (a marker whose run is over does not count)."""
        layout = self.layout
        reply = self._enqueue_mark(keys=[layout.enqueued(key), *layout.runs(key, slots)],
                                   args=[task_id, _ms(ttl)])
        return _str(reply) if reply else None

    def clear_enqueued(self, key: str, task_id: str) -> bool:
        return int(self._clear_mark(keys=[self.layout.enqueued(key)], args=[task_id])) == 1

    def remembered(self, idem_key: str) -> str | None:
        raw = self.client.get(self.layout.done(idem_key))
        return None if raw is None else _str(raw)

    def remember(self, idem_key: str, record: str, ttl: float) -> None:
        self.client.set(self.layout.done(idem_key), record, px=_ms(ttl))


_stores: dict[tuple[int, str], LeaseStore] = {}


def store_for(
    url: str | RedisTarget, namespace: str, status_retention: float = 300.0, history_length: int = 100
) -> LeaseStore:
    """The lease store of this process for ``url`` (or the target of the settings, see
    :mod:`.clients`) and ``namespace`` (cached, fork-safe: the client is per process)."""
    client = redis_client(url)
    cache_key = (id(client), namespace)
    store = _stores.get(cache_key)
    if store is None or store.client is not client:
        store = LeaseStore(client, KeyLayout(namespace), status_retention, history_length)
        _stores[cache_key] = store
    return store
