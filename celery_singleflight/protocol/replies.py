"""What the protocol answers: plain data, carried from a script's reply to whoever acts on it.

A release (and an acquire or a sweep that hands a key on) returns a :class:`Settlement`: what
must happen next. Exactly one function carries it out (:func:`celery_singleflight.run.settle.settle`),
whichever path released the key.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

__all__ = ["Acquired", "DeadHolder", "Held", "Holder", "Parked", "Settlement", "this_process"]

_HOST = socket.gethostname()
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


def _pid() -> int:
    return _PID[0]


def this_process() -> tuple[str, int]:
    """The host and pid a run record of this process names (its inbox's address)."""
    return _HOST, _PID[0]


@dataclass(frozen=True)
class Holder:
    """Who is asking for (or holds) a lease. Host and pid are read once per process."""

    task_id: str
    worker: str = ""
    task_name: str = ""
    host: str = _HOST
    pid: int = field(default_factory=_pid)

    @cached_property
    def fields(self) -> str:
        """The holder's members of a run record, JSON-encoded (the acquire script adds them to
        the record as they are); all but the task id are the same for every run of a task in a
        process, and encoded once."""
        rest = _constant_fields(self.task_name, self.worker, self.host, self.pid)
        return f'"task_id":{_encode(self.task_id)},{rest}'


_encode = json.encoder.encode_basestring_ascii  # a JSON string literal, as json.dumps(str) gives


@lru_cache(maxsize=1024)
def _constant_fields(task_name: str, worker: str, host: str, pid: int) -> str:
    return (f'"task_name":{_encode(task_name)},"worker":{_encode(worker)},"host":{_encode(host)},'
            f'"pid":"{pid}"')


@dataclass(frozen=True)
class Acquired:
    """The lease is ours: its fencing token, when Redis granted it (epoch seconds), and which of
    the key's ``max_concurrency`` slots it is (0 for a plain one-at-a-time key)."""

    fence: int
    since: float
    slot: int = 0
    #: the run whose lease ran out unreleased on this slot, replaced by this one (it is ended)
    dead: DeadHolder | None = None
    acquired = True


@dataclass(frozen=True)
class DeadHolder:
    """A run whose lease ran out unreleased (its worker died): its task id, worker, task name."""

    task_id: str
    worker: str
    task_name: str


@dataclass(frozen=True)
class Held:
    """Someone else holds the key: their task id and the lease time they have left.

    ``handoff`` is set when the key was free but runs were parked: the first of them got the key
    and its message (this) must be sent to the broker; :func:`~..run.settle.settle` does it.
    ``trace`` is the holder's trace context (a W3C traceparent, '' when it is not traced): a
    duplicate's span links to it.
    """

    holder: str
    ttl_left: float
    handoff: str | None = None
    copy: bool = False  # another copy of a parked run's message, whose run took its slot before
    dead: DeadHolder | None = None  # with ``handoff``: the run that died holding the slot handed on
    trace: str = ""
    acquired = False


@dataclass(frozen=True)
class Parked:
    """A duplicate parked in the key's queue: its place, and the holder's lease time left."""

    position: int
    holder_ttl_left: float


@dataclass(frozen=True)
class Settlement:
    """What a release (or a hand-on) obliges the caller to do, as data.

    ``ours``: the lease was this run's (False: it had run out and another run took the key).
    ``handoff``: the message of the parked run now handed the key, to send to the broker.
    ``joined``: the messages of runs that joined this one, to answer with its result (or error).
    ``dead``: the runs whose leases ran out unreleased on the slots the script replaced (their
    workers died), to end as lost. Truthy when ``ours``.
    """

    ours: bool
    handoff: str | None = None
    joined: tuple[str, ...] = ()
    dead: tuple[DeadHolder, ...] = ()

    def __bool__(self) -> bool:
        return self.ours

    @property
    def duties(self) -> bool:
        """True when something is left to do (a message to send, runs to answer or end)."""
        return self.handoff is not None or bool(self.joined) or bool(self.dead)
