"""One Lua script on one client, called the shortest way (every script of the protocol goes here).

On a standalone or Sentinel client the call is packed by hand and sent on a connection the
calling thread keeps (:func:`~.clients.kept_connection`), under the client's own retry policy (a
second run of a protocol script is safe): this skips the layers of ``Redis.execute_command`` and
of the pool that a lease does not need (about 55 % of redis-py's cost per call). On a Cluster
it goes the same short way to the node that owns the keys' slot. Any other client (a
pipeline-bound or single-connection client, a client factory's own class) goes through
redis-py's ``Script`` as usual. A server that lost the script gets it again (:func:`loading`).

:meth:`ClientScript.call_then_wait` sends ``WAIT`` right behind the script, in the same write on
the same connection: ``WAIT`` counts the replicas that have every write *of its connection*, so
only that connection can tell whether the script's writes reached them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.crc import key_slot
from redis.sentinel import SentinelConnectionPool

from .clients import UNREACHABLE, kept_connection, take_connection
from .targets import is_cluster

__all__ = ["NOSCRIPT_TRIES", "ClientScript", "loading", "reloaded"]

_T = TypeVar("_T")

#: how many times a call Redis answers NOSCRIPT is loaded and sent again. The server forgot the
#: script (a restart, a failover, a cache flushed by a managed service or evicted): NOSCRIPT ran
#: nothing, so each try is a first run, and a flush between a load and its call costs one more
NOSCRIPT_TRIES = 5


def reloaded(client: Any, source: Any, call: Callable[[], _T]) -> _T:
    """After a NOSCRIPT: ``SCRIPT LOAD`` ``source`` on ``client`` and ``call()`` again, as long as
    the server keeps forgetting it, :data:`NOSCRIPT_TRIES` calls in all."""
    for _ in range(NOSCRIPT_TRIES - 2):
        client.script_load(source)
        with contextlib.suppress(redis.exceptions.NoScriptError):
            return call()
    client.script_load(source)
    return call()


def loading(client: Any, source: Any, call: Callable[[], _T]) -> _T:
    """``call()``, and :func:`reloaded` on NOSCRIPT."""
    try:
        return call()
    except redis.exceptions.NoScriptError:
        return reloaded(client, source, call)


#: errors of a call on a Cluster node's own connection that send it again through the cluster client
_THROUGH_THE_CLUSTER: tuple[type[Exception], ...] = (
    redis.exceptions.MovedError, redis.exceptions.AskError, redis.exceptions.TryAgainError,
    redis.exceptions.NoScriptError, redis.exceptions.ClusterDownError, *UNREACHABLE,
)


class ClientScript:
    """The script ``source`` on ``client``: ``call(keys, args)`` is one round trip."""

    __slots__ = ("client", "cluster", "direct", "script", "send", "sha")

    def __init__(self, client: Any, source: str) -> None:
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
            return self._through_redis_py(keys, args)
        try:  # the hot path: no closure unless Redis forgot the script
            return self._evalsha(keys, args)
        except redis.exceptions.NoScriptError:
            return reloaded(self.client, self.script.script, lambda: self._evalsha(keys, args))

    def _through_redis_py(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        """redis-py's ``Script`` (which loads a forgotten script once), loading it again as long
        as the server keeps forgetting it."""
        return loading(self.client, self.script.script, lambda: self.script(keys=keys, args=args))

    def call_then_wait(self, keys: Sequence[Any], args: Sequence[Any], replicas: int,
                       timeout_ms: int) -> tuple[Any, int]:
        """The script, then ``WAIT replicas timeout_ms`` on the same connection, in one round trip:
        (the script's reply, how many replicas acknowledged every write of that connection so
        far, the script's included). A script error is raised (and ``WAIT``'s answer dropped).
        ``timeout_ms`` must be above zero (``WAIT 0`` blocks for ever) and below the socket timeout."""
        packed = _pack([b"EVALSHA", self.sha, b"%d" % len(keys), *keys, *args]) + _pack(
            [b"WAIT", replicas, timeout_ms])
        if self.cluster:
            return self._pair_on_node(keys, args, packed)
        if not self.direct:
            return self._pair_pipelined(keys, args, replicas, timeout_ms)
        connecting = self.send is _send_connecting
        try:
            return self._pair(packed, connecting)
        except redis.exceptions.NoScriptError:
            return reloaded(self.client, self.script.script, lambda: self._pair(packed, connecting))

    def _pair(self, packed: bytes, connecting: bool) -> tuple[Any, int]:
        conn = kept_connection(self.client)
        if conn is not None:
            return _send_pair(conn, packed, connecting)
        pool = self.client.connection_pool
        conn = take_connection(pool)
        try:
            return _send_pair(conn, packed, connecting)
        finally:
            pool.release(conn)

    def _pair_on_node(self, keys: Sequence[Any], args: Sequence[Any], packed: bytes) -> tuple[Any, int]:
        """:meth:`call_then_wait` on the node that owns the keys' slot. What the short way cannot
        send (a redirection, a node without the script, a connection trouble) goes through the
        cluster client, which follows it, and then the short way once more (a protocol script is
        safe to run twice); failing again, no replica is counted."""
        for _ in range(2):
            conn = self._node_connection(keys)
            if conn is not None:
                with contextlib.suppress(*_THROUGH_THE_CLUSTER):
                    return _send_pair(conn, packed, False)
            reply = self._through_redis_py(keys, args)
        return reply, 0

    def _pair_pipelined(self, keys: Sequence[Any], args: Sequence[Any], replicas: int,
                        timeout_ms: int) -> tuple[Any, int]:
        """Any other client: a pipeline (one connection, one round trip) of the script and ``WAIT``."""
        def pair() -> tuple[Any, int]:
            pipe = self.client.pipeline(transaction=False)
            pipe.evalsha(self.script.sha, len(keys), *keys, *args)
            pipe.wait(replicas, timeout_ms)
            reply, acked = pipe.execute(raise_on_error=False)
            for answer in (reply, acked):
                if isinstance(answer, Exception):
                    raise answer
            return reply, int(acked)

        return loading(self.client, self.script.script, pair)

    def _node_connection(self, keys: Sequence[Any]) -> Any | None:
        first = keys[0]
        cluster: Any = self.client
        node = cluster.nodes_manager.get_node_from_slot(
            key_slot(first if isinstance(first, bytes) else str(first).encode())
        )
        node_client = node.redis_connection
        return None if node_client is None else kept_connection(node_client)

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
            return self._through_redis_py(keys, args)
        try:
            return _send(conn, _pack([b"EVALSHA", self.sha, b"%d" % len(keys), *keys, *args]))
        except _THROUGH_THE_CLUSTER:
            return self._through_redis_py(keys, args)

    def _evalsha(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        packed = _pack([b"EVALSHA", self.sha, b"%d" % len(keys), *keys, *args])
        conn = kept_connection(self.client)
        if conn is not None:
            return self.send(conn, packed)
        pool = self.client.connection_pool
        conn = take_connection(pool)
        try:
            return self.send(conn, packed)
        finally:
            pool.release(conn)


def _send(conn: Any, packed: bytes) -> Any:
    """Send one packed command on ``conn`` and read its reply, under the connection's retry
    policy (a lost reply sends it again: every protocol script is safe to run twice)."""

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


def _send_pair(conn: Any, packed: bytes, connecting: bool) -> tuple[Any, int]:
    """Send a packed script call and ``WAIT`` on ``conn`` and read both replies (both are read
    even when the first is an error, so the connection stays in step), under the connection's
    retry policy: a lost reply sends both again. Not the hot path: one function for direct and
    Sentinel-managed connections (``connecting``: a closed one asks the sentinels)."""

    def send() -> tuple[Any, Any]:
        if connecting and conn._sock is None:
            conn.connect()
        conn.send_packed_command([packed])
        replies: list[Any] = []
        for _ in (1, 2):
            try:
                replies.append(conn.read_response())
            except redis.exceptions.ResponseError as exc:
                replies.append(exc)
        return replies[0], replies[1]

    try:
        reply, acked = conn.retry.call_with_retry(send, lambda _error: conn.disconnect())
    except BaseException:
        conn.disconnect()  # stopped between send and replies: they must not be read as the next ones
        raise
    for answer in (reply, acked):  # the script's error first: WAIT fails on a replica (READONLY)
        if isinstance(answer, Exception):
            raise answer
    return reply, int(acked)


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
    """One command in the Redis protocol: the arguments of a protocol script are bytes, str or
    int (redis-py's general packer spends more on checks than on the bytes)."""
    out = [b"*%d\r\n" % len(items)]
    for item in items:
        if type(item) is not bytes:
            item = item.encode() if isinstance(item, str) else b"%d" % item
        out += (b"$%d\r\n" % len(item), item, b"\r\n")
    return b"".join(out)
