"""The lease protocol of one lock key as an abstract model, transcribed to Python: what each
script must do to the key's state and answer, with no Redis and no I/O. ``test_conformance.py``
drives the real scripts on a real Redis beside it and compares both after every step.

**The state** (:class:`Store`, what Redis holds; it can be copied for a snapshot):

- per slot: nothing or a run that ended (:class:`Ended`: who, how), a run holding it
  (:class:`Held`: who, its token, its fence, whether its lease ran out, who superseded it), or a
  reservation for a parked run (:class:`Reserved`: who, its hand-off token, who reserved it,
  whether it ran out). A slot is *free* when it holds no live lease or reservation. A lease or
  a reservation that replaced a holder whose lease ran out unreleased names that *dead* holder
  (a call sent again names it again: its caller ends that run as lost), unless it is the very
  run that takes the slot.
- the queue of parked runs (``(task id, hand-off token)`` in order; an own copy's token starts
  with ``own-`` and waits at the front) and their messages; the joined runs' messages; what
  releases and sweeps handed over (``settled``, for a replay and for orphans); the hand-off
  tokens of parked runs that took their slot, with the fence they took it with (``adopted``);
  the fences of leases that ran out unreleased and were taken over (``lost``); the newest book
  of ``coalesce``/``supersede`` (the last-sent run pending or started, each pending run's send
  stamp, the runs each one replaced until answered); the journal marks of the runs that began to
  wait on the key (``journaled``: PARK, JOIN and COALESCE add the call's mark only when they make
  the run wait).

Besides the store the model keeps what no data loss undoes: every fence granted, in order (each
must be larger than all before it), and the fenced resource's stored fence (it lives in the
user's Redis, not the lease Redis).

**The transitions**, one method per script, each the first run of a call: what a second run of
the same call must do (answer as the first, change nothing more) is the conformance test's
business, not the model's. The fence of a grant is not predicted (a clock in microseconds):
:meth:`Model.acquire` answers ``("ACQUIRED", slot)`` and :meth:`Model.grant` learns the fence,
refusing one that is not larger than every earlier grant. Replies are tuples, their first item
the code.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from celery_singleflight.protocol.handoff import OWN_COPY

__all__ = ["Ended", "Held", "Model", "ModelViolation", "Reply", "Reserved", "Slot", "Store",
           "is_own_copy"]

#: a script's answer: the code, then what the code carries
Reply = tuple[object, ...]


class ModelViolation(AssertionError):
    """An invariant of the protocol does not hold (a fence that did not grow, a stale write
    accepted): the real scripts broke it, whatever the model predicted."""


def is_own_copy(token: str) -> bool:
    """The hand-off token of a turned-away redelivery's copy of its own run."""
    return token.startswith(OWN_COPY)


@dataclass(frozen=True)
class Held:
    """A run holds the slot: ``token`` is its execution's, ``fence`` is learned from the grant
    (None until then), ``handoff`` the hand-off token it adopted the slot with ('' if none),
    ``dead`` the holder whose lease ran out unreleased that it took the slot from (None if none)."""

    run: str
    token: str
    fence: int | None = None
    expired: bool = False
    sup_by: str | None = None
    handoff: str = ""
    dead: str | None = None
    #: its record's flags: runs wait in the key's queue (``waiting``), runs joined it (``joined``);
    #: should it die, a plain take of its slot names it only with one of them (a holder nobody
    #: waited on may only have frozen)
    waiting: bool = False
    joined: bool = False


@dataclass(frozen=True)
class Reserved:
    """The slot waits for parked run ``run`` (its hand-off token ``token``), reserved by ``by``
    (a releasing token, an acquiring token, a sweep's call id). ``fence``: the fence of the run
    before, which the slot's record keeps (not compared: the next grant only has to exceed it).
    ``dead``: the holder whose lease ran out unreleased on the slot (its caller ends it)."""

    run: str
    token: str
    by: str
    expired: bool = False
    sup_by: str | None = None
    fence: int | None = None
    dead: str | None = None
    joined: bool = False  # its record's joined flag, passed on from the record it replaced


@dataclass(frozen=True)
class Ended:
    """The slot's last run ended: released (its outcome) or recorded lost by a late release."""

    run: str
    outcome: str
    sup_by: str | None = None
    fence: int | None = None


Slot = Held | Reserved | Ended | None


@dataclass
class Store:
    """What the lease Redis holds for one key (see the module docstring)."""

    n: int
    slots: list[Slot] = field(default_factory=list)
    rt: list[str | None] = field(default_factory=list)  # per slot: the token of its last release
    queue: list[tuple[str, str]] = field(default_factory=list)
    parked: dict[str, str] = field(default_factory=dict)
    joined: list[str] = field(default_factory=list)
    settled: dict[str, tuple[str, ...]] = field(default_factory=dict)
    taken: dict[str, bool] = field(default_factory=dict)  # who took joined runs: whether ANSWER_GRACE passed
    adopted: dict[str, int | None] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    latest: tuple[int, str] | None = None
    stamps: dict[str, int] = field(default_factory=dict)
    owed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    journaled: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [None] * self.n
            self.rt = [None] * self.n


class Model:
    """The protocol on one key with ``n`` slots (``max_concurrency``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.store = Store(n)
        self.fences: list[int] = []  # every fence granted, in order (never undone)
        self.resource: int | None = None  # the fence stored with the fenced value

    # -- reading the state ------------------------------------------------------------------

    def live(self, i: int) -> bool:
        """Slot ``i`` holds a lease or a reservation whose time has not run out."""
        s = self.store.slots[i]
        return isinstance(s, Held | Reserved) and not s.expired

    def free_slot(self) -> int | None:
        """The first slot that is not live (the one an acquire or a hand-on takes)."""
        return next((i for i in range(self.n) if not self.live(i)), None)

    def live_runs(self) -> set[str]:
        return {s.run for i, s in enumerate(self.store.slots) if self.live(i) and s is not None}

    def slot_of(self, token: str) -> int | None:
        """The slot held with execution ``token``, live or run out."""
        return next((i for i, s in enumerate(self.store.slots) if isinstance(s, Held) and s.token == token),
                    None)

    def pending(self) -> tuple[str, str] | None:
        """The queue entry of the pending run of ``coalesce``/``supersede``: the last one that is
        neither handed a slot (reserved) nor an own copy."""
        found = None
        reserved = {s.token for s in self.store.slots if isinstance(s, Reserved)}
        for run, token in self.store.queue:
            if not is_own_copy(token) and token not in reserved:
                found = (run, token)
        return found

    def pending_entries(self) -> list[str]:
        """Every queued run that is neither reserved nor an own copy (``coalesce`` allows one)."""
        reserved = {s.token for s in self.store.slots if isinstance(s, Reserved)}
        return [run for run, token in self.store.queue if not is_own_copy(token) and token not in reserved]

    # -- hand-off helpers ---------------------------------------------------------------------

    def _lose(self, prev: Slot) -> None:
        """A lease that ran out unreleased is taken over: its holder lost it."""
        if isinstance(prev, Held) and prev.expired and prev.fence is not None:
            self.store.lost.add(prev.fence)

    def _carried_fence(self, prev: Slot) -> int | None:
        return None if prev is None else prev.fence

    @staticmethod
    def _dead(prev: Slot, run: str) -> str | None:
        """The holder a script that gives the slot to ``run`` replaces and names (its lease ran out
        unreleased: it died, or froze), unless it is ``run`` itself (its own earlier attempt)."""
        if isinstance(prev, Held) and prev.expired and prev.run != run:
            return prev.run
        return None

    def _waited_on(self) -> None:
        """A run parks, or is the pending one: every holder's record is flagged ``waiting`` (PARK,
        COALESCE; a reservation always is)."""
        st = self.store
        st.slots[:] = [replace(s, waiting=True) if isinstance(s, Held) else s for s in st.slots]

    @staticmethod
    def _joined_flag(prev: Slot) -> bool:
        return isinstance(prev, Held | Reserved) and prev.joined

    def _journal(self, mark: str) -> None:
        """A run begins to wait on the key: its journal line's mark is kept ('' : none)."""
        if mark:
            self.store.journaled.add(mark)

    def _hand_off(self, slot: int, by: str, mine: tuple[str, str] | None = None) -> str | None:
        """Reserve the free ``slot`` for the first parked run that is not busy (reserved on
        another slot, its reservation live or run out: a run waits for one slot at a time; an
        own copy whose run holds another live slot): its message, or None. An entry without a
        message is dropped. ``mine``: the asking run's own entry; when its turn has come,
        nothing is handed on (it takes the slot itself)."""
        st = self.store
        for entry in list(st.queue[:100]):
            if entry == mine:
                return None
            run, token = entry
            busy = reserved_out = False
            for i, s in enumerate(st.slots):
                if i == slot or not isinstance(s, Held | Reserved):
                    continue
                if self.live(i) and (s.token == token or (is_own_copy(token) and s.run == run)):
                    busy = True
                elif isinstance(s, Reserved) and s.token == token:
                    reserved_out = True  # its reservation there ran out
            if busy or reserved_out:
                continue
            if run in st.parked:
                prev = st.slots[slot]
                self._lose(prev)
                st.slots[slot] = Reserved(run, token, by, fence=self._carried_fence(prev),
                                          dead=self._dead(prev, run), joined=self._joined_flag(prev))
                return st.parked[run]
            st.queue.remove(entry)
        return None

    def _drop_own_copy(self, run: str) -> None:
        """``run`` ended: the copy its redelivery parked must not run, unless it was handed a
        slot already (its message is on its way)."""
        st = self.store
        if run not in st.parked:
            return
        for entry in list(st.queue):
            if entry[0] == run and is_own_copy(entry[1]):
                for i, s in enumerate(st.slots):
                    if isinstance(s, Held | Reserved) and s.token == entry[1] and self.live(i):
                        return
                st.queue.remove(entry)
                st.parked.pop(run, None)

    def _take_joined(self, by: str) -> tuple[str, ...]:
        """The joined runs go to ``by`` (a release, a sweep): kept under its name, and stamped,
        so that a sweeper answers those still waiting once ANSWER_GRACE has passed."""
        st = self.store
        joined = tuple(st.joined)
        st.settled[by] = joined
        st.taken[by] = False
        st.joined = []
        return joined

    def _taken_before(self, handoff: str) -> bool:
        """The parked run of ``handoff`` took its slot before and did not lose that lease: its
        fence is not among the lost ones, and no record still holds a lease with it."""
        st = self.store
        if handoff not in st.adopted:
            return False
        fence = st.adopted[handoff]
        return not (fence in st.lost or any(isinstance(s, Held) and s.fence == fence for s in st.slots))

    def _holds_elsewhere(self, handoff: str, slot: int) -> bool:
        """The run that adopted ``handoff`` before still holds that lease (live, its fence the
        adopted one) on a slot other than ``slot``, which is reserved for the same token again."""
        st = self.store
        fence = st.adopted.get(handoff)
        return fence is not None and any(
            i != slot and self.live(i) and isinstance(s, Held) and s.fence == fence
            for i, s in enumerate(st.slots))

    # -- the transitions ----------------------------------------------------------------------

    def acquire(self, run: str, token: str, handoff: str = "") -> Reply:
        """ACQUIRE by an execution of ``run`` (``handoff``: the token its message was re-sent
        with, '' if it never parked).

        Another copy of a parked run's message, whose run took its slot before and kept it to its
        release (or still holds it on another slot), is ``ADOPTED`` (dropped), also when a
        reservation for its token exists (checked first: a second reservation for one token is a
        copy's, never a second run). Else a run adopts the slot reserved for it. Otherwise the
        first free slot: with runs parked it goes to the first of them that is not busy
        (``HANDED_ON``, the caller sends its message and ends the run that died holding the
        slot, if any and not the parked run itself), unless that is the asking run itself.
        ``ACQUIRED`` names the run that died holding the slot it took, if any and not the asking
        run itself (the caller ends it). ``HELD`` when every slot is live (a run already live on
        one slot of several is told it holds the key)."""
        st = self.store
        slot = next((i for i, s in enumerate(st.slots)
                     if handoff and isinstance(s, Reserved) and s.token == handoff), None)
        adopting = slot is not None
        if handoff and (self._taken_before(handoff) or (adopting and self._holds_elsewhere(handoff, slot))):
            return ("ADOPTED",)  # checked before a reservation is adopted: a second one is a copy's
        if slot is None:
            slot = self.free_slot()
            if self.n > 1 and run in self.live_runs():
                return ("HELD", frozenset({run}))
            if slot is None:
                return ("HELD", frozenset(self.live_runs()))
            if st.queue:
                message = self._hand_off(slot, token, (run, handoff) if handoff else None)
                if message is not None:
                    reserved = st.slots[slot]
                    assert isinstance(reserved, Reserved)
                    return ("HANDED_ON", reserved.run, message, reserved.dead)
        if handoff:
            if (run, handoff) in st.queue:
                st.queue.remove((run, handoff))
            st.parked.pop(run, None)
            st.adopted[handoff] = None  # its fence is learned with the grant
        prev = st.slots[slot]
        sup_by = dead = None
        if adopting:
            assert isinstance(prev, Reserved)
            sup_by = prev.sup_by  # superseded on its way: it starts superseded
        else:
            self._lose(prev)
            # a plain take names a dead holder only if runs waited on it, or the taker was parked
            waited_on = handoff or (isinstance(prev, Held) and (prev.waiting or prev.joined))
            dead = self._dead(prev, run) if waited_on else None
        st.slots[slot] = Held(run, token, None, sup_by=sup_by, handoff=handoff, dead=dead,
                              waiting=bool(st.queue), joined=self._joined_flag(prev))
        return ("ACQUIRED", slot, dead)

    def grant(self, slot: int, fence: int) -> None:
        """The fence of the grant :meth:`acquire` just predicted: larger than every fence
        granted before, whatever Redis lost meanwhile."""
        if self.fences and fence <= max(self.fences):
            raise ModelViolation(f"fence {fence} is not larger than the earlier grant {max(self.fences)}")
        self.fences.append(fence)
        held = self.store.slots[slot]
        assert isinstance(held, Held) and held.fence is None
        self.store.slots[slot] = replace(held, fence=fence)
        if held.handoff:
            self.store.adopted[held.handoff] = fence

    def release(self, run: str, token: str, outcome: str, slot: int, answer: bool = True) -> Reply:
        """RELEASE by the execution of ``token`` on ``slot``: if the lease is still its own (run
        out or not, as long as nobody took it), the run ends with ``outcome`` (``superseded``
        for one a newer run superseded and that did not succeed); the runs joined to the key go
        to the caller (to answer); with runs parked, the slot goes to the first of them that is
        not busy (its message to the caller; the run's own parked copy is dropped first).
        ``NOT_OURS`` otherwise (and its own copy is dropped all the same)."""
        st = self.store
        held = st.slots[slot]
        if not (isinstance(held, Held) and held.token == token):
            if st.queue:
                self._drop_own_copy(run)
            if held is None:
                st.slots[slot] = Ended(run, "lost")  # Redis lost it: the late release records how it ended
            return ("NOT_OURS",)
        if held.sup_by and outcome != "succeeded":
            outcome = "superseded"
        st.slots[slot] = Ended(run, outcome, sup_by=held.sup_by, fence=held.fence)
        st.rt[slot] = token
        joined: tuple[str, ...] = ()
        if answer and st.joined:
            joined = self._take_joined(token)
        message = None
        if st.queue:
            self._drop_own_copy(run)
            message = self._hand_off(slot, token)
        return ("RELEASED", message, joined)

    def renew(self, token: str, slot: int) -> Reply:
        """RENEW: the lease is still this execution's (even run out, as long as nobody took
        it): renewed, and told if a newer run superseded it; else ``GONE``."""
        held = self.store.slots[slot]
        if not (isinstance(held, Held) and held.token == token):
            return ("GONE",)
        self.store.slots[slot] = replace(held, expired=False)
        return ("RENEWED_SUPERSEDED",) if held.sup_by else ("RENEWED",)

    def park(self, run: str, token: str, message: str, mark: str = "") -> Reply:
        """PARK (``queue``; an own copy with an ``own-`` token, at the front): a run already
        parked, or whose hand-off token took a slot, is ``PARKED`` (a second run of the call:
        it waits, or waited); else ``FREE`` if a slot is free, or for an own copy whose run holds
        no slot; else the run waits in the queue with its message (and its journal ``mark``)."""
        st = self.store
        own = is_own_copy(token)
        if token in st.adopted or (not own and run in st.parked):
            found = next((k for k, entry in enumerate(st.queue) if entry == (run, token)), None)
            return ("PARKED", 1 if found is None else found + 1)
        if self.free_slot() is not None:
            return ("FREE",)
        if own and not any(isinstance(s, Held) and s.run == run and not s.expired for s in st.slots):
            return ("FREE",)  # its run ended (its release dropped the copy): a copy would run it again
        if run not in st.parked:
            if own:
                st.queue.insert(0, (run, token))
            else:
                st.queue.append((run, token))
            st.parked[run] = message
            self._journal(mark)
        self._waited_on()
        return ("PARKED", 1 if own else len(st.queue))

    def join(self, message: str, mark: str = "") -> Reply:
        """JOIN (``join``, one slot): ``FREE`` if the slot is free; else the run waits for the
        result of whoever ends the slot's run next (the holder, or a run it was handed to), its
        journal ``mark`` kept."""
        st = self.store
        if not self.live(0):
            return ("FREE",)
        if message not in st.joined:
            st.joined.append(message)
            self._journal(mark)
        if isinstance(st.slots[0], Held | Reserved):  # live: its record is flagged joined
            st.slots[0] = replace(st.slots[0], joined=True)
        return ("JOINED", len(st.joined))

    def coalesce(self, run: str, token: str, message: str, mode: str, stamp: int, mark: str = "") -> Reply:
        """COALESCE (mode ``last``: ``coalesce``; ``supersede``): a run already pending, or whose
        hand-off token took a slot, is ``PENDING`` (a second run of the call). A run sent before
        the last-sent run pending or started ``GIVES_WAY`` to it (before ``FREE``: a late copy,
        or a call sent again after its run was replaced); else ``FREE`` if a slot is free. It
        gives way to a pending run sent after it too; otherwise it replaces the pending run
        (taking over the runs that one replaced) and is the key's one pending run, and with
        ``supersede`` every holder (and reservation) is marked superseded by it."""
        st = self.store
        if run in st.parked or token in st.adopted:  # a second run of the call: it is (or was) pending
            return ("PENDING", st.owed.get(run, ()))
        if st.latest is not None and st.latest[1] != run and st.latest[0] > stamp:
            return ("GIVES_WAY", st.latest[1])
        if self.free_slot() is not None:
            return ("FREE",)
        replaced: tuple[str, ...] = ()
        entry = self.pending()
        if entry is not None:
            pending = entry[0]
            theirs = st.stamps.get(pending)
            if mode == "first" or not (theirs is None or stamp >= theirs):
                return ("GIVES_WAY", pending)
            theirs_message = st.parked.pop(pending, None)
            replaced = (*st.owed.pop(pending, ()), *(() if theirs_message is None else (theirs_message,)))
            st.queue.remove(entry)
            st.stamps.pop(pending, None)
            if replaced:
                st.owed[run] = replaced
        st.queue.append((run, token))
        st.parked[run] = message
        self._journal(mark)
        st.stamps[run] = stamp
        st.latest = (stamp, run)
        self._waited_on()
        if mode == "supersede":
            for i, s in enumerate(st.slots):
                if isinstance(s, Held | Reserved):
                    st.slots[i] = replace(s, sup_by=run)
        return ("PENDING", replaced)

    def answered(self, run: str) -> None:
        """The caller of ``run``'s COALESCE ended the runs it replaced: forget them."""
        self.store.owed.pop(run, None)

    def newest_start(self, run: str, stamp: int, slot: int) -> Reply:
        """NEWEST_START: a run of ``coalesce``/``supersede`` starts under its lease. ``STALE`` if
        the last-sent run pending or started is another, sent after it (it must not run); else
        ``STARTED``, the last-sent started run now. Either way the runs it replaced (to end again)
        and it is no longer pending; started, also who superseded the slot's run, if anyone."""
        st = self.store
        owed = st.owed.get(run, ())
        st.stamps.pop(run, None)
        if st.latest is not None and st.latest[1] != run and st.latest[0] > stamp:
            return ("STALE", st.latest[1], owed)
        st.latest = (stamp, run)
        record = st.slots[slot]
        return ("STARTED", owed, record.sup_by if record is not None else None)

    def resume(self, call: str) -> Reply:
        """RESUME, the sweeper's look: ``NOTHING_WAITS`` with no run parked or joined (naming every
        holder that died on the key);
        ``ALL_HELD`` when no slot is free (or nothing was handed on); else the first free slot
        goes to the first parked run (its message to the caller) and, the first slot free, the
        joined runs of its gone holder come back (to answer). Also every holder that died on the
        key (:meth:`dead_on_key`): the sweeper's settlement ends those runs."""
        st = self.store
        if not st.queue and not st.joined:  # a holder that died while runs waited is named still
            return ("NOTHING_WAITS", self.dead_on_key(None))
        slot = self.free_slot()
        if slot is None:
            return ("ALL_HELD",)
        # a reservation that ran out is handed again first: its run waits for that slot alone
        slot = next((i for i, s in enumerate(st.slots) if isinstance(s, Reserved) and s.expired), slot)
        joined: tuple[str, ...] = ()
        if slot == 0 and st.joined:
            joined = self._take_joined(call)
        if slot == 0 and isinstance(st.slots[0], Held | Reserved):  # RESUME clears slot 1's joined flag
            st.slots[0] = replace(st.slots[0], joined=False)
        message = self._hand_off(slot, call)
        if message is None and not joined:
            return ("ALL_HELD",)
        reserved = st.slots[slot] if message is not None else None
        handed = reserved if isinstance(reserved, Reserved) else None
        return ("HANDED_ON", message, joined, self.dead_on_key(handed))

    def dead_on_key(self, reserved: Reserved | None) -> tuple[str, ...]:
        """Whom a RESUME names dead (``reserved``: the slot it handed on, None if it handed none),
        in order: the holder that died on the slot handed on (the reservation keeps it), then
        every other holder whose lease ran out unreleased on a slot of the key. A second run of
        the call names them as they are then."""
        first = reserved.dead if reserved is not None else None
        named = [first] if first is not None else []
        named += [s.run for s in self.store.slots
                  if isinstance(s, Held) and s.expired and s.run != (first or "")]
        return tuple(named)

    def fenced_set(self, fence: int) -> Reply:
        """FENCED_SET on the user's resource: written unless a newer fence is stored."""
        if self.resource is not None and fence < self.resource:
            return ("STALE", self.resource)
        self.resource = fence
        return ("WRITTEN", fence)

    # -- faults -------------------------------------------------------------------------------

    def expire(self, slot: int) -> None:
        """The abstract clock passes the deadline of the slot's lease or reservation."""
        s = self.store.slots[slot]
        assert isinstance(s, Held | Reserved), s
        self.store.slots[slot] = replace(s, expired=True)

    def grace(self) -> None:
        """ANSWER_GRACE passes for every release (or sweep) that took joined runs."""
        for by in self.store.taken:
            self.store.taken[by] = True

    def unanswered(self) -> tuple[str, ...]:
        """The joined runs a sweeper answers (those still waiting, says the result backend) at
        its look: taken by a release (or sweep) ANSWER_GRACE ago or more."""
        st = self.store
        return tuple(m for by, aged in st.taken.items() if aged for m in st.settled.get(by, ()))

    def snapshot(self) -> Store:
        return copy.deepcopy(self.store)

    def restore(self, snapshot: Store | None) -> None:
        """Redis comes back from ``snapshot`` (None: empty). Granted fences and the resource,
        which live elsewhere, stay."""
        self.store = copy.deepcopy(snapshot) if snapshot is not None else Store(self.n)
