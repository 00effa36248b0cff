"""The real lease scripts held to the protocol's model (``transcription.py``), on a real Redis.

A hypothesis state machine plays one lock key (1 or 2 slots) with a few runs of the duplicate
policies the library has (``queue``, ``join``, ``skip``; ``coalesce``, ``supersede``), each
run a task id whose deliveries (*attempts*, one worker process each, one token each) make the
calls the library makes, in its order (``run/pipeline.py``, ``run/guard.py``,
``run/settle.py``, ``policies/``, ``worker/sweeper.py``): ACQUIRE, then the run's NEWEST_START
or its duplicate policy (PARK, JOIN, COALESCE), RENEW, FENCED_SET and RELEASE while it holds the
key; the settlement's duties carried out (a handed-on message to the broker, which delivers it
later; joined and replaced runs answered; the holder that died on a slot the call took, handed
on or reserved, which ACQUIRE and RESUME name, ended as lost); the sweeper's look, RESUME once
per free slot (no read of the records before it: what it hands on names every holder dead on the
key). The calls that make a run wait
(PARK, JOIN, COALESCE) carry a journal mark (every third run none). Faults: a lost reply (the fault
proxy drops it and redis-py sends the call again; or the call is sent again later by hand,
with other steps in between), a process that dies (also right after its release, owing its
settlement), a lease or reservation that runs out (its deadline rewritten into the past), and
Redis restored from a snapshot or come back empty.

Beside it the model predicts every reply and the key's state; after every step both are
compared (every slot's record with the dead holder it names, the queue, parked and joined runs,
what releases handed over, the adopted tokens, the lost fences, the newest book, the journal
marks, the fenced resource), and the invariants are checked: fences only grow, also across a
restore; a write with an older fence than one stored is refused; ``coalesce`` keeps one pending
run, the last sent; no waiting run is lost; a dead holder a call names is no live holder.
At the end of each example the key is driven to quiescence (runs finish, leases run out, the
sweeper looks, messages are delivered) and every run must have ended, unless its worker died
with it or Redis lost the data it waited in, as the model says.

Profiles: the default (CI) runs each configuration for a fixed, derandomized set of examples;
``SF_MODEL_PROFILE=long`` runs ten times as many, longer, with a random seed::

    .venv/bin/pytest -n 0 tests/model -q                           # also part of make test
    make model-long                                                # SF_MODEL_PROFILE=long
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import redis
from celery import Celery
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis.backoff import ExponentialBackoff

from celery_singleflight import constants
from celery_singleflight.config.options import app_options
from celery_singleflight.connection.clients import AttemptClock
from celery_singleflight.protocol import fences
from celery_singleflight.protocol import handoff as handoff_calls
from celery_singleflight.protocol import lease as lease_calls
from celery_singleflight.protocol.handoff import (
    ADOPTED,
    ANSWERED,
    JOINED,
    OWN_COPY,
    PARKED,
    QUEUE,
    SETTLED,
    TAKEN,
    WAITING,
)
from celery_singleflight.protocol.journaled import JOURNALED
from celery_singleflight.protocol.layout import Layout
from celery_singleflight.protocol.lease import RenewReply
from celery_singleflight.protocol.newest import BOOK, RenewNotice
from celery_singleflight.protocol.record import RunRecord
from celery_singleflight.protocol.replies import Acquired, Holder, Parked
from celery_singleflight.protocol.store import SCRIPTS, USER_SCRIPTS, KeyLayout, LeaseStore
from celery_singleflight.run.guard import Guard

from ..chaos.faultproxy import DROP_REPLY
from .harness import Env, conformance_env, text
from .harness import pick as pick_of
from .transcription import Ended, Held, Model, Reply, Reserved, Slot, Store

LONG = os.environ.get("SF_MODEL_PROFILE", "") == "long"
#: print every call, the model's prediction and the real answer (to read a failing example)
TRACE = bool(os.environ.get("SF_MODEL_TRACE"))
#: tolerate no known disagreement (see LeaseMachine._known)
STRICT = bool(os.environ.get("SF_MODEL_STRICT"))

KEY = "acct:1"
TTL = 60.0  # long: a lease runs out only when a step says so
MAX_RUNS = 7 if LONG else 5
MAX_DEATHS = 3 if LONG else 2
MAX_LOSSES = 3 if LONG else 2
SOURCES = {script.name: script.source for script in (*SCRIPTS, *USER_SCRIPTS)}

#: a release of a lease Redis lost, sent twice (its reply lost): EARLIER, read as its own release
LOSS_AND_RESEND = "a release after a data loss, sent twice: read as its own earlier release"

#: a re-sent call whose first run handed a slot on, once that reservation is gone
GONE_RESERVATION = "a call sent again after the reservation it made is gone answers without the hand-on"

#: what the machine did, over the whole session (a script's answers, by fault; the known
#: disagreements met): for a look at the coverage, never printed by the tests
EVENTS: Counter[str] = Counter()

#: scripts whose second run is a call of its own: renewing, writing or starting again later is what
#: a later call does (RENEW answers the lease's state then, FENCED_SET the resource's, NEWEST_START
#: the newest book's: a run that a newer one overtook meanwhile gives way to it)
FRESH_ON_RESEND = frozenset({"RENEW", "FENCED_SET", "NEWEST_START"})

PICKS = st.integers(min_value=0, max_value=15)
#: how a call's reply travels: as sent; dropped by the proxy (redis-py sends the call again at
#: once); or lost and sent again by a later step (other steps may come in between)
FAULTS = st.sampled_from([None, None, None, None, "drop", "replay"])
#: a process that dies right after a release (or a sweep), before it settles the duties
DIES = st.sampled_from([False] * 7 + [True])
OUTCOMES = st.sampled_from(["succeeded", "succeeded", "failed"])


# -- the Redis, the proxy, the clients ------------------------------------------------------------

@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with conformance_env() as made:
        yield made


# -- the client side: runs, attempts, what waits to be sent again ---------------------------------

TERMINAL = ("SUCCESS", "FAILURE")
#: the phases in which an attempt's next step is a call
CALLING = ("acquire", "policy", "start", "stop", "answered")


@dataclass
class Run:
    """One task id, as its result backend would show it (``state``: PENDING, QUEUED, JOINED,
    STARTED, or ``SUCCESS:<why>`` / ``FAILURE:<why>``)."""

    id: str
    policy: str
    stamp: int
    state: str = "PENDING"
    waited_at: int = -1  # the last step it was seen waiting in Redis (parked, pending, joined)
    completed: int = -1  # the step its body ended with a release that was still its own

    @property
    def message(self) -> str:
        """Its message (distinct per run: its arguments are its send stamp)."""
        return json.dumps({"task_id": self.id, "args": [self.stamp]}, sort_keys=True)

    def parked_message(self, handoff: str) -> str:
        return json.dumps({"task_id": self.id, "args": [self.stamp], "handoff": handoff}, sort_keys=True)

    @property
    def terminal(self) -> bool:
        return self.state.startswith(TERMINAL)


@dataclass
class Got:
    """A real reply, decoded to the model's terms (``fence``: an ACQUIRE's grant)."""

    reply: Reply
    fence: int | None = None


@dataclass
class Stash:
    """A call whose reply was lost: it ran once and is sent again by a later step."""

    name: str
    real: Callable[[], Got]
    predict: Callable[[], Reply]
    first: Got
    changed: bool
    then: Callable[[Got], None]
    absorb: Callable[[Got], None] | None


@dataclass
class Owner:
    """Who makes calls: an attempt, or the sweeper."""

    name: str
    token: str = ""
    stash: Stash | None = None
    dead: bool = False


@dataclass
class Attempt(Owner):
    """One delivery of a run's message in one worker process (``token``: its execution's).
    ``phase``: its next call (acquire, policy, start, stop, answered), running (it holds the
    key: renew, write, release), or over."""

    run: str = ""
    handoff: str = ""
    phase: str = "acquire"
    tries: int = 0
    holder: str = ""
    slot: int = 0
    fence: int = 0
    granted_at: int = -1  # the step its acquire answered
    lost: bool = False
    superseded: bool = False
    stop: str = ""  # the outcome of a release that ends the run without its body

    @property
    def active(self) -> bool:
        return not self.dead and self.phase != "over"


@dataclass(frozen=True)
class Config:
    name: str
    slots: int
    policies: tuple[str, ...]

    @property
    def newest(self) -> bool:
        return self.policies[0] in ("coalesce", "supersede")


CONFIGS = (
    Config("queue-join", 1, ("queue", "join", "skip")),
    Config("coalesce", 1, ("coalesce",)),
    Config("supersede", 1, ("supersede",)),
    Config("queue-2-slots", 2, ("queue", "skip")),
    Config("coalesce-2-slots", 2, ("coalesce",)),
)


@dataclass
class LeaseRef:
    """What RENEW needs of a lease."""

    key: str
    token: str
    slot: int
    ttl: float
    layout: Layout


def _run_of(message: str) -> str:
    return str(json.loads(message)["task_id"])


@contextlib.contextmanager
def _call_id(call: str) -> Iterator[None]:
    """The hand-off calls draw a call id per sweep (``uuid4().hex``): this one, so that the
    very same call can be sent again."""
    fixed = SimpleNamespace(uuid4=lambda: SimpleNamespace(hex=call))
    with mock.patch.object(handoff_calls, "uuid", fixed):
        yield


# -- the machine -----------------------------------------------------------------------------------

class LeaseMachine(RuleBasedStateMachine):
    """See the module docstring. ``config`` and ``env`` are set by :func:`machine_for`."""

    config: Config
    env: Env

    def __init__(self) -> None:
        super().__init__()
        self.n = self.config.slots
        self.ns = f"model-{os.urandom(5).hex()}"
        self.store = LeaseStore(self.env.client, KeyLayout(self.ns))
        self.layout = self.store.layout
        self.resource = f"resource-{self.ns}"
        self.model = Model(self.n)
        self.runs: dict[str, Run] = {}
        self.attempts: list[Attempt] = []
        self.broker: list[str] = []
        self.sweeper = Owner("sweeper")
        self.saved: tuple[list[tuple[bytes, int, bytes]], Store] | None = None
        self.losses: list[int] = []  # the steps at which Redis lost data
        self.deaths = 0
        self.snapshots = 0
        self.steps = 0
        self.counter = 0
        self.writes: list[int] = []  # the fences of accepted writes, in order
        self.coalesced_stamp = -1  # the last-sent run a COALESCE made pending
        self.started_stamp = -1  # the last-sent run of coalesce/supersede whose body started
        self.replaced: set[str] = set()  # runs a newer pending run replaced
        self.broken = False

    # -- plumbing --------------------------------------------------------------------------

    def _id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}{os.urandom(3).hex()}"

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        """A step: one that raises leaves the machine broken (teardown then only cleans up)."""
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def _check(self, name: str, expected: Reply, got: Got, owner: Owner | None = None,
               before: Store | None = None) -> None:
        EVENTS[f"{name} {got.reply[0]}"] += 1
        if name in ("ACQUIRE", "RESUME") and got.reply[-1] and got.reply[0] in ("ACQUIRED", "HANDED_ON"):
            many = name == "RESUME" and len(got.reply[-1]) > 1  # type: ignore[arg-type]
            EVENTS[f"{name} {got.reply[0]} names {'dead holders' if many else 'a dead holder'}"] += 1
        if TRACE:
            print(f"    {name} answered {got.reply}" + (f" fence {got.fence}" if got.fence else ""))
        if expected[0] == "HELD":
            ok = got.reply[0] == "HELD" and got.reply[1] in expected[1]  # type: ignore[operator]
        else:
            ok = got.reply == expected
        if not ok and not STRICT and before is not None:
            known, unchanged = self._known(name, expected, got, owner, before)
            if known:
                EVENTS[f"known: {known}"] += 1
                if TRACE:
                    print(f"    (a known disagreement: {known})")
                if unchanged:
                    self.model.store = before  # the script took a branch that changes nothing
                return
        assert ok, f"{name}: the model expects {expected!r}, the script answered {got.reply!r}"

    def _known(self, name: str, expected: Reply, got: Got, owner: Owner | None,
               before: Store) -> tuple[str, bool]:
        """A known difference, tolerated so that the machine looks further: its name ('' if it
        is none), and whether the script changed nothing (the model's transition is undone).
        Only one is left: a release of a lease Redis lost whose reply was lost too (redis-py
        sent it twice) is told released (EARLIER: the caller cannot tell it from its own release
        sent again after newer runs took the key; see the two release tests below)."""
        if (name == "RELEASE" and expected == ("NOT_OURS",) and got.reply == ("RELEASED", None, ())
                and isinstance(owner, Attempt) and self._excused(owner.granted_at)):
            return LOSS_AND_RESEND, True
        return "", False

    def _known_resend(self, stash: Stash, got: Got, owner: Owner) -> tuple[str, bool]:
        """A re-sent call that answers otherwise than its first run, and is right to: its name
        ('' if none), and whether it ran as a call of its own (the model's transition for it
        then applies; else it changed nothing)."""
        first = stash.first.reply
        if (stash.name == "RELEASE" and first == ("NOT_OURS",) and got.reply == ("RELEASED", None, ())
                and isinstance(owner, Attempt) and self._excused(owner.granted_at)):
            return LOSS_AND_RESEND, False
        handed = (first[0] == "HANDED_ON" and first[2 if stash.name == "ACQUIRE" else 1] is not None) or (
            first[0] == "RELEASED" and first[1] is not None)
        slots = self.model.store.slots
        if handed and not any(isinstance(s, Reserved) and s.by == owner.token for s in slots):
            return f"{GONE_RESERVATION} (its run took it, or another hand-on did)", True
        if (stash.name == "PARK" and first[0] == "PARKED" and got.reply == ("FREE",)
                and isinstance(owner, Attempt) and owner.holder == owner.run):
            # its caller (a turned-away redelivery) drops the delivery on either answer
            return "a re-sent PARK of an own copy answers FREE once a slot is free", False
        replaced = isinstance(owner, Attempt) and (owner.run in self.replaced or any(
            _run_of(m) == owner.run for owed in self.model.store.owed.values() for m in owed))
        if stash.name == "COALESCE" and first[0] == "PENDING" and got.reply[0] == "GIVES_WAY" and replaced:
            return "a re-sent COALESCE whose run was replaced meanwhile answers GIVES_WAY", False
        if (stash.name == "COALESCE" and first[0] == "PENDING" and first[1] and got.reply == ("PENDING", ())
                and isinstance(owner, Attempt) and owner.run not in self.model.store.owed):
            # its run was handed the key and started meanwhile: NEWEST_START's caller answered them
            return "a re-sent COALESCE whose run started meanwhile owes the runs it replaced no more", False
        return "", False

    def _call(self, name: str, real: Callable[[], Got], predict: Callable[[], Reply], *, fault: str | None,
              owner: Owner | None, then: Callable[[Got], None],
              absorb: Callable[[Got], None] | None = None) -> None:
        """One script call as ``owner`` makes it: the model's transition, the real call (its
        reply dropped once, or lost and stashed to be sent again later), the comparison, then
        what the caller does with the answer."""
        EVENTS[f"fault {fault}"] += 1
        before = copy.deepcopy(self.model.store)
        expected = predict()
        changed = self.model.store != before
        if TRACE:
            print(f"  {owner.name if owner else '-'} {name} ({fault or 'sent'}): the model says {expected}")
        if fault == "replay" and owner is not None:
            first = real()
            self._check(name, expected, first, owner, before)
            if absorb is not None:
                absorb(first)
            owner.stash = Stash(name, real, predict, first, changed, then, absorb)
            return
        proxy = self.env.proxy
        armed = proxy.add_rule(DROP_REPLY, script=SOURCES[name], times=1) if fault == "drop" else None
        try:
            got = real()
        finally:
            if armed is not None:
                self.env.proxy.remove_rule(armed)
        assert armed is None or armed.faulted == 1, f"{name}: no reply was dropped"
        self._check(name, expected, got, owner, before)
        if absorb is not None:
            absorb(got)
        then(got)

    def _resend(self, owner: Owner) -> None:
        """The call whose reply was lost is sent again: if its first run changed the state, the
        second answers as the first and changes nothing more; else it is a call of its own."""
        stash = owner.stash
        assert stash is not None
        owner.stash = None
        EVENTS[f"{stash.name} sent again"] += 1
        fresh = not stash.changed or stash.name in FRESH_ON_RESEND
        if not fresh:
            with _sent_again():
                got = stash.real()
            if TRACE:
                print(f"  {owner.name} {stash.name} sent again: answered {got.reply}"
                      f" (first: {stash.first.reply})")
            known, fresh = ("", False) if STRICT else self._known_resend(stash, got, owner)
            if not known and self._same_answer(stash, got, owner):
                stash.then(got)
                return
            assert known, f"{stash.name} sent again: the first run answered {stash.first!r}, then {got!r}"
            EVENTS[f"known: {known}"] += 1
            if TRACE:
                print(f"    (a known disagreement: {known})")
            if not fresh:
                stash.then(got)
                return
            # it ran as a call of its own (a release as one that ran before, without the hand-on)
            before = copy.deepcopy(self.model.store)
            if stash.name == "RELEASE":
                expected: Reply = ("RELEASED", None, stash.first.reply[2])
            else:
                expected = stash.predict()
            self._check(stash.name, expected, got, owner, before)
        else:
            before = copy.deepcopy(self.model.store)
            expected = stash.predict()
            with _sent_again():
                got = stash.real()
            self._check(stash.name, expected, got, owner, before)
        if stash.absorb is not None:
            stash.absorb(got)
        stash.then(got)

    def _same_answer(self, stash: Stash, got: Got, owner: Owner) -> bool:
        """A second run of a call answers as the first (:func:`_same_answer`); RESUME names the
        holders dead on the key as they are now (the one its reservation keeps first)."""
        if stash.name != "RESUME" or got.reply[0] != "HANDED_ON" or stash.first.reply[0] != "HANDED_ON":
            return _same_answer(stash.name, got, stash.first)
        if got.reply[:3] != stash.first.reply[:3]:
            return False
        slots = self.model.store.slots
        reserved = next((s for s in slots if isinstance(s, Reserved) and s.by == owner.token), None)
        return got.reply[3] == self.model.dead_on_key(reserved)

    def _send(self, message: str) -> None:
        """settle(): a handed-on parked run's message goes to the broker."""
        self.broker.append(message)

    def _excused(self, since: int) -> bool:
        """Redis lost data after step ``since``."""
        return any(step > since for step in self.losses)

    def _end_dead(self, run_id: str) -> None:
        """end_dead_holder(): the run of a holder that died ends FAILURE (RunLost) unless ready."""
        run = self.runs[run_id]
        slots = {a.name: self.model.slot_of(a.token) for a in self.attempts
                 if a.run == run_id and a.active and a.phase == "running"}
        holding = [name for name, slot in slots.items() if slot is not None and self.model.live(slot)]
        assert not holding, f"{run_id} is named dead while {holding} holds a live lease of it"
        if not run.terminal:
            run.state = "FAILURE:run-lost"

    def _answer(self, messages: tuple[str, ...], state: str, *, unless_ready: bool = False) -> None:
        for message in messages:
            run = self.runs[_run_of(message)]
            if not (unless_ready and run.terminal):
                run.state = state

    def _mark(self, run: Run) -> str:
        """The journal mark of a call that makes ``run`` wait: a fresh one per call (a journal
        line's), or '' for a run its worker does not journal (every third run)."""
        return "" if run.stamp % 3 == 0 else self._id("mark-")

    def _waiting(self, run: Run, state: str) -> None:
        run.state = state  # stored before the call: once it waits, it can be handed on or answered

    # -- the real calls, decoded to the model's replies -------------------------------------------

    def _real_acquire(self, a: Attempt) -> Got:
        got = self.store.acquire(KEY, a.token, TTL, Holder(a.run, a.name, "model.task"), handoff=a.handoff,
                                 slots=self.n)
        if isinstance(got, Acquired):
            return Got(("ACQUIRED", got.slot, got.dead.task_id if got.dead else None), got.fence)
        if got.copy:
            return Got(("ADOPTED",))
        if got.handoff is not None:
            return Got(("HANDED_ON", got.holder, got.handoff, got.dead.task_id if got.dead else None))
        return Got(("HELD", got.holder))

    def _real_release(self, a: Attempt, outcome: str) -> Got:
        settled = self.store.release(KEY, a.token, outcome, TTL, fence=a.fence, slot=a.slot, slots=self.n,
                                     answer_joined=True, task_id=a.run)
        if not settled:
            return Got(("NOT_OURS",))
        return Got(("RELEASED", settled.handoff, settled.joined))

    def _real_park(self, run: str, token: str, message: str, mark: str) -> Got:
        got = self.store.handoff.park(KEY, run, token, message, None, self.n, mark=mark)
        if got is None:
            return Got(("FREE",))
        assert isinstance(got, Parked), got
        return Got(("PARKED", got.position))

    # -- runs are sent, messages delivered --------------------------------------------------------

    @initialize(picks=st.lists(PICKS, min_size=1, max_size=3))
    def first_runs(self, picks: list[int]) -> None:
        """A few runs are sent before anything else happens."""
        with self._step():
            for pick in picks:
                self._new_run(pick)

    def _new_run(self, pick: int) -> None:
        run = Run(f"r{len(self.runs) + 1}", pick_of(list(self.config.policies), pick), len(self.runs) + 1)
        self.runs[run.id] = run
        self.broker.append(run.message)

    @precondition(lambda self: len(self.runs) < MAX_RUNS)
    @rule(pick=PICKS)
    def send(self, pick: int) -> None:
        """A run is sent (``apply_async``): its message waits in the broker."""
        with self._step():
            self._new_run(pick)

    @precondition(lambda self: bool(self.broker))
    @rule(pick=PICKS, fault=FAULTS)
    def deliver(self, pick: int, fault: str | None) -> None:
        """The broker delivers a message to a worker process: a new attempt of its run, which
        takes the key at once."""
        with self._step():
            a = self._deliver(pick)
            self._acquire(a, fault)

    def _deliver(self, pick: int) -> Attempt:
        data = json.loads(self.broker.pop(pick % len(self.broker)))
        aid = len(self.attempts) + 1
        a = Attempt(f"w{aid}", token=self._id(f"x{aid}-"), run=data["task_id"],
                    handoff=data.get("handoff", ""))
        self.attempts.append(a)
        return a

    # -- an attempt's next call -------------------------------------------------------------------

    def _steppable(self) -> list[Attempt]:
        return [a for a in self.attempts
                if a.active and a.stash is None and a.phase in CALLING]

    @precondition(lambda self: bool(self._steppable()))
    @rule(pick=PICKS, fault=FAULTS)
    def step(self, pick: int, fault: str | None) -> None:
        """An attempt makes its next call (take, its duplicate policy, its start, a release
        that ends it without its body, forgetting the runs it replaced)."""
        with self._step():
            a: Attempt = pick_of(self._steppable(), pick)
            {"acquire": self._acquire, "policy": self._policy, "start": self._start, "stop": self._stop,
             "answered": self._answered}[a.phase](a, fault)

    def _acquire(self, a: Attempt, fault: str | None) -> None:
        a.tries += 1

        def predict() -> Reply:
            return self.model.acquire(a.run, a.token, a.handoff)

        def absorb(got: Got) -> None:
            if got.reply[0] == "ACQUIRED":
                assert got.fence is not None
                self.model.grant(int(got.reply[1]), got.fence)  # type: ignore[call-overload]
                a.granted_at, a.fence = self.steps, got.fence  # the lease is its own, seen or not

        self._call("ACQUIRE", lambda: self._real_acquire(a), predict, fault=fault, owner=a,
                   then=lambda got: self._after_acquire(a, got), absorb=absorb)

    def _after_acquire(self, a: Attempt, got: Got) -> None:
        """Guard.take() and Pipeline._take(): what the run does with the answer."""
        code = got.reply[0]
        if code == "ACQUIRED":
            a.slot, a.fence = int(got.reply[1]), int(got.fence or 0)  # type: ignore[call-overload]
            if got.reply[2]:  # taken in place of a holder that died: settle() ends its run
                self._end_dead(str(got.reply[2]))
            if a.handoff and self.runs[a.run].state.startswith("SUCCESS"):
                # Recovered.drop_a_stale_hand_off(): the run succeeded already (an older snapshot
                # brought its parked entry back): it is not run again (Ignore: released as ignored)
                a.stop, a.phase = "ignored", "stop"
            elif self.config.newest:
                a.phase = "start"
            else:
                self._begin_body(a)
        elif code == "ADOPTED":
            a.phase = "over"  # another copy of a run that took its slot before: dropped
        else:
            holder = str(got.reply[1])
            if code == "HANDED_ON":
                self._send(str(got.reply[2]))
                if got.reply[3]:
                    self._end_dead(str(got.reply[3]))
                a.token = self._id(f"{a.name}-")  # Guard.take(): the next take is a call of its own
            if a.handoff and holder != a.run:
                a.phase = "over"  # a parked run whose turn has not come: it stays parked
            else:
                a.holder, a.phase = holder, "policy"

    def _begin_body(self, a: Attempt) -> None:
        run = self.runs[a.run]
        if run.completed >= 0 and not self._lease_ran_out(run):
            assert self._excused(run.completed), (
                f"{run.id} runs a second time: it ran and released its own lease at step {run.completed},"
                " and Redis lost no data since")
        if self.config.newest:
            assert run.stamp >= self.started_stamp or self.losses, (
                f"{run.id} starts after a run sent after it started (send order)")
            self.started_stamp = max(self.started_stamp, run.stamp)
        run.state = "STARTED"
        a.phase = "running"

    def _lease_ran_out(self, run: Run) -> bool:
        """A lease of ``run`` ran out unreleased and another took the slot over: its worker froze
        (or died); then the run may run again, as a redelivery would (fences order the two)."""
        lost = self.model.store.lost
        return any(a.run == run.id and a.granted_at >= 0 and a.fence in lost for a in self.attempts)

    def _again(self, a: Attempt) -> None:
        """The policy found a slot free: take again (at most ACQUIRE_ATTEMPTS takes)."""
        if a.tries >= constants.ACQUIRE_ATTEMPTS:
            self.runs[a.run].state = "FAILURE:lock-held"
            a.phase = "over"
        else:
            a.phase = "acquire"

    def _policy(self, a: Attempt, fault: str | None) -> None:
        run = self.runs[a.run]
        if a.holder == a.run:
            # a redelivery of a run that holds the key: a copy is parked behind it, not run
            token = self._id(f"{OWN_COPY}{a.name}-")
            message = run.parked_message(token)

            def over(got: Got) -> None:
                a.phase = "over"

            mark = self._mark(run)
            self._call("PARK", lambda: self._real_park(run.id, token, message, mark),
                       lambda: self.model.park(run.id, token, message, mark), fault=fault, owner=a, then=over)
            return
        if run.policy == "skip":
            run.state = "SUCCESS:skipped"
            a.phase = "over"
            return
        if run.policy == "join":
            self._waiting(run, "JOINED")

            def joined(got: Got) -> None:
                if got.reply[0] == "FREE":
                    self._again(a)
                else:
                    a.phase = "over"

            join_mark = self._mark(run)

            def real_join() -> Got:
                got = self.store.handoff.join(KEY, run.message, mark=join_mark)
                return Got(("FREE",)) if got is None else Got(("JOINED", got[0]))

            self._call("JOIN", real_join, lambda: self.model.join(run.message, join_mark), fault=fault,
                       owner=a, then=joined)
            return
        handoff = self._id(f"h{a.name}-")
        message = run.parked_message(handoff)
        mark = self._mark(run)
        self._waiting(run, "QUEUED")
        if run.policy == "queue":
            def parked(got: Got) -> None:
                if got.reply[0] == "FREE":
                    self._again(a)
                else:
                    a.phase = "over"

            self._call("PARK", lambda: self._real_park(run.id, handoff, message, mark),
                       lambda: self.model.park(run.id, handoff, message, mark), fault=fault, owner=a,
                       then=parked)
            return
        mode = "supersede" if run.policy == "supersede" else "last"

        def real_coalesce() -> Got:
            got = self.store.newest.coalesce(KEY, run.id, handoff, message, mode, str(run.stamp), self.n,
                                             supersede_grace=10.0, mark=mark)
            if got is None:
                return Got(("FREE",))
            if isinstance(got, str):
                return Got(("GIVES_WAY", got))
            return Got(("PENDING", got))

        def pending(got: Got) -> None:
            code = got.reply[0]
            if code == "FREE":
                self._again(a)
                return
            if code == "GIVES_WAY":
                run.state = "FAILURE:superseded" if mode == "supersede" else "SUCCESS:coalesced"
                a.phase = "over"
                return
            self.coalesced_stamp = max(self.coalesced_stamp, run.stamp)
            replaced = tuple(got.reply[1])  # type: ignore[arg-type]
            self.replaced |= {_run_of(m) for m in replaced}
            self._answer(replaced, "FAILURE:superseded" if mode == "supersede" else "SUCCESS:coalesced")
            a.phase = "answered" if replaced else "over"

        self._call("COALESCE", real_coalesce,
                   lambda: self.model.coalesce(run.id, handoff, message, mode, run.stamp, mark),
                   fault=fault, owner=a, then=pending)

    def _answered(self, a: Attempt, fault: str | None) -> None:
        """The caller of COALESCE ended the runs it replaced: it forgets them (HDEL)."""
        self.store.newest.answered(KEY, a.run)
        self.model.answered(a.run)
        a.phase = "over"

    def _start(self, a: Attempt, fault: str | None) -> None:
        """Newest.on_start(): NEWEST_START, then run, give way, or stop superseded."""
        run = self.runs[a.run]
        supersede = run.policy == "supersede"

        def real() -> Got:
            got = self.store.newest.started(KEY, run.id, a.slot, str(run.stamp))
            if got.newer is not None:
                return Got(("STALE", got.newer, got.owed))
            return Got(("STARTED", got.owed, got.notice.by if got.notice else None))

        def then(got: Got) -> None:
            owed = tuple(got.reply[2] if got.reply[0] == "STALE" else got.reply[1])  # type: ignore[arg-type]
            if owed:
                self._answer(owed, "FAILURE:superseded" if supersede else "SUCCESS:coalesced")
                self.store.newest.answered(KEY, run.id)
                self.model.answered(run.id)
            if got.reply[0] == "STALE":
                run.state = "FAILURE:superseded" if supersede else "SUCCESS:coalesced"
                a.stop, a.phase = "failed" if supersede else "succeeded", "stop"
                return
            if got.reply[2]:  # superseded on its way here: it stops at once
                run.state = "FAILURE:superseded"
                a.stop, a.phase = "failed", "stop"
                return
            self._begin_body(a)

        self._call("NEWEST_START", real, lambda: self.model.newest_start(run.id, run.stamp, a.slot),
                   fault=fault, owner=a, then=then)

    def _stop(self, a: Attempt, fault: str | None) -> None:
        self._release(a, a.stop, fault, die=False, body=False)

    def _release(self, a: Attempt, outcome: str, fault: str | None, *, die: bool, body: bool) -> None:
        """Guard.end(): RELEASE, then settle() (unless the process dies first)."""
        run = self.runs[a.run]
        recorded = "lost" if a.lost else outcome

        def then(got: Got) -> None:
            a.phase = "over"
            if die:
                a.dead = True  # neither its result nor the duties are carried out
                return
            ours = got.reply[0] == "RELEASED"
            if body:
                if a.superseded:
                    run.state = "FAILURE:superseded"
                else:
                    run.state = "SUCCESS:ran" if outcome == "succeeded" else "FAILURE:ran"
                if ours and not a.lost:
                    run.completed = self.steps
            if ours:
                if got.reply[1] is not None:
                    self._send(str(got.reply[1]))
                answered = "SUCCESS:joined" if outcome == "succeeded" and body else "FAILURE:joined"
                self._answer(tuple(got.reply[2]), answered)  # type: ignore[arg-type]

        self._call("RELEASE", lambda: self._real_release(a, recorded),
                   lambda: self.model.release(a.run, a.token, recorded, a.slot), fault=fault, owner=a,
                   then=then)

    # -- a holder's calls -------------------------------------------------------------------------

    def _running(self) -> list[Attempt]:
        return [a for a in self.attempts if a.active and a.stash is None and a.phase == "running"]

    @precondition(lambda self: bool(self._running()))
    @rule(pick=PICKS, fault=FAULTS)
    def renew(self, pick: int, fault: str | None) -> None:
        """The heartbeat renews a holder's lease."""
        with self._step():
            a: Attempt = pick_of(self._running(), pick)

            def real() -> Got:
                code = self.store.renew([LeaseRef(KEY, a.token, a.slot, TTL, self.layout)])[0]
                return Got(({RenewReply.GONE: "GONE", RenewReply.RENEWED: "RENEWED",
                             RenewNotice.RENEWED_SUPERSEDED: "RENEWED_SUPERSEDED"}[code],))

            def then(got: Got) -> None:
                if got.reply[0] == "GONE":
                    # told: its next check() raises LeaseLost; it ends, recorded as lost
                    a.lost = True
                    self.runs[a.run].state = "FAILURE:lease-lost"
                    a.stop, a.phase = "failed", "stop"
                elif got.reply[0] == "RENEWED_SUPERSEDED":
                    # told: its next check() raises Superseded, and it writes nothing more
                    a.superseded = True
                    self.runs[a.run].state = "FAILURE:superseded"
                    a.stop, a.phase = "failed", "stop"

            self._call("RENEW", real, lambda: self.model.renew(a.token, a.slot), fault=fault, owner=a,
                       then=then)

    @precondition(lambda self: bool(self._running()))
    @rule(pick=PICKS, fault=FAULTS)
    def write(self, pick: int, fault: str | None) -> None:
        """A holder writes the fenced resource with its fence (``fenced_set``); a refused write
        (StaleFence) ends its body."""
        with self._step():
            a: Attempt = pick_of(self._running(), pick)
            newer = any(fence > a.fence for fence in self.writes)

            def predict() -> Reply:
                expected = self.model.fenced_set(a.fence)
                assert not (newer and expected[0] == "WRITTEN"), "the model lets a stale write through"
                return expected

            def real() -> Got:
                value = f"{a.run}@{a.name}"
                written, stored = fences.fenced_set(self.env.client, self.resource, value, a.fence, None)
                return Got(("WRITTEN", a.fence) if written else ("STALE", stored))

            def then(got: Got) -> None:
                if got.reply[0] == "WRITTEN":
                    self.writes.append(a.fence)
                else:
                    self.runs[a.run].state = "FAILURE:stale-fence"
                    a.stop, a.phase = "failed", "stop"

            self._call("FENCED_SET", real, predict, fault=fault, owner=a, then=then)

    @precondition(lambda self: bool(self._running()))
    @rule(pick=PICKS, outcome=OUTCOMES, fault=FAULTS, die=DIES)
    def release(self, pick: int, outcome: str, fault: str | None, die: bool) -> None:
        """A holder's body ends: it releases (a superseded one as failed: Superseded)."""
        with self._step():
            a: Attempt = pick_of(self._running(), pick)
            self._release(a, "failed" if a.superseded else outcome, fault, die=die, body=True)

    # -- the sweeper ------------------------------------------------------------------------------

    def _look(self, fault: str | None, die: bool) -> bool:
        """HandOn.sweep_once() on the key: RESUME once per slot at most, each hands one free slot
        on, as long as each hands a run on (a look that finds nothing, hands on joined runs only,
        or whose process dies stops). ``fault`` is the first call's (a reply lost for later ends
        the look: its thread waits). True if it handed something on."""
        handed = False
        for i in range(self.n):
            found, sent = self._sweep(fault if i == 0 else None, die)
            handed = handed or found
            if not sent or die or (i == 0 and fault == "replay"):
                break
            EVENTS["a look hands on another slot"] += int(i > 0)
        return handed

    def _sweep(self, fault: str | None, die: bool) -> tuple[bool, bool]:
        """One RESUME of a look, then settle (the runs of dead holders end, the handed-on run is
        sent, joined runs of a gone holder are answered, and joined runs a dead releaser took are
        answered). Whether it handed something on, and whether a parked run's message."""
        call = self._id("sweep-")
        self.sweeper.token = call
        handed: list[bool] = []

        def real() -> Got:
            # no read of the records before: RESUME names the holder that died on the slot it
            # hands on (the settlement's dead), and settle() ends it
            with _call_id(call):
                found = self.store.handoff.resume(KEY, TTL, self.n)
            if found is None:
                return Got(("NONE",))
            return Got(("HANDED_ON", found.handoff, found.joined, tuple(d.task_id for d in found.dead)))

        def predict() -> Reply:
            expected = self.model.resume(call)
            if expected[0] == "NOTHING_WAITS" and expected[1]:
                return ("HANDED_ON", None, (), expected[1])  # the dead it names end, as on a hand-on
            if expected[0] in ("NOTHING_WAITS", "ALL_HELD"):
                return ("NONE",)
            return expected

        def then(got: Got) -> None:
            if die:
                self.sweeper.dead = True
                return
            self._unanswered()
            if got.reply[0] == "NONE":
                return
            _, message, joined, dead = got.reply
            handed.append(message is not None)
            for run_id in dead:  # type: ignore[attr-defined]
                self._end_dead(str(run_id))
            if message is not None:
                self._send(str(message))
            self._answer(tuple(joined), "FAILURE:joined-lost")  # type: ignore[arg-type]
            if message is not None:
                record = self.store.record(KEY)
                if record.rt:
                    orphans = tuple(self.store.handoff.settled_joined(KEY, record.rt))
                    self._answer(orphans, "FAILURE:joined-orphaned", unless_ready=True)

        self._call("RESUME", real, predict, fault=fault, owner=self.sweeper, then=then)
        self.sweeper.dead = False  # a sweeper that died is another worker's next sweep
        return bool(handed), any(handed)

    def _unanswered(self) -> None:
        """HandOn._unanswered(): joined runs a release (or a sweep) took ANSWER_GRACE ago or more,
        still waiting, are answered (their releaser's worker was lost before it answered them)."""
        found: list[str] = []
        taken, now = self.store.handoff.taken_joined(KEY)
        for token, taken_at in taken.items():
            if now - taken_at >= constants.ANSWER_GRACE * 1000:
                found += self.store.handoff.settled_joined(KEY, token)
        assert sorted(found) == sorted(self.model.unanswered()), (
            f"a sweep answers {found}, the model says {self.model.unanswered()}")
        self._answer(tuple(found), "FAILURE:joined-orphaned", unless_ready=True)

    def _waits(self) -> bool:
        """Something waits for the sweeper's look: parked or joined runs, joined runs taken."""
        store = self.model.store
        return bool(store.queue or store.joined or store.taken)

    @precondition(lambda self: self.sweeper.stash is None)
    @rule(fault=FAULTS, die=DIES)
    def resume(self, fault: str | None, die: bool) -> None:
        """The sweeper looks at the key (it has runs waiting)."""
        with self._step():
            self._look(fault, die)

    # -- faults -----------------------------------------------------------------------------------

    def _stashed(self) -> list[Owner]:
        owners: list[Owner] = [a for a in self.attempts if a.stash is not None and not a.dead]
        if self.sweeper.stash is not None:
            owners.append(self.sweeper)
        return owners

    @precondition(lambda self: bool(self._stashed()))
    @rule(pick=PICKS)
    def resend(self, pick: int) -> None:
        """redis-py sends a call again whose reply was lost."""
        with self._step():
            self._resend(pick_of(self._stashed(), pick))

    def _expirable(self) -> list[int]:
        """Live slots whose lease may run out now: not one a lost reply's call is still about
        (the re-sent call would find its own lease gone: a reply later than the TTL)."""
        waiting = {owner.token for owner in self._stashed()}
        out = []
        for i, slot in enumerate(self.model.store.slots):
            if not self.model.live(i):
                continue
            if isinstance(slot, Held) and slot.token in waiting:
                continue
            if isinstance(slot, Reserved) and slot.by in waiting:
                continue
            out.append(i)
        return out

    @precondition(lambda self: bool(self._expirable()))
    @rule(pick=PICKS)
    def expire(self, pick: int) -> None:
        """The clock passes a lease's (or a reservation's) deadline: its holder died, froze, or
        its message is slow."""
        with self._step():
            slot = pick_of(self._expirable(), pick)
            self._expire(slot)

    def _expire(self, slot: int) -> None:
        _run_out(self.env.direct, self.layout.run(KEY, slot))
        self.model.expire(slot)

    @precondition(lambda self: bool(self.model.store.taken))
    @rule()
    def grace(self) -> None:
        """ANSWER_GRACE passes for the joined runs releases (or sweeps) took (their stamps are
        rewritten into the past)."""
        with self._step():
            self._age_taken()

    def _age_taken(self) -> None:
        direct, name = self.env.direct, self.layout.key(SETTLED, KEY)
        raw = direct.hget(name, TAKEN)
        if raw is not None:
            seconds, micros = direct.time()
            past = int(seconds) * 1000 + int(micros) // 1000 - int(constants.ANSWER_GRACE * 1000) - 1000
            direct.hset(name, TAKEN, json.dumps({token: str(past) for token in json.loads(raw)}))
        self.model.grace()

    def _active(self) -> list[Attempt]:
        return [a for a in self.attempts if a.active]

    @precondition(lambda self: self.deaths < MAX_DEATHS and bool(self._active()))
    @rule(pick=PICKS)
    def die(self, pick: int) -> None:
        """A worker process dies: its attempt makes no more calls (a lost reply is never sent
        again); a lease it holds runs out later, a message it was to send is never sent."""
        with self._step():
            a: Attempt = pick_of(self._active(), pick)
            a.dead, a.stash = True, None
            self.deaths += 1

    def _keys(self) -> list[bytes]:
        return list(self.env.direct.scan_iter(match=f"{self.ns}:*", count=200))

    @precondition(lambda self: self.snapshots < MAX_LOSSES)
    @rule()
    def snapshot(self) -> None:
        """Redis saves a snapshot (every key of the namespace, DUMP)."""
        with self._step():
            direct = self.env.direct
            keys = self._keys()
            pipe = direct.pipeline(transaction=False)
            for key in keys:
                pipe.dump(key)
                pipe.pttl(key)
            replies = pipe.execute()
            dumps = [(key, int(replies[2 * i + 1]), replies[2 * i]) for i, key in enumerate(keys)]
            self.saved = ([d for d in dumps if d[2] is not None], self.model.snapshot())
            self.snapshots += 1

    @precondition(lambda self: self.saved is not None and len(self.losses) < MAX_LOSSES
                  and not self._stashed())
    @rule()
    def restore(self) -> None:
        """Redis comes back from the last snapshot (its scripts forgotten too)."""
        with self._step():
            assert self.saved is not None
            dumps, store = self.saved
            self._lose_data(dumps)
            self.model.restore(store)

    @precondition(lambda self: len(self.losses) < MAX_LOSSES and not self._stashed())
    @rule()
    def wipe(self) -> None:
        """Redis comes back empty."""
        with self._step():
            self._lose_data([])
            self.model.restore(None)

    def _lose_data(self, dumps: list[tuple[bytes, int, bytes]]) -> None:
        direct = self.env.direct
        keys = self._keys()
        if keys:
            direct.delete(*keys)
        for key, pttl, value in dumps:
            direct.restore(key, max(pttl, 0), value)
        direct.script_flush()
        self.losses.append(self.steps + 1)  # after every step seen so far

    # -- comparison and invariants ----------------------------------------------------------------

    def _real(self) -> dict[str, Any]:
        layout, key = self.layout, KEY
        pipe = self.env.direct.pipeline(transaction=False)
        pipe.time()
        for slot in range(self.n):
            pipe.get(layout.run(key, slot))
        pipe.lrange(layout.key(QUEUE, key), 0, -1)
        pipe.hgetall(layout.key(PARKED, key))
        pipe.lrange(layout.key(JOINED, key), 0, -1)
        pipe.hgetall(layout.key(SETTLED, key))
        pipe.zrange(layout.key(ADOPTED, key), 0, -1, withscores=True)
        pipe.hgetall(layout.key(BOOK, key))
        pipe.hget(self.resource, "fence")
        pipe.zrange(layout.key(JOURNALED, key), 0, -1)
        got = pipe.execute()
        seconds, micros = got[0]
        now = int(seconds) * 1000 + int(micros) // 1000
        records = [RunRecord.decode(raw) for raw in got[1 : 1 + self.n]]
        queue, parked, joined, settled, adopted, book, resource, journaled = got[1 + self.n :]
        return {
            "slots": [_slot(record, now) for record in records],
            "rt": [record.rt or None for record in records],
            "lost": {int(f) for record in records for f in record.lost.split(",") if f},
            "queue": [tuple(text(e).split("|", 1)) for e in queue],
            "parked": {text(k): text(v) for k, v in parked.items()},
            "joined": [text(m) for m in joined],
            "settled": {text(k): tuple(json.loads(v)) for k, v in settled.items()
                        if text(k) != TAKEN and not text(k).startswith(ANSWERED)},
            "answered": {text(k)[len(ANSWERED):]: text(v) for k, v in settled.items()
                         if text(k).startswith(ANSWERED)},
            "taken": {token: now - int(at) >= constants.ANSWER_GRACE * 1000
                      for token, at in json.loads(settled.get(TAKEN.encode(), b"{}")).items()},
            "adopted": {text(k): int(v) for k, v in adopted},
            "book": {text(k): text(v) for k, v in book.items()},
            "resource": None if resource is None else int(resource),
            "journaled": {text(mark) for mark in journaled},
        }

    def _expected(self) -> dict[str, Any]:
        m = self.model.store
        book = {f"s:{run}": str(stamp) for run, stamp in m.stamps.items()}
        book.update({f"o:{run}": json.dumps(list(msgs)) for run, msgs in m.owed.items() if msgs})
        if m.latest is not None:
            book["latest"] = f"{m.latest[0]} {m.latest[1]}"
        return {
            "slots": list(m.slots),
            "rt": [rt if slot is not None else None for rt, slot in zip(m.rt, m.slots, strict=True)],
            "lost": set(m.lost),
            "queue": list(m.queue),
            "parked": dict(m.parked),
            "joined": list(m.joined),
            "settled": dict(m.settled),
            # each joined message a release (or sweep) took is marked with its taker, for JOIN
            "answered": {hashlib.sha1(msg.encode()).hexdigest(): by for by, msgs in m.settled.items()
                         for msg in msgs},
            "taken": dict(m.taken),
            "adopted": {token: fence for token, fence in m.adopted.items() if fence is not None},
            "book": book,
            "resource": self.model.resource,
            "journaled": set(m.journaled),
        }

    @invariant()
    def agrees_with_the_model(self) -> None:
        """After every step: the real key is the model's, and the invariants hold."""
        with self._step():
            self.steps += 1
            real, expected = self._real(), self._expected()
            real_book = {k: v for k, v in real["book"].items()}
            for name in expected:
                got, want = real[name], expected[name]
                if name == "slots":
                    for i, (r, w) in enumerate(zip(got, want, strict=True)):
                        assert _same_slot(r, w), f"slot {i}: Redis holds {r!r}, the model {w!r}"
                elif name == "book":
                    got = {k: (json.loads(v) if k.startswith("o:") else v) for k, v in real_book.items()}
                    want = {k: (json.loads(v) if k.startswith("o:") else v) for k, v in want.items()}
                    assert got == want, f"newest book: Redis holds {got!r}, the model {want!r}"
                else:
                    assert got == want, f"{name}: Redis holds {got!r}, the model {want!r}"
            self._invariants()

    def _invariants(self) -> None:
        model = self.model
        holding = [a for a in self.attempts if a.active and a.phase in ("start", "running", "stop")
                   and isinstance(model.store.slots[a.slot], Held)
                   and model.store.slots[a.slot].token == a.token and model.live(a.slot)]  # type: ignore[union-attr]
        assert len(holding) <= self.n, f"{len(holding)} valid leases on {self.n} slot(s)"
        if self.config.newest:
            pending = model.pending_entries()
            assert len(pending) <= 1, f"several pending runs: {pending}"
            if pending:
                run = self.runs[pending[0]]
                assert _run_of(model.store.parked[run.id]) == run.id
                parked = json.loads(model.store.parked[run.id])
                assert parked["args"] == [run.stamp], "not the run's arguments"
                if not self.losses:
                    assert run.stamp >= self.coalesced_stamp, (
                        f"pending {run.id} was sent before a run made pending since")
        store = model.store
        waiting = {run for run, token in store.queue if not token.startswith(OWN_COPY)}
        waiting |= {_run_of(m) for m in store.joined}
        waiting |= {_run_of(m) for messages in store.settled.values() for m in messages}
        waiting |= {_run_of(m) for messages in store.owed.values() for m in messages}
        for run in self.runs.values():
            if run.id in waiting:
                run.waited_at = self.steps
            elif run.state == "QUEUED" and not self._accounted(run):
                assert self._gone_excused(run), f"{run.id} waits QUEUED but nothing will send it"

    def _gone_excused(self, run: Run) -> bool:
        """A run neither ended nor waiting anywhere: Redis lost the data it waited in; or its
        worker died with it after it took the key (ending it is the started-runs sweep's, or the
        next hand-on's, as a dead holder), or before it ever waited in Redis."""
        if any(a.dead and a.granted_at >= 0 for a in self.attempts if a.run == run.id):
            return True
        if run.waited_at >= 0:
            return self._excused(run.waited_at)
        return any(a.dead for a in self.attempts if a.run == run.id)

    def _accounted(self, run: Run) -> bool:
        """A QUEUED run is in the queue, in the broker, or in the hands of a live attempt."""
        if any(entry[0] == run.id for entry in self.model.store.queue):
            return True
        if any(_run_of(message) == run.id for message in self.broker):
            return True
        return any(a.run == run.id and a.active for a in self.attempts)

    # -- the end of an example ----------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if not self.broken:
                self._quiesce()
                self._everything_ended()
        finally:
            keys = self._keys()
            if keys:
                self.env.direct.delete(*keys)
            self.env.direct.delete(self.resource)

    def _quiesce(self) -> None:
        """Drive the key until nothing moves: lost replies sent again, attempts finish (a
        holder's body succeeds), messages delivered; when stuck, every live lease or
        reservation runs out and the sweeper looks."""
        for _ in range(400):
            moved = False
            for owner in self._stashed():
                self._resend(owner)
                moved = True
            for a in self._active():
                if a.phase == "running":
                    self._release(a, "failed" if a.superseded else "succeeded", None, die=False, body=True)
                else:
                    steps = {"acquire": self._acquire, "policy": self._policy, "start": self._start,
                             "stop": self._stop, "answered": self._answered}
                    steps[a.phase](a, None)
                self.agrees_with_the_model()
                moved = True
            while self.broker:
                self._deliver(0)
                moved = True
            if moved:
                continue
            for slot in range(self.n):
                if self.model.live(slot):
                    self._expire(slot)
            if self.model.store.taken and not all(self.model.store.taken.values()):
                self._age_taken()
                moved = True
            if self._waits() and self._look(None, False):
                moved = True
            self.agrees_with_the_model()
            if moved:
                continue
            return
        raise AssertionError("the key did not come to rest")

    def _everything_ended(self) -> None:
        """Every run ended, unless its worker died with it (it never waited in Redis since) or
        Redis lost the data it waited in."""
        for run in self.runs.values():
            if run.terminal:
                continue
            assert self._gone_excused(run), f"{run.id} never ended: {run.state}"
        assert not self.model.store.queue or self.losses, f"runs left parked: {self.model.store.queue}"


@contextlib.contextmanager
def _sent_again() -> Iterator[None]:
    """A stashed call goes out as redis-py's second send of it (only later, with steps between):
    a release told EARLIER asks its client whether a send failed meanwhile, so it is told one did."""
    with mock.patch.object(lease_calls, "failed_sends", side_effect=itertools.count()):
        yield


def _run_out(client: redis.Redis, name: str) -> None:
    """The lease (or reservation) in run record ``name`` runs out: its deadline is rewritten a
    second into the past (the server's clock), in place (a plain record stays plain)."""
    seconds, micros = client.time()
    past = int(seconds) * 1000 + int(micros) // 1000 - 1000
    raw = client.get(name)
    assert raw is not None
    text, count = re.subn(r'"deadline":"\d+"', f'"deadline":"{past}"', raw.decode(), count=1)
    assert count == 1, text
    client.set(name, text, keepttl=True)


def _same_answer(name: str, got: Got, first: Got) -> bool:
    """A second run of a call answers as the first: the same code and what it carries, but for a
    place in the queue and a count of joined runs, which others may change between."""
    if name in ("PARK", "JOIN"):
        return got.reply[0] == first.reply[0]
    return got == first


def _slot(record: RunRecord, now: int) -> Slot:
    """A real record in the model's terms (``dead``: the holder it names, by ``prev_worker``)."""
    if not record:
        return None
    sup_by = record.sup_by or None
    if record.token:
        expired = (record.deadline or 0) <= now
        dead = record["prev_task_id"] if "prev_worker" in record else None
        if record.reserved:
            return Reserved(record.task_id, record.token, record.by, expired, sup_by, record.fence, dead)
        return Held(record.task_id, record.token, record.fence, expired, sup_by, dead=dead)
    return Ended(record.task_id, record.outcome, sup_by, record.fence)


def _same_slot(real: Slot, model: Slot) -> bool:
    if real is None or model is None:
        return real is None and model is None
    if type(real) is not type(model):
        return False
    if isinstance(real, Held) and isinstance(model, Held):
        return (real.run, real.token, real.fence, real.expired, real.sup_by, real.dead) == (
            model.run, model.token, model.fence, model.expired, model.sup_by, model.dead)
    if isinstance(real, Reserved) and isinstance(model, Reserved):
        return (real.run, real.token, real.by, real.expired, real.sup_by, real.dead) == (
            model.run, model.token, model.by, model.expired, model.sup_by, model.dead)
    assert isinstance(real, Ended) and isinstance(model, Ended)
    return (real.run, real.outcome, real.sup_by) == (model.run, model.outcome, model.sup_by)


# -- the tests ---------------------------------------------------------------------------------------

def machine_for(config: Config, environment: Env) -> type[LeaseMachine]:
    return type(f"LeaseMachine_{config.name.replace('-', '_')}", (LeaseMachine,),
                {"config": config, "env": environment})


EXAMPLES = {"queue-join": 60, "coalesce": 40, "supersede": 40, "queue-2-slots": 50, "coalesce-2-slots": 30}


def profile(config: Config) -> settings:
    if LONG:
        return settings(max_examples=EXAMPLES[config.name] * 10, stateful_step_count=80, deadline=None,
                        database=None, suppress_health_check=list(HealthCheck))
    # no shrinking unless asked (SF_MODEL_SHRINK=1): a failing example of 40 steps takes minutes to shrink
    shrink = bool(os.environ.get("SF_MODEL_SHRINK"))
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=EXAMPLES[config.name], stateful_step_count=40, deadline=None, database=None,
                    derandomize=True, suppress_health_check=list(HealthCheck), print_blob=False,
                    phases=phases)


@pytest.mark.timeout(3600 if LONG else 150)
@pytest.mark.parametrize("config", CONFIGS, ids=[config.name for config in CONFIGS])
def test_the_scripts_follow_the_model(env: Env, config: Config) -> None:
    """Given one key with a few runs of the library's policies, when any sequence of the
    protocol's calls and faults runs on a real Redis, then every reply and the key's state are
    the model's after each step, fences only grow, stale writes are refused, and every run ends."""
    run_state_machine_as_test(machine_for(config, env), settings=profile(config))


# -- the defects it found, each replayed on its own ----------------------------------------------------

@pytest.fixture
def store(env: Env) -> Iterator[LeaseStore]:
    """A store of a namespace of its own, straight on the private Redis."""
    found = LeaseStore(env.server.client(), KeyLayout(f"found-{os.urandom(4).hex()}"))
    yield found
    keys = list(found.client.scan_iter(match=f"{found.layout.namespace}:*", count=200))
    if keys:
        found.client.delete(*keys)


def _token() -> str:
    return os.urandom(8).hex()


def _wipe(store: LeaseStore) -> None:
    keys = list(store.client.scan_iter(match=f"{store.layout.namespace}:*", count=200))
    if keys:
        store.client.delete(*keys)


def _parked_message(run: str, handoff: str) -> str:
    return json.dumps({"task_id": run, "handoff": handoff})


def test_a_paused_holder_is_refused_when_it_wakes(store: LeaseStore) -> None:
    """Kleppmann's case. Given a holder that froze past its TTL while another run took the key and
    wrote the resource, when it wakes, its fenced write is refused, its renewal finds the lease
    gone and its release is told the lease was not its own."""
    paused = _token()
    first = store.acquire("k", paused, TTL, Holder("paused"))
    assert isinstance(first, Acquired)
    assert fences.fenced_set(store.client, "k-resource", "paused", first.fence, None)[0]
    _run_out(store.client, store.layout.run("k"))
    second = store.acquire("k", _token(), TTL, Holder("next"))
    assert isinstance(second, Acquired) and second.fence > first.fence
    assert fences.fenced_set(store.client, "k-resource", "next", second.fence, None)[0]
    assert fences.fenced_set(store.client, "k-resource", "paused", first.fence, None) == (False, second.fence)
    assert store.renew([LeaseRef("k", paused, 0, TTL, store.layout)]) == [RenewReply.GONE]
    assert not store.release("k", paused, fence=first.fence, task_id="paused")
    store.client.delete("k-resource")


def test_a_late_release_after_redis_lost_the_lease_is_told_it_was_not_ours(env: Env) -> None:
    """Given a holder whose lease Redis lost (it came back empty) and a newer run that took the
    key since, when the old holder releases (a call sent once), it is told the lease was not its
    own (NOT_OURS), so that it records and signals the loss. (The script alone cannot tell this
    from its own release sent again after newer runs took the key: it answers EARLIER, and the
    caller knows whether it sent the call twice.)"""
    store = LeaseStore(env.client, KeyLayout(f"found-{os.urandom(4).hex()}"))
    old = _token()
    first = store.acquire("k", old, TTL, Holder("old"))
    assert isinstance(first, Acquired)
    _wipe(store)
    assert isinstance(store.acquire("k", _token(), TTL, Holder("new")), Acquired)
    try:
        assert not store.release("k", old, fence=first.fence, task_id="old")
    finally:
        _wipe(store)


def test_a_release_sent_again_after_newer_runs_took_the_key_is_released(env: Env) -> None:
    """Given a release whose reply is lost and which redis-py sends again only after two newer
    runs took and released the key (its record no longer names this release), then the second
    send is told RELEASED, as the first was: the run is not reported lost."""
    slow = redis.Redis(host="127.0.0.1", port=env.proxy.port, socket_timeout=constants.SOCKET_TIMEOUT,
                       retry=AttemptClock(ExponentialBackoff(cap=1.0, base=1.0), 1))
    store = LeaseStore(slow, KeyLayout(f"found-{os.urandom(4).hex()}"))
    direct = LeaseStore(env.direct, store.layout)
    holder = _token()
    got = store.acquire("k", holder, TTL, Holder("holder"))
    assert isinstance(got, Acquired)
    record = store.layout.run("k")

    def two_more_runs() -> None:  # while redis-py waits to send the release again
        deadline = time.monotonic() + 5
        while b'"rt":"' + holder.encode() not in (env.direct.get(record) or b""):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for name in ("second", "third"):
            token = _token()
            took = direct.acquire("k", token, TTL, Holder(name))
            assert isinstance(took, Acquired)
            assert direct.release("k", token, fence=took.fence, task_id=name)

    runs = threading.Thread(target=two_more_runs)
    armed = env.proxy.add_rule(DROP_REPLY, script=SOURCES["RELEASE"], times=1)
    try:
        runs.start()
        released = store.release("k", holder, fence=got.fence, task_id="holder")
        runs.join()
        assert armed.faulted == 1
        assert released, "its own release, sent again, was taken for a lost lease"
    finally:
        env.proxy.remove_rule(armed)
        slow.close()
        _wipe(store)


def test_a_take_again_after_a_hand_on_takes_the_free_slot(env: Env) -> None:
    """Given two slots held, a run parked and the first holder's lease run out, when a newcomer's
    take hands that slot to the parked run, the other holder releases, and the newcomer takes
    again (its policy found a slot free), it takes the free slot: Guard.take() makes the next
    take a call of its own (with the same token ACQUIRE read it as the first take sent again,
    answered the same hand-on, the parked run's message went out twice, and after
    ACQUIRE_ATTEMPTS the newcomer failed with LockHeld beside a free slot)."""
    app = Celery("take-again", broker="memory://")
    app.conf.singleflight_redis_url = env.server.url
    options = app_options(app, max_concurrency=2, lock_ttl=TTL, lock_namespace=f"found-{os.urandom(4).hex()}")
    guard = Guard(app, "k", options, Holder("d", "w", "t.d"), sender="t.d")
    store = guard.store
    try:
        store.acquire("k", _token(), TTL, Holder("a"), slots=2)
        other = _token()
        held = store.acquire("k", other, TTL, Holder("b"), slots=2)
        assert isinstance(held, Acquired) and held.slot == 1
        assert isinstance(store.handoff.park("k", "c", "hc", _parked_message("c", "hc"), None, 2), Parked)
        _run_out(store.client, store.layout.run("k", 0))
        first = guard.take()
        assert not first.acquired and first.handoff == _parked_message("c", "hc")
        assert store.release("k", other, fence=held.fence, slot=1, slots=2, task_id="b").handoff is None
        again = guard.take()
        assert isinstance(again, Acquired) and again.slot == 1
    finally:
        _wipe(store)


def _two_held_one_parked_first_handed_on(store: LeaseStore) -> tuple[Acquired, str]:
    """Two slots of ``k`` held (by a and b), run c parked (hand-off token ``hc``), a's release
    hands slot 0 to c: b's lease and token."""
    first_holder, second_holder = _token(), _token()
    one = store.acquire("k", first_holder, TTL, Holder("a"), slots=2)
    two = store.acquire("k", second_holder, TTL, Holder("b"), slots=2)
    assert isinstance(one, Acquired) and isinstance(two, Acquired)
    message = _parked_message("c", "hc")
    assert isinstance(store.handoff.park("k", "c", "hc", message, None, 2), Parked)
    assert store.release("k", first_holder, fence=one.fence, slot=0, slots=2, task_id="a").handoff == message
    return two, second_holder


def test_a_parked_run_handed_two_slots_runs_once(store: LeaseStore) -> None:
    """Given two slots held and a run parked, when the first holder's release hands its slot to the
    parked run and that reservation runs out (the message is slow: a broker backlog longer than
    the TTL), and the second holder's release hands its slot to the same run, then only one copy
    of the run's message runs it: the first copy takes its slot and runs; the second is a copy
    (ADOPTED), not a second run."""
    two, second_holder = _two_held_one_parked_first_handed_on(store)
    _run_out(store.client, store.layout.run("k", 0))
    store.release("k", second_holder, fence=two.fence, slot=1, slots=2, task_id="b")  # hands it on again
    ran = _token()
    took = store.acquire("k", ran, TTL, Holder("c"), handoff="hc", slots=2)
    assert isinstance(took, Acquired)
    assert store.release("k", ran, fence=took.fence, slot=took.slot, slots=2, task_id="c")
    copy_of_it = store.acquire("k", _token(), TTL, Holder("c"), handoff="hc", slots=2)
    assert not copy_of_it.acquired, "the parked run ran a second time"


def test_a_copy_of_a_run_that_ran_is_dropped_while_its_slot_waits_for_the_next(store: LeaseStore) -> None:
    """Given two slots held and two runs parked, when the first parked run's reservation runs out
    and the sweeper hands it that slot again (two copies of its message are on their way), the
    first copy runs it and its release hands the slot to the second parked run, and the other
    holder releases, then the second copy is a copy (ADOPTED): it does not take the free slot."""
    first_holder, second_holder = _token(), _token()
    one = store.acquire("k", first_holder, TTL, Holder("a"), slots=2)
    two = store.acquire("k", second_holder, TTL, Holder("b"), slots=2)
    assert isinstance(one, Acquired) and isinstance(two, Acquired)
    assert isinstance(store.handoff.park("k", "c", "hc", _parked_message("c", "hc"), None, 2), Parked)
    assert isinstance(store.handoff.park("k", "d", "hd", _parked_message("d", "hd"), None, 2), Parked)
    assert store.release("k", first_holder, fence=one.fence, slot=0, slots=2, task_id="a").handoff is not None
    _run_out(store.client, store.layout.run("k", 0))
    swept = store.handoff.resume("k", TTL, 2)
    assert swept is not None and swept.handoff == _parked_message("c", "hc")  # a second copy
    ran = _token()
    took = store.acquire("k", ran, TTL, Holder("c"), handoff="hc", slots=2)
    assert isinstance(took, Acquired) and took.slot == 0
    released = store.release("k", ran, fence=took.fence, slot=0, slots=2, task_id="c")
    assert released.handoff == _parked_message("d", "hd")
    store.release("k", second_holder, fence=two.fence, slot=1, slots=2, task_id="b")
    copy_of_it = store.acquire("k", _token(), TTL, Holder("c"), handoff="hc", slots=2)
    assert not copy_of_it.acquired, "the parked run ran a second time"


def test_a_coalesce_sent_again_after_its_run_was_replaced_does_not_answer_free(store: LeaseStore) -> None:
    """Given a run made pending whose reply was lost, and a newer run that replaced it, when the
    holder's lease runs out and the first call is sent again, it does not answer FREE (the run
    waits, or gives way: it was replaced), so that its caller does not take the key for it."""
    store.acquire("k", _token(), TTL, Holder("holder"))
    assert store.newest.coalesce("k", "x", "hx", _parked_message("x", "hx"), "last", "1") == ()
    assert store.newest.coalesce("k", "y", "hy", _parked_message("y", "hy"), "last", "2") == (
        _parked_message("x", "hx"),)
    _run_out(store.client, store.layout.run("k"))
    again = store.newest.coalesce("k", "x", "hx", _parked_message("x", "hx"), "last", "1")
    assert again is not None, "answered FREE: the replaced run takes the key"


def test_a_join_sent_again_after_its_run_was_answered_still_answers_joined(store: LeaseStore) -> None:
    """Given a run joined to a holder whose reply was lost, when the holder releases (its caller
    answers the joined run with its result), another run takes the key and releases, and the JOIN
    is sent again, it answers JOINED (the run waits for, in fact already has, its result): not
    FREE, which would run it too."""
    holder = _token()
    got = store.acquire("k", holder, TTL, Holder("holder"))
    assert isinstance(got, Acquired)
    message = json.dumps({"task_id": "joiner"})
    assert store.handoff.join("k", message) is not None
    assert store.release("k", holder, fence=got.fence, task_id="holder").joined == (message,)
    then = _token()
    later = store.acquire("k", then, TTL, Holder("later"))
    assert isinstance(later, Acquired)
    assert store.release("k", then, fence=later.fence, task_id="later")
    assert store.handoff.join("k", message) is not None, "answered FREE: the answered run runs itself"


def test_a_hand_on_sent_again_still_names_the_dead_holder(store: LeaseStore) -> None:
    """Given a holder that died with a run parked behind it, when a newcomer's take hands the key
    to the parked run and its reply is lost, the take sent again names the dead holder too, so
    that its run ends (FAILURE, RunLost)."""
    store.acquire("k", _token(), TTL, Holder("dead", "w1", "t.dead"))
    assert isinstance(store.handoff.park("k", "p", "hp", _parked_message("p", "hp"), None), Parked)
    _run_out(store.client, store.layout.run("k"))
    newcomer = _token()
    first = store.acquire("k", newcomer, TTL, Holder("n"))
    assert not first.acquired and first.dead is not None and first.dead.task_id == "dead"
    again = store.acquire("k", newcomer, TTL, Holder("n"))
    assert not again.acquired and again.handoff == first.handoff
    assert again.dead == first.dead


def test_an_own_copy_parked_again_after_its_run_ended_is_not_parked(store: LeaseStore) -> None:
    """Given a redelivery of a running task that parked a copy of itself (its PARK's reply lost),
    and the first delivery's release that dropped the copy, when the PARK is sent again while
    another run holds the key, it parks nothing (FREE: the redelivery is dropped): a copy parked
    again would run the ended run once more at the next hand-on."""
    holder = _token()
    got = store.acquire("k", holder, TTL, Holder("r"))
    assert isinstance(got, Acquired)
    own = f"{OWN_COPY}{_token()}"
    assert isinstance(store.handoff.park("k", "r", own, _parked_message("r", own), None), Parked)
    assert store.release("k", holder, fence=got.fence, task_id="r")
    assert store.client.llen(store.layout.key(QUEUE, "k")) == 0  # the release dropped the copy
    assert isinstance(store.acquire("k", _token(), TTL, Holder("next")), Acquired)
    assert store.handoff.park("k", "r", own, _parked_message("r", own), None) is None
    assert store.client.llen(store.layout.key(QUEUE, "k")) == 0, "the ended run's copy was parked again"


@pytest.mark.parametrize("then", ["holds", "released"])
def test_a_copy_finding_a_second_reservation_for_its_token_is_a_copy(store: LeaseStore, then: str) -> None:
    """Given a parked run that adopted the slot reserved for its hand-off token, and a second
    reservation for the same token on another slot (planted by hand: a fair run's reservation that
    ran out while its message was slow was once reserved another slot; no sequence of the lease
    machine's calls makes one: a hand-on skips a token reserved elsewhere, and a restore brings
    the adopted tokens back with the records), when another copy of the run's message takes the
    key while the run still holds its slot, or after it released it, then the copy is ADOPTED
    (dropped): ACQUIRE asks whether the token was adopted before it adopts a reservation, so the
    run does not run twice."""
    two, second_holder = _two_held_one_parked_first_handed_on(store)
    reservation = store.client.get(store.layout.run("k", 0))
    ran = _token()
    took = store.acquire("k", ran, TTL, Holder("c"), handoff="hc", slots=2)
    assert isinstance(took, Acquired) and took.slot == 0
    assert store.release("k", second_holder, fence=two.fence, slot=1, slots=2, task_id="b").handoff is None
    store.client.set(store.layout.run("k", 1), reservation, px=int(TTL * 1000))  # the second reservation
    if then == "released":
        assert store.release("k", ran, fence=took.fence, slot=0, slots=2, task_id="c")
    copy_of_it = store.acquire("k", _token(), TTL, Holder("c"), handoff="hc", slots=2)
    assert not copy_of_it.acquired and copy_of_it.copy, f"the parked run ran a second time: {copy_of_it}"


@pytest.mark.parametrize("look", ["after", "before and after"])
def test_a_dead_holder_of_a_second_slot_is_ended_after_the_queue_drained_through_the_first(
    store: LeaseStore, look: str
) -> None:
    """Given two slots held by runs whose worker died and two runs parked, when slot 0's lease runs
    out first, the sweeper hands it on (ending a), and both parked runs run through slot 0 before
    slot 1's lease runs out, then the sweeper's next look still names b, whose key runs waited on,
    as dead (docs/guarantees.md: it ends RunLost; found by test_nothing_lost[holders-worker] on a
    loaded machine: the look answered NOTHING_WAITS and b stayed PENDING). A look while b's lease
    is live names nobody and keeps the key in the waiting index, due when that lease runs out
    (once dropped, nothing would look at b again)."""
    a, b = _token(), _token()
    assert isinstance(store.acquire("k", a, TTL, Holder("a", "w1", "t.a"), slots=2), Acquired)
    assert isinstance(store.acquire("k", b, TTL, Holder("b", "w1", "t.b"), slots=2), Acquired)
    for run in ("c", "d"):
        message = _parked_message(run, f"h{run}")
        assert isinstance(store.handoff.park("k", run, f"h{run}", message, None, 2), Parked)
    _run_out(store.client, store.layout.run("k", 0))
    first = store.handoff.resume("k", TTL, 2)
    assert first is not None and first.handoff == _parked_message("c", "hc")
    assert [d.task_id for d in first.dead] == ["a"]
    for run, then in (("c", _parked_message("d", "hd")), ("d", None)):
        token = _token()
        took = store.acquire("k", token, TTL, Holder(run), handoff=f"h{run}", slots=2)
        assert isinstance(took, Acquired) and took.slot == 0
        released = store.release("k", token, fence=took.fence, slot=0, slots=2, task_id=run)
        assert released and released.handoff == then
    index = store.layout.index(WAITING)
    if look == "before and after":
        assert store.handoff.resume("k", TTL, 2) is None  # b's lease is live: nobody is named
        due = store.client.zscore(index, "k")
        assert due is not None, "the key left the waiting index while b's lease was live"
        assert due / 1000.0 - time.time() > TTL - 2.0  # looked at again when it would run out
    _run_out(store.client, store.layout.run("k", 1))
    later = store.handoff.resume("k", TTL, 2)
    assert later is not None and later.handoff is None and [d.task_id for d in later.dead] == ["b"]
    assert not store.client.zscore(index, "k"), "the key stays in the waiting index"
