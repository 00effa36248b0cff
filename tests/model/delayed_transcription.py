"""The delayed runs of one key as an abstract model, transcribed to Python: what each script of
:mod:`celery_singleflight.protocol.delayed` must do to a run's entry and answer, and what the
Python side of each call does to the namespace's delayed index. ``test_delayed_conformance.py``
drives the real calls on a real Redis beside it and compares both after every step.

**The state** (:class:`Store`): per run its entry in the key's ``delayed`` hash (:class:`Entry`,
the JSON fields by their names: ``t``, ``ts``, ``old``, ``m``, ``w``, ``r``, ``c``, ``o``,
``lt``, ``took``; whether ``sent`` and ``ca`` are set), the runs in the ``delayed_ends`` sorted set
(claimed entries kept for late copies), the journal marks DELAY left, and the runs in the delayed
index (the sweeper looks only at those).

**Time** is abstract: an entry not claimed has an *age* counted from its due time or the last
copy a sweeper sent, whichever is later (0: before :data:`~celery_singleflight.constants.DELAYED_GRACE`,
1: before :data:`~celery_singleflight.constants.DELAYED_UNSEEN_GRACE`, 2: after); a claim not done
has a *claim age* (0: younger than :data:`~celery_singleflight.constants.WORKER_GONE_AFTER`, 1:
younger than :data:`~celery_singleflight.constants.DELAYED_CLAIM_PATIENCE`, 2: older). The test
rewrites the stored times to match (:func:`since_offset`, :func:`claim_offset`).

**The transitions**, one method per script, apply to every run of a call, a second run too (a
reply lost and the call sent again): the scripts are transcribed, not their intent; whether the
protocol is sound is the invariants' business (in the test). Replies are tuples, the code first.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from celery_singleflight import constants

__all__ = ["AGES", "Entry", "Model", "Reply", "Store", "claim_offset", "since_offset"]

Reply = tuple[object, ...]

#: the ages an entry (or a claim) goes through
AGES = (0, 1, 2)


def since_offset(age: int) -> int:
    """Milliseconds from now to the time an entry of ``age`` counts from (its due time, or its
    last copy sent): the middle of the age's window, so that a few hundred ms of the test's own
    time change nothing."""
    grace, unseen = int(constants.DELAYED_GRACE * 1000), int(constants.DELAYED_UNSEEN_GRACE * 1000)
    return {0: 30_000, 1: -(grace + unseen) // 2, 2: -(unseen + 3_000)}[age]


def claim_offset(age: int) -> int:
    """Milliseconds from now to the claim time of a claim of ``age`` (as :func:`since_offset`)."""
    gone, patience = int(constants.WORKER_GONE_AFTER * 1000), int(constants.DELAYED_CLAIM_PATIENCE * 1000)
    return {0: -gone // 4, 1: -(gone + patience) // 2, 2: -(patience + 10_000)}[age]


@dataclass
class Entry:
    """A run's entry. ``delay``: the token of the DELAY that wrote it (the model's, not Redis's:
    which delay a copy belongs to)."""

    t: str
    ts: list[str]
    m: str | None
    delay: str
    old: list[str] = field(default_factory=list)
    w: dict[str, str] | None = None
    r: bool = False
    sent: bool = False
    c: str | None = None
    o: str | None = None
    lt: str | None = None
    claimed_at: bool = False  # ``ca``: set by CLAIM, cleared once done or taken back
    took: str | None = None
    age: int = 0
    claim_age: int = 0

    def has_token(self, token: str) -> bool:
        """A token of this delay's copies (``has_token`` in delayed.lua)."""
        return token in self.ts or self.t == token

    def is_old(self, token: str) -> bool:
        """A token of an earlier delay, or of a copy found stale or taken back (``is_old``)."""
        return token in self.old

    def make_stale(self, token: str) -> None:
        """``token`` is stale from now on (``make_stale``): out of ``ts`` (``t`` stays as it is),
        appended to ``old`` unless there already, the last DELAYED_OLD_KEPT kept."""
        self.ts = [t for t in self.ts if t != token]
        if token not in self.old:
            self.old = [*self.old, token]
        self.old = self.old[-constants.DELAYED_OLD_KEPT:]

    def fields(self) -> dict[str, object]:
        """What the test compares with the real entry."""
        return {"t": self.t, "ts": list(self.ts), "old": list(self.old), "m": self.m, "w": self.w,
                "r": self.r, "sent": self.sent, "c": self.c, "o": self.o, "lt": self.lt,
                "ca": self.claimed_at, "took": self.took}


@dataclass
class Store:
    entries: dict[str, Entry] = field(default_factory=dict)
    ends: set[str] = field(default_factory=set)
    journaled: set[str] = field(default_factory=set)
    indexed: set[str] = field(default_factory=set)


class Model:
    """The delayed runs of one key."""

    def __init__(self) -> None:
        self.store = Store()
        #: every token of a copy, by the delay it belongs to (the model's bookkeeping)
        self.delay_of: dict[str, str] = {}
        #: the tokens whose claim a sweeper took back (CLAIM_DONE must never answer them DONE)
        self.taken_back: set[str] = set()

    def entry(self, run: str) -> Entry | None:
        return self.store.entries.get(run)

    # -- the scripts ----------------------------------------------------------------------------

    def delay(self, run: str, token: str, message: str, mark: str, claimed: str = "") -> Reply:
        """DELAY: a new entry due after the countdown (its earlier tokens stale, the last
        DELAYED_OLD_KEPT kept); a token the entry knows (current, stale or the claim's: a second
        run of this call, its copies moved on meanwhile) changes nothing, the journal mark too,
        and answers NOT_CLAIMED if another copy's claim is on the entry (it owns the run now).
        ``claimed``: the caller's claim token ('' none); an entry claimed by another copy, or
        not claimed and no longer knowing that token as current (taken back), is left as it is:
        NOT_CLAIMED. Not claimed with that token current: the caller's own copy (its claim found
        no entry, and the recovery put the copy back), as in CLAIM_DONE."""
        st = self.store
        e = st.entries.get(run)
        if e is not None and (e.has_token(token) or e.is_old(token) or e.c == token):
            if e.c is not None and e.c != token:
                return ("NOT_CLAIMED",)
            return ("DELAYED",)
        if e is not None and claimed and (e.c != claimed if e.c is not None else not e.has_token(claimed)):
            return ("NOT_CLAIMED",)
        old: list[str] = []
        if e is not None:
            old = [*e.old, *e.ts][-constants.DELAYED_OLD_KEPT:]
        st.entries[run] = Entry(t=token, ts=[token], m=message, delay=token, old=old)
        self.delay_of[token] = token
        st.ends.discard(run)
        if mark:
            st.journaled.add(mark)
        return ("DELAYED",)

    def touch(self, run: str, token: str, worker: str) -> Reply:
        """TOUCH: note the worker holding the copy of ``token``, unless claimed or not a copy of
        the entry's delay."""
        e = self.entry(run)
        if e is None or e.c is not None or not e.has_token(token):
            return ("IGNORED",)
        e.w = {**(e.w or {}), token: worker}
        return ("NOTED",)

    def claim(self, run: str, token: str, owner: str, lease: str) -> Reply:
        """CLAIM: the first copy of the current delay claims the entry (GO, GO_LATE once a sweeper
        sent a copy); the claiming token again answers the same; any other STALE, and a copy of
        the current delay found so (another claimed the run) is made stale: a late TOUCH of it is
        then ignored; no entry GO. A claim clears ``took`` (the copies sent from then on carry no
        lease to take over)."""
        e = self.entry(run)
        if e is None:
            return ("GO",)
        late = "GO_LATE" if e.r else "GO"
        if e.c is not None:
            if e.c == token:
                return (late,)
            if e.has_token(token):
                e.make_stale(token)
            return ("STALE",)
        if not e.has_token(token):
            return ("STALE",)
        e.c, e.o, e.lt, e.claimed_at, e.claim_age, e.w, e.took = token, owner, lease, True, 0, None, None
        return (late,)

    def done(self, run: str, token: str) -> Reply:
        """CLAIM_DONE: the claimant's run started or ended: its copy goes (the entry too, unless a
        later copy may come: a sweeper sent one, or an earlier delay's), and the run leaves the
        delayed index (in the script, on every DONE); TAKEN_BACK if the claim is another's or the
        token stale (a token current and unclaimed claims and is done at once): the index is left
        as it is (the copy sent again is looked after there)."""
        st = self.store
        e = self.entry(run)
        if e is not None:
            if e.c is not None and e.c != token:
                return ("TAKEN_BACK",)
            if e.c is None and not e.has_token(token):
                return ("TAKEN_BACK",)
        self.index(run, False)
        if e is None or e.m is None:
            return ("DONE",)
        if not e.r and not e.old:
            del st.entries[run]
            return ("DONE",)
        e.c, e.m, e.w, e.o, e.lt, e.claimed_at = token, None, None, None, None, False
        st.ends.add(run)
        return ("DONE",)

    def resend(self, run: str, token: str, alive: frozenset[str]) -> Reply:
        """RESEND, a sweeper's look: GONE once no copy waits; the same token again answers the
        same; a claim not done is taken back once it is WORKER_GONE_AFTER old and its worker gone,
        or DELAYED_CLAIM_PATIENCE old; an unclaimed copy is sent again a grace after its due time
        (or the last copy sent) if no worker that noted holding one is alive, and, if none noted
        one, only after the unseen grace. ``took``: the lease token of the claimant whose claim was
        taken back last ('' if it had none), carried by every copy sent from then on until a copy
        claims (CLAIM clears it). ``("RESEND", message, took)``."""
        e = self.entry(run)
        if e is None or e.m is None:
            return ("GONE",)
        if e.t == token:
            return ("RESEND", e.m, e.took or "")
        if e.c is not None:
            if e.claim_age == 0 or (e.o in alive and e.claim_age < 2):
                return ("NOT_DUE",)
            self.taken_back.add(e.c)
            e.make_stale(e.c)
            e.took = e.lt or ""  # kept for every copy sent after it, until a copy claims
            e.c, e.o, e.lt, e.claimed_at = None, None, None, False
        else:
            if e.age == 0:
                return ("NOT_DUE",)
            noted = list((e.w or {}).values())
            if any(worker in alive for worker in noted):
                return ("NOT_DUE",)
            if not noted and e.age < 2:
                return ("NOT_DUE",)
        e.r, e.t, e.w, e.sent, e.age = True, token, None, True, 0
        e.ts = [*e.ts, token]
        self.delay_of[token] = e.delay
        return ("RESEND", e.m, e.took or "")

    # -- the Python side: the delayed index --------------------------------------------------------

    def index(self, run: str, present: bool) -> None:
        if present:
            self.store.indexed.add(run)
        else:
            self.store.indexed.discard(run)

    # -- time ---------------------------------------------------------------------------------

    def age(self, run: str, level: int) -> None:
        """Time passes for ``run``'s entry: its copy (or its claim, if claimed and not done) is
        ``level`` old (never younger than it was)."""
        e = self.entry(run)
        assert e is not None
        level = min(level, AGES[-1])
        if e.claimed_at:
            e.claim_age = max(e.claim_age, level)
        elif e.m is not None:
            e.age = max(e.age, level)

    def snapshot(self) -> Store:
        return copy.deepcopy(self.store)
