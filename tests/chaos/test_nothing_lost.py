"""Nothing waiting is lost: every policy that makes runs wait, against four faults.

Policies (the ``chaos.nl_*`` tasks, one key each): ``queue``, ``queue`` with ``ordered=True``,
``max_concurrency=2`` with ``queue``, ``coalesce``, ``supersede`` (grace 2 s), ``debounce`` (1 s,
max wait 3 s), ``key_rate_limit="4/s"`` and fair share (``fair_concurrency=2``, three tenants:
two runs hold the gate's slots, six wait parked at the gate by the waiting worker's main process;
each run has a lock key of its own, so only the gate limits them). In each scenario every policy
first has a run holding its key and runs waiting for it (parked or pending in Redis, or delayed
as countdown messages), then one fault comes, the same for all:

- ``holders-worker``: the worker running every holder SIGKILLed (its whole process group);
- ``waiting-worker``: the worker holding the waiting runs SIGKILLed: its pool parked the parked
  and pending runs, its main process holds the countdown messages of debounce and the rate limit
  (and parked the fair runs at their gate);
- ``redis-empty``: the lease Redis SIGKILLed and back on its port ``OUTAGE`` later, empty;
- ``redis-aof``: the same, back from its AOF (``appendfsync always``).

Two prefork workers, each its own process group; TTL 3 s; Celery's default (early) acks and the
Redis broker's default visibility timeout (an hour: a dead worker's reserved messages do not come
back within the test). The holders' worker has one process per holder; the other has 2. Each
message goes to the queue of the worker that must take it; once a worker is killed the other
consumes its queue too, as workers sharing a queue do.

Each scenario checks every policy: all its AsyncResults terminal within the bound after the fault,
the work it promises done, no overlap beyond its concurrency, no key held at the end; it prints a
table of figures (``-s``) and fails naming every cell that broke and what was seen.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.result import AsyncResult

import celery_singleflight as sf
from celery_singleflight import constants
from celery_singleflight.protocol.delayed import DELAYED
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import Workers, interval_overlaps, max_at_once, overlaps, round3, runs, wait_for

pytestmark = pytest.mark.worker

TTL = 3.0  # the chaos app's lock_ttl
SWEEP = 1.0  # the sweeper's interval
GRACE = 2.0  # the policies' own grace: supersede_grace and order_timeout of the tasks
OUTAGE = 2.0  # how long the lease Redis is away
# Every AsyncResult must be terminal this long after the fault. TTL + sweep + grace (6 s) is the
# expected worst for a waiting run, then the bodies of the runs behind it; the rest is room for a
# loaded CI machine. The empty Redis adds the outage and the fail_closed re-sends meanwhile.
BOUND = {"holders-worker": 20.0, "waiting-worker": 20.0, "redis-empty": 25.0, "redis-aof": 20.0}
HOLD = 60.0  # the most a holder's body takes: it holds its key until the scenario opens HOLDERS_GO
HOLDERS_GO = "go:holders"  # a recorder key: once it exists the holders (and a burst's leader) end
SHORT = 0.1  # a waiting run's body
RATE_INTERVAL = 0.25  # key_rate_limit="4/s"
RATE_TOLERANCE = 0.05  # the broker's countdown timers on a busy machine
DEBOUNCE_MAX_WAIT = 3.0
DEBOUNCE_BOUND = DEBOUNCE_MAX_WAIT + GRACE  # a burst's run starts at most this long after its first call
HOLDER_PROCS = 10  # one per holder: queue, ordered, 2 x max_concurrency, coalesce, supersede, rate, debounce,
# 2 x fair share
WAITING_PROCS = 2
KEY = "k"

#: policy -> (task of the chaos app, max_concurrency)
POLICIES: dict[str, tuple[str, int]] = {
    "queue": ("nl_queue", 1),
    "ordered": ("nl_ordered", 1),
    "max_concurrency=2": ("nl_limited", 2),
    "coalesce": ("nl_coalesce", 1),
    "supersede": ("nl_supersede", 1),
    "debounce": ("nl_debounce", 1),
    "rate limit": ("nl_rate", 8),
    "fair share": ("nl_fair", 2),
}
FAIR_TENANTS = ("tenant-a", "tenant-b", "tenant-c")
FAIR_WAITING = 6  # parked at the gate, two per tenant
FAULTS = ["holders-worker", "waiting-worker", "redis-empty", "redis-aof"]


@dataclass
class Call:
    """One ``apply_async``: its argument ``n``, its role, the key argument and when it was sent."""

    n: int
    role: str  # "holder" (runs at once, holds its key), "waiting", "follower" (a debounced call)
    result: AsyncResult
    key: str
    sent: float


@dataclass
class Matrix:
    """Every policy's calls of one scenario, sent to the holders' queue or the waiting one."""

    chaos: ModuleType
    holders_q: str
    waiting_q: str
    calls: dict[str, list[Call]] = field(default_factory=lambda: {p: [] for p in POLICIES})

    def task(self, policy: str) -> Any:
        return getattr(self.chaos, POLICIES[policy][0])

    def send(self, policy: str, n: int, role: str, seconds: float = SHORT, key: str = KEY,
             **kwargs: Any) -> Call:
        queue = self.holders_q if role == "holder" else self.waiting_q
        if role in ("holder", "follower"):  # a follower's arguments are the ones its leader runs with
            kwargs["until"] = HOLDERS_GO
        sent = time.time()
        call = Call(n, role, self.task(policy).apply_async((key, n, seconds), kwargs, queue=queue), key, sent)
        self.calls[policy].append(call)
        return call

    def results(self) -> list[AsyncResult]:
        return [c.result for calls in self.calls.values() for c in calls]

    def started(self, *calls: Call) -> bool:
        ids = {r["task_id"] for r in runs(self.chaos)}
        return all(c.result.id in ids for c in calls)


def parked(call: Call) -> bool:
    return call.result.state == "QUEUED" or call.result.ready()


def noted_or_ran(task: Any, call: Call) -> bool:
    """A delayed run's copy is noted as held by a worker (``TOUCH``), or the run started or ended."""
    if call.result.ready():
        return True
    ctx = task.store.ctx
    raw = ctx.client.hget(ctx.layout.key(DELAYED, task.render_key(call.key, call.n, SHORT)), call.result.id)
    entry = json.loads(raw) if raw is not None else {}
    return "w" in entry or "c" in entry


def load(m: Matrix) -> None:
    """Bring every policy to its state at the fault: a holder running in the holders' worker and
    runs waiting in the other one (parked there, or delayed as its countdown messages)."""
    holders = [m.send(p, 0, "holder", HOLD) for p in POLICIES if p not in ("debounce", "fair share")]
    holders.append(m.send("max_concurrency=2", 1, "holder", HOLD))
    # fair share: both slots of the gate held, by two tenants
    holders += [m.send("fair share", n, "holder", HOLD, tenant=FAIR_TENANTS[n]) for n in (0, 1)]
    # debounce burst 1: its first call's message runs (with the last call's arguments) in the
    # holders' worker and holds its key across the fault; the two others fold into it
    leader = m.send("debounce", 0, "holder", HOLD, key="b1")
    for n in (1, 2):
        time.sleep(0.1)  # the burst's shape: calls 0.1 s apart (debounce 1 s), not a wait
        m.send("debounce", n, "follower", HOLD, key="b1")
    wait_for(lambda: m.started(*holders), timeout=60)

    waiting = [m.send("queue", n, "waiting") for n in (1, 2, 3)]
    waiting += [m.send("ordered", n, "waiting") for n in (1, 2, 3, 4)]
    waiting += [m.send("max_concurrency=2", n, "waiting") for n in (2, 3, 4, 5)]
    waiting += [m.send("coalesce", n, "waiting") for n in (1, 2, 3)]
    # parked at the gate by the waiting worker's main process as their messages arrive
    waiting += [m.send("fair share", n, "waiting", tenant=FAIR_TENANTS[n % 3])
                for n in range(2, 2 + FAIR_WAITING)]
    wait_for(lambda: all(parked(c) for c in waiting), timeout=60)
    followers = [c for c in m.calls["debounce"] if c.role == "follower"]
    wait_for(lambda: m.started(leader) and all(c.result.ready() for c in followers), timeout=60)

    # last, what must still be delayed or in its grace when the fault comes: 8 rate-limited runs
    # (cells 0.25 s apart), supersede (grace 2 s), then debounce burst 2 (due 1 s after its last
    # call: sent after the waits below, which a loaded machine can make longer than that)
    rate_first = m.send("rate limit", 1, "waiting")  # starts at once: the holder's cell is long past
    for n in range(2, 9):
        m.send("rate limit", n, "waiting")
    superseding = [m.send("supersede", n, "waiting") for n in (1, 2, 3)]
    wait_for(lambda: rate_first.result.ready() and all(parked(c) for c in superseding), timeout=10)
    # the worker holds the rate-limited runs' countdown messages and has noted so: its death then
    # frees their copies once it is seen gone (tests/chaos/test_waiting_windows.py: unnoted ones)
    rate = m.task("rate limit")
    delayed = [c for c in m.calls["rate limit"] if c.role == "waiting" and c is not rate_first]
    wait_for(lambda: all(noted_or_ran(rate, c) for c in delayed), timeout=10)
    for n in (10, 11, 12):
        m.send("debounce", n, "waiting", key="b2")
        time.sleep(0.2)  # the burst's calls, 0.2 s apart (debounce 1 s): one burst


class Terminal:
    """When each result was first seen terminal."""

    def __init__(self, results: list[AsyncResult]) -> None:
        self.results = results
        self.at: dict[str, float] = {}

    def poll(self) -> None:
        for result in self.results:
            if result.id not in self.at and result.ready():
                self.at[result.id] = time.time()

    def wait(self, deadline: float, optional: set[str]) -> None:
        """Until every result but the ``optional`` ones is terminal, or ``deadline``."""
        needed = [r.id for r in self.results if r.id not in optional]
        while True:
            self.poll()
            if all(i in self.at for i in needed) or time.time() > deadline:
                return
            time.sleep(0.1)


def may_stay_pending(fault: str, policy: str, call: Call) -> bool:
    """A killed holder that never waited, on a key no run was parked on (the rate limit's first
    run), is Celery's own at-most-once delivery: it may stay PENDING (see :func:`check_cell`)."""
    return fault == "holders-worker" and policy == "rate limit" and call.role == "holder"


# -- faults ----------------------------------------------------------------------------------------


def kill_worker(chaos: ModuleType, victim: WorkerProcess, survivor: WorkerProcess) -> dict[int, float]:
    """SIGKILL ``victim``'s process group; ``survivor`` then consumes its queue too. Returns the
    dead pool processes (pid -> time of death)."""
    children = victim.children()
    at = time.time()
    victim.kill()
    queue: str = victim.queue  # type: ignore[attr-defined]
    told = chaos.app.control.add_consumer(queue, destination=[survivor.hostname], reply=True, timeout=5)
    assert told, f"{survivor.hostname} did not answer add_consumer"
    return dict.fromkeys(children, at)


def holders_decided(m: Matrix, back: float) -> bool:
    """Each holder's lease met the outage's end: its run ended (it saw its lease lost, or was
    revoked), or it renewed its lease after Redis was back (at ``back``): nothing more can be seen
    of it while it holds."""
    ended = {r["task_id"] for r in runs(m.chaos) if r["end"] is not None}
    for policy, calls in m.calls.items():
        task = m.task(policy)
        slots = 1 if policy == "fair share" else POLICIES[policy][1]  # a fair run's own lock key
        for c in calls:
            if c.role != "holder" or c.result.ready() or c.result.id in ended:
                continue
            records = [task.store.record(task.render_key(c.key, c.n), slot) for slot in range(slots)]
            if not any(r.task_id == c.result.id and r.token and (r.deadline or 0) > (back + TTL) * 1000
                       for r in records):
                return False
    return True


def redis_outage(server: RedisServer, meanwhile: Callable[[], None]) -> None:
    """SIGKILL ``server``; start it again on its port ``OUTAGE`` later (from its AOF if it has one)."""
    server.kill()
    back = time.time() + OUTAGE
    try:
        while time.time() < back:
            meanwhile()
            time.sleep(0.05)
    finally:
        server.start()


@contextlib.contextmanager
def appendonly(server: RedisServer, where: Path) -> Iterator[None]:
    """``server`` restarted on its port with an AOF fsynced at every write (in ``where``); plain
    and empty again afterwards."""
    plain = list(server.extra)
    where.mkdir()
    server.kill()
    server.extra = [*plain, "--appendonly", "yes", "--appendfsync", "always", "--dir", str(where)]
    server.start()
    try:
        got = server.client().config_get("append*")
        assert (got["appendonly"], got["appendfsync"]) == ("yes", "always")
        yield
    finally:
        server.kill()
        server.extra = plain
        server.start()


# -- what each policy promises -----------------------------------------------------------------------


def ran(key_runs: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    return [r for r in key_runs if r["n"] == str(n)]


def once_each(calls: list[Call], key_runs: list[dict[str, Any]], deaths: dict[int, float]) -> list[str]:
    """Every call's body started exactly once; every waiting call ended SUCCESS with its ``n``, or,
    if the kill cut its body (it never ended, in a process killed), FAILURE with RunLost: a run lost
    with its worker (a rate-limited run whose cell came just before the kill)."""
    found = []
    for c in calls:
        if len(ran(key_runs, c.n)) != 1:
            found.append(f"{c.role} {c.n} ran {len(ran(key_runs, c.n))} times")
        elif c.role == "waiting" and not (c.result.state == "SUCCESS" and c.result.result == c.n):
            run = ran(key_runs, c.n)[0]
            cut = run["end"] is None and int(run["pid"]) in deaths
            if not (cut and c.result.state == "FAILURE" and isinstance(c.result.result, sf.RunLost)):
                found.append(f"waiting {c.n} ended {c.result.state} {c.result.result!r}")
    return found


def last_sent_ran_last(calls: list[Call], key_runs: list[dict[str, Any]], replaced: Callable[[Call], bool]
                       ) -> list[str]:
    """coalesce, supersede: the last-sent run ran once, after every other run of the key; the runs
    it replaced never ran and ended as ``replaced`` says."""
    found = []
    last = max((c for c in calls if c.role == "waiting"), key=lambda c: c.sent)
    if len(ran(key_runs, last.n)) != 1:
        found.append(f"the last sent ({last.n}) ran {len(ran(key_runs, last.n))} times")
    elif key_runs[-1]["n"] != str(last.n):
        found.append(f"the last sent ({last.n}) ran before {key_runs[-1]['n']}")
    if not (last.result.state == "SUCCESS" and last.result.result == last.n):
        found.append(f"the last sent ({last.n}) ended {last.result.state} {last.result.result!r}")
    for c in calls:
        if c.role == "waiting" and c is not last:
            if ran(key_runs, c.n):
                found.append(f"replaced {c.n} ran")
            if not replaced(c):
                found.append(f"replaced {c.n} ended {c.result.state} {c.result.result!r}")
    return found


def bursts(calls: list[Call], all_runs: list[dict[str, Any]], bound: float,
           after: tuple[float, float] | None = None, deaths: dict[int, float] | None = None
           ) -> tuple[list[str], float | None]:
    """debounce: one run per burst, with its last call's argument, within ``bound`` of its first
    call, or else within ``after[1]`` of the time ``after[0]`` (the death of the worker holding
    its countdown message: its copy goes out once that worker is seen gone); the other calls of
    the burst end SUCCESS, debounced into that run. A run whose body the kill cut (it never ended,
    in a process in ``deaths``) may end FAILURE with RunLost: lost with its worker."""
    found, worst = [], None
    for key in ("b1", "b2"):
        burst = [c for c in calls if c.key == key]
        key_runs = [r for r in all_runs if r["key"] == f"nl:d:{key}"]
        if len(key_runs) != 1:
            found.append(f"burst {key}: {len(key_runs)} runs")
            continue
        run, first, last = key_runs[0], burst[0], burst[-1]
        waited = run["start"] - first.sent
        worst = waited if worst is None else max(worst, waited)
        if run["n"] != str(last.n):
            found.append(f"burst {key} ran with {run['n']}, not its last call's {last.n}")
        if waited > bound and not (after is not None and run["start"] - after[0] <= after[1]):
            found.append(f"burst {key} ran {waited:.2f} s after its first call")
        for c in burst:
            if c.result.id == run["task_id"]:
                cut = run["end"] is None and int(run["pid"]) in (deaths or {})
                lost = cut and c.result.state == "FAILURE" and isinstance(c.result.result, sf.RunLost)
                if c.role == "waiting" and not (c.result.state == "SUCCESS" and c.result.result == last.n) \
                        and not lost:
                    found.append(f"burst {key}: its run ended {c.result.state} {c.result.result!r}")
            elif not (c.result.state == "SUCCESS" and sf.is_debounced(c.result.result)
                      and c.result.result["into"] == run["task_id"]):
                found.append(f"burst {key}: call {c.n} ended {c.result.state} {c.result.result!r}")
    return found, worst


def spaced(key_runs: list[dict[str, Any]]) -> tuple[list[str], float | None]:
    """The rate holds when the cells the runs were given are an interval apart and no run started
    before its cell. Two starts may be closer than an interval when a busy machine's countdown
    timer started the first one late: that does not break the rate (a fresh-clone run under load
    saw two starts 0.126 s apart, cells 0.25 s apart). Returns the problems and the closest starts."""
    starts = sorted(r["start"] for r in key_runs)
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    closest = min(gaps) if gaps else None
    found = [f"run {r['n']} has no cell recorded" for r in key_runs if not r.get("planned")]
    cells = sorted(float(r["planned"]) for r in key_runs if r.get("planned"))
    cell_gaps = [b - a for a, b in itertools.pairwise(cells)]
    if cell_gaps and min(cell_gaps) < RATE_INTERVAL - 0.001:
        found.append(f"two cells {min(cell_gaps):.3f} s apart (interval {RATE_INTERVAL} s)")
    found += [f"run {r['n']} started {float(r['planned']) - r['start']:.3f} s before its cell"
              for r in key_runs if r.get("planned") and r["start"] < float(r["planned"]) - RATE_TOLERANCE]
    return found, closest


def within_late_bound(key_runs: list[dict[str, Any]]) -> list[str]:
    """After an outage, runs whose cells fell in its last RATE_LATE seconds start when Redis is
    back, beside the next cell's: any window of 1 s holds at most rate x (1 s + RATE_LATE) + burst
    starts (docs/time-policies.md)."""
    starts = sorted(r["start"] for r in key_runs)
    rate = 1 / RATE_INTERVAL
    most = max((sum(1 for t in starts if a <= t < a + 1.0) for a in starts), default=0)
    allowed = int(rate * (1.0 + constants.RATE_LATE)) + 1
    return [] if most <= allowed else [f"{most} starts in 1 s (at most {allowed} after an outage)"]


def superseded(c: Call) -> bool:
    return c.result.state == "FAILURE" and type(c.result.result).__name__ == "Superseded"


def coalesced(c: Call) -> bool:
    return c.result.state == "SUCCESS" and sf.is_coalesced(c.result.result)


def check_cell(policy: str, m: Matrix, terminal: Terminal, fault_at: float, deaths: dict[int, float],
               waiting_at_fault: int, fault: str) -> dict[str, Any]:
    """The cell's figures, with ``problems`` (empty when the policy kept every promise).

    What the docs state as the limits of a fault is allowed, and nothing more:

    - a killed holder that never waited, on a key no run was parked on (the rate limit's first run),
      is Celery's own at-most-once delivery: it may stay PENDING (the others end FAILURE, RunLost);
    - after the lease Redis was away, rate-limited runs whose cells fell in its last second start
      together when it is back (at most rate x 2 s + burst in any second);
    - a lease Redis back empty has lost the rate limit's state (spacing starts afresh) and the
      lease of a holder still running: a run may start while that holder finishes (its fenced
      writes are refused), so runs that started before the fault are left out of the overlap
      checks.
    """
    bound = BOUND[fault]
    task, slots = m.task(policy), POLICIES[policy][1]
    calls = m.calls[policy]
    if policy == "debounce":
        keys = [task.render_key("b1", 0), task.render_key("b2", 0)]
    elif policy == "fair share":  # each run's own lock key: the recorder counts them by this prefix
        keys = [task.render_key(KEY, 0).rsplit(":", 1)[0] + ":"]
    else:
        keys = [task.render_key(KEY, 0)]
    all_runs = [r for r in runs(m.chaos) if r["name"] == task.name]
    key_runs = sorted(all_runs, key=lambda r: r["start"])
    problems: list[str] = [] if waiting_at_fault else ["nothing waited at the fault (the load came late)"]
    extra: dict[str, Any] = {}

    # the wait does not wait for a run that may stay PENDING: if it ended meanwhile, it is in time
    late = [c for c in calls if c.result.id not in terminal.at and not (
        may_stay_pending(fault, policy, c) and (c.result.state == "PENDING" or c.result.ready()))]
    if late:
        problems.append(f"not terminal {bound:.0f} s after the fault: "
                        + ", ".join(f"{c.role} {c.n} {c.result.state}" for c in late))
    worst = max((terminal.at[c.result.id] - fault_at for c in calls if c.result.id in terminal.at),
                default=None)

    if policy in ("queue", "max_concurrency=2", "rate limit", "fair share"):
        problems += once_each(calls, key_runs, deaths)
    elif policy == "ordered":
        problems += once_each(calls, key_runs, deaths)
        order = [int(r["n"]) for r in key_runs]
        # back empty, the sequence numbers went with the data: recovered runs go by arrival (as
        # docs/guarantees.md says; a fresh-clone run saw [0, 1, 2, 4, 3])
        if order != sorted(order) and fault != "redis-empty":
            problems.append(f"started in the order {order}")
    elif policy in ("coalesce", "supersede"):
        if len(ran(key_runs, 0)) != 1:
            problems.append(f"holder 0 ran {len(ran(key_runs, 0))} times")
        problems += last_sent_ran_last(calls, key_runs, coalesced if policy == "coalesce" else superseded)
    elif policy == "debounce":
        # back empty, a burst is recorded again when its messages come, a debounce and a grace
        # later than the outage ended: its first call's time is gone with the data
        debounce_bound = DEBOUNCE_BOUND + (OUTAGE + 1.0 if fault == "redis-empty" else 0.0)
        # its countdown message's worker killed: the copy goes out once the worker is seen gone, at
        # the next sweep (on a loaded machine that can end past the first bound)
        after = (fault_at, constants.WORKER_GONE_AFTER + SWEEP + GRACE) if fault == "waiting-worker" else None
        found, extra["debounce_worst_wait_s"] = bursts(calls, key_runs, debounce_bound, after, deaths)
        problems += found
    if policy == "rate limit":
        found, extra["rate_closest_starts_s"] = spaced(key_runs)
        if fault in ("holders-worker", "waiting-worker"):
            problems += found
        elif fault == "redis-aof":
            problems += within_late_bound(key_runs)

    checked = key_runs if fault != "redis-empty" else [r for r in key_runs if r["start"] >= fault_at]
    seen = [o for o in overlaps(m.chaos) if o["run"]["name"] == task.name
            and (fault != "redis-empty" or float(o["other"].get("start", 0)) >= fault_at)]
    if seen:
        problems.append(f"{len(seen)} overlaps in the recorder")
    crossed = interval_overlaps(checked, deaths)
    if crossed:
        problems.append("overlapping runs: " + "; ".join(crossed))
    # back empty, a holder whose lease went with the data may overlap new runs until its lease
    # clock runs out (documented; fenced writes stay ordered): counted among the runs after the fault
    most = max(max_at_once([r for r in checked if r["key"].startswith(k)], deaths) for k in keys)
    if most > slots:
        problems.append(f"{most} runs at once (max_concurrency={slots})")

    def held() -> list[str]:
        if policy == "fair share":
            return fair_held(task, calls)
        found = []
        for key in keys:
            if sf.status_all(m.chaos.app, key, slots=slots):
                found.append(f"{key} held")
            st = sf.status(m.chaos.app, key)
            if st is not None and st.queued:
                found.append(f"{key} has {st.queued} parked")
        return found

    with contextlib.suppress(AssertionError):  # a release may land just after its result
        wait_for(lambda: not held(), timeout=2)
    problems += held()
    return {
        "waiting_at_fault": waiting_at_fault,
        "worst_terminal_s": round3(worst),
        "not_terminal": len(late),
        "runs": len(key_runs),
        "max_at_once": most,
        **{k: round3(v) for k, v in extra.items()},
        "problems": problems,
    }


def fair_held(task: Any, calls: list[Call]) -> list[str]:
    """A fair task's gate slots held or runs left parked at it, and its runs' lock keys held."""
    gate = task.fair_status()
    found = [f"{gate.gate} slot {r.slot} held by {r.task_id}" for r in gate.running]
    if gate.waiting:
        found.append(f"{gate.gate} has {len(gate.waiting)} parked")
    found += [f"{task.render_key(c.key, c.n)} held" for c in calls
              if task.store.holder_record(task.render_key(c.key, c.n)).token]
    return found


def table(fault: str, cells: dict[str, dict[str, Any]]) -> str:
    head = f"{'policy':<18} {'waiting':>7} {'worst s':>8} {'not end':>7} {'runs':>4} {'at once':>7}  verdict"
    rows = [f"fault {fault}:", head]
    for policy, cell in cells.items():
        verdict = "ok" if not cell["problems"] else "FAIL: " + " | ".join(cell["problems"])
        worst = "-" if cell["worst_terminal_s"] is None else f"{cell['worst_terminal_s']:.2f}"
        rows.append(f"{policy:<18} {cell['waiting_at_fault']:>7} {worst:>8} {cell['not_terminal']:>7}"
                    f" {cell['runs']:>4} {cell['max_at_once']:>7}  {verdict}")
    return "\n".join(rows)


# inherent: two workers' start, then the recovery's own clock after the fault (TTL 3 s, a sweep
# each second, grace 2 s, a dead worker seen gone after WORKER_GONE_AFTER)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault", FAULTS)
def test_nothing_waiting_is_lost(
    fault: str, chaos: ModuleType, workers: Workers, queue: str, lease_redis: RedisServer,
    figures: dict[str, Any], tmp_path: Path,
) -> None:
    with contextlib.ExitStack() as stack:
        if fault == "redis-aof":
            stack.enter_context(appendonly(lease_redis, tmp_path / "aof"))
        holders, waiting = workers.start(workers.make(f"{queue}-h", concurrency=HOLDER_PROCS),
                                         workers.make(f"{queue}-w", concurrency=WAITING_PROCS))
        m = Matrix(chaos, f"{queue}-h", f"{queue}-w")
        load(m)
        terminal = Terminal(m.results())
        waiting_at_fault = {p: sum(1 for c in calls if c.role != "holder" and not c.result.ready())
                            for p, calls in m.calls.items()}
        fault_at = time.time()
        deaths: dict[int, float] = {}
        try:
            if fault == "holders-worker":
                deaths = kill_worker(chaos, holders, waiting)
            elif fault == "waiting-worker":
                deaths = kill_worker(chaos, waiting, holders)  # the holders release once it is dead
            else:
                redis_outage(lease_redis, terminal.poll)
                # the holders hold on until their leases met Redis back (lost, or renewed)
                back = time.time()
                with contextlib.suppress(AssertionError):  # what went wrong shows in the cells
                    wait_for(lambda: (terminal.poll(), holders_decided(m, back))[1], timeout=BOUND[fault],
                             interval=0.05)
        finally:
            chaos.recorder.set(HOLDERS_GO, 1)
        terminal.wait(fault_at + BOUND[fault], {c.result.id for p, calls in m.calls.items() for c in calls
                                                 if may_stay_pending(fault, p, c)})
        cells = {p: check_cell(p, m, terminal, fault_at, deaths, waiting_at_fault[p], fault)
                 for p in POLICIES}

    report = table(fault, cells)
    print("\n" + report)
    figures.update({"fault": fault, "ttl_s": TTL, "sweep_s": SWEEP, "bound_s": BOUND[fault],
                    "load_to_fault_s": round3(fault_at - m.calls["queue"][0].sent), **cells})
    m.calls.clear()  # the results go now, while their backend is up (a failed test's frame lives on)
    terminal.results.clear()
    assert not any(cell["problems"] for cell in cells.values()), report
