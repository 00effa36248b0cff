"""One listener per process and Redis hears the pushes of :mod:`..protocol.inbox`: a holder is
told within milliseconds that a newer run superseded it or an operator force-released it.

The listener is a daemon thread on one pub/sub connection, subscribed to this process's inbox
channel of every namespace whose leases it holds; it starts with the process's first lease (a
prefork child gets its own after the fork). A message names a lease by its run key and token;
the listener finds it among the leases the process holds, which marks itself exactly as a
renewal would, so the body's next ``check()`` or ``progress()`` raises and
``wait_superseded()`` wakes. A message for a lease the process no longer holds is dropped.

Nothing depends on the push: while the connection is down (a failover, a restart) messages are
lost, and the renewal, every ``lock_ttl / 3``, finds the same news in the run record.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from .. import constants
from ..protocol.inbox import Told, inbox_channel
from ..protocol.layout import Layout
from ..protocol.replies import this_process
from .lease import Lease

__all__ = ["Inbox"]

log = logging.getLogger("celery_singleflight.renew")

#: how long one read waits before the listener looks for a new namespace to subscribe to
LISTEN_WAIT = 1.0
#: how long the listener waits before it tries again when the ACL refuses its channel (or user)
NOT_ALLOWED_WAIT = 60.0
_REFUSED = (redis.exceptions.NoPermissionError, redis.exceptions.AuthenticationError)


class Inbox:
    """The push listener of one process for one Redis client. ``leases`` lists what it holds."""

    def __init__(self, client: Any, leases: Callable[[], list[Lease]]) -> None:
        self.client = client
        self._leases = leases
        self._channels: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._refused = False  # the ACL refused the channel (warned once)
        self.heard = 0  # messages that marked a lease; read by tests and benchmarks
        self.subscribed = threading.Event()  # set once the first subscription is confirmed

    def listen(self, layout: Layout) -> None:
        """Hear this process's inbox of ``layout``'s namespace from now on."""
        host, pid = this_process()
        channel = inbox_channel(layout, host, pid)
        with self._lock:
            self._channels.add(channel)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="singleflight-inbox", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = None
            try:
                pubsub = self.client.pubsub(ignore_subscribe_messages=True)
                self._listen(pubsub)
            except Exception as exc:  # the renewal covers what is missed meanwhile
                wait = constants.HEARTBEAT_ERROR_RETRY
                if isinstance(exc, _REFUSED):
                    # an ACL rule from before the push, or a user refused: holders learn at their renewals
                    if not self._refused:
                        log.warning("cannot subscribe to this process's inbox (%s): a holder whose lease"
                                    " is taken away learns it at its next renewal; give the user the"
                                    " rule of `celery singleflight acl`", exc)
                    self._refused, wait = True, NOT_ALLOWED_WAIT
                elif isinstance(exc, redis.RedisError):
                    log.debug("inbox connection lost (%s); renewals cover the gap", exc)
                else:
                    log.exception("inbox listener failed; listening again")
                self._stop.wait(wait)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):  # closing a broken connection
                        pubsub.close()

    def _listen(self, pubsub: Any) -> None:
        heard: set[str] = set()
        while not self._stop.is_set():
            with self._lock:
                new = self._channels - heard
            if new:
                pubsub.subscribe(*sorted(new))
                heard |= new
            message = pubsub.get_message(timeout=LISTEN_WAIT)
            if message is None:
                if heard and pubsub.subscribed:
                    self.subscribed.set()
                continue
            self.subscribed.set()
            if message.get("type") == "message":
                told = Told.decode(message["data"])
                if told is not None:
                    self.deliver(told)

    def deliver(self, told: Told) -> bool:
        """Tell the lease ``told`` is about; False if this process does not hold it (or the
        message's kind is unknown)."""
        for lease in self._leases():
            if lease.token == told.token and lease.layout.run(lease.key, lease.slot) == told.run_key:
                if not lease.hear(told):
                    return False
                self.heard += 1
                return True
        return False
