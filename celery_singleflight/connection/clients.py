"""One Redis client per URL per process, and what a Redis error means for a run.

Clients are not shared across ``fork()``: a prefork child that inherited its parent's sockets
would interleave replies with it, so the cache is keyed by PID as well.

redis-py sends a command again when its reply timed out or its connection dropped (``retry``
below); every lease script is safe to run twice (see :mod:`..protocol`), so that is allowed.
"""

from __future__ import annotations

import inspect
import os
import re
import sys
import threading
import time as mod_time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from .. import constants
from ..errors import ReplicasUnavailable
from .targets import RedisTarget, build_client, redacted_url, target_from_settings

__all__ = [
    "UNAVAILABLE_STATES",
    "UNREACHABLE",
    "AttemptClock",
    "client_options",
    "is_unavailable",
    "kept_connection",
    "last_attempt_sent",
    "redacted_url",
    "redis_client",
    "take_connection",
]

_T = TypeVar("_T")

#: the Redis errors that mean "not reachable now" (fail_closed / fail_open apply)
UNREACHABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
)
#: server states that refuse a command for now: out of memory, a replica during a failover,
#: loading a dataset, no primary, a script running too long, a cluster resharding or down, too
#: few replicas for ``min-replicas-to-write``; and a grant too few replicas confirmed (``min_replicas``)
UNAVAILABLE_STATES = ("OOM", "READONLY", "LOADING", "MASTERDOWN", "BUSY", "TRYAGAIN", "CLUSTERDOWN",
                      "NOREPLICAS")
_STATE_CLASSES: tuple[type[Exception], ...] = (
    redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError, redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError, ReplicasUnavailable,
)
# the error code opens the reply, or follows a '-' inside a script error (Redis 6.2 wraps them)
_STATE_CODE = re.compile(r"(?:^|-)(" + "|".join(UNAVAILABLE_STATES) + r")\b")


def is_unavailable(exc: BaseException) -> bool:
    """True when ``exc`` means "Redis cannot serve this now": unreachable, or one of
    :data:`UNAVAILABLE_STATES` (then ``fail_closed`` retries and ``fail_open`` runs unguarded).

    Any other error (NOPERM from an ACL, WRONGTYPE, a script error) is a configuration or
    programming problem: it fails loudly instead of being waited out or run unguarded.
    """
    if isinstance(exc, UNREACHABLE + _STATE_CLASSES):
        return True
    if isinstance(exc, redis.exceptions.NoPermissionError) or not isinstance(exc, redis.ResponseError):
        return False
    return _STATE_CODE.search(str(exc)) is not None

_attempt = threading.local()


class AttemptClock(Retry):
    """redis-py's :class:`~redis.retry.Retry` that also notes, per thread, when the last attempt
    of a command was sent (:func:`last_attempt_sent`).

    A lease counts from when the call that took it was sent. When a reply is lost and redis-py
    sends the call again, the second run is what the caller gets (and, for an acquire, what
    restarts the lease's time), so the clock must start at that second send, not the first.
    It also counts, per thread, the sends that failed (each sent again within the retries:
    :func:`failed_sends`): a release told ``EARLIER`` learns from it whether it was sent twice
    (protocol/lease.py). Nothing more is done on a send that succeeds.
    """

    def call_with_retry(
        self, do: Callable[[], _T], fail: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> _T:
        def attempt() -> _T:
            _attempt.sent = mod_time.monotonic()
            return do()

        def failed(*error: Any) -> Any:
            _attempt.failed = getattr(_attempt, "failed", 0) + 1
            return fail(*error)

        result: _T = super().call_with_retry(attempt, failed, *args, **kwargs)
        return result


def last_attempt_sent(default: float) -> float:
    """When this thread last sent an attempt of a command through a client of
    :func:`redis_client` (monotonic), or ``default`` when that is later (other clients)."""
    return max(default, getattr(_attempt, "sent", default))


def failed_sends() -> int:
    """How many sends of commands through an :class:`AttemptClock` failed in this thread so far
    (a reply lost or a connection cut: redis-py sends the command again). Unchanged across a
    call: the call was sent once (a reconnect that failed inside it counts too: read as twice)."""
    return getattr(_attempt, "failed", 0)


def counts_sends(client: Any) -> bool:
    """Whether ``client`` sends through an :class:`AttemptClock` (the clients the library builds;
    not a Cluster's node connections, nor a client ``singleflight_redis_client`` returns)."""
    get_retry = getattr(client, "get_retry", None) if type(client) is redis.Redis else None
    return get_retry is not None and isinstance(get_retry(), AttemptClock)


_clients: dict[tuple[int, str], Any] = {}
_lock = threading.Lock()


def redis_client(target: str | RedisTarget) -> Any:
    """The shared client of this process for ``target`` (a URL, or the settings read by
    :func:`~.targets.target_from_settings`), with short timeouts so an outage is seen in seconds.

    A :class:`redis.Redis` for standalone and Sentinel (the master, found through the sentinels
    again after a failover), a :class:`redis.cluster.RedisCluster` for a Cluster, or whatever
    ``singleflight_redis_client`` returns.
    """
    key = (os.getpid(), target if isinstance(target, str) else target.cache_key)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                if isinstance(target, str):
                    target = target_from_settings(target)
                client = _clients[key] = build_client(target, client_options(target))
    return client


def client_options(target: RedisTarget, retry_class: type[Any] = AttemptClock) -> dict[str, Any]:
    """The connection options of every client the library builds for ``target``: short timeouts
    and a few retries, so an outage is seen in seconds. ``retry_class``: ``redis.asyncio``'s
    ``Retry`` for an asyncio client (the blocking ones also note when each attempt was sent)."""
    backoff = ExponentialBackoff(cap=constants.CLIENT_BACKOFF_CAP, base=constants.CLIENT_BACKOFF_BASE)
    common: dict[str, Any] = {
        "socket_connect_timeout": constants.CONNECT_TIMEOUT,
        "socket_timeout": constants.SOCKET_TIMEOUT,
        "retry": retry_class(backoff, constants.CLIENT_RETRIES),
    }
    if not target.cluster:
        common["health_check_interval"] = constants.CLIENT_HEALTH_CHECK
    return common


_kept = threading.local()


def kept_connection(client: redis.Redis) -> Any | None:
    """A connection of ``client``'s pool that the calling thread keeps for its lease scripts, or
    None under green threads (gevent, eventlet: a task is a short-lived greenlet, which would
    take a connection each and give it back only when collected), where the caller takes one
    from the pool per call.

    Taking a connection from the pool and giving it back costs more than the script call itself
    (a lock, a poll for stale data, bookkeeping): about 80,000 instructions of redis-py per call.
    A thread that runs tasks or renews leases calls again and again, so it keeps one; the
    connection goes back to the pool when the thread ends. A connection left with unread data by
    an error is disconnected by redis-py itself, and reconnects on the next send.
    """
    pid = os.getpid()
    table: dict[int, tuple[redis.Redis, Any]] | None = getattr(_kept, "table", None)
    if table is None or getattr(_kept, "pid", None) != pid:  # a new thread, or a forked child
        if _green_threads():
            return None
        table = _kept.table = {}
        _kept.pid = pid
    found = table.get(id(client))
    if found is not None and found[0] is client:
        return found[1]
    pool = client.connection_pool
    conn = take_connection(pool)
    table[id(client)] = (client, conn)
    weakref.finalize(threading.current_thread(), _give_back, pool, conn, pid)
    return conn


def take_connection(pool: Any) -> Any:
    """A connection from ``pool``: redis-py 5.0 to 5.2 require a command name, later versions
    deprecate passing one."""
    named = inspect.signature(pool.get_connection).parameters.get("command_name")
    if named is not None and named.default is inspect.Parameter.empty:
        return pool.get_connection("EVALSHA")
    return pool.get_connection()


def _green_threads() -> bool:
    """Whether this process runs on green threads (gevent or eventlet patched the socket module)
    or the calling thread was not started by ``threading`` (no end to wait for)."""
    if isinstance(threading.current_thread(), threading._DummyThread):
        return True
    gevent = sys.modules.get("gevent.monkey")
    if gevent is not None and gevent.is_module_patched("socket"):
        return True
    eventlet = sys.modules.get("eventlet.patcher")
    return eventlet is not None and bool(eventlet.is_monkey_patched("socket"))


def _give_back(pool: Any, conn: Any, pid: int) -> None:
    if os.getpid() == pid:
        pool.release(conn)


def _forget_after_fork() -> None:
    global _lock
    _clients.clear()
    _lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_forget_after_fork)
