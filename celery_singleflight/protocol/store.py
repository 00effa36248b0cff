"""The protocol as one object per namespace and Redis: :class:`LeaseStore`, a thin facade over
the calls of each feature, and the whole tables: every Redis key (:data:`PARTS`,
:class:`KeyLayout`) and every script (:data:`SCRIPTS`).

Each call is one round trip (one script, or one pipeline) and answers plain data. Every script
is safe to run twice (see :mod:`.lease`), so a reply lost and re-sent by redis-py changes
nothing: the caller gets the answer the first run gave. The library makes no Redis call but
through this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import constants
from ..connection.clients import redis_client
from ..connection.targets import RedisTarget
from . import (
    controls,
    delayed,
    epoch,
    fair,
    fences,
    handoff,
    inbox,
    journaled,
    lease,
    marks,
    newest,
    order,
    started,
    timing,
)
from .context import Context, ms
from .controls import ControlCalls
from .delayed import DelayedCalls
from .epoch import EpochCalls
from .fair import FairCalls
from .handoff import HandoffCalls
from .layout import HISTORY, RUN, Layout, Part, parts_table
from .lease import LeaseCalls, RenewedLease
from .lua import Script
from .marks import MarkCalls
from .newest import NewestCalls
from .order import OrderCalls
from .reads import RunReads
from .record import RunRecord
from .server import MARK
from .started import StartedCalls
from .timing import TimeCalls

__all__ = ["CHANNELS", "INDEXES", "PARTS", "SCRIPTS", "USER_SCRIPTS", "KeyLayout", "LeaseStore", "keys_table",
           "store_for"]

#: every Redis key of one lock (``<ns>:{<key>}:<name>``), in the order of the docs' table
PARTS: tuple[Part, ...] = (RUN, HISTORY, *handoff.PARTS, marks.ENQUEUED, *newest.PARTS, *order.PARTS,
                           marks.DONE, *timing.PARTS, delayed.DELAYED, delayed.DELAYED_ENDS, *fair.PARTS,
                           *controls.PARTS, journaled.JOURNALED)
#: the keys of a whole namespace (``<ns>:<name>``), outside any lock's hash slot
INDEXES: tuple[Part, ...] = (handoff.WAITING, newest.SUPERSEDING, order.ORDERING, delayed.DELAYED_DUE,
                             delayed.WORKERS, started.STARTED, epoch.EPOCH_KEY, MARK)
#: the pub/sub channels of a namespace (``<ns>:<name>:...``)
CHANNELS: tuple[Part, ...] = (inbox.INBOX,)
#: every script the library runs on the lease Redis (the worker's start loads them all)
SCRIPTS: tuple[Script, ...] = (*lease.SCRIPTS, *handoff.SCRIPTS, *marks.SCRIPTS, *newest.SCRIPTS,
                               *order.SCRIPTS, *timing.SCRIPTS, *delayed.SCRIPTS, *epoch.SCRIPTS,
                               *fair.SCRIPTS, *controls.SCRIPTS)
#: and the one it runs on the user's Redis (``fencing.fenced_set``)
USER_SCRIPTS: tuple[Script, ...] = fences.SCRIPTS


class KeyLayout(Layout):
    """Where the Redis keys of one namespace live: a method per part of :data:`PARTS` (and
    :data:`INDEXES`), so that a misspelt part is an AttributeError, not a new key."""

    __slots__ = ()


def _part_method(part: Part) -> Any:
    if part.index:
        return lambda self: self.index(part)
    if part.per_slot:
        return lambda self, key, slot=0: self.key(part, key, slot)
    return lambda self, key: self.key(part, key)


for _part in (*PARTS, *INDEXES):
    if not hasattr(KeyLayout, _part.name):
        setattr(KeyLayout, _part.name, _part_method(_part))


def keys_table(namespace: str = "sf", key: str = "sync:42", idempotency_key: str = "msg:acme:7") -> str:
    """The Markdown table of every Redis key of the protocol, for the docs."""
    return parts_table((*PARTS, *INDEXES, *CHANNELS), namespace, key, idempotency_key)


class LeaseStore:
    """The protocol of one namespace on one Redis: the lease's own calls here, each feature's
    on its attribute (``store.handoff.park(...)``, ``store.order.gate(...)``).

    ``status_retention`` (seconds) is how long a run's record (its outcome, its fence, the proof
    of its release) outlives it, at least :data:`~..constants.REPLAY_WINDOW`; ``history_length``
    caps the history stream of a key. ``min_replicas`` (0: off): a grant or a renewal counts only
    once that many replicas confirmed it within ``replica_timeout`` seconds (:mod:`.replicas`).
    """

    def __init__(self, client: Any, layout: Layout, status_retention: float = 300.0,
                 history_length: int = 100, min_replicas: int = 0, replica_timeout: float = 0.5) -> None:
        self.client = client
        self.layout = layout if isinstance(layout, KeyLayout) else KeyLayout(layout.namespace)
        self.status_retention = status_retention
        self.history_length = history_length
        self.keep_ms = ms(max(status_retention, constants.REPLAY_WINDOW))
        ctx = self.ctx = Context(client, self.layout, self.keep_ms, history_length)
        self.cluster = ctx.cluster
        self.lease = LeaseCalls(ctx)
        self.handoff = HandoffCalls(ctx)
        self.newest = NewestCalls(ctx)
        self.order = OrderCalls(ctx)
        self.marks = MarkCalls(ctx)
        self.timing = TimeCalls(ctx)
        self.delayed = DelayedCalls(ctx)
        self.started = StartedCalls(ctx)
        self.epoch = EpochCalls(ctx)
        self.fair = FairCalls(ctx)
        self.reads = RunReads(ctx)
        self.controls = ControlCalls(ctx)
        self.min_replicas = min_replicas
        self.replica_timeout = replica_timeout
        if min_replicas:
            self.lease.wait_for_replicas(min_replicas, replica_timeout)
        # the lease's own calls, one attribute lookup shorter (every run makes two of them)
        self.acquire = self.lease.acquire
        self.release = self.lease.release

    def renew(self, leases: Sequence[RenewedLease]) -> list[int]:
        """Renew any number of leases in one round trip (see :meth:`.lease.LeaseCalls.renew`)."""
        return self.lease.renew(leases)

    @property
    def renew_round_trips(self) -> int:
        return self.lease.renew_round_trips

    def record(self, key: str, slot: int = 0) -> RunRecord:
        """The stored run record of one slot of ``key`` (empty if nothing is known)."""
        return self.reads.record(key, slot)

    def holder_record(self, key: str, slot: int = 0) -> RunRecord:
        """The record of the run holding one slot of ``key`` (empty if free, ended or run out)."""
        found, _ = self.reads.held(key, slot)
        return found if found is not None else RunRecord()

    def time_left(self, key: str, slot: int = 0) -> float | None:
        """Seconds left on the lease holding one slot of ``key``, by the server's clock (None if
        the slot is not held)."""
        found, left = self.reads.held(key, slot)
        return left if found is not None else None


_stores: dict[tuple[int, str, int, float], LeaseStore] = {}


def store_for(
    url: str | RedisTarget, namespace: str, status_retention: float = 300.0, history_length: int = 100,
    min_replicas: int = 0, replica_timeout: float = 0.5,
) -> LeaseStore:
    """The lease store of this process for ``url`` (or the target of the settings) and
    ``namespace`` (cached, fork-safe: the client is per process), whose grants wait for
    ``min_replicas`` replicas (0: none)."""
    client = redis_client(url)
    cache_key = (id(client), namespace, min_replicas, replica_timeout if min_replicas else 0.0)
    store = _stores.get(cache_key)
    if store is None or store.client is not client:
        store = LeaseStore(client, KeyLayout(namespace), status_retention, history_length, min_replicas,
                           replica_timeout)
        _stores[cache_key] = store
    return store
