"""A worker SIGKILLed (its whole process group) inside each window of the waiting machinery.

Every run that waits is, at every instant, recorded as waiting in Redis with a live owner, or
started and watched, or terminal (issue 37). These scenarios hold a worker inside one window at a
time, deterministically (a reply of the lease Redis held back by a :class:`~.faultproxy.FaultProxy`
in front of the victim's lease Redis, or the victim's main process stopped), then SIGKILL its
process group:

- ``claim``: a delayed run (rate limit, debounce, the ``retry`` policy) claimed its copy and its
  ACQUIRE ran, but its reply never came: it is not in the started index yet (the reproduction of
  issue 37: such a run stayed ``RETRY`` for ever);
- ``touch``: the countdown message of a delayed run arrived, but its worker's note that it holds
  it (TOUCH) never landed: the copy is "unseen", and goes out ``DELAYED_UNSEEN_GRACE`` after its
  due time;
- ``fair-enter``: a fair run's FAIR_ENTER ran in the worker's main process (a slot reserved for
  it, or the run parked) and the worker died before the run took its slot or its message was
  acknowledged;
- ``hand-on``: a fair slot handed on through the releasing worker's own queue (``<node>.dq2``),
  that worker killed before it consumed the message: the reservation runs out and a sweeper hands
  the slot again;
- ``take``: a run that waited (parked by ``queue``, or parked at a fair gate) is handed the key or
  a slot, its ACQUIRE adopts it on the server, and the reply is held: killed between its take and
  its start, on a key (a gate) nobody uses afterwards, it is found by its provisional member in
  the started index and ends ``FAILURE`` with ``RunLost`` within the lease TTL + 10 s.

The victim's lease Redis goes through the proxy (only the victim's commands are faulted); the
other worker and this process reach it directly. Copies a sweeper sends go to the queue their run
was sent to: once the victim is dead the other worker consumes its queue too (as workers sharing a
queue would). Every cell: each run terminal within ``BOUND`` of the fault (or of its due time, or
of the release of the holder it waits for, if later) plus its own work, none ran twice, no key
left held or parked. ``-s`` prints each cell's figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_singleflight import RunLost, constants
from celery_singleflight.protocol.lease import AcquireReply
from celery_singleflight.protocol.started import STARTED
from celery_singleflight.testing import RedisServer, WorkerProcess

from ..conftest import wait_for
from ..lua_sources import SOURCE
from .conftest import Workers, max_at_once, round3, runs
from .faultproxy import DROP_COMMAND, FaultProxy, Rule, stall_reply

pytestmark = pytest.mark.worker

TTL = 3.0  # the workers' lease TTL
#: each run terminal this long after the fault (or its due time, or its holder's release), plus
#: its own work (the issue's bound for every cell)
BOUND = 10.0
#: the reproduction's bound: the lease TTL + 15 s after the kill
REPRO_BOUND = TTL + 15.0
#: the Redis broker's visibility timeout in the fair-enter cells: the message the dead worker held
#: unacknowledged comes back this long after it was delivered (kombu restores on its own schedule)
VISIBILITY = 5.0
STALL = 120.0  # a held reply: far longer than any cell (the victim is killed while it waits)
SHORT = 0.1  # a waiting run's body


@pytest.fixture
def proxy(lease_redis: RedisServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the lease Redis, for the victim worker only."""
    with FaultProxy(lease_redis.port) as started:
        yield started


# -- workers and faults ----------------------------------------------------------------------------


def start_pair(workers: Workers, queue: str, proxy: FaultProxy | None, *, victim_procs: int = 2,
               survivor_procs: int = 2, extra: dict[str, str] | None = None
               ) -> tuple[WorkerProcess, WorkerProcess]:
    """The victim (its lease Redis through ``proxy``) and the survivor (direct), each on a queue of
    its own."""
    env = {"CHAOS_TTL": str(TTL), **(extra or {})}
    victim_env = {**env, "CHAOS_LEASE_URL": proxy.url(2)} if proxy is not None else env
    victim = workers.make(f"{queue}-victim", concurrency=victim_procs, env=victim_env)
    survivor = workers.make(f"{queue}-survivor", concurrency=survivor_procs, env=env)
    workers.start(victim, survivor)
    return victim, survivor


def kill(chaos: ModuleType, victim: WorkerProcess, survivor: WorkerProcess) -> tuple[float, dict[int, float]]:
    """SIGKILL ``victim``'s process group; the survivor then consumes its queue too. Returns the
    time of the kill and the dead pool processes (pid -> time of death)."""
    children = victim.children()
    at = time.time()
    victim.kill()
    told = chaos.app.control.add_consumer(victim.queue, destination=[survivor.hostname],  # type: ignore[attr-defined]
                                          reply=True, timeout=5)
    assert told, f"{survivor.hostname} did not answer add_consumer"
    return at, dict.fromkeys(children, at)


def mentions(task_id: str) -> Callable[[list[bytes]], bool]:
    """A proxy predicate: the command names ``task_id`` in one of its arguments."""
    needle = task_id.encode()
    return lambda args: any(needle in arg for arg in args)


def took_the_key(reply: bytes) -> bool:
    """A proxy predicate on an ACQUIRE's raw reply: the key is the caller's (``'fence:since:slot'``,
    or TOOK). Asked of the reply, not the command: an attempt sent while the key was held can
    run on the server just after the holder's release (a retry tries every 60 ms)."""
    took = b":%d" % AcquireReply.TOOK
    return reply.startswith(b"$") or (reply.startswith(b"*") and reply.split(b"\r\n")[1] == took)


def script_argv(args: list[bytes]) -> list[bytes]:
    """The ARGV of an EVAL/EVALSHA command."""
    return args[3 + int(args[2]):]


def await_fault(rule: Rule, what: str, timeout: float, *logs: WorkerProcess) -> None:
    """Wait until the proxy did ``rule``'s fault; else fail naming ``what`` and the workers' last lines."""
    if not rule.event.wait(timeout):
        tails = "\n".join(f"--- {w.hostname}\n" + "\n".join(w.log().splitlines()[-15:]) for w in logs)
        raise AssertionError(f"no {what} within {timeout:.0f} s (rule matched {rule.matched} commands)"
                             f"\n{tails}")


def log_lines(worker: WorkerProcess, *needles: str, last: int = 12) -> list[str]:
    """The last lines of ``worker``'s log naming any of ``needles``."""
    with contextlib.suppress(OSError):
        return [line for line in worker.log().splitlines() if any(n in line for n in needles)][-last:]
    return []


# -- the runs of a cell and their verdicts ---------------------------------------------------------


@dataclass
class Case:
    """One run of a cell: terminal within BOUND + ``work`` of ``since`` (the fault, its due time,
    or the release it waits for, whichever is last)."""

    label: str
    result: AsyncResult
    since: float
    work: float = SHORT
    ended: float | None = None
    bound: float = BOUND

    def poll(self) -> None:
        if self.ended is None and self.result.ready():
            self.ended = time.time()

    @property
    def took(self) -> float | None:
        return None if self.ended is None else round(self.ended - self.since, 3)


def wait_terminal(cases: list[Case], deadline: float) -> None:
    while True:
        for case in cases:
            case.poll()
        if all(c.ended is not None for c in cases) or time.time() > deadline:
            return
        time.sleep(0.05)


def ran(chaos: ModuleType, task_id: str) -> list[dict[str, Any]]:
    return [r for r in runs(chaos) if r["task_id"] == task_id]


def verdicts(chaos: ModuleType, cases: list[Case], *, lost_ok: bool = True) -> list[str]:
    """What broke: a run not terminal (or late), one that ran twice, one that ended otherwise than
    SUCCESS having run once (or FAILURE with RunLost, when ``lost_ok``)."""
    problems = []
    for c in cases:
        state, times = c.result.state, len(ran(chaos, c.result.id))
        if c.ended is None:
            problems.append(f"{c.label} not terminal {time.time() - c.since:.1f} s after its clock started:"
                            f" {state}")
        elif c.took is not None and c.took > c.bound + c.work:
            problems.append(f"{c.label} terminal {c.took:.2f} s after its clock started (bound"
                            f" {c.bound + c.work:.1f} s)")
        if times > 1:
            problems.append(f"{c.label} ran {times} times")
        if c.ended is not None:
            if state == "SUCCESS" and times != 1:
                problems.append(f"{c.label} ended SUCCESS having run {times} times")
            elif state == "FAILURE" and not (lost_ok and isinstance(c.result.result, RunLost)):
                problems.append(f"{c.label} ended FAILURE {c.result.result!r}")
            elif state not in ("SUCCESS", "FAILURE"):
                problems.append(f"{c.label} ended {state}")
    return problems


def figures_of(cases: list[Case], chaos: ModuleType) -> dict[str, Any]:
    return {c.label: {"state": c.result.state, "terminal_after_s": c.took, "bound_s": c.bound + c.work,
                      "runs": len(ran(chaos, c.result.id))} for c in cases}


def table(title: str, cases: list[Case], chaos: ModuleType) -> str:
    rows = [title, f"  {'run':<22} {'state':<8} {'terminal s':>10} {'bound s':>8} {'runs':>4}"]
    for c in cases:
        took = "-" if c.took is None else f"{c.took:.2f}"
        rows.append(f"  {c.label:<22} {c.result.state:<8} {took:>10} {c.bound + c.work:>8.1f}"
                    f" {len(ran(chaos, c.result.id)):>4}")
    return "\n".join(rows)


def report(figures: dict[str, Any], title: str, cases: list[Case], chaos: ModuleType, problems: list[str],
           **extra: Any) -> None:
    """Print the cell's table and figures; fail naming every problem."""
    text = table(title, cases, chaos)
    print("\n" + text)
    figures.update({"ttl_s": TTL, **figures_of(cases, chaos), **extra,
                    "problems": problems})
    assert not problems, text + "\n" + "\n".join(problems)


# -- delayed runs ----------------------------------------------------------------------------------


def delayed_entry(task: Any, rendered: str, task_id: str) -> dict[str, Any]:
    """The run's entry in its key's ``delayed`` hash ({} if none)."""
    store = task.store
    raw = store.client.hget(store.delayed.keys(rendered)[0], task_id)
    return json.loads(raw) if raw is not None else {}


def started_index(task: Any) -> list[str]:
    store = task.store
    return [m.decode() for m in store.client.zrange(store.layout.index(STARTED), 0, -1)]


def delayed_leftovers(task: Any, rendered: str, task_id: str, slot: int = 0) -> list[str]:
    """A key left held, or a copy left waiting, once the run is terminal."""
    found = []
    if task.store.holder_record(rendered, slot).token:
        found.append(f"{rendered} still held")
    entry = delayed_entry(task, rendered, task_id)
    if "m" in entry:
        found.append(f"its copy still waits: {entry}")
    return found


def settle_leftovers(check: Callable[[], list[str]], timeout: float = 5.0) -> list[str]:
    """``check()`` once it is empty, or what it still finds after ``timeout`` (a release may land
    just after its result)."""
    with contextlib.suppress(AssertionError):
        wait_for(lambda: not check(), timeout=timeout, interval=0.1)
    return check()


DELAYED_TASKS = {"rate limit": "win_rate", "debounce": "nl_debounce", "retry": "win_retry"}


@dataclass
class Delayed:
    """A run of the victim that the library delays: its task, key and (rendered) lock key."""

    task: Any
    key: str
    rendered: str
    task_id: str
    result: AsyncResult | None = None

    @classmethod
    def of(cls, chaos: ModuleType, policy: str, key: str) -> Delayed:
        task = getattr(chaos, DELAYED_TASKS[policy])
        return cls(task, key, task.render_key(key, 1, SHORT), str(uuid.uuid4()))


def send_delayed(chaos: ModuleType, policy: str, run: Delayed, victim: WorkerProcess,
                 survivor: WorkerProcess) -> Callable[[], None]:
    """Send ``run`` to the victim so that it is delayed: a rate-limited run right after another one
    started (in the survivor; one cell every 5 s), a debounced call, or a ``retry`` duplicate of a
    holder (in the survivor) once it was re-sent with a countdown. Returns what lets it go on (the
    ``retry`` holder's end)."""
    task, release = run.task, (lambda: None)
    if policy == "rate limit":
        first = task.apply_async((run.key, 0, SHORT), queue=survivor.queue)  # type: ignore[attr-defined]
        wait_for(lambda: ran(chaos, first.id), timeout=30)
    elif policy == "retry":
        flag = f"go:{uuid.uuid4().hex[:8]}"
        holder = task.apply_async((run.key, 0, 60.0), {"until": flag}, queue=survivor.queue)  # type: ignore[attr-defined]
        wait_for(lambda: ran(chaos, holder.id), timeout=30)
        release = lambda: chaos.recorder.set(flag, "1")  # noqa: E731
    run.result = task.apply_async((run.key, 1, SHORT), queue=victim.queue, task_id=run.task_id)  # type: ignore[attr-defined]
    if policy == "retry":  # its first attempt found the key held: re-sent with a countdown, a copy in Redis
        wait_for(lambda: run.result is not None and run.result.state == "RETRY", timeout=30)
    return release


def claim_window_cell(policy: str, proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str,
                      figures: dict[str, Any], bound: float) -> None:
    """A delayed run claims its copy in the victim, its ACQUIRE runs on the server and the reply is
    held: the victim is killed inside the window between CLAIM and the started index."""
    victim, survivor = start_pair(workers, queue, proxy)
    run = Delayed.of(chaos, policy, f"claim-{policy.replace(' ', '-')}")
    # the ACQUIRE that takes the key (a retry's attempts find it held until its holder ends)
    rule = proxy.add_rule(stall_reply(STALL), script=SOURCE["ACQUIRE"], times=1,
                          where=mentions(run.task_id), if_reply=took_the_key)
    release = send_delayed(chaos, policy, run, victim, survivor)
    assert run.result is not None
    release()
    await_fault(rule, f"ACQUIRE of the claimed delayed run {run.task_id}", 60.0, victim)
    entry = delayed_entry(run.task, run.rendered, run.task_id)
    in_window = (entry.get("c") and str(entry.get("o", "")).startswith(f"{victim.hostname}#")
                 and not any(slot >= 0 for _, slot in started_members(run.task, run.task_id)))
    assert in_window, f"not in the window between CLAIM and the started index: entry {entry}," \
                      f" started index {started_index(run.task)}"
    fault_at, _ = kill(chaos, victim, survivor)

    case = Case(f"{policy} run", run.result, fault_at, bound=bound)
    wait_terminal([case], fault_at + bound + 20.0)
    problems = verdicts(chaos, [case])
    if case.ended is not None:
        # a copy still out must not run it again: wait until none waits, then count its runs again
        problems += settle_leftovers(lambda: delayed_leftovers(run.task, run.rendered, run.task_id))
        if len(ran(chaos, run.task_id)) > 1:
            problems.append(f"ran {len(ran(chaos, run.task_id))} times")
    else:
        problems.append(f"its entry now: {delayed_entry(run.task, run.rendered, run.task_id)}; survivor's"
                        f" log: {log_lines(survivor, run.task_id)}")
    report(figures, f"kill between CLAIM and the started index ({policy}):", [case], chaos, problems,
           policy=policy, window="claim")


# inherent: the rate limit's 5 s cell (12/m) delays the run for sure; TTL and sweeps bound its end
@pytest.mark.timeout(180)
def test_a_rate_limited_run_killed_between_its_claim_and_the_started_index_ends_terminal(
    proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """The reproduction of issue 37: a rate-limited run claims its delayed copy, its ACQUIRE runs
    but the reply is held (so it is not in the started index), its worker's process group is
    SIGKILLed, another worker runs. The run ends SUCCESS having run once (its copy taken back and
    sent again; it takes over the lease the dead claimant took), or FAILURE with RunLost, within
    the lease TTL + 15 s of the kill; it never runs twice. (Before the claim had an owner, it
    stayed RETRY for ever: no sweeper sent a claimed copy, and nobody watched the run.)"""
    claim_window_cell("rate limit", proxy, chaos, workers, queue, figures, REPRO_BOUND)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["debounce", "retry"])
def test_a_delayed_run_killed_between_its_claim_and_the_started_index_ends_terminal(
    policy: str, proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """The same window for a debounced run and a ``retry`` duplicate re-sent with a countdown:
    terminal within BOUND of the kill, once."""
    claim_window_cell(policy, proxy, chaos, workers, queue, figures, BOUND)


# inherent: the run is due a rate-limit cell (5 s) or a debounce (1 s) later, and its copy goes out
# DELAYED_UNSEEN_GRACE (3 s) after that
@pytest.mark.timeout(180)
@pytest.mark.parametrize("policy", ["rate limit", "debounce"])
def test_a_delayed_run_whose_worker_died_before_noting_it_goes_out_the_unseen_grace_after_due(
    policy: str, proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """The victim receives a delayed run's countdown message; its note that it holds it (TOUCH)
    never reaches Redis (every TOUCH of the victim is dropped before the server sees it), and it
    is SIGKILLed at the first attempt. No worker noted the copy: it is sent DELAYED_UNSEEN_GRACE
    (3 s) after its due time, and the run ends within BOUND of its due time (or the kill, if
    later). (With the former 30 s unseen grace it ended about 30 s after its due time.)"""
    victim, survivor = start_pair(workers, queue, proxy)
    run = Delayed.of(chaos, policy, f"touch-{policy.replace(' ', '-')}")
    task_id = run.task_id
    rule = proxy.add_rule(DROP_COMMAND, script=SOURCE["TOUCH"], where=mentions(task_id))
    send_delayed(chaos, policy, run, victim, survivor)
    assert run.result is not None
    await_fault(rule, f"TOUCH of the delayed run {task_id}", 30.0, victim)
    fault_at, _ = kill(chaos, victim, survivor)
    entry = delayed_entry(run.task, run.rendered, task_id)
    assert entry.get("due") and not entry.get("w") and not entry.get("c"), \
        f"the copy should be unseen and unclaimed at the kill: {entry}"
    due = float(entry["due"]) / 1000.0

    case = Case(f"{policy} run", run.result, max(fault_at, due))
    wait_terminal([case], case.since + BOUND + 30.0)
    problems = verdicts(chaos, [case], lost_ok=False)  # it never started: nothing to lose
    if case.ended is not None:
        problems += settle_leftovers(lambda: delayed_leftovers(run.task, run.rendered, task_id))
    else:
        problems.append(f"its entry now: {delayed_entry(run.task, run.rendered, task_id)}")
    started = ran(chaos, task_id)
    report(figures, f"kill between TOUCH due and done ({policy}):", [case], chaos, problems, policy=policy,
           window="touch", due_after_kill_s=round3(due - fault_at),
           started_after_due_s=round3(started[0]["start"] - due) if started else None,
           unseen_grace_s=constants.DELAYED_UNSEEN_GRACE)


# -- fair share ------------------------------------------------------------------------------------

GATE_SLOTS = 2


@dataclass
class Fair:
    """The fair runs of one cell, each with the recorder flag that ends it (holders) if any."""

    chaos: ModuleType
    key: str
    cases: list[Case]

    @property
    def task(self) -> Any:
        return self.chaos.nl_fair

    def send(self, n: int, tenant: str, queue: str, *, until: str | None = None, seconds: float = SHORT,
             task_id: str | None = None) -> AsyncResult:
        kwargs = {"tenant": tenant, **({"until": until} if until else {})}
        return self.task.apply_async((self.key, n, 60.0 if until else seconds), kwargs, queue=queue,
                                     task_id=task_id or str(uuid.uuid4()))

    def started(self, result: AsyncResult) -> bool:
        return bool(ran(self.chaos, result.id))

    def leftovers(self, ns: list[int]) -> list[str]:
        found = []
        gate = self.task.fair_status()
        if gate.running:
            found.append(f"gate slots held: {[(r.slot, r.task_id, r.state) for r in gate.running]}")
        if gate.waiting:
            found.append(f"gate has {len(gate.waiting)} parked: {[w.task_id for w in gate.waiting]}")
        for n in ns:
            if self.task.store.holder_record(self.task.render_key(self.key, n)).token:
                found.append(f"lock key of run {n} still held")
        return found

    def at_once(self, deaths: dict[int, float]) -> int:
        return max_at_once([r for r in runs(self.chaos) if r["name"] == self.task.name], deaths)


def started_within(fair: Fair, result: AsyncResult, early: list[Case]) -> bool:
    """Whether ``result``'s run starts within BOUND; the ``early`` cases are polled meanwhile
    (their end times are taken as they come)."""

    def started() -> bool:
        for case in early:
            case.poll()
        return fair.started(result)

    try:
        wait_for(started, timeout=BOUND, interval=0.05)
    except AssertionError:
        return False
    return True


def parked(result: AsyncResult) -> bool:
    return bool(result.state == "QUEUED")


def fair_verdicts(fair: Fair, deaths: dict[int, float], ns: list[int]) -> tuple[list[str], int]:
    problems = verdicts(fair.chaos, fair.cases, lost_ok=False)  # no fair run here dies holding its slot
    problems += settle_leftovers(lambda: fair.leftovers(ns))
    most = fair.at_once(deaths)
    if most > GATE_SLOTS:
        problems.append(f"{most} fair runs in their bodies at once (fair_concurrency={GATE_SLOTS})")
    return problems, most


@pytest.mark.timeout(180)
@pytest.mark.parametrize("entered", ["admitted", "parked"])
def test_a_fair_run_whose_worker_died_after_fair_enter_runs_once_and_frees_its_slot(
    entered: str, proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """The victim's main process enters run X at the gate (FAIR_ENTER runs on the server: a slot
    reserved for X, or X parked); the reply is held and the victim SIGKILLed before X takes its
    slot or its message is acknowledged. Runs Y and Z (two more tenants) park in the survivor.

    - admitted: X's reservation runs out and a sweeper hands that slot to Y while holder A still
      holds the other one; X's message comes back after the broker's visibility timeout and runs.
    - parked: X stays parked in Redis and is handed a slot when the holders end; its message, back
      after the visibility timeout, is a second copy of a run that ran: dropped.

    Every run terminal within BOUND of its clock (the fault, or the holder release it waits for;
    X in the admitted case: the visibility timeout later), once; no slot held, nothing parked; at
    most 2 in their bodies at once."""
    vis = {"CHAOS_VISIBILITY": str(VISIBILITY)}
    victim, survivor = start_pair(workers, queue, proxy, victim_procs=2, survivor_procs=3, extra=vis)
    fair = Fair(chaos, f"enter-{entered}", [])
    go_a, go_b = f"go:a:{uuid.uuid4().hex[:6]}", f"go:b:{uuid.uuid4().hex[:6]}"
    a = fair.send(0, "tenant-a", survivor.queue, until=go_a)  # type: ignore[attr-defined]
    holders = [a]
    if entered == "parked":
        holders.append(fair.send(1, "tenant-b", survivor.queue, until=go_b))  # type: ignore[attr-defined]
    wait_for(lambda: all(fair.started(h) for h in holders), timeout=30)

    x_id = str(uuid.uuid4())
    # admitted: its first FAIR_ENTER (the dry look) reserves the free slot; parked: the one that parks it
    dry_wanted = entered == "admitted"
    rule = proxy.add_rule(
        stall_reply(STALL), script=SOURCE["FAIR_ENTER"], times=1,
        where=lambda args: mentions(x_id)(args) and (script_argv(args)[7] == b"1") == dry_wanted)
    x = fair.send(2, "tenant-c", victim.queue, task_id=x_id)  # type: ignore[attr-defined]
    await_fault(rule, f"FAIR_ENTER of run X ({entered})", 30.0, victim)
    y = fair.send(3, "tenant-a", survivor.queue)  # type: ignore[attr-defined]
    z = fair.send(4, "tenant-b", survivor.queue)  # type: ignore[attr-defined]
    wait_for(lambda: parked(y) and parked(z), timeout=20)
    fault_at, deaths = kill(chaos, victim, survivor)

    problems: list[str] = []
    if entered == "admitted":
        # the slot reserved for X must go to Y while A still holds the other one
        early = [Case("Y", y, fault_at)]
        if not started_within(fair, y, early):
            problems.append(f"the slot reserved for X was not handed on within {BOUND:.0f} s while A held"
                            f" the other: gate {fair.task.fair_status()}")
        released = time.time()
        chaos.recorder.set(go_a, "1")
        fair.cases = [Case("X (admitted)", x, fault_at, bound=BOUND + VISIBILITY + 10.0), *early,
                      Case("Z", z, released), Case("holder A", a, released)]
    else:
        released = time.time()
        chaos.recorder.set(go_a, "1")
        chaos.recorder.set(go_b, "1")
        fair.cases = [Case("X (parked)", x, released), Case("Y", y, released), Case("Z", z, released),
                      Case("holder A", a, released), Case("holder B", holders[1], released)]
    wait_terminal(fair.cases, max(c.since + c.bound + c.work for c in fair.cases) + 5.0)
    if entered == "parked" and x.ready():
        # its message the victim held comes back: a second copy of a run that ran, dropped
        try:
            wait_for(lambda: len(chaos.recorder.lrange(f"deliveries:{x_id}", 0, -1)) >= 2,
                     timeout=VISIBILITY + 30.0, interval=0.2)
        except AssertionError:
            problems.append("the message the victim held never came back (visibility timeout)")
        else:
            # the survivor said what it did with that copy: dropped it (or it ran: counted below)
            try:
                wait_for(lambda: len(ran(chaos, x_id)) > 1 or any(
                    x_id in line and "this copy of its message is dropped" in line
                    for line in survivor.log().splitlines()), timeout=10, interval=0.05)
            except AssertionError:
                problems.append("the survivor did not drop the message that came back: "
                                f"{log_lines(survivor, x_id)}")
    problems += fair_verdicts(fair, deaths, list(range(5)))[0]
    if problems:
        problems.append(f"survivor's log: {log_lines(survivor, x_id, 'fair', 'RunLost', 'lost')}")
    report(figures, f"kill between FAIR_ENTER and the slot taken ({entered}):", fair.cases, chaos, problems,
           window="fair-enter", entered=entered, at_once=fair.at_once(deaths),
           x_deliveries=len(chaos.recorder.lrange(f"deliveries:{x_id}", 0, -1)))


@pytest.mark.timeout(180)
def test_a_fair_hand_on_lost_with_its_worker_is_handed_again(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """Holder A (victim, one pool process) and holder B (survivor) hold the gate's two slots;
    P1, P2, P3 (three tenants) park in the survivor. The victim's main process is stopped
    (SIGSTOP), then A ends: its release reserves its slot for P1 and sends P1's message to the
    victim's own queue (``<node>.dq2``), which nobody consumes; the victim is SIGKILLed. P1's
    reservation runs out and a sweeper hands the slot to P1 again (through the task's queue),
    while B still holds the other slot. Every run terminal within BOUND, once; nothing held."""
    victim, survivor = start_pair(workers, queue, None, victim_procs=1, survivor_procs=2)
    fair = Fair(chaos, "hand-on", [])
    go_a, go_b = f"go:a:{uuid.uuid4().hex[:6]}", f"go:b:{uuid.uuid4().hex[:6]}"
    a = fair.send(0, "tenant-a", victim.queue, until=go_a)  # type: ignore[attr-defined]
    b = fair.send(1, "tenant-b", survivor.queue, until=go_b)  # type: ignore[attr-defined]
    wait_for(lambda: fair.started(a) and fair.started(b), timeout=30)
    p = [fair.send(2 + i, tenant, survivor.queue)  # type: ignore[attr-defined]
         for i, tenant in enumerate(("tenant-c", "tenant-a", "tenant-b"))]
    wait_for(lambda: all(parked(r) for r in p), timeout=20)
    first = fair.task.fair_status().waiting[0].task_id  # the run A's slot is handed to

    assert victim.proc is not None
    os.kill(victim.proc.pid, signal.SIGSTOP)  # its main process: it consumes nothing from now on
    try:
        chaos.recorder.set(go_a, "1")
        # A's pool process ends it: its release hands the slot on (the message goes to the stopped
        # worker's own queue), then it stores A's result
        wait_for(lambda: a.state == "SUCCESS", timeout=20)
        handed = [s for s in fair.task.fair_status().running if s.task_id == first]
    finally:
        fault_at, deaths = kill(chaos, victim, survivor)
    assert handed, f"A's slot was not handed to {first}: gate {fair.task.fair_status()}"

    problems: list[str] = []
    p1 = next(r for r in p if r.id == first)
    early = [Case("holder A", a, fault_at), Case("P1 (handed on)", p1, fault_at)]
    # handed again while B still holds the other slot: the reservation's end, not B's release
    if not started_within(fair, p1, early):
        problems.append(f"the lost hand-on's slot was not handed again within {BOUND:.0f} s:"
                        f" gate {fair.task.fair_status()}")
    p1_started_at = time.time()
    chaos.recorder.set(go_b, "1")
    released = time.time()
    others = [r for r in p if r is not p1]
    fair.cases = [*early, *[Case(f"P{2 + i}", r, released) for i, r in enumerate(others)],
                  Case("holder B", b, released)]
    wait_terminal(fair.cases, released + BOUND + 5.0)
    problems += fair_verdicts(fair, deaths, list(range(5)))[0]
    if problems:
        problems.append(f"survivor's log: {log_lines(survivor, first, 'parked', 'hand', 'RunLost')}")
    report(figures, "kill with a hand-on message in the worker's own queue:", fair.cases, chaos, problems,
           window="hand-on", p1_started_after_kill_s=round3(p1_started_at - fault_at),
           at_once=fair.at_once(deaths))


# -- handed the key or a fair slot: killed between the take and the start --------------------------

#: a run lost between its take and its start ends FAILURE with RunLost this long after the kill
TAKE_BOUND = TTL + 10.0


def handed_take(task_id: str, key_part: str) -> Callable[[list[bytes]], bool]:
    """A proxy predicate: the ACQUIRE of ``task_id`` on a key naming ``key_part`` that adopts a
    slot handed to it: its first argument (token, ttl, keep ttl, handoff, earlier, keep, task id,
    slots; joined by ``\x1f``) carries a handoff token."""
    wanted, part = task_id.encode(), key_part.encode()

    def selects(args: list[bytes]) -> bool:
        call = script_argv(args)[0].split(b"\x1f")
        keys = args[3:3 + int(args[2])]
        return len(call) > 6 and call[6] == wanted and call[3] != b"" and any(part in k for k in keys)

    return selects


def started_members(task: Any, task_id: str) -> list[tuple[str, int]]:
    """(key, slot) of the started index's members naming ``task_id``: slot -n is a provisional one."""
    found = []
    for member in started_index(task):
        with contextlib.suppress(ValueError, TypeError):
            key, slot, who, *_ = json.loads(member)
            if who == task_id:
                found.append((str(key), int(slot)))
    return found


def took_slot(task: Any, key: str, slots: int, task_id: str) -> bool:
    """``task_id`` holds a slot of ``key`` (its lease, not a reservation for it)."""
    return any(r.task_id == task_id and r.token and not r.reserved
               for r in (task.store.holder_record(key, slot) for slot in range(slots)))


def ended(case: Case) -> bool:
    """``case`` is terminal (its end noted when first seen)."""
    case.poll()
    return case.ended is not None


def lost_case(chaos: ModuleType, case: Case, task_id: str) -> list[str]:
    """The run that died between its take and its start: FAILURE with RunLost, its body never run."""
    problems = verdicts(chaos, [case])
    state, result = case.result.state, case.result.result
    if case.ended is not None and not (state == "FAILURE" and isinstance(result, RunLost)):
        problems.append(f"{case.label} ended {state} {result!r}, not FAILURE RunLost")
    if ran(chaos, task_id):
        problems.append(f"{case.label}'s body ran {len(ran(chaos, task_id))} times (its worker died before)")
    return problems


@pytest.mark.timeout(180)
def test_a_queued_run_killed_between_its_take_and_its_start_ends_lost(
    proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """Run X (``queue`` policy, sent to the victim) parks behind holder H (survivor): ``QUEUED``.
    H ends: its release hands X the key and sends X's message to the victim, whose ACQUIRE adopts
    the slot on the server; the reply is held, and the victim is SIGKILLed before X starts. Nobody
    uses the key afterwards. X ends FAILURE with RunLost within the lease TTL + 10 s of the kill
    (fair-start: X entered the started index with a provisional member right before its take;
    before that fix it stayed ``QUEUED`` for ever). Its body never ran; the key is left free."""
    victim, survivor = start_pair(workers, queue, proxy)
    task, key, x_id = chaos.win_queue, "take-queued", str(uuid.uuid4())
    rendered = task.render_key(key, 1, SHORT)
    go = f"go:{uuid.uuid4().hex[:8]}"
    holder = task.apply_async((key, 0, 60.0), {"until": go}, queue=survivor.queue)  # type: ignore[attr-defined]
    wait_for(lambda: ran(chaos, holder.id), timeout=30)
    # its take of the key handed to it (the ACQUIRE of its first delivery carries no handoff token)
    rule = proxy.add_rule(stall_reply(STALL), script=SOURCE["ACQUIRE"], times=1,
                          where=handed_take(x_id, rendered))
    x = task.apply_async((key, 1, SHORT), queue=victim.queue, task_id=x_id)  # type: ignore[attr-defined]
    wait_for(lambda: parked(x) and task.store.handoff.queued(rendered) == 1, timeout=30)
    released = time.time()
    chaos.recorder.set(go, "1")
    holder_case = Case("holder H", holder, released)
    await_fault(rule, f"ACQUIRE of the handed run {x_id}", 30.0, victim, survivor)
    wait_for(lambda: ended(holder_case), timeout=10, interval=0.05)
    members = started_members(task, x_id)
    in_window = (took_slot(task, rendered, 1, x_id) and x.state == "QUEUED" and not ran(chaos, x_id)
                 and not any(slot >= 0 for _, slot in members))
    assert in_window, f"not between the take and the start: record {task.store.holder_record(rendered)}," \
                      f" state {x.state}, started index {members}"
    fault_at, _ = kill(chaos, victim, survivor)

    case = Case("X (handed the key)", x, fault_at, work=0.0, bound=TAKE_BOUND)
    wait_terminal([case], fault_at + TAKE_BOUND + 10.0)
    problems = lost_case(chaos, case, x_id)
    problems += verdicts(chaos, [holder_case], lost_ok=False)

    def left() -> list[str]:
        found = [f"{rendered} still held"] if task.store.holder_record(rendered).token else []
        if task.store.handoff.queued(rendered):
            found.append(f"{task.store.handoff.queued(rendered)} run(s) still parked on {rendered}")
        if case.ended is not None and started_members(task, x_id):
            found.append(f"the started index still names X: {started_members(task, x_id)}")
        return found

    problems += settle_leftovers(left)
    lost_lines = log_lines(survivor, x_id)
    if problems:
        problems.append(f"survivor's log: {lost_lines}")
    report(figures, "kill between the take of a handed key and the start (queue):", [case, holder_case],
           chaos, problems, window="take-queue", started_index_at_kill=members, lost_log=lost_lines[-1:])


@pytest.mark.timeout(180)
def test_a_fair_run_killed_between_its_gate_take_and_its_start_ends_lost_and_frees_its_slot(
    proxy: FaultProxy, chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """Holder A (victim) and holder B (survivor) hold the gate's two slots; run X (a third tenant)
    is parked at the gate by the survivor. A ends: its release hands its slot to X through the
    victim's own queue; X's take of the gate (ACQUIRE adopting the slot) runs on the server, the
    reply is held, and the victim is SIGKILLed before X starts; B ends at once, and nobody uses the
    gate afterwards. X ends FAILURE with RunLost within the lease TTL + 10 s of the kill (its
    provisional member for the gate; before the fix it stayed ``QUEUED`` for ever), its body never
    ran, and the gate's slots are both free again: two new runs then start at once."""
    victim, survivor = start_pair(workers, queue, proxy)
    fair = Fair(chaos, "take-fair", [])
    gate = fair.task.fair_status().gate
    go_a, go_b = f"go:a:{uuid.uuid4().hex[:6]}", f"go:b:{uuid.uuid4().hex[:6]}"
    a = fair.send(0, "tenant-a", victim.queue, until=go_a)  # type: ignore[attr-defined]
    b = fair.send(1, "tenant-b", survivor.queue, until=go_b)  # type: ignore[attr-defined]
    wait_for(lambda: fair.started(a) and fair.started(b), timeout=30)
    x_id = str(uuid.uuid4())
    rule = proxy.add_rule(stall_reply(STALL), script=SOURCE["ACQUIRE"], times=1,
                          where=handed_take(x_id, gate))
    x = fair.send(2, "tenant-c", survivor.queue, task_id=x_id)  # type: ignore[attr-defined]
    wait_for(lambda: parked(x) and [w.task_id for w in fair.task.fair_status().waiting] == [x_id], timeout=20)
    holder_a = Case("holder A", a, time.time())
    chaos.recorder.set(go_a, "1")
    await_fault(rule, f"gate take of the fair run {x_id}", 30.0, victim, survivor)
    wait_for(lambda: ended(holder_a), timeout=10, interval=0.05)
    members = started_members(fair.task, x_id)
    in_window = (took_slot(fair.task, gate, GATE_SLOTS, x_id) and x.state == "QUEUED"
                 and not fair.started(x) and not any(slot >= 0 for _, slot in members))
    assert in_window, f"not between the gate take and the start: gate {fair.task.fair_status()}," \
                      f" state {x.state}, started index {members}"
    fault_at, deaths = kill(chaos, victim, survivor)
    released_b = time.time()
    chaos.recorder.set(go_b, "1")

    case = Case("X (handed a slot)", x, fault_at, work=0.0, bound=TAKE_BOUND)
    fair.cases = [case, holder_a, Case("holder B", b, released_b)]
    wait_terminal(fair.cases, fault_at + TAKE_BOUND + 10.0)
    problems = lost_case(chaos, case, x_id)
    problems += verdicts(chaos, fair.cases[1:], lost_ok=False)
    problems += settle_leftovers(lambda: fair.leftovers([0, 1, 2]) + (
        [f"the started index still names X: {started_members(fair.task, x_id)}"]
        if case.ended is not None and started_members(fair.task, x_id) else []))
    # both slots free: two new runs (two tenants) are in their bodies at once
    both_at = None
    if case.ended is not None:
        go_c = f"go:c:{uuid.uuid4().hex[:6]}"
        fresh = [fair.send(3 + i, tenant, survivor.queue, until=go_c)  # type: ignore[attr-defined]
                 for i, tenant in enumerate(("tenant-a", "tenant-b"))]
        try:
            wait_for(lambda: all(fair.started(r) for r in fresh), timeout=BOUND)
            both_at = time.time()
        except AssertionError:
            problems.append(f"two new runs did not both start: gate {fair.task.fair_status()}")
        chaos.recorder.set(go_c, "1")
        wait_for(lambda: all(r.ready() for r in fresh), timeout=30)
        problems += [f"new run {r.id} ended {r.state}" for r in fresh if r.state != "SUCCESS"]
    most = fair.at_once(deaths)
    if most > GATE_SLOTS:
        problems.append(f"{most} fair runs in their bodies at once (fair_concurrency={GATE_SLOTS})")
    lost_lines = log_lines(survivor, x_id)
    if problems:
        problems.append(f"survivor's log: {lost_lines}")
    report(figures, "kill between the gate take of a handed fair slot and the start:", fair.cases, chaos,
           problems, window="take-fair", started_index_at_kill=members, at_once=most,
           both_slots_taken_after_kill_s=round3(None if both_at is None else both_at - fault_at),
           lost_log=lost_lines[-1:])
