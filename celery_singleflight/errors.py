"""The error tree. Every error carries what a user needs to act on it, and pickles.

    SingleFlightError
    ├── ConfigurationError      (bad setting or task option; raised at definition / worker start)
    │   └── KeyTemplateError    (a lock_key template that cannot be rendered)
    │       └── UnstableKeyError (an argument whose rendering holds a memory address)
    ├── LockHeld                (the `raise` outcome of a duplicate: key, holder, time left)
    │   ├── QueueFull           (the `queue` policy's overflow outcome: max_queued runs wait)
    │   └── KeyPaused           (a direct or eager call of a paused key)
    ├── LeaseLost               (the lease of the running task is gone)
    │   └── Superseded          (a newer run of the key took over: ``on_duplicate="supersede"``)
    ├── NotInsideRun            (lease/progress used outside a SingleFlightTask run)
    ├── ProgressError           (a progress() call with bad values; also a ValueError)
    ├── ProtocolMismatch        (a key's record was written by another protocol version)
    ├── RedisUnavailable        (Redis could not be reached and the task failed closed)
    ├── ReplicasUnavailable     (a grant not acknowledged by ``min_replicas`` replicas; also a RedisError)
    ├── RunLost                 (a run that waited, then started, was lost with its worker)
    ├── WaitingLost             (a waiting run lost with the lease Redis's data, not sent again)
    ├── RetryAfter              (raised by a task: pause its key, run again first; also a celery Retry)
    └── Throttled               (the ``RETRY`` meta of a run over its key_rate_limit: not a failure)

Celery serializes task exceptions as (type, module, args) and rebuilds them on the caller
side, so every constructor passes all of its arguments to ``super().__init__``.
"""

from __future__ import annotations

from celery.exceptions import Retry
from redis.exceptions import RedisError

__all__ = [
    "ConfigurationError",
    "KeyPaused",
    "KeyTemplateError",
    "LeaseLost",
    "LockHeld",
    "NotInsideRun",
    "ProgressError",
    "ProtocolMismatch",
    "QueueFull",
    "QueueTimeout",
    "RedisUnavailable",
    "ReplicasUnavailable",
    "RetryAfter",
    "RunLost",
    "SingleFlightError",
    "Throttled",
    "Superseded",
    "UnstableKeyError",
    "WaitingLost",
]


class SingleFlightError(Exception):
    """Base class of every error raised by celery_singleflight."""


class ConfigurationError(SingleFlightError, ValueError):
    """A setting or task option is invalid; the message says what to change."""


class KeyTemplateError(ConfigurationError):
    """A lock key template names something the task does not have, or renders badly."""


class UnstableKeyError(KeyTemplateError):
    """An argument renders differently per process (a memory address): the key would drift."""


class LockHeld(SingleFlightError):
    """Another run holds the key: the outcome of a duplicate under ``on_duplicate="raise"``."""

    def __init__(self, key: str, holder: str | None = None, ttl_left: float | None = None) -> None:
        super().__init__(key, holder, ttl_left)
        self.key = key
        self.holder = holder
        self.ttl_left = ttl_left

    def __str__(self) -> str:
        left = "unknown" if self.ttl_left is None else f"{self.ttl_left:.1f}s"
        return f"key {self.key!r} is held by task {self.holder or '<unknown>'} (lease time left: {left})"


class QueueFull(LockHeld):
    """The key's queue already has ``max_queued`` parked runs; this duplicate was not parked."""

    def __init__(self, key: str, holder: str | None = None, ttl_left: float | None = None,
                 queued: int = 0) -> None:
        SingleFlightError.__init__(self, key, holder, ttl_left, queued)
        self.key = key
        self.holder = holder
        self.ttl_left = ttl_left
        self.queued = queued

    def __str__(self) -> str:
        return f"{super().__str__()}; its queue is full ({self.queued} waiting, max_queued reached)"


class LeaseLost(SingleFlightError):
    """The lease of this run expired or was taken over; another run may now hold the key."""

    def __init__(self, key: str, reason: str = "") -> None:
        super().__init__(key, reason)
        self.key = key
        self.reason = reason

    def __str__(self) -> str:
        return f"lease on key {self.key!r} was lost" + (f": {self.reason}" if self.reason else "")


class Superseded(LeaseLost):
    """A newer run of the key (``by``) superseded this one (``on_duplicate="supersede"``): stop
    soon; after ``supersede_grace`` seconds from ``at`` (epoch seconds) the run is revoked."""

    def __init__(
        self, key: str, by: str = "", at: float | None = None, grace_left: float | None = None
    ) -> None:
        SingleFlightError.__init__(self, key, by, at, grace_left)
        self.key = key
        self.by = by
        self.at = at
        self.grace_left = grace_left
        self.reason = f"superseded by task {by or '<unknown>'}"

    def __str__(self) -> str:
        left = ""
        if self.grace_left is not None:
            left = f"; revoked in {max(self.grace_left, 0.0):.1f}s unless it ends"
        return f"run on key {self.key!r} was superseded by task {self.by or '<unknown>'}{left}"


class NotInsideRun(SingleFlightError):
    """``self.lease`` or a lease operation was used outside a guarded run."""


class ProgressError(SingleFlightError, ValueError):
    """``progress()`` was given a value it cannot record; the message names it."""


class ProtocolMismatch(SingleFlightError):
    """A run record of ``key`` was written by protocol version ``found``, which this library
    (version ``ours``) cannot read: a worker of another release holds or held the key. The run
    does not go ahead unguarded; a task is re-sent as under ``fail_closed``."""

    def __init__(self, key: str, found: str = "", ours: str = "") -> None:
        super().__init__(key, found, ours)
        self.key = key
        self.found = found
        self.ours = ours

    def __str__(self) -> str:
        return (
            f"key {self.key!r}: its run record was written by protocol version {self.found}, and this"
            f" worker speaks version {self.ours}; stop the workers of the other version (or let them"
            " finish) before this one takes the key"
        )


class RedisUnavailable(SingleFlightError):
    """Redis could not serve ``key`` (unreachable, or refusing for now: OOM, READONLY, LOADING,
    ...) and the run did not go ahead unguarded (``fail_closed``, or a ``hold()``)."""

    def __init__(self, key: str, detail: str = "", waited: float = 0.0) -> None:
        super().__init__(key, detail, waited)
        self.key = key
        self.detail = detail
        self.waited = waited

    def __str__(self) -> str:
        return (
            f"Redis could not guard key {self.key!r} for {self.waited:.1f}s: {self.detail}. Nothing ran"
            " unguarded (fail_closed); check that Redis is reachable, has memory left and is a primary"
        )


class ReplicasUnavailable(SingleFlightError, RedisError):
    """The primary granted ``key``, but only ``acknowledged`` of the ``needed`` replicas
    (``min_replicas``) confirmed the grant within ``timeout`` seconds: a failover now could lose
    the lease. It counts as "Redis unavailable" (``on_redis_error``); the grant is released."""

    def __init__(self, key: str, needed: int = 1, acknowledged: int = 0, timeout: float = 0.0) -> None:
        super().__init__(key, needed, acknowledged, timeout)
        self.key = key
        self.needed = needed
        self.acknowledged = acknowledged
        self.timeout = timeout

    def __repr__(self) -> str:  # redis-py's RedisError shows only the class
        return f"ReplicasUnavailable({self.key!r}, {self.needed}, {self.acknowledged}, {self.timeout})"

    def __str__(self) -> str:
        return (f"key {self.key!r}: {self.acknowledged} of the {self.needed} replica(s) min_replicas asks"
                f" for confirmed the grant within {self.timeout:g}s")


class RunLost(SingleFlightError):
    """The result of run ``task_id`` on ``key``, lost with its whole worker (``worker``: Celery's
    hostname): its lease ran out unreleased, and a sweeper set its result to FAILURE with this
    error in place of the state it had waited in (``QUEUED``, ``DEBOUNCED``, ``RETRY``)."""

    def __init__(self, key: str, task_id: str = "", worker: str = "") -> None:
        super().__init__(key, task_id, worker)
        self.key = key
        self.task_id = task_id
        self.worker = worker

    def __str__(self) -> str:
        return (f"task {self.task_id or '<unknown>'} on key {self.key!r} was lost with worker"
                f" {self.worker or '<unknown>'}: its lease ran out unreleased")


class WaitingLost(SingleFlightError):
    """Run ``task_id`` waited in the lease Redis on ``key`` (``what``: how it waited, and why it
    could not be sent again), and that Redis lost its data: the worker that parked it set its
    result to FAILURE with this error instead of leaving it waiting forever."""

    def __init__(self, key: str, task_id: str = "", what: str = "") -> None:
        super().__init__(key, task_id, what)
        self.key = key
        self.task_id = task_id
        self.what = what

    def __str__(self) -> str:
        return (f"task {self.task_id or '<unknown>'} waiting on key {self.key!r} was lost with the lease"
                f" Redis's data" + (f": {self.what}" if self.what else ""))


class Throttled(SingleFlightError):
    """A run over its key's ``key_rate_limit``: re-sent to start at ``planned`` (epoch seconds),
    ``wait`` seconds after it came. Never raised to a caller: it is the ``RETRY`` state's meta
    (Celery stores an exception there), readable as ``AsyncResult.info.throttled``."""

    def __init__(self, key: str, limit: str = "", planned: float = 0.0, wait: float = 0.0) -> None:
        super().__init__(key, limit, planned, wait)
        self.key = key
        self.limit = limit
        self.planned = planned
        self.wait = wait

    @property
    def throttled(self) -> dict[str, object]:
        """The meta as a dict: key, limit, planned, wait."""
        return {"key": self.key, "limit": self.limit, "planned": self.planned, "wait": self.wait}

    def __str__(self) -> str:
        return f"key {self.key!r} is over key_rate_limit={self.limit}: starts in {self.wait:.3f}s"


class QueueTimeout(SingleFlightError):
    """A run waited longer than its ``queue_timeout`` (``timeout``) for its fair slot at ``gate``
    (``waited`` seconds): it ends FAILURE without running. ``key``: its lock key ('' when a
    sweeper took it out of the queue, which knows its ``fair_key`` only)."""

    def __init__(self, key: str, gate: str = "", waited: float = 0.0, timeout: float = 0.0,
                 fair_key: str = "") -> None:
        super().__init__(key, gate, waited, timeout, fair_key)
        self.key = key
        self.gate = gate
        self.waited = waited
        self.timeout = timeout
        self.fair_key = fair_key

    def __str__(self) -> str:
        who = f"on key {self.key!r}" if self.key else f"of fair key {self.fair_key!r}"
        return (f"run {who} waited {self.waited:.1f}s for a slot at {self.gate!r}, longer than its"
                f" queue_timeout of {self.timeout:.1f}s; it did not run")


class KeyPaused(LockHeld):
    """A direct or eager call found its key paused (``ttl_left``: seconds left, -1 until resumed):
    it has no message to park, so it fails."""


class RetryAfter(SingleFlightError, Retry):  # type: ignore[misc]  # celery ships no types
    """Raised in a task's body (``raise RetryAfter(30)``, e.g. on a downstream 429): the run
    releases its key, the key is paused ``seconds`` for every worker, and this run waits at the
    front of the key's queue to run first when the pause ends, without spending ``max_retries``.
    A :class:`celery.exceptions.Retry`, so the task shows ``RETRY`` meanwhile."""

    def __init__(self, seconds: float, key: str | None = None) -> None:
        if not seconds > 0:
            raise ValueError(f"RetryAfter({seconds!r}): the pause must be above zero seconds")
        Retry.__init__(self, message=None, exc=None, when=seconds)
        self.args = (seconds, key)
        self.seconds = float(seconds)
        self.key = key

    def __reduce__(self) -> tuple[type[RetryAfter], tuple[float, str | None]]:
        return type(self), (self.seconds, self.key)

    def __str__(self) -> str:
        where = f"key {self.key!r}" if self.key else "its key"
        return f"retry after {self.seconds:g}s: {where} is paused that long, and this run goes first then"
