"""One Redis client per URL per process.

Clients are not shared across ``fork()``: a prefork child that inherited its parent's sockets
would interleave replies with it, so the cache is keyed by PID as well.
"""

from __future__ import annotations

import os
import re
import threading
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

__all__ = ["UNREACHABLE", "redacted_url", "redis_client"]

#: the Redis errors that mean "not reachable now" (fail_closed / fail_open apply). Any other
#: RedisError (NOPERM from an ACL, WRONGTYPE, a script error) is a configuration or programming
#: problem and fails loudly instead of being retried as an outage or run unguarded.
UNREACHABLE: tuple[type[Exception], ...] = (
    redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError,
)

_clients: dict[tuple[int, str], redis.Redis] = {}
_lock = threading.Lock()


def redis_client(url: str) -> redis.Redis:
    """A shared client for ``url``, with short timeouts so an outage is seen in seconds."""
    key = (os.getpid(), url)
    client = _clients.get(key)
    if client is None:
        with _lock:
            client = _clients.get(key)
            if client is None:
                client = redis.Redis.from_url(
                    url,
                    socket_connect_timeout=2.0,
                    socket_timeout=5.0,
                    retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
                    health_check_interval=30,
                )
                _clients[key] = client
    return client


def redacted_url(url: str) -> str:
    """``url`` fit for a log line or an error: its password (in the user info or a ``password=``
    query parameter) shown as ``***``."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return "<invalid url>"
    if has_password:
        host = parts.netloc.rpartition("@")[2]
        url = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))
    return re.sub(r"(?i)([?&]password=)[^&#]*", r"\1***", url)


def _forget_after_fork() -> None:
    _clients.clear()


os.register_at_fork(after_in_child=_forget_after_fork)
