"""What a Redis Cluster changes: a call over many locks goes one script call per hash slot,
pipelined per node.

Every script of the protocol touches the keys of one lock, which share a hash slot (the braces
of :mod:`..protocol.layout`), so a Cluster routes each call to the node of its slot. Only a call
that spans many locks (the heartbeat's renewal) must be split: one call per slot, pipelined.
redis-py's cluster pipeline would do; :func:`call_per_slot` writes the calls of every node
before it reads the replies, so any number of slots costs one round trip per node, in
parallel. A ``MOVED``/``ASK`` (resharding, a failover) is followed through the cluster client and
never read as an answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

from redis.commands.core import Script
from redis.crc import key_slot
from redis.exceptions import ConnectionError, NoScriptError, ResponseError, TimeoutError

from .clients import take_connection
from .scripts import loading

__all__ = ["call_per_slot", "clocks_ms", "slot_of"]


def slot_of(key: str) -> int:
    """The hash slot of ``key``."""
    return int(key_slot(key.encode()))


def call_per_slot(
    client: Any, script: Script, calls: Mapping[int, tuple[Sequence[Any], Sequence[Any]]],
    wait: tuple[int, int] | None = None, acked: dict[int, int] | None = None,
) -> tuple[dict[int, Any], int]:
    """Run ``script`` once per hash slot (``calls``: slot -> (keys, args)) on a Cluster, the
    calls of each node written on one of its connections before any reply is read (one round
    trip per node, all nodes at once). Returns the reply per slot and the round trips made.

    A call that meets a redirection (``MOVED``/``ASK`` while a slot moves, a failover), an
    unknown script or a broken connection is sent again through the cluster client, which
    follows redirections and reloads scripts: only scripts that are safe to run twice are
    called this way, and only a reply from the node that owns the slot counts.

    ``wait`` (replicas, timeout ms): each node's calls are followed by ``WAIT`` on their connection,
    and ``acked`` gets per slot how many replicas confirmed them (0 for a slot sent again).
    """
    by_node: dict[str, tuple[Any, list[int]]] = {}
    for slot in calls:
        node = client.nodes_manager.get_node_from_slot(slot)
        by_node.setdefault(node.name, (node, []))[1].append(slot)
    replies: dict[int, Any] = {}
    round_trips = 0
    again: list[int] = []
    pending = by_node
    for attempt in (1, 2):
        round_trips += len(pending)
        unknown = _batch(pending, calls, script.sha, replies, again, wait, acked)
        if not unknown:
            break
        pending = {}
        for node, slots in unknown:
            if attempt == 2:
                again += slots
                continue
            node.redis_connection.script_load(script.script)  # the node forgot it (a restart)
            round_trips += 1
            pending[node.name] = (node, slots)
    for slot in again:
        keys, args = calls[slot]
        replies[slot] = loading(client, script.script, partial(script, keys=keys, args=args, client=client))
    return replies, round_trips + len(again)


def _batch(
    by_node: dict[str, tuple[Any, list[int]]], calls: Mapping[int, tuple[Sequence[Any], Sequence[Any]]],
    sha: str,
    replies: dict[int, Any], again: list[int], wait: tuple[int, int] | None = None,
    acked: dict[int, int] | None = None,
) -> list[tuple[Any, list[int]]]:
    """Send every node its calls, then read the replies into ``replies``; slots to send again
    through the cluster client go to ``again``. Returns (node, slots) that answered NOSCRIPT."""
    unknown: list[tuple[Any, list[int]]] = []
    sent: list[tuple[Any, Any, Any, list[int]]] = []
    for node, slots in by_node.values():  # write every node's calls first ...
        pool = node.redis_connection.connection_pool
        conn = take_connection(pool)
        commands: list[tuple[Any, ...]] = [
            ("EVALSHA", sha, len(calls[slot][0]), *calls[slot][0], *calls[slot][1]) for slot in slots]
        if wait is not None:
            commands.append(("WAIT", *wait))
        try:
            conn.send_packed_command(conn.pack_commands(commands))
        except (ConnectionError, TimeoutError, OSError):
            conn.disconnect()
            pool.release(conn)
            again += slots
            continue
        sent.append((node, pool, conn, slots))
    for node, pool, conn, slots in sent:  # ... then read them: the nodes work at the same time
        missing: list[int] = []
        try:
            for n, slot in enumerate(slots):
                try:
                    replies[slot] = conn.read_response()
                except NoScriptError:
                    missing.append(slot)
                except ResponseError:  # MOVED, ASK, TRYAGAIN ...: through the cluster client
                    again.append(slot)
                except (ConnectionError, TimeoutError, OSError):
                    conn.disconnect()
                    again += slots[n:]
                    break
            else:
                if wait is not None and acked is not None:
                    _read_wait(conn, slots, acked)
        finally:
            pool.release(conn)
        if missing:
            unknown.append((node, missing))
    return unknown


def _read_wait(conn: Any, slots: list[int], acked: dict[int, int]) -> None:
    """Read the ``WAIT`` reply behind a node's calls: the replicas that confirmed them."""
    try:
        count = int(conn.read_response())
    except ResponseError:
        count = 0
    except (ConnectionError, TimeoutError, OSError):
        conn.disconnect()
        count = 0
    for slot in slots:
        acked[slot] = count


def clocks_ms(client: Any, keys: Sequence[str]) -> list[int]:
    """The clock (``TIME``, milliseconds) of the node that holds each of ``keys``: a lease's
    deadline was written by its own node's clock, so its time left is read against that one.
    One ``TIME`` per primary, whatever the number of keys."""
    replies: Any = client.time(target_nodes=client.PRIMARIES)
    if not isinstance(replies, dict):  # a single primary
        replies = {node.name: replies for node in client.get_primaries()}
    clocks = {name: int(reply[0]) * 1000 + int(reply[1]) // 1000 for name, reply in replies.items()}
    fallback = max(clocks.values())
    out = []
    for key in keys:
        node = client.nodes_manager.get_node_from_slot(key_slot(key.encode()))
        out.append(clocks.get(node.name, fallback))
    return out
