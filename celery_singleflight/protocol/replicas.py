"""``min_replicas``: a grant, and a renewal, count only once enough replicas have them.

Redis replicates asynchronously: a primary that dies right after an ACQUIRE may take the grant
with it, and the replica promoted in its place hands the key to a second run while the first
one's body runs. With ``min_replicas=N`` the ACQUIRE is followed by ``WAIT N timeout`` on the
connection that sent it, in the same round trip
(:meth:`~..connection.scripts.ClientScript.call_then_wait`). A grant fewer replicas confirmed
raises :class:`~..errors.ReplicasUnavailable`, which a run takes as "Redis unavailable"
(``on_redis_error``), after releasing the grant. Only a grant's ``WAIT`` matters: a duplicate's
answer is the same whatever the replicas have.

A renewal is confirmed the same way: a renewal fewer replicas confirmed does not move the
lease's clock forward (``confirmed_at``), so a holder whose renewals the replicas do not get
counts its lease lost by its own clock, as the promoted replica will.

Off (``min_replicas=0``, the default) none of this runs: the store calls the plain ACQUIRE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..connection.scripts import ClientScript
from ..errors import ReplicasUnavailable
from .context import ms, text
from .layout import Layout

__all__ = ["AcquireWaiting", "ReplicatedLease", "Renewing", "renew_confirmed"]


class AcquireWaiting:
    """ACQUIRE followed by ``WAIT``: called as the script is (``keys=``, ``args=``), it answers
    the script's reply, or raises :class:`ReplicasUnavailable` for a grant (a string:
    ``'fence:since:slot'``) fewer than ``replicas`` replicas confirmed within ``timeout`` seconds."""

    __slots__ = ("layout", "replicas", "script", "timeout", "timeout_ms")

    def __init__(self, script: ClientScript, layout: Layout, replicas: int, timeout: float) -> None:
        self.script = script
        self.layout = layout
        self.replicas = replicas
        self.timeout = timeout
        self.timeout_ms = ms(timeout)

    def __call__(self, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        reply, acked = self.script.call_then_wait(keys, args, self.replicas, self.timeout_ms)
        if acked < self.replicas and not isinstance(reply, list):
            name = text(keys[0])
            raise ReplicasUnavailable(self.layout.user_key(name) or name, self.replicas, acked, self.timeout)
        return reply


class ReplicatedLease(Protocol):
    """What :func:`renew_confirmed` needs of a lease: what its renewal names
    (:class:`~.lease.RenewedLease`), and its store's ``min_replicas`` and ``replica_timeout``."""

    key: str
    token: str
    slot: int
    ttl: float

    @property
    def layout(self) -> Layout: ...

    @property
    def store(self) -> Any: ...


class Renewing(Protocol):
    """What :func:`renew_confirmed` needs of a store (a :class:`~.store.LeaseStore`)."""

    lease: Any

    def renew(self, leases: Sequence[Any]) -> list[int]: ...


def renew_confirmed(store: Renewing, leases: Sequence[ReplicatedLease]) -> tuple[list[int], list[bool]]:
    """Renew ``leases`` in one round trip: per lease its code, and whether the renewal counts
    (as many replicas confirmed it as the lease's store asks for). With none asking, the plain
    renewal; else one ``WAIT`` for the most any asks, behind the renewal on its connection."""
    need, timeout = 0, 0.0
    for lease in leases:
        wanted = getattr(lease.store, "min_replicas", 0)
        if wanted:
            need, timeout = max(need, wanted), max(timeout, lease.store.replica_timeout)
    if not need:
        return store.renew(leases), [True] * len(leases)
    codes, acked = store.lease.renew_then_wait(leases, need, timeout)
    confirmed = [count >= getattr(lease.store, "min_replicas", 0) for lease, count in zip(leases, acked,
                                                                                          strict=True)]
    return codes, confirmed
