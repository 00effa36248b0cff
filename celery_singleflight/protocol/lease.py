"""The core lease: ACQUIRE, RENEW, RELEASE, PROGRESS and REVISE_OUTCOME, their calls and replies.

Every script is atomic, checks the owner token, and is safe to run twice: redis-py sends a
command again when its reply was lost, so a script can run on the server twice while the
caller sees one answer, the second. Each recognises its own earlier run (by the token, a call
id, ``rt``: the token of the release that ended the last run, or ``by``: who reserved a slot for
a parked run) and gives the answer the first run gave, changing nothing more.

**Fences** are ``max(last fence + 1, server clock in microseconds)``: they only grow, also after
Redis lost its data or came back from an older snapshot, unless the server's clock goes back.

**The plain path.** Most runs are plain: one slot, never parked, nobody joined, no progress.
ACQUIRE writes such a run's record as text in the layout of :mod:`.fields` and RELEASE reads it
as text, so an uncontended pair decodes and encodes no JSON and makes no Lua helper (the plain
path comes first in both scripts). ``tests/test_plain_path.py`` holds both paths to the same
answers and records.

Times are milliseconds in Redis and in the scripts; the Python API speaks seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from .. import constants
from ..connection.clients import counts_sends, failed_sends
from ..connection.cluster import call_per_slot, slot_of
from ..connection.scripts import ClientScript
from .context import Context, Feature, ms, text, texts
from .controls import CONTROL_CONSTANTS, LIMITS, PAUSED, Paused, remember_slots, slots_for
from .fields import PATTERNS, TEMPLATES, VersionReply, refuse_foreign
from .handoff import ADOPTED, ANSWERED, JOINED, OWN_COPY, PARKED, QUEUE, SETTLED, TAKEN
from .layout import Layout
from .lua import Replies, Script
from .marks import ENQUEUED
from .newest import NEWEST_PATTERNS, NEWEST_TEMPLATES, ProgressNotice, RenewNotice
from .replicas import AcquireWaiting
from .replies import Acquired, DeadHolder, Held, Holder, Settlement

__all__ = [
    "ACQUIRE", "ACQUIRE_CALL", "LUA", "PROGRESS", "RELEASE", "RELEASE_CALL", "RENEW", "REVISE_OUTCOME",
    "SCRIPTS", "AcquireReply", "Call", "LeaseCalls", "ProgressReply", "ReleaseReply", "RenewReply",
    "RenewedLease", "ReviseReply",
]


class Call:
    """The fields of a script call packed into one argument, separated by ``\x1f`` (the unit
    separator). One argument is cheaper to send than many, and one ``string.match`` is the
    cheapest way for a script to read it: :attr:`head` captures the fields the script's plain
    path needs, which come first, and stops there (a pattern costs the server per byte it
    reads); :attr:`rest` skips them and captures the others, for the general path only."""

    def __init__(self, head: tuple[str, ...], rest: tuple[str, ...]) -> None:
        self.names = (*head, *rest)
        self.head = "^" + "([^\x1f]*)\x1f" * len(head)
        self.rest = "^" + "[^\x1f]*\x1f" * len(head) + "([^\x1f]*)\x1f" * (len(rest) - 1) + "(.*)$"


#: ACQUIRE's call: for the plain path the ``token``, ``ttl`` (ms), ``px`` (ttl + keep: the
#: record's expiry), the ``handoff`` and ``earlier`` tokens ('' if none); then ``keep`` (ms) and
#: the holder's task ``id``, and the task's ``own`` max_concurrency
ACQUIRE_CALL = Call(("token", "ttl", "px", "handoff", "earlier"), ("keep", "id", "own"))
#: RELEASE's call: for the plain path the ``token``, ``outcome``, ``slot`` (1-based) and
#: ``flags`` ('1': clear the enqueue marker, '2': the run raised RetryAfter, '3': both, '0');
#: then the ``fence`` ('' for an attempt that may not have taken the key), ``reservation_ttl``
#: (ms), ``answer`` ('1': hand joined runs back), the task ``id``, and for RetryAfter the
#: ``pause`` (ms) and the run's queue ``entry``; the task's ``own`` max_concurrency
RELEASE_CALL = Call(("token", "outcome", "slot", "flags"),
                    ("fence", "reservation_ttl", "answer", "id", "pause", "entry", "own"))

#: the constants every script of the protocol may use
LUA: dict[str, int | str] = {**constants.LUA_CONSTANTS, **PATTERNS, **NEWEST_PATTERNS, **CONTROL_CONSTANTS,
                             "OWN_COPY": OWN_COPY,
                             "TAKEN": TAKEN, "ANSWERED": ANSWERED,
                             "ACQUIRE_CALL": ACQUIRE_CALL.head, "ACQUIRE_REST": ACQUIRE_CALL.rest,
                             "RELEASE_CALL": RELEASE_CALL.head, "RELEASE_REST": RELEASE_CALL.rest}


class AcquireReply(Replies):
    """ACQUIRE's answers besides ``'fence:since ms:slot'`` (the key is this run's)."""

    HELD = 0, ("{HELD, holder task id, lease ms left, its trace context or ''}: every slot is held (the"
               " holder whose lease ends first)")
    HANDED_ON = 2, ("{HANDED_ON, its task id, reservation ms, message, dead task id, its worker, its task"
                    " name}: a slot was free but handed to the first parked run, whose message the caller"
                    " sends (and whose dead holder's run it ends, if any)")
    ADOPTED = 3, "{ADOPTED}: this parked run took its slot before: this message is another copy of it"
    PAUSED = 4, "{PAUSED, ms left or -1 (until resumed)}: the key is paused: the run parks"
    MORE_SLOTS = 5, "{MORE_SLOTS, slots}: the key's limits allow more slots than were named: call again so"
    TOOK = 6, ("{TOOK, 'fence:since ms:slot', dead task id, its worker, its task name}: the key is this"
               " run's, in place of a run whose lease ran out unreleased (the caller ends that run)")


class ReleaseReply(Replies):
    NOT_OURS = 0, "{NOT_OURS}: the lease ran out and another run took the key (or Redis lost it)"
    RELEASED = 1, ("RELEASED when nothing is handed on; else {RELEASED, message of the parked run now "
                   "handed the key or '', joined messages...}")
    EARLIER = 2, ("{EARLIER}: a newer run holds the key, and this run's fence is older and not among the lost"
                  " ones: this call ran before (its reply was lost, and runs took the key since), or Redis"
                  " lost this lease with its data; only the caller knows whether it sent the call twice")


class RenewReply(Replies):
    GONE = 0, "the lease is no longer this run's"
    RENEWED = 1, "the lease is renewed"


class ProgressReply(Replies):
    NOT_OURS = 0, "{NOT_OURS}: the lease is not this run's"
    WRITTEN = 1, "{WRITTEN, history entry id}: the update is written"


class ReviseReply(Replies):
    NOT_REVISED = 0, "the record is not that run's, or says another outcome"
    REVISED = 1, "the outcome is revised (or was before)"


_COMMON = "shared/common.lua"
_DEAD = "shared/dead.lua"
_HANDOFF = "handoff/handoff.lua"
_NEWEST = "newest/newest.lua"
_LEASE = "lease/lease.lua"
_CONTROLS = "controls/controls.lua"

#: the record's text, as the lease scripts write it (the core's and newest-wins' fields)
_TEMPLATES = {**TEMPLATES, **NEWEST_TEMPLATES}

ACQUIRE = Script("ACQUIRE", "lease/acquire.lua", (_COMMON, _DEAD, _HANDOFF, _NEWEST, _LEASE, _CONTROLS),
                 plain="lease/acquire_plain.lua", replies=(AcquireReply, VersionReply), constants=LUA,
                 templates=_TEMPLATES)
RELEASE = Script("RELEASE", "lease/release.lua", (_COMMON, _HANDOFF, _NEWEST, _LEASE, _CONTROLS),
                 plain="lease/release_plain.lua", replies=(ReleaseReply,), constants=LUA,
                 templates=_TEMPLATES)
RENEW = Script("RENEW", "lease/renew.lua", (_COMMON, _NEWEST), replies=(RenewReply, RenewNotice),
               constants=LUA, templates=_TEMPLATES)
PROGRESS = Script("PROGRESS", "lease/progress.lua", (_COMMON, _NEWEST),
                  replies=(ProgressReply, ProgressNotice), constants=LUA, templates=_TEMPLATES)
REVISE_OUTCOME = Script("REVISE_OUTCOME", "lease/revise_outcome.lua", (_COMMON,), replies=(ReviseReply,),
                        constants=LUA)
SCRIPTS = (ACQUIRE, RELEASE, RENEW, PROGRESS, REVISE_OUTCOME)


class RenewedLease(Protocol):
    """What a renewal needs of a lease (its layout: leases of several namespaces may share one
    Redis client, and so one heartbeat)."""

    key: str
    token: str
    slot: int
    ttl: float

    @property
    def layout(self) -> Layout: ...


class _Names:
    """The Redis key names of one lock, encoded once (every acquire and release names seven)."""

    __slots__ = ("adopted", "enqueued", "histories", "joined", "limits", "parked", "paused", "queue", "runs",
                 "settled")

    def __init__(self, layout: Layout, key: str, slots: int) -> None:
        self.runs = [layout.run(key, slot).encode() for slot in range(slots)]
        self.histories = [layout.history(key, slot).encode() for slot in range(slots)]
        self.queue = layout.key(QUEUE, key).encode()
        self.parked = layout.key(PARKED, key).encode()
        self.joined = layout.key(JOINED, key).encode()
        self.enqueued = layout.key(ENQUEUED, key).encode()
        self.settled = layout.key(SETTLED, key).encode()
        self.adopted = layout.key(ADOPTED, key).encode()
        self.paused = layout.key(PAUSED, key).encode()
        self.limits = layout.key(LIMITS, key).encode()


#: how many locks' key names are kept encoded (the hot keys of a worker; a few MB at most)
_NAMES_KEPT = 2048
#: a release that hands nothing on (the script answers a bare RELEASED: the cheapest reply to read)
_RELEASED = Settlement(True)


def settlement(reply: Sequence[Any], first: int = 1) -> Settlement:
    """The duties in ``reply`` from index ``first``: the handed-on message, then joined runs."""
    handoff = text(reply[first]) or None
    return Settlement(True, handoff, tuple(text(m) for m in reply[first + 1 :]))


class LeaseCalls(Feature):
    """The lease's own calls (each one round trip)."""

    __slots__ = ("_acquire", "_cap", "_counts", "_keep", "_known", "_progress", "_release", "_renew",
                 "_revise", "renew_round_trips")

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self._acquire: ClientScript | AcquireWaiting = ctx.script(ACQUIRE)
        self._release = ctx.script(RELEASE)
        self._renew = ctx.script(RENEW)
        self._progress = ctx.script(PROGRESS)
        self._revise = ctx.script(REVISE_OUTCOME)
        self._keep, self._cap = b"%d" % ctx.keep_ms, b"%d" % ctx.history_length  # encoded once
        self._known: dict[tuple[str, int], _Names] = {}
        self._counts = counts_sends(ctx.client)  # its failed sends are counted: see release()
        self.renew_round_trips = 0  # on a Cluster: batches sent by renew() (one per node), for benchmarks

    def wait_for_replicas(self, replicas: int, timeout: float) -> None:
        """From now on a grant counts only once ``replicas`` replicas confirmed it within
        ``timeout`` seconds, else :meth:`acquire` raises :class:`ReplicasUnavailable` (see
        :mod:`.replicas`); 0: the plain call, which waits for nothing."""
        script = self.ctx.script(ACQUIRE)
        self._acquire = AcquireWaiting(script, self.ctx.layout, replicas, timeout) if replicas else script

    def _names(self, key: str, slots: int) -> _Names:
        found = self._known.get((key, slots))
        if found is None:
            if len(self._known) >= _NAMES_KEPT:
                self._known.clear()
            found = self._known[(key, slots)] = _Names(self.ctx.layout, key, slots)
        return found

    def acquire(
        self, key: str, token: str, ttl: float, holder: Holder, *, handoff: str = "", earlier: str = "",
        slots: int = 1, trace: str = "",
    ) -> Acquired | Held:
        """Take a free slot of the key, or learn who holds it and for how long.

        ``handoff``: the token a parked run was re-sent with; it adopts the slot reserved for it.
        A run that was never parked does not jump the queue: if runs are parked on a free key,
        the first of them gets it (:attr:`Held.handoff`). ``earlier``: the token of an earlier
        attempt of this run whose reply never came; if that attempt got the key, this one takes
        it over. ``trace``: the run's trace context (a W3C traceparent; '' when it is not traced),
        kept in its record for the spans of its duplicates (:attr:`Held.trace`). Raises
        :class:`ProtocolMismatch` for a record of another protocol version, and
        :class:`ReplicasUnavailable` for a grant too few replicas confirmed (:meth:`wait_for_replicas`).
        """
        ttl_ms = ms(ttl)
        keep = self.ctx.keep_ms
        call = (f"{token}\x1f{ttl_ms}\x1f{ttl_ms + keep}\x1f{handoff}\x1f{earlier}\x1f{keep}"
                f"\x1f{holder.task_id}\x1f{slots}")
        namespace = self.ctx.layout.namespace
        slots = slots_for(namespace, key, slots)
        args = [call, holder.fields, trace] if trace else [call, holder.fields]
        while True:
            names = self._names(key, slots)
            reply = self._acquire(keys=[*names.runs, names.queue, names.parked, names.enqueued, names.adopted,
                                        names.paused, names.limits], args=args)
            if not isinstance(reply, list):  # acquired: one string, 'fence:since:slot'
                fence, since, slot = text(reply).split(":", 2)
                return Acquired(fence=int(fence), since=int(since) / 1000.0, slot=int(slot))
            code = int(reply[0])
            if code == AcquireReply.TOOK:  # acquired in place of a dead holder
                fence, since, slot = text(reply[1]).split(":", 2)
                return Acquired(fence=int(fence), since=int(since) / 1000.0, slot=int(slot),
                                dead=DeadHolder(*texts(reply[2:5])))
            if code != AcquireReply.MORE_SLOTS:
                break
            slots = remember_slots(namespace, key, int(reply[1]))
        if code == VersionReply.FOREIGN:
            refuse_foreign(key, reply)
        if code == AcquireReply.ADOPTED:
            return Held(holder=holder.task_id, ttl_left=0.0, copy=True)
        if code == AcquireReply.PAUSED:
            left = int(reply[1])
            return Paused(holder="", ttl_left=-1.0 if left < 0 else left / 1000.0)
        message = (text(reply[3]) or None) if code == AcquireReply.HANDED_ON else None
        dead = DeadHolder(*texts(reply[4:7])) if message and len(reply) >= 7 and text(reply[4]) else None
        linked = text(reply[3]) if code == AcquireReply.HELD and len(reply) > 3 else ""
        return Held(holder=text(reply[1]), ttl_left=max(0, int(reply[2])) / 1000.0, handoff=message,
                    dead=dead, trace=linked)

    def renew(self, leases: Sequence[RenewedLease]) -> list[int]:
        """Renew any number of leases in one round trip: per lease a code, :class:`RenewReply`
        or a feature's notice (:class:`~.newest.RenewNotice`).

        On a Redis Cluster a script may touch the keys of one hash slot only, so the leases are
        grouped by slot (one call each), pipelined per node: one round trip per node."""
        if not leases:
            return []
        if self.ctx.cluster:
            return self._renew_per_slot(leases)[0]
        keys, args = self._renew_call(leases)
        return [int(x) for x in self._renew(keys=keys, args=args)]

    def renew_then_wait(self, leases: Sequence[RenewedLease], replicas: int,
                        timeout: float) -> tuple[list[int], list[int]]:
        """:meth:`renew`, with ``WAIT replicas`` behind it on its connection (on a Cluster, behind
        each node's calls), in the same round trip: per lease its code and how many replicas
        confirmed its renewal within ``timeout`` seconds."""
        if not leases:
            return [], []
        if self.ctx.cluster:
            return self._renew_per_slot(leases, (replicas, ms(timeout)))
        keys, args = self._renew_call(leases)
        reply, acked = self._renew.call_then_wait(keys, args, replicas, ms(timeout))
        return [int(x) for x in reply], [acked] * len(leases)

    def _renew_call(self, leases: Sequence[RenewedLease]) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        args: list[Any] = []
        for lease in leases:
            keys += [lease.layout.run(lease.key, lease.slot), lease.layout.history(lease.key, lease.slot)]
            args += [lease.token, ms(lease.ttl)]
        args.append(self.ctx.keep_ms)
        return keys, args

    def _renew_per_slot(self, leases: Sequence[RenewedLease],
                        wait: tuple[int, int] | None = None) -> tuple[list[int], list[int]]:
        groups: dict[int, list[int]] = {}
        for i, lease in enumerate(leases):
            groups.setdefault(slot_of(lease.layout.run(lease.key, lease.slot)), []).append(i)
        calls = {hash_slot: self._renew_call([leases[i] for i in indexes])
                 for hash_slot, indexes in groups.items()}
        acked: dict[int, int] = {}
        replies, round_trips = call_per_slot(self.ctx.client, self._renew.script, calls, wait, acked)
        self.renew_round_trips += round_trips
        out: list[int] = [RenewReply.GONE] * len(leases)
        confirmed = [0] * len(leases)
        for hash_slot, indexes in groups.items():
            for i, value in zip(indexes, replies[hash_slot], strict=True):
                out[i] = int(value)
                confirmed[i] = acked.get(hash_slot, 0)
        return [int(code) for code in out], confirmed

    def release(
        self, key: str, token: str, outcome: str = "succeeded", ttl: float = 30.0, *,
        fence: int | None = None, slot: int = 0, slots: int = 1, answer_joined: bool = True,
        clear_marker: bool = False, task_id: str = "", retry_after: tuple[float, str, str] | None = None,
    ) -> Settlement:
        """Free the slot if the lease is ours, record the run's outcome, hand the key to the
        first parked run and take the runs joined to this one (see :class:`Settlement`).

        ``answer_joined=False`` (a run that is retried) leaves joined runs waiting for the next run.
        ``clear_marker`` (tasks with ``dedup_enqueue``) removes the enqueue-time marker of this
        task id. ``task_id``: the run's task id, so that a copy its redelivery parked is dropped
        even when the lease was already gone. ``ttl``: the reservation made for a parked run.
        ``fence`` None: an attempt that may or may not have taken the key (nothing is recorded if
        it did not). ``retry_after`` (seconds, queue entry, message): the run raised RetryAfter;
        the release also pauses the key that long and parks the run's message at the front of
        its queue (one script: a crash between the two cannot lose the run).
        """
        names = self._names(key, max(slots_for(self.ctx.layout.namespace, key, slots), slot + 1))
        flags = (1 if clear_marker else 0) + (2 if retry_after else 0)
        pause, entry, message = ("", "", "") if retry_after is None else retry_after
        pause = "" if retry_after is None else ms(retry_after[0])
        call = (f"{token}\x1f{outcome}\x1f{slot + 1}\x1f{flags}"
                f"\x1f{'' if fence is None else fence}\x1f{ms(ttl)}\x1f{1 if answer_joined else 0}"
                f"\x1f{task_id}\x1f{pause}\x1f{entry}\x1f{slots}")
        before = failed_sends()
        reply = self._release(
            keys=[*names.runs, names.histories[slot], names.queue, names.parked, names.joined, names.enqueued,
                  names.settled, names.paused, names.limits],
            args=[call, self._keep, self._cap, message],
        )
        if reply == ReleaseReply.RELEASED:
            return _RELEASED
        code = int(reply[0])
        if code == ReleaseReply.EARLIER:
            # sent once, as this process's client knows: nothing ran before it, so Redis lost the
            # lease; sent twice, or not known (another client): the first send released it
            return Settlement(False) if self._counts and failed_sends() == before else _RELEASED
        if code == ReleaseReply.NOT_OURS:
            return Settlement(False)
        return settlement(reply)

    def progress(self, key: str, slot: int, token: str, update_json: str, state: str, seq: int,
                 args_json: str = "") -> tuple[int, str]:
        """An owner-checked status update plus a history entry (wakes watchers): (a code of
        :class:`ProgressReply` or :class:`~.newest.ProgressNotice`, the entry id or who
        superseded the run). ``seq`` numbers the run's updates, so a re-sent one is written once."""
        layout = self.ctx.layout
        reply = self._progress(
            keys=[layout.run(key, slot), layout.history(key, slot)],
            args=[token, self.ctx.history_length, update_json, state, seq, args_json, self.ctx.keep_ms],
        )
        return int(reply[0]), (text(reply[1]) if len(reply) > 1 else "")

    def revise_outcome(self, key: str, task_id: str, recorded: str, known: str, slot: int = 0) -> bool:
        """Correct the recorded outcome of ``task_id``'s run on ``slot`` (e.g. terminated -> revoked,
        retried -> failed)."""
        reply = self._revise(keys=[self.ctx.layout.run(key, slot)], args=[task_id, recorded, known])
        return int(reply) == ReviseReply.REVISED
