"""The real delayed-copy calls held to their model (``delayed_transcription.py``), on a real Redis.

A hypothesis state machine plays one key with one or two runs the library delays, through the
store's calls in the library's order (``run/delay.py``, ``policies/delayed.py``,
``worker/copies.py``): a run delays itself (DELAY, then its countdown message goes to the broker);
the broker delivers messages to workers, whose main process notes each one it holds (TOUCH);
a message starts and claims its run (CLAIM with the worker as owner and a lease token); the
claimant says its run started (CLAIM_DONE, in one round trip with a started-index entry: only
then does its body run), or it ends before it starts (CLAIM_DONE: failed; or delayed again:
DELAY with a new token, then CLAIM_DONE); a body ends, or retries (DELAY with a new token). Each
worker's sweeper says it is alive and reads the live workers (``alive``), and looks at a run of
the delayed index (RESEND with that list; a copy to send goes to the broker, unless the run has
ended: then CLAIM_DONE drops it). Faults: a reply dropped by the proxy (redis-py sends the call
again at once), a call sent again later by hand (its first run reached Redis, its caller waits),
a whole worker dying (its held and started messages come back after the broker's visibility
timeout; its calls in flight are never sent again; a sweeper or a delaying run may die between
its call and the message it was to send), a pool process killed (its run ends FAILURE, stored by
the main process), and time passing: a dead worker's alive mark ages out, and an entry's due
time, last copy sent or claim ages (the stored times rewritten into the past, as
``test_conformance.py`` rewrites deadlines; nothing sleeps).

After every step every run's real entry (``t``, ``ts``, ``old``, ``m``, ``w``, ``r``, ``c``, ``o``,
``lt``, ``took``, whether ``sent`` and ``ca`` are set), the claimed entries kept, the journal marks
and the delayed index must be the model's, and so must every reply. Invariants: a body runs only
after its CLAIM_DONE answered DONE, and at most one body of a delay runs (another only after the
first one's worker died in it, as a redelivery would run it); a claim taken back is never told
DONE; a claim whose worker is gone is taken back and its copy sent at the sweeper's look once it
is WORKER_GONE_AFTER old, and a copy no live worker holds is sent after the unseen grace; every
copy sent after a take-back, until a copy claims, carries the lease token of the claim taken back
last (``took``: the copy takes that lease over, kept apart from the model's entry). At the
end the key is driven to quiescence (calls sent again, messages delivered and started,
claimants finish, dead workers gone, every entry's time past its graces, the sweeper looks at
every run of the index; no copy may wait then, for a message that comes back only after the
visibility timeout; then those messages come back) and every run must have ended: its last
delay's body ran exactly once, or it ended FAILURE; no copy waits.

Three protocol defects found while building it (now fixed) are replayed by the regression tests at
the end (with a fourth, found by the first model run: a second copy sent after a take-back carried
no lease token), and the machine tolerates none of them: a DELAY sent again after its delay's copy ran
wrote the entry anew, and its countdown message ran the delay a second time (A); CLAIM_DONE dropped
the run from the delayed index whatever it answered, so a claimant that died after a TAKEN_BACK left
a copy waiting unindexed (B); a TOUCH landing after its message started (and was found stale) held
the run for a live worker that holds no copy of it (C: the machine also checks that such a TOUCH
notes nothing). Left out: Redis losing data (DELAY's ``restore``, the journal's recovery), the
lease a copy sent again takes over (ACQUIRE's ``earlier``: ``took`` is checked, not used), revoked
messages, ``h`` headers, the prune after DELAYED_KEEP, a Cluster, and the index's scores (a
sweeper may look at any run of the index at any time: a look too early answers NOT_DUE).

Two more it found are fixed too (DELAY's NOT_CLAIMED), and the machine tolerates neither: a
retry's DELAY answered late (its reply lost) after a copy of its new delay claimed the run made
its attempt store RETRY over the end that copy gave the run (D); a claimant whose claim was taken
back delayed the run again (a new delay, whose countdown message ran the body a second time: E).
Every re-delay of a delayed copy of the key now passes its claim's token (``claimed``, as
``run/delay.py`` does; a first execution passes ''), and on NOT_CLAIMED the attempt ends sending
nothing and storing no state; the machine checks that a claimant whose claim was taken back never
makes a new delay. Profiles as in ``test_conformance.py``: ``SF_MODEL_PROFILE=long`` runs
ten times the examples, longer; ``SF_MODEL_TRACE=1`` prints every call, the model's answer and the
real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import pytest
from celery.exceptions import Ignore
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

from celery_singleflight import constants
from celery_singleflight.protocol import delayed as delayed_calls
from celery_singleflight.protocol.delayed import (
    CLAIM,
    CLAIM_DONE,
    DELAY,
    DELAYED,
    DELAYED_DUE,
    DELAYED_ENDS,
    RESEND,
    TOUCH,
    WORKERS,
    Claim,
    DelayedCalls,
)
from celery_singleflight.protocol.journaled import JOURNALED
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run import delay as run_delay
from celery_singleflight.run.messages import HEADER_DELAYED

from ..chaos.faultproxy import DROP_REPLY
from .delayed_transcription import Model, Reply, claim_offset, since_offset
from .harness import Env, conformance_env, text
from .harness import pick as pick_of

LONG = os.environ.get("SF_MODEL_PROFILE", "") == "long"
TRACE = bool(os.environ.get("SF_MODEL_TRACE"))
KEY = "acct:7"
COUNTDOWN = 30.0  # a delay's countdown (the machine's ages decide when it is due)
MAX_DELAYS = 4 if LONG else 3  # per run: its first delay, retries and delays before it starts
MAX_DEATHS = 3 if LONG else 2  # workers that die (pool processes killed count too)
MAX_ALIVE = 2  # live workers at a time (another starts when one died)
SCRIPTS = (DELAY, TOUCH, CLAIM, CLAIM_DONE, RESEND)
SOURCES = {script.name: script.source for script in SCRIPTS}

#: what the machine did over the session (a look at the coverage; never printed by the tests)
EVENTS: Counter[str] = Counter()

PICKS = st.integers(min_value=0, max_value=15)
#: how a call's reply travels: as sent; dropped by the proxy (redis-py sends the call again at once);
#: or lost, the call sent again by a later step
FAULTS = st.sampled_from([None, None, None, "drop", "replay"])
DIES = st.sampled_from([False] * 5 + [True])
#: what a claimant does next: start its body, fail before it, or be delayed again first
CLAIMED = st.sampled_from(["start", "start", "start", "fail", "redelay"])
#: how a body ends: it succeeds, or retries (delayed again)
BODIES = st.sampled_from(["succeed", "succeed", "retry"])


# -- the Redis, the proxy, the clients ------------------------------------------------------------

@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    with conformance_env(SOURCES.values()) as made:
        yield made


# -- workers, messages, callers ----------------------------------------------------------------------

@dataclass(eq=False)
class Worker:
    """A worker (``node#instance``): alive, dead (its alive mark still fresh: listed alive for up
    to WORKER_GONE_AFTER), or gone."""

    name: str
    state: str = "alive"

    @property
    def alive(self) -> bool:
        return self.state == "alive"


@dataclass(eq=False)
class Message:
    """A delayed run's message (its countdown message, or a copy a sweeper sent), where it is:
    in the broker, held by a worker (its time not come), started (unacknowledged until its task
    ends), lost with its worker (back after the visibility timeout), or acknowledged."""

    run: str
    token: str
    kind: str
    took: str = ""
    where: str = "broker"
    worker: Worker | None = None
    noted: bool = False


@dataclass
class Stash:
    """A call whose reply was lost: it reached Redis once, and is sent again by a later step."""

    name: str
    again: Callable[[], None]
    run: str = ""


@dataclass(eq=False)
class Owner:
    """Who makes calls, in a worker: a run delaying itself, a claimant, a noter, a sweeper."""

    name: str
    worker: Worker
    stash: Stash | None = None
    over: bool = False

    @property
    def active(self) -> bool:
        return self.worker.alive and not self.over


@dataclass(eq=False)
class Exec(Owner):
    """A run's task in a pool process: the first one (it delays the run: ``phase`` delay), or a
    delayed message started (claim, claimed, running; redelay, finish: delayed again before it
    started). ``body``: its body's fate (running, completed, lost with its worker)."""

    run: str = ""
    msg: Message | None = None
    phase: str = "claim"
    lease: str = ""
    body: str = ""
    delay: str = ""  # the delay its copy belongs to (its body's)
    plan: str = ""


@dataclass
class Run:
    id: str
    state: str = "PENDING"  # DELAYED, STARTED, SUCCESS, FAILURE
    delays: int = 0
    last_delay: str = ""

    @property
    def message(self) -> str:
        return json.dumps({"task": "model.delayed", "id": self.id, "args": [self.id]}, sort_keys=True)

    @property
    def terminal(self) -> bool:
        return self.state in ("SUCCESS", "FAILURE")


def _listed(value: Any) -> list[str]:
    """A JSON list as Lua's cjson writes it (an empty table is an empty object)."""
    return [] if not value else list(value)


class _Recorded:
    """RESEND's client script, recording its last reply: resend() answers None for GONE and
    NOT_DUE alike, which the machine tells apart."""

    def __init__(self, script: Any) -> None:
        self.script, self.sha, self.last = script, script.sha, None

    def __call__(self, keys: Any, args: Any) -> Any:
        self.last = self.script(keys=keys, args=args)
        return self.last


# -- the machine -----------------------------------------------------------------------------------

class DelayedMachine(RuleBasedStateMachine):
    """See the module docstring. ``env`` is set by the test."""

    env: Env

    def __init__(self) -> None:
        super().__init__()
        self.ns = f"delayed-{os.urandom(5).hex()}"
        self.store = LeaseStore(self.env.client, KeyLayout(self.ns))
        self.calls: DelayedCalls = self.store.delayed
        self.layout = self.store.layout
        ctx = self.calls.ctx
        self.resend_script = _Recorded(ctx.script(RESEND))
        ctx._scripts[RESEND.name] = self.resend_script  # type: ignore[assignment]
        self.model = Model()
        self.runs: dict[str, Run] = {}
        self.workers: list[Worker] = []
        self.messages: list[Message] = []
        self.execs: list[Exec] = []
        self.noters: dict[str, Owner] = {}
        self.sweepers: dict[str, Owner] = {}
        self.bodies: dict[str, list[Exec]] = {}  # delay -> the execs whose body started
        #: per run, the lease token of its current claim, and the one of the claim taken back last
        #: since (every copy sent until a copy claims must carry it: its ACQUIRE takes that lease over)
        self.claimed_lease: dict[str, str] = {}
        self.carried: dict[str, str] = {}
        self.deaths = 0
        self.counter = 0
        self.broken = False

    # -- plumbing ---------------------------------------------------------------------------------

    def _id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}{self.counter}-{os.urandom(3).hex()}"

    @contextlib.contextmanager
    def _step(self) -> Iterator[None]:
        try:
            yield
        except BaseException:
            self.broken = True
            raise

    def _worker(self) -> Worker:
        w = Worker(f"node{len(self.workers) + 1}#{os.urandom(3).hex()}")
        self.workers.append(w)
        self.noters[w.name] = Owner(f"noter@{w.name}", w)
        self.sweepers[w.name] = Owner(f"sweeper@{w.name}", w)
        return w

    def _alive(self) -> list[Worker]:
        return [w for w in self.workers if w.alive]

    def _someone(self) -> Worker:
        """A live worker (one starts if every worker died)."""
        alive = self._alive()
        return alive[0] if alive else self._worker()

    def _check(self, name: str, expected: Reply, got: Reply) -> None:
        EVENTS[f"{name} {got[0]}"] += 1
        if TRACE:
            print(f"    {name}: the model says {expected}, the call answered {got}")
        assert got == expected, f"{name}: the model expects {expected!r}, the call answered {got!r}"

    def _call(self, owner: Owner, name: str, fault: str | None, *, api: Callable[[], Reply],
              wire: Callable[[], Reply], model: Callable[[], Reply], then: Callable[[Reply], None],
              after: Callable[[Reply], None] | None = None,
              prepare: Callable[[], None] | None = None, run: str = "") -> None:
        """One call as ``owner`` makes it. ``api``: the store's call; ``wire``: what of it reaches
        Redis in its round trip (its first run when its reply is lost and it is sent again
        later); ``model``: the transcription of that round trip (script and index); ``after``: the
        model of what the call does with its reply (the index); ``then``: what its caller does;
        ``prepare``: before each run (the stored times rewritten to the model's ages)."""
        EVENTS[f"fault {fault}"] += 1
        if TRACE:
            print(f"  {owner.name} {name} ({fault or 'sent'})")
        if prepare is not None:
            prepare()
        if fault == "replay":
            self._check(name, model(), wire())

            def again() -> None:
                EVENTS[f"{name} sent again"] += 1
                if TRACE:
                    print(f"  {owner.name} {name} sent again")
                if prepare is not None:
                    prepare()
                expected = model()
                got = api()
                self._check(name, expected, got)
                if after is not None:
                    after(expected)
                then(got)

            owner.stash = Stash(name, again, run)
            return
        armed = None
        if fault == "drop":
            model()  # its first run, whose reply the proxy drops
            armed = self.env.proxy.add_rule(DROP_REPLY, script=SOURCES[name], times=1)
        expected = model()
        try:
            got = api()
        finally:
            if armed is not None:
                self.env.proxy.remove_rule(armed)
        assert armed is None or armed.faulted == 1, f"{name}: no reply was dropped"
        self._check(name, expected, got)
        if after is not None:
            after(expected)
        then(got)

    # -- the calls ----------------------------------------------------------------------------------

    def _delay(self, owner: Exec, fault: str | None, then: Callable[[], None]) -> None:
        """delay_again(): DELAY under a new token (and the run in the delayed index, in the same
        round trip, whatever it answers), passing as ``claimed`` the token of the owner's message
        if it is a delayed copy of the key (every message is: a first execution has none, and
        passes ''); then its countdown message goes to the broker (and the run is RETRY). On
        NOT_CLAIMED (another copy owns the run) the attempt raises Ignore: nothing is sent, no
        state stored (a claimant's copy is then done as any run's that ended before it started)."""
        run = self.runs[owner.run]
        token = self._id(f"d-{run.id}-")
        mark = "" if run.delays % 2 else self._id("mark-")
        claimed = owner.msg.token if owner.msg is not None else ""
        run.delays += 1

        def real() -> Reply:
            due = self.calls.delay(KEY, run.id, token, run.message, COUNTDOWN, mark=mark, claimed=claimed)
            return ("NOT_CLAIMED",) if due is None else ("DELAYED",)

        def model() -> Reply:
            before = self.model.entry(run.id)
            got = self.model.delay(run.id, token, run.message, mark, claimed)
            self.model.index(run.id, True)
            entry = self.model.entry(run.id)
            assert entry is not None
            if entry is not before:  # a new delay: no claim, nothing carried
                assert claimed not in self.model.taken_back, (
                    f"{owner.name}, whose claim was taken back, made a new delay of {run.id}")
                self.claimed_lease.pop(run.id, None)
                self.carried.pop(run.id, None)
            run.last_delay = entry.delay  # the run's delay from now on (its message sent or not)
            return got

        def sent(got: Reply) -> None:
            if got[0] == "NOT_CLAIMED":  # Ignore: no countdown message, no RETRY
                why = "its claim taken back" if claimed in self.model.taken_back else "another copy claimed"
                EVENTS["a DELAY not claimed: the attempt is dropped"] += 1
                EVENTS[f"a DELAY not claimed: {why}"] += 1
                then()
                return
            self.messages.append(Message(run.id, token, "countdown"))
            if run.terminal:  # (the machine checks at the end that the run ends all the same)
                EVENTS["RETRY stored over a run's end"] += 1
            run.state = "DELAYED"
            then()

        self._call(owner, "DELAY", fault, api=real, wire=real, model=model, then=sent)

    def _claim(self, ex: Exec, fault: str | None) -> None:
        msg = ex.msg
        assert msg is not None

        def real() -> Reply:
            return (self.calls.claim(KEY, ex.run, msg.token, ex.worker.name, ex.lease).name,)

        def model() -> Reply:
            before = self.model.entry(ex.run)
            unclaimed = before is not None and before.c is None
            got = self.model.claim(ex.run, msg.token, ex.worker.name, ex.lease)
            self.model.index(ex.run, True)
            if unclaimed and got[0] != "STALE":  # a copy claims: the copies after it carry nothing
                self.claimed_lease[ex.run] = ex.lease
                self.carried.pop(ex.run, None)
            return got

        def then(got: Reply) -> None:
            if got[0] == "STALE":
                msg.where, ex.over = "acked", True  # Ignore: dropped
            else:
                ex.phase = "claimed"

        self._call(ex, "CLAIM", fault, api=real, wire=real, model=model, then=then)

    def _done(self, owner: Owner, run: str, token: str, fault: str | None, then: Callable[[Reply], None], *,
              started: bool = False) -> None:
        """DelayedCopies: CLAIM_DONE (at the start in one pipeline behind the started index's
        ZADD); the script drops the run's index entry on DONE only (a TAKEN_BACK leaves it)."""
        claim = Claim(KEY, run, token)
        probe = f"{self.ns}:started-probe"

        def before(pipe: Any) -> None:
            pipe.zadd(probe, {run: 1})

        def real() -> Reply:
            return (self.calls.done(claim, before if started else None).name,)

        def model() -> Reply:
            return self.model.done(run, token)

        def checked(got: Reply) -> None:
            assert not (got[0] == "DONE" and token in self.model.taken_back), (
                f"a claim taken back ({token}) was told DONE")
            then(got)

        self._call(owner, "CLAIM_DONE", fault, api=real, wire=real, model=model, then=checked, run=run)

    def _touch(self, noter: Owner, msg: Message, fault: str | None) -> None:
        worker = noter.worker.name

        def real() -> Reply:
            self.calls.touch([(KEY, msg.run, msg.token)], worker)
            return ("?",)  # touch() keeps no reply: the entry tells

        def model() -> Reply:
            got = self.model.touch(msg.run, msg.token, worker)
            EVENTS[f"TOUCH (the model) {got[0]}"] += 1
            assert not (got[0] == "NOTED" and msg.where in ("started", "acked")), (
                f"a TOUCH of {msg.token}, whose message {msg.where}, notes {worker} as holding it")
            return ("?",)

        def then(_: Reply) -> None:
            msg.noted = True

        self._call(noter, "TOUCH", fault, api=real, wire=real, model=model, then=then)

    def _sweep(self, sweeper: Owner, run_id: str, fault: str | None, dies: bool) -> bool:
        """SendCopies.sweep_once() for one run: alive(), then send_copy(): RESEND; a copy to send
        goes to the broker (then sent()), unless the run ended: CLAIM_DONE drops it. True if
        RESEND handed out a copy."""
        alive = frozenset(self._alive_list(sweeper.worker))
        token = self._id(f"c-{run_id}-")
        before = self.model.entry(run_id)
        must = ""  # (a call sent again later may find its run started meanwhile)
        if before is not None and before.m is not None and fault != "replay":
            if before.claimed_at and before.claim_age >= 1 and before.o not in alive:
                must = "a claim whose worker is gone"
            elif not before.claimed_at and before.age == 2 and not any(
                    w in alive for w in (before.w or {}).values()):
                must = "a copy no live worker holds, past the unseen grace"
        handed: list[bool] = []
        resend_keys = [self.layout.key(DELAYED, KEY)]
        args = [run_id, token, *sorted(alive)]

        def decode(raw: Any) -> Reply:
            code = int(raw[0])
            if code == delayed_calls.ResendReply.RESEND:
                return ("RESEND", text(raw[1]), text(raw[3]))
            return (delayed_calls.ResendReply(code).name,)

        def real() -> Reply:
            self.calls.resend(KEY, run_id, token, sorted(alive))
            return decode(self.resend_script.last)

        def wire() -> Reply:
            return decode(self.resend_script(resend_keys, args))

        def model() -> Reply:
            entry = self.model.entry(run_id)
            taking = entry is not None and entry.m is not None and entry.c is not None and entry.t != token
            got = self.model.resend(run_id, token, alive)
            if got[0] == "RESEND":
                if taking:  # the claim was taken back: its lease goes with this copy and the next ones
                    self.carried[run_id] = self.claimed_lease.pop(run_id, "")
                    EVENTS["a claim taken back"] += 1
                elif run_id in self.carried:
                    EVENTS["a copy sent again after a take-back carries its lease"] += 1
                assert got[2] == self.carried.get(run_id, ""), (
                    f"a copy of {run_id} carries lease {got[2]!r}: the claim taken back last had"
                    f" {self.carried.get(run_id, '')!r}")
            return got

        def after(got: Reply) -> None:
            if got[0] == "GONE":
                self.model.index(run_id, False)
            elif got[0] == "NOT_DUE":
                self.model.index(run_id, True)

        def then(got: Reply) -> None:
            assert not must or got[0] == "RESEND", f"{must} was not sent again: {got}"
            if must:
                EVENTS[f"sent again: {must}"] += 1
            if got[0] != "RESEND":
                return
            handed.append(True)
            if dies and self._can_die():
                self._die(sweeper.worker)  # between RESEND and the copy it was to send
                return
            run = self.runs[run_id]
            if run.terminal:  # _ended(): its result is ready: the copy is dropped
                EVENTS["a copy of an ended run dropped"] += 1
                self._done(sweeper, run_id, token, None, lambda _: None)
                return
            self.messages.append(Message(run_id, token, "copy", took=str(got[2])))
            self.calls.sent(KEY, run_id)
            self.model.index(run_id, True)

        self._call(sweeper, "RESEND", fault, api=real, wire=wire, model=model, after=after, then=then,
                   prepare=self._pin)
        return bool(handed)

    def _alive_list(self, worker: Worker) -> list[str]:
        """The sweeper of ``worker`` says it is alive and reads who is: every worker's mark is
        rewritten first (a live one's now; a dead one's as its last, within WORKER_GONE_AFTER; a
        gone one's long ago)."""
        now = int(time.time() * 1000)
        gone_after = int(constants.WORKER_GONE_AFTER * 1000)
        last = {"alive": now, "dead": now - gone_after // 3, "gone": now - 3 * gone_after}
        marks = {w.name: last[w.state] for w in self.workers}
        self.env.direct.zadd(self.layout.index(WORKERS), marks)
        got = self.calls.alive(worker.name)
        expected = {w.name for w in self.workers if w.state != "gone"}
        assert set(got) == expected, f"alive() answered {sorted(got)}, the model {sorted(expected)}"
        return got

    def _pin(self) -> None:
        """Rewrite every entry's times to the model's ages (its due time and last copy sent, or
        its claim time), counted from Redis's clock now."""
        direct, name = self.env.direct, self.layout.key(DELAYED, KEY)
        seconds, micros = direct.time()
        now = int(seconds) * 1000 + int(micros) // 1000
        for run, e in self.model.store.entries.items():
            raw = direct.hget(name, run)
            if raw is None:
                continue
            data = json.loads(raw)
            if e.claimed_at:
                data["ca"] = str(now + claim_offset(e.claim_age))
            elif e.m is not None:
                data["due"] = str(now + since_offset(e.age))
                if "sent" in data:
                    data["sent"] = data["due"]
            else:
                continue
            direct.hset(name, run, json.dumps(data))

    # -- the steps ----------------------------------------------------------------------------------

    @initialize(runs=st.integers(min_value=1, max_value=2), fault=FAULTS)
    def first_runs(self, runs: int, fault: str | None) -> None:
        """One or two runs, each delayed by its first execution (rate-limited, say)."""
        with self._step():
            for _ in range(2):
                self._worker()
            for i in range(runs):
                run = self.runs.setdefault(f"r{i + 1}", Run(f"r{i + 1}"))
                ex = Exec(f"first-{run.id}", pick_of(self._alive(), i), run=run.id, phase="delay")
                self.execs.append(ex)
                self._delay(ex, fault if i == 0 else None, lambda ex=ex: setattr(ex, "over", True))

    def _steppable(self) -> list[Exec]:
        return [ex for ex in self.execs if ex.active and ex.stash is None]

    @precondition(lambda self: bool(self._steppable()))
    @rule(pick=PICKS, fault=FAULTS, claimed=CLAIMED, body=BODIES, dies=DIES)
    def step(self, pick: int, fault: str | None, claimed: str, body: str, dies: bool) -> None:
        """A run's task makes its next call."""
        with self._step():
            self._advance(pick_of(self._steppable(), pick), fault, claimed, body, dies)

    def _advance(self, ex: Exec, fault: str | None, claimed: str, body: str, dies: bool) -> None:
        run = self.runs[ex.run]
        msg = ex.msg
        if ex.phase == "claim":
            self._claim(ex, fault)
        elif ex.phase == "claimed":
            assert msg is not None
            plan = ex.plan or claimed
            if plan == "redelay" and run.delays >= MAX_DELAYS:
                plan = "start"
            if plan == "start":
                self._done(ex, ex.run, msg.token, fault, lambda got: self._started(ex, got), started=True)
            elif plan == "fail":
                def failed(_: Reply) -> None:
                    run.state = "FAILURE"
                    self._end(ex)

                self._done(ex, ex.run, msg.token, fault, failed)
            else:  # delayed again before it started (a rate limit): DELAY, then its copy is done
                ex.plan = "redelay"

                def then() -> None:
                    ex.phase = "finish"
                    if dies and self._can_die():
                        self._die(ex.worker)

                self._delay(ex, fault, then)
        elif ex.phase == "finish":
            assert msg is not None
            self._done(ex, ex.run, msg.token, fault, lambda _: self._end(ex))
        elif ex.phase == "running":
            if body == "retry" and run.delays < MAX_DELAYS:
                def retried() -> None:
                    ex.body = "completed"
                    self._end(ex)
                    if dies and self._can_die():
                        self._die(ex.worker)

                self._delay(ex, fault, retried)
            else:
                ex.body = "completed"
                run.state = "SUCCESS"
                self._end(ex)
        else:
            raise AssertionError(f"{ex.name}: phase {ex.phase}")

    def _end(self, ex: Exec) -> None:
        """The task returned: its message is acknowledged."""
        ex.over = True
        if ex.msg is not None:
            ex.msg.where = "acked"

    def _started(self, ex: Exec, got: Reply) -> None:
        """started(): DONE, the body runs; TAKEN_BACK, Ignore (the copy sent again runs)."""
        if got[0] == "TAKEN_BACK":
            self._end(ex)
            return
        msg = ex.msg
        assert msg is not None
        delay = self.model.delay_of[msg.token]
        others = [o.name for o in self.bodies.get(delay, []) if o.body in ("running", "completed")]
        assert not others, f"{ex.name}'s body runs beside {others}, of the same delay {delay}"
        self.bodies.setdefault(delay, []).append(ex)
        ex.body, ex.delay, ex.phase = "running", delay, "running"
        self.runs[ex.run].state = "STARTED"
        EVENTS["a body starts"] += 1

    @precondition(lambda self: any(m.where == "broker" for m in self.messages) and bool(self._alive()))
    @rule(pick=PICKS, to=PICKS, how=st.sampled_from(["note", "note", "hold", "start"]), fault=FAULTS)
    def deliver(self, pick: int, to: int, how: str, fault: str | None) -> None:
        """The broker delivers a message to a live worker, which holds it until its time; its
        noter says so at once (TOUCH), or later; or its time has come: it starts at once."""
        with self._step():
            msg = pick_of([m for m in self.messages if m.where == "broker"], pick)
            msg.where, msg.worker, msg.noted = "held", pick_of(self._alive(), to), False
            noter = self.noters[msg.worker.name]
            if how == "start":
                self._fire(msg, fault)
            elif how == "note" and noter.stash is None:
                self._touch(noter, msg, fault)

    def _held(self, noted: bool | None = None) -> list[Message]:
        return [m for m in self.messages if m.where == "held" and m.worker is not None and m.worker.alive
                and (noted is None or m.noted == noted)]

    @precondition(lambda self: any(self.noters[m.worker.name].stash is None  # type: ignore[union-attr]
                                   for m in self._held(noted=False)))
    @rule(pick=PICKS, fault=FAULTS)
    def touch(self, pick: int, fault: str | None) -> None:
        """A worker's noter says it holds a message (TOUCH)."""
        with self._step():
            msg = pick_of([m for m in self._held(noted=False)
                         if self.noters[m.worker.name].stash is None], pick)  # type: ignore[union-attr]
            assert msg.worker is not None
            self._touch(self.noters[msg.worker.name], msg, fault)

    @precondition(lambda self: bool(self._held()))
    @rule(pick=PICKS, fault=FAULTS)
    def fire(self, pick: int, fault: str | None) -> None:
        """A held message's time comes: its task starts and claims its run."""
        with self._step():
            self._fire(pick_of(self._held(), pick), fault)

    def _fire(self, msg: Message, fault: str | None) -> None:
        assert msg.worker is not None
        msg.where = "started"
        ex = Exec(self._id(f"x-{msg.run}-"), msg.worker, run=msg.run, msg=msg, lease=self._id("lease-"))
        self.execs.append(ex)
        self._claim(ex, fault)

    def _lookable(self) -> list[tuple[Owner, str]]:
        return [(self.sweepers[w.name], run) for w in self._alive() if self.sweepers[w.name].stash is None
                for run in sorted(self.model.store.indexed)]

    @precondition(lambda self: bool(self._alive()))
    @rule(pick=PICKS, fault=FAULTS, dies=DIES, later=st.sampled_from([0, 0, 1, 2]))
    def sweep(self, pick: int, fault: str | None, dies: bool, later: int) -> None:
        """A live worker's sweeper says it is alive, reads who is, and looks at a run of the
        delayed index (if any: it always has a worker to say is alive), ``later`` ages after the
        run's last change (time passes for its entry first)."""
        with self._step():
            lookable = self._lookable()
            if not lookable:
                self._alive_list(pick_of(self._alive(), pick))
                return
            sweeper, run = pick_of(lookable, pick)
            e = self.model.entry(run)
            if later and e is not None and (e.claimed_at or e.m is not None):
                self.model.age(run, (e.claim_age if e.claimed_at else e.age) + later)
            self._sweep(sweeper, run, fault, dies)

    def _agable(self) -> list[str | Worker]:
        out: list[str | Worker] = []
        for run, e in self.model.store.entries.items():
            if (e.claimed_at and e.claim_age < 2) or (not e.claimed_at and e.m is not None and e.age < 2):
                out.append(run)
        return out + [w for w in self.workers if w.state == "dead"]

    @precondition(lambda self: bool(self._agable()))
    @rule(pick=PICKS)
    def time_passes(self, pick: int) -> None:
        """Time passes for a run's entry (past its due time's grace, then the unseen grace; or its
        claim WORKER_GONE_AFTER, then DELAYED_CLAIM_PATIENCE old), or a dead worker's alive mark
        is WORKER_GONE_AFTER old."""
        with self._step():
            found = pick_of(self._agable(), pick)
            if isinstance(found, Worker):
                found.state = "gone"
                return
            e = self.model.entry(found)
            assert e is not None
            self.model.age(found, (e.claim_age if e.claimed_at else e.age) + 1)
            self._pin()

    def _can_die(self) -> bool:
        return self.deaths < MAX_DEATHS

    @precondition(lambda self: self._can_die() and bool(self._alive()))
    @rule(pick=PICKS)
    def die(self, pick: int) -> None:
        """A whole worker dies (SIGKILL): its calls in flight are never sent again, the messages
        it held or started come back after the visibility timeout."""
        with self._step():
            self._die(pick_of(self._alive(), pick))

    def _die(self, w: Worker) -> None:
        self.deaths += 1
        w.state = "dead"
        for msg in self.messages:
            if msg.worker is w and msg.where in ("held", "started"):
                msg.where = "lost"
        for ex in self.execs:
            if ex.worker is w and ex.body == "running":
                ex.body = "lost"
        EVENTS["a worker dies"] += 1

    @precondition(lambda self: len(self._alive()) < MAX_ALIVE)
    @rule()
    def start_worker(self) -> None:
        """A worker starts (a node started again is another worker: a new instance)."""
        with self._step():
            self._worker()

    @precondition(lambda self: any(m.where == "lost" for m in self.messages))
    @rule(pick=PICKS)
    def visibility_timeout(self, pick: int) -> None:
        """A message a dead worker held comes back from the broker (the visibility timeout)."""
        with self._step():
            msg = pick_of([m for m in self.messages if m.where == "lost"], pick)
            msg.where, msg.worker = "broker", None
            EVENTS["a message comes back late"] += 1

    def _killable(self) -> list[Exec]:
        return [ex for ex in self.execs if ex.active and ex.phase in ("claimed", "running")]

    @precondition(lambda self: self._can_die() and bool(self._killable()))
    @rule(pick=PICKS)
    def kill_pool(self, pick: int) -> None:
        """A claimant's pool process is killed (its worker lives on): the main process stores
        FAILURE (WorkerLostError) and acknowledges the message; its claim, if not done, stays."""
        with self._step():
            ex = pick_of(self._killable(), pick)
            self.deaths += 1
            ex.over, ex.stash = True, None
            if ex.body == "running":
                ex.body = "lost"
            assert ex.msg is not None
            ex.msg.where = "acked"
            self.runs[ex.run].state = "FAILURE"
            EVENTS["a pool process killed"] += 1

    def _stashed(self) -> list[Owner]:
        owners: list[Owner] = [ex for ex in self.execs if ex.stash is not None and ex.active]
        owners += [o for o in (*self.noters.values(), *self.sweepers.values())
                   if o.stash is not None and o.worker.alive]
        return owners

    @precondition(lambda self: bool(self._stashed()))
    @rule(pick=PICKS)
    def send_again(self, pick: int) -> None:
        """A call whose reply was lost is sent again."""
        with self._step():
            self._again(pick_of(self._stashed(), pick))

    def _again(self, owner: Owner) -> None:
        stash = owner.stash
        assert stash is not None
        owner.stash = None
        stash.again()

    # -- comparison ---------------------------------------------------------------------------------

    def _real(self) -> dict[str, Any]:
        direct, layout = self.env.direct, self.layout
        pipe = direct.pipeline(transaction=False)
        pipe.hgetall(layout.key(DELAYED, KEY))
        pipe.zrange(layout.key(DELAYED_ENDS, KEY), 0, -1)
        pipe.zrange(layout.key(JOURNALED, KEY), 0, -1)
        pipe.zrange(layout.index(DELAYED_DUE), 0, -1)
        entries, ends, journaled, indexed = pipe.execute()
        found: dict[str, dict[str, object]] = {}
        for run, raw in entries.items():
            e = json.loads(raw)
            assert "h" not in e and "due" in e, e
            found[text(run)] = {
                "t": e.get("t"), "ts": _listed(e.get("ts")), "old": _listed(e.get("old")), "m": e.get("m"),
                "w": e.get("w") or None, "r": "r" in e, "sent": "sent" in e, "c": e.get("c"),
                "o": e.get("o"), "lt": e.get("lt"), "ca": "ca" in e, "took": e.get("took"),
            }
        members = [json.loads(text(m)) for m in indexed]
        assert all(key == KEY for key, _ in members), members
        return {"entries": found, "ends": {text(r) for r in ends},
                "journaled": {text(m) for m in journaled}, "indexed": {run for _, run in members}}

    def _expected(self) -> dict[str, Any]:
        st_ = self.model.store
        return {"entries": {run: e.fields() for run, e in st_.entries.items()}, "ends": set(st_.ends),
                "journaled": set(st_.journaled), "indexed": set(st_.indexed)}

    @invariant()
    def agrees_with_the_model(self) -> None:
        with self._step():
            real, expected = self._real(), self._expected()
            for name, want in expected.items():
                if name == "entries":
                    assert real[name].keys() == want.keys(), f"entries: Redis {real[name]!r}, model {want!r}"
                    for run, fields in want.items():
                        got = real[name][run]
                        assert got == fields, f"{run}: Redis holds {got!r}, the model {fields!r}"
                else:
                    assert real[name] == want, f"{name}: Redis holds {real[name]!r}, the model {want!r}"

    # -- the end of an example ------------------------------------------------------------------------

    def teardown(self) -> None:
        try:
            if not self.broken:
                self._quiesce()
                self._everything_ended()
        finally:
            keys = list(self.env.direct.scan_iter(match=f"{self.ns}:*", count=200))
            if keys:
                self.env.direct.delete(*keys)

    def _quiesce(self) -> None:
        """Drive the key until nothing moves: calls sent again, tasks go on (bodies succeed),
        messages delivered and started; when stuck, dead workers are gone, every entry's time
        runs past its graces and the sweeper looks at every run of the index. Then no copy may
        wait (none waits for a broker's visibility timeout); last, the messages dead workers
        held come back, and the key is driven again."""
        checked = False
        for _ in range(300):
            moved = False
            for owner in self._stashed():
                self._again(owner)
                moved = True
            for ex in self._steppable():
                self._advance(ex, None, ex.plan or "start", "succeed", False)
                moved = True
            for msg in self._held():
                self._fire(msg, None)
                moved = True
            for msg in [m for m in self.messages if m.where == "broker"]:
                msg.where, msg.worker = "held", self._someone()
                moved = True
            if moved:
                self.agrees_with_the_model()
                continue
            for w in self.workers:
                if w.state == "dead":
                    w.state = "gone"
            for run in list(self.model.store.entries):
                self.model.age(run, 2)
            sweeper = self.sweepers[self._someone().name]
            for run in sorted(self.model.store.indexed):
                moved = self._sweep(sweeper, run, None, False) or moved
            self.agrees_with_the_model()
            if moved:
                continue
            if not checked:
                checked = True
                self._nothing_waits()
            for msg in self.messages:
                if msg.where == "lost":
                    msg.where, msg.worker = "broker", None
                    moved = True
            if not moved:
                return
        raise AssertionError("the key did not come to rest")

    def _nothing_waits(self) -> None:
        """Every worker that died is gone, every grace passed, every run of the index looked at:
        no copy waits (for the visibility timeout of a message a dead worker held)."""
        for run, e in self.model.store.entries.items():
            if e.m is not None:
                raise AssertionError(f"{run}'s copy waits for a visibility timeout: {e} (indexed:"
                                     f" {run in self.model.store.indexed})")

    def _everything_ended(self) -> None:
        """Every run ended: its last delay's body ran exactly once, or it ended FAILURE; no copy
        waits in Redis."""
        for run in self.runs.values():
            assert run.terminal, f"{run.id} never ended: {run.state}"
            if run.state == "SUCCESS":
                done = [ex.name for ex in self.bodies.get(run.last_delay, []) if ex.body == "completed"]
                assert len(done) == 1, f"{run.id}'s last delay ran its body {len(done)} times"
        waiting = {run: e for run, e in self.model.store.entries.items() if e.m is not None}
        assert not waiting, f"copies left waiting: {waiting}"


# -- the test ------------------------------------------------------------------------------------------

EXAMPLES = 120


def profile() -> settings:
    if LONG:
        return settings(max_examples=EXAMPLES * 10, stateful_step_count=80, deadline=None, database=None,
                        suppress_health_check=list(HealthCheck))
    shrink = bool(os.environ.get("SF_MODEL_SHRINK"))
    phases = list(Phase) if shrink else [Phase.explicit, Phase.reuse, Phase.generate]
    return settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None, database=None,
                    derandomize=True, suppress_health_check=list(HealthCheck), print_blob=False,
                    phases=phases)


# about 15 s: Hypothesis runs its examples (sequences of calls, deaths, lost replies) on a real Redis;
# fewer would miss the windows the model found (SF_MODEL_PROFILE=long: ten times as many)
@pytest.mark.timeout(3600 if LONG else 120)
def test_the_delayed_scripts_follow_the_model(env: Env) -> None:
    """Given one key with one or two delayed runs, when any sequence of the delayed-copy calls,
    worker deaths, lost replies and time passing runs on a real Redis, then every reply and every
    entry are the model's after each step, no delay's body runs twice, a claim taken back is never
    told done, a lost claim or copy is sent again once due, and every run ends."""
    machine = type("DelayedMachine_", (DelayedMachine,), {"env": env})
    run_state_machine_as_test(machine, settings=profile())


# -- the defects it found (fixed), each replayed on its own ---------------------------------------------

@pytest.fixture
def calls(env: Env) -> Iterator[DelayedCalls]:
    """The delayed calls of a namespace of its own, straight on the private Redis."""
    store = LeaseStore(env.server.client(), KeyLayout(f"found-{os.urandom(4).hex()}"))
    yield store.delayed
    keys = list(store.client.scan_iter(match=f"{store.layout.namespace}:*", count=200))
    if keys:
        store.client.delete(*keys)


def _past(calls: DelayedCalls, run: str, field: str, ms: int) -> None:
    """``ms`` pass for the time ``field`` of ``run``'s entry (rewritten into the past)."""
    client, name = calls.ctx.client, calls.ctx.layout.key(DELAYED, "k")
    entry = json.loads(client.hget(name, run))
    entry[field] = str(int(entry[field]) - ms)
    client.hset(name, run, json.dumps(entry))


@pytest.mark.parametrize("then", ["ran", "ran and retried"])
def test_a_delay_sent_again_after_its_copy_ran_does_not_run_it_again(calls: DelayedCalls, then: str) -> None:
    """Defect A (fixed). Given a DELAY whose reply is lost (redis-py sends it again after
    SOCKET_TIMEOUT, 5 s), and meanwhile, the countdown message not sent yet, a sweeper's copy of
    the run (no worker noted one; past the unseen grace) that claimed and started (and, in the
    second case, whose body retried: a new delay), when the DELAY is sent again, it writes nothing
    (its token is the entry's: current, or stale once the run was delayed again), and the
    countdown message its caller then sends is stale: the delay ran already."""
    calls.delay("k", "r", "tok0", "message", 1.0)  # its reply lost
    _past(calls, "r", "due", 10_000)
    assert calls.resend("k", "r", "copy1", ["w2#b"]) is not None
    assert calls.claim("k", "r", "copy1", "w2#b", "lease-b") == delayed_calls.ClaimReply.GO_LATE
    assert calls.done(Claim("k", "r", "copy1")) == delayed_calls.ClaimDoneReply.DONE  # its body runs
    if then == "ran and retried":
        calls.delay("k", "r", "tok1", "message", 1.0)  # its body retries: tok0 and copy1 are stale
    name = calls.ctx.layout.key(DELAYED, "k")
    before = calls.ctx.client.hget(name, "r")
    calls.delay("k", "r", "tok0", "message", 1.0)  # sent again
    assert calls.ctx.client.hget(name, "r") == before, "a DELAY sent again wrote its delay's entry anew"
    if then == "ran and retried":
        assert calls.claim("k", "r", "tok1", "w3#c", "lease-c") == delayed_calls.ClaimReply.GO
    assert calls.claim("k", "r", "tok0", "w3#c", "lease-d") == delayed_calls.ClaimReply.STALE, (
        "the countdown message of a delay whose copy ran claims the run: the delay runs twice")


def test_a_claim_taken_back_whose_claimant_dies_in_claim_done_stays_indexed(calls: DelayedCalls) -> None:
    """Defect B (fixed). Given a claimant too slow to start (its claim past
    DELAYED_CLAIM_PATIENCE), whose claim a sweeper took back, the sweeper's worker killed before it
    sent the copy, when the claimant says CLAIM_DONE (TAKEN_BACK) and dies right after that round
    trip, then the run is still in the delayed index, so that a sweeper sends the copy within
    seconds (not when the claimant's message comes back after the broker's visibility timeout);
    and once a copy's claimant says CLAIM_DONE (DONE), the run leaves the index."""
    index, member = calls.ctx.layout.index(DELAYED_DUE), json.dumps(["k", "r"])
    calls.delay("k", "r", "tok0", "message", 1.0)
    assert calls.claim("k", "r", "tok0", "w1#a", "lease-a") == delayed_calls.ClaimReply.GO
    _past(calls, "r", "ca", 11_000)
    resent = calls.resend("k", "r", "copy1", ["w1#a", "w2#b"])  # taken back; w2 dies before sending it
    assert resent is not None and resent.took == "lease-a"
    # w1 dies right after the round trip: a second call of done() (none now) would never be made
    with mock.patch.object(DelayedCalls, "look_again"):
        assert calls.done(Claim("k", "r", "tok0")) == delayed_calls.ClaimDoneReply.TAKEN_BACK
    assert calls.waiting("k", "r")
    assert calls.ctx.client.zscore(index, member) is not None, "a copy waits and no sweeper will look at it"
    assert calls.claim("k", "r", "copy1", "w3#c", "lease-c") == delayed_calls.ClaimReply.GO_LATE
    assert calls.done(Claim("k", "r", "copy1")) == delayed_calls.ClaimDoneReply.DONE
    assert not calls.waiting("k", "r")
    assert calls.ctx.client.zscore(index, member) is None, "a run whose copy started stays in the index"


def test_a_late_touch_does_not_hold_a_run_for_a_worker_that_dropped_its_message(calls: DelayedCalls) -> None:
    """Defect C (fixed). Given a countdown message held by w1 whose TOUCH is late (its reply lost,
    sent again after SOCKET_TIMEOUT), a sweeper's copy claimed by w2, w1's message started and
    stale (dropped: CLAIM makes its token stale), w2 gone and its claim taken back, and the copy
    sent since noted by w3, which died too, when w1's TOUCH lands, it notes nothing, and the next
    look past the grace sends the copy again: w1 holds no message of the run (it is alive, and
    would hold the run as long as it lives)."""
    calls.delay("k", "r", "t0", "message", 1.0)
    _past(calls, "r", "due", 10_000)
    assert calls.resend("k", "r", "t1", ["w1#a"]) is not None  # nobody noted one: a copy
    assert calls.claim("k", "r", "t1", "w2#b", "lease-b") == delayed_calls.ClaimReply.GO_LATE
    assert calls.claim("k", "r", "t0", "w1#a", "lease-a") == delayed_calls.ClaimReply.STALE  # w1 drops it
    _past(calls, "r", "ca", 5_000)  # w2 died: gone
    assert calls.resend("k", "r", "t2", ["w1#a"]) is not None  # taken back: copy t2
    calls.touch([("k", "r", "t2")], "w3#c")  # w3 holds copy t2, then dies
    calls.touch([("k", "r", "t0")], "w1#a")  # w1's late TOUCH
    entry = json.loads(calls.ctx.client.hget(calls.ctx.layout.key(DELAYED, "k"), "r"))
    assert entry["w"] == {"t2": "w3#c"}, f"w1's late TOUCH noted it as holding a copy: {entry['w']}"
    _past(calls, "r", "sent", 10_000)
    assert calls.resend("k", "r", "t3", ["w1#a"]) is not None, "the run waits for w1, which dropped it"


def test_every_copy_sent_after_a_take_back_carries_the_claimants_lease(calls: DelayedCalls) -> None:
    """Given a claim taken back (its claimant's worker gone, past DELAYED_CLAIM_PATIENCE) and its
    copy sent with the claimant's lease token, when that copy is lost too (its worker died before
    anyone noted it) and a sweeper sends the run again past the unseen grace, before any copy
    claimed, then the second copy still carries the taken-back claimant's lease token (had the
    claimant taken its lease, only a copy carrying it takes that lease over, instead of waiting
    for it to run out); once a copy claims, the token is cleared, and a claim of that copy taken
    back in turn hands on its own lease token."""
    calls.delay("k", "r", "tok0", "message", 1.0)
    _past(calls, "r", "due", 10_000)
    assert calls.claim("k", "r", "tok0", "w1#a", "lease-a") == delayed_calls.ClaimReply.GO
    _past(calls, "r", "ca", 11_000)
    first = calls.resend("k", "r", "copy1", ["w2#b"])  # taken back; copy1 goes to w2, which dies
    assert first is not None and first.took == "lease-a"
    _past(calls, "r", "sent", 10_000)  # nobody noted copy1: past the unseen grace
    second = calls.resend("k", "r", "copy2", ["w3#c"])
    assert second is not None, "the lost copy was not sent again"
    assert second.took == "lease-a", (
        f"the second copy after a take-back carries {second.took!r}, not the claimant's lease token")
    assert calls.claim("k", "r", "copy2", "w3#c", "lease-c") == delayed_calls.ClaimReply.GO_LATE
    entry = json.loads(calls.ctx.client.hget(calls.ctx.layout.key(DELAYED, "k"), "r"))
    assert "took" not in entry, f"a claim kept the token of a lease taken back before: {entry}"
    _past(calls, "r", "ca", 11_000)
    third = calls.resend("k", "r", "copy3", ["w4#d"])
    assert third is not None and third.took == "lease-c"


# -- D and E (fixed): each replayed through the machine, and through delay_again --------------------

def _machine(env: Env) -> DelayedMachine:
    """A machine on ``env`` whose steps the test calls one by one."""
    return type("DelayedMachine_", (DelayedMachine,), {"env": env})()


def _countdowns(m: DelayedMachine) -> list[str]:
    return [msg.token for msg in m.messages if msg.kind == "countdown"]


def test_a_retry_answered_late_does_not_replace_the_end_of_its_copy(env: Env) -> None:
    """Defect D (fixed). Given a run whose body retries with a short countdown (``retry_backoff``
    0.1 s, say), and whose DELAY's reply is lost (redis-py sends it again after SOCKET_TIMEOUT,
    5 s), when, its countdown message not sent yet and no worker noting one, a sweeper sends the
    new delay's copy past the unseen grace (countdown + 3 s), the copy runs and the run ends
    (FAILURE: it fails before its body), and then the DELAY is sent again, it answers NOT_CLAIMED
    (the copy owns the run): the retrying attempt sends no countdown message and stores no RETRY
    over the run's end (which, the message being stale, would stay for good)."""
    m = _machine(env)
    try:
        m.first_runs(runs=1, fault=None)
        m.deliver(pick=0, to=0, how="start", fault=None)  # its countdown message claims the run
        m.step(pick=0, fault=None, claimed="start", body="succeed", dies=False)  # CLAIM_DONE: the body runs
        m.step(pick=0, fault="replay", claimed="start", body="retry", dies=False)  # DELAY: its reply lost
        m.agrees_with_the_model()
        m.sweep(pick=0, fault=None, dies=False, later=2)  # the new delay's copy, past the unseen grace
        m.deliver(pick=0, to=0, how="start", fault=None)  # the copy claims (GO_LATE)
        m.step(pick=0, fault=None, claimed="fail", body="succeed", dies=False)  # and ends the run: FAILURE
        m.agrees_with_the_model()
        assert m.runs["r1"].state == "FAILURE"
        sent = _countdowns(m)
        m.send_again(pick=0)  # the DELAY sent again: NOT_CLAIMED
        m.agrees_with_the_model()
        assert _countdowns(m) == sent, "a retry answered after its copy ended the run sent a countdown"
        assert m.runs["r1"].state == "FAILURE", "RETRY was stored over the run's end"
        assert EVENTS["a DELAY not claimed: the attempt is dropped"] > 0
        m.teardown()  # the run has ended, and stays so
    finally:
        m.broken = True
        m.teardown()


@pytest.mark.parametrize("copy", ["not claimed yet", "claimed and started"])
def test_a_claimant_whose_claim_was_taken_back_does_not_delay_the_run_again(env: Env, copy: str) -> None:
    """Defect E (fixed). Given a delayed run whose claimant is slow before its start (past
    DELAYED_CLAIM_PATIENCE, 10 s: lost replies on its way to the key), whose claim a sweeper took
    back, the copy sent again waiting or claimed and started (it holds the key), when the slow
    claimant finds its key held by its own task id (``wait_for_own_attempt``) or meets a rate
    limit, and is delayed again, its DELAY (passing its claim's token) answers NOT_CLAIMED: it
    makes no new delay and sends no countdown message (which would run the body a second time);
    its CLAIM_DONE answers TAKEN_BACK, and the copy's body runs once."""
    m = _machine(env)
    try:
        m.first_runs(runs=1, fault=None)
        m.deliver(pick=0, to=0, how="start", fault=None)  # x1 claims the run
        m.sweep(pick=0, fault=None, dies=False, later=2)  # x1 past the patience: taken back, a copy sent
        x1 = m.execs[1]
        if copy == "claimed and started":
            m.deliver(pick=0, to=1, how="start", fault=None)  # x2: the copy claims (GO_LATE)
            x2 = m.execs[2]
            assert (x1.phase, x2.phase) == ("claimed", "claimed")
            m._advance(x2, None, "start", "succeed", False)  # CLAIM_DONE: DONE, the copy's body runs
        sent = _countdowns(m)
        entry = m.env.direct.hget(m.layout.key(DELAYED, KEY), "r1")
        m._advance(x1, None, "redelay", "succeed", False)  # x1 delayed again: DELAY answers NOT_CLAIMED
        m.agrees_with_the_model()
        assert m.env.direct.hget(m.layout.key(DELAYED, KEY), "r1") == entry, "a stale claimant wrote a delay"
        assert _countdowns(m) == sent, "a claimant whose claim was taken back sent a countdown message"
        m._advance(x1, None, "redelay", "succeed", False)  # CLAIM_DONE: TAKEN_BACK
        assert x1.over
        m.teardown()  # the copy's body runs, once
    finally:
        m.broken = True
        m.teardown()


@dataclass
class _Attempt:
    """What run/delay.py's delay_again did for an attempt: the ``claimed`` it passed, and whether it
    sent its countdown message (and journaled its wait), or raised Ignore."""

    claimed: str
    sent: bool
    journaled: bool
    ignored: bool


def _delay_again(calls: DelayedCalls, token: str, header: str | None) -> _Attempt:
    """delay_again() of run ``r`` on key ``k`` under the new ``token``, as an attempt whose message
    carries ``header`` (HEADER_DELAYED: ``"<token> <key>"``; None: not delayed), on ``calls``'s
    store; the message, its sending and the journal stubbed out."""
    headers = {HEADER_DELAYED: header} if header is not None else {}
    request = mock.Mock(spec=["id", "headers"], id="r", headers=headers)
    delayed = mock.Mock(wraps=calls)
    task = mock.Mock(request=request, store=mock.Mock(delayed=delayed))
    task.name = "model.delayed"
    with mock.patch.object(run_delay, "message_of", return_value="message"), \
            mock.patch.object(run_delay, "send_again") as send, \
            mock.patch.object(run_delay, "journal_waiting") as journal, \
            mock.patch.object(run_delay.uuid, "uuid4", return_value=mock.Mock(hex=token)):
        try:
            run_delay.delay_again(task, (), {}, 1.0, "k")
        except Ignore:
            ignored = True
        else:
            ignored = False
    delayed.delay.assert_called_once()
    return _Attempt(delayed.delay.call_args.kwargs.get("claimed", ""), send.called, journal.called, ignored)


@pytest.mark.parametrize("case", ["claim taken back (E)", "answered late (D)", "claim stands",
                                  "first execution", "a copy of another key"])
def test_delay_again_passes_its_claim_and_sends_nothing_once_another_copy_owns_the_run(
        calls: DelayedCalls, case: str) -> None:
    """run/delay.py, as the machine models it. Given a delayed run on ``k``, when an attempt
    delays it again: a delayed copy of ``k`` passes its claim's token (its message's), any other
    attempt ''; once another copy owns the run (the attempt's claim was taken back: E; or its
    DELAY, sent again, finds a copy that claimed it: D), it raises Ignore, sends no countdown
    message and journals nothing, and the entry is left as it is; else it is delayed again."""
    name = calls.ctx.layout.key(DELAYED, "k")
    calls.delay("k", "r", "tok0", "message", 1.0)
    header, token = "tok0 k", "tok1"
    if case == "claim taken back (E)":
        assert calls.claim("k", "r", "tok0", "w1#a", "lease-a") == delayed_calls.ClaimReply.GO
        _past(calls, "r", "ca", 11_000)
        assert calls.resend("k", "r", "copy1", ["w1#a"]) is not None  # taken back: a copy sent
    elif case == "answered late (D)":
        assert calls.claim("k", "r", "tok0", "w1#a", "lease-a") == delayed_calls.ClaimReply.GO
        assert calls.done(Claim("k", "r", "tok0")) == delayed_calls.ClaimDoneReply.DONE  # its body runs
        calls.delay("k", "r", "tok1", "message", 1.0, claimed="tok0")  # it retries: the reply is lost
        _past(calls, "r", "due", 10_000)
        assert calls.resend("k", "r", "copy1", ["w2#b"]) is not None  # nobody noted one: a copy
        assert calls.claim("k", "r", "copy1", "w2#b", "lease-b") == delayed_calls.ClaimReply.GO_LATE
    elif case == "claim stands":
        assert calls.claim("k", "r", "tok0", "w1#a", "lease-a") == delayed_calls.ClaimReply.GO
    elif case == "first execution":
        header = None
    else:
        header = "tok9 other"
    before = calls.ctx.client.hget(name, "r")
    got = _delay_again(calls, token, header)
    assert got.claimed == ("tok0" if header == "tok0 k" else ""), f"delay_again passed {got.claimed!r}"
    if case in ("claim taken back (E)", "answered late (D)"):
        assert got.ignored and not got.sent and not got.journaled, f"another copy owns the run: {got}"
        assert calls.ctx.client.hget(name, "r") == before, "the entry was written"
    else:
        assert not got.ignored and got.sent and got.journaled, got
        assert json.loads(calls.ctx.client.hget(name, "r"))["t"] == "tok1"
