"""Fair share between tenants (``fair_key`` / ``fair_concurrency``) next to plain Celery, on real workers.

The scenario (from the issue): tenant A sends 2,000 tasks of 20 ms, then tenants B, C, D and E send
20 each. With plain Celery the light tenants' runs wait behind A's whole backlog (FIFO); with
``fair_key="<tenant>"`` and ``fair_concurrency=4`` at most 4 runs of the task run at once across
all workers, waiting runs are parked in Redis by the workers' main processes, and each freed slot
goes to the next tenant in round-robin order. The budget: the light tenants' p99 wait (sent ->
started) at least 20 x lower than plain Celery's, and A's total time within 10 % of plain Celery's.

Like for like: ``fair_concurrency=4`` allows 4 runs at once, so the plain Celery side runs the same
4 slots: two workers of ``--plain-procs`` (2) prefork processes each, while the fair side runs two
workers of ``--fair-procs`` (4) processes each with ``--fair-concurrency`` (4). Both sides use
``worker_prefetch_multiplier=1`` by default (``--plain-prefetch``, ``--fair-prefetch``; for plain
Celery the best case for fairness: a worker reserves at most one message per pool process), early
acks, results ignored, per-task log lines on (INFO). The plain side's workers do not load the
library's tasks at all (``SF_BENCH_SIDE=plain``): pure Celery.

Two cases, each measured for both sides:

1. ``unique``: every run its own lock key (``job:<tenant>-<n>``), the default ``on_duplicate``;
2. ``spread``: A's 2,000 runs spread over 200 lock keys (``acct:<n % 200>``, 10 runs per key), the
   light tenants' runs keep their own keys; ``on_duplicate="queue"``, so a run whose key is busy
   parks in that key's FIFO and runs later instead of being dropped as a duplicate (with the
   default policy some of A's runs would be lost by design). Plain Celery has no lock keys: its
   side of this case is the same workload as in case 1, run again so every fair measurement has a
   plain one next to it.

One measurement: start the side's two workers (``celery -A benchmarks.fairapp worker -P prefork
-c N --without-heartbeat --without-gossip --without-mingle -Q <own queue>``, a fresh pair each
time), wait until both answer a ping, run a few unmeasured warm-up tasks, purge the queue, then
send A's 2,000 messages (``--tasks``) and right after them the light tenants' 20 each
(``--light``; B, C, D, E interleaved), wait until every run has recorded itself, and stop the
workers by their PIDs (SIGTERM, then SIGKILL of their own process group if anything is left).
Every message carries ``sent`` (``time.time()`` just before it is published); every run records
``started`` (first statement of its body) and ``finished`` with one RPUSH to a recorder list (see
``fairapp.py``), so no result backend is involved. Each run is checked to have run exactly once.

Figures per measurement: the light tenants' wait p50 / p99 (sent -> started, 80 runs) and their
completion (last light run finished - first light run sent); A's total time (first A sent ->
last A finished); runs/s (all runs / (last finished - first sent)); A's share of the slots while
the light tenants wait (of the runs started between the first light send and the last light
start, the fraction that were A's: an even round-robin over 5 tenants gives 1/5, FIFO A's whole
remaining backlog and then the light runs, 96 % here); the
most runs seen running at once; the workers' CPU seconds per run (main and pool processes, from
the first measured send to the last record; psutil). For the fair side also where the light
tenants' wait goes: a run that waited was parked at the fair gate by a main process, and its
re-sent message carries when (the library's ``HEADER_FAIR_WAITED``), so sent -> parked (the broker
backlog ahead of it, drained by the main processes) and parked -> started (the fair queue) are
shown apart, with how long the main processes took to park every waiting run and how many runs
started meanwhile. Measurements are interleaved (per round and case: plain, then fair;
``--rounds``, default 2); the verdicts use the median over rounds of the paired ratios of the same
round and case (plain / fair for the wait, fair / plain for A's total time).

The fair-share options are new: if ``SingleFlightTask`` does not know them, or the fair side's
workers fail, the report says the fair side is not available and still prints the plain side
(``--write-docs`` then writes nothing).

Broker: RabbitMQ by default (``--broker amqp``, ``--amqp-url``; a queue of this run's own, deleted
at the end), or the Redis broker (``--broker redis``). Leases and the recorder live on a private
redis-server on a free loopback port (leases db 2, recorder db 3, Redis broker db 0), stopped
afterwards; with ``--redis-url`` that server and DB are used instead, every key written starts
with a unique prefix, and only keys under that prefix are deleted (nothing is flushed).

A report, not a test: the exit status is 0 whatever the verdicts.

    .venv/bin/python benchmarks/bench_fair.py [--tasks 2000] [--light 20] [--rounds 2]
        [--plain-procs 2] [--fair-procs 4] [--fair-concurrency 4] [--broker amqp|redis] [--write-docs]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import kombu
import redis
from kombu.utils.url import maybe_sanitize_url

from celery_singleflight.testing import WorkerProcess

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from benchutil import (  # noqa: E402
    IMAGES,
    delete_matching,
    import_app,
    machine,
    pyplot,
    redis_for,
    worker_problems,
    write_section,
)

WORKERS = 2
SLEEP = 0.02  # each run's body
LIGHT_TENANTS = ("B", "C", "D", "E")
SPREAD_KEYS = 200
BUDGET_WAIT_RATIO = 20.0  # light tenants' p99 wait: plain / fair at least this
BUDGET_TOTAL_RATIO = 1.10  # A's total time: fair / plain at most this
WARMUP_PER_SLOT = 3
CASES = ("unique", "spread")
CASE_TITLES = {
    "unique": "each run its own lock key",
    "spread": f"A's runs over {SPREAD_KEYS} lock keys (`on_duplicate=\"queue\"`)",
}


@dataclass
class Rec:
    tenant: str
    n: int
    sent: float
    start: float
    end: float
    pid: int
    parked: float | None = None  # fair side: when a main process parked it at the gate, if it waited


@dataclass
class Measurement:
    side: str  # "plain" or "fair"
    case: str
    round_no: int
    records: list[Rec] = field(default_factory=list)
    expected: int = 0
    lost: int = 0
    duplicated: int = 0
    cpu_s: float | None = None
    send_seconds: float = 0.0
    error: str | None = None
    figures: dict[str, float] = field(default_factory=dict)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear interpolation between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def most_at_once(recs: Sequence[Rec]) -> int:
    """The largest number of runs whose [start, end] intervals overlap."""
    events = sorted([(r.start, 1) for r in recs] + [(r.end, -1) for r in recs], key=lambda e: (e[0], e[1]))
    now = best = 0
    for _, step in events:
        now += step
        best = max(best, now)
    return best


def figures(recs: Sequence[Rec], slots: int) -> dict[str, float]:
    heavy = [r for r in recs if r.tenant == "A"]
    light = [r for r in recs if r.tenant != "A"]
    waits = [r.start - r.sent for r in light]
    first_light_sent = min(r.sent for r in light)
    last_light_start = max(r.start for r in light)
    window = [r for r in recs if first_light_sent <= r.start <= last_light_start]
    span = max(r.end for r in recs) - min(r.sent for r in recs)
    runs_per_s = len(recs) / span
    parked = [r for r in light if r.parked is not None]
    diagnostics = {}
    every_parked = [r.parked for r in recs if r.parked is not None]
    if every_parked:
        last_park = max(every_parked)
        diagnostics["backlog_parked"] = last_park - min(r.sent for r in recs)
        diagnostics["started_by_then"] = float(sum(r.start <= last_park for r in recs))
    if parked:
        diagnostics |= {
            "light_parked": len(parked) / len(light),
            "to_park_p50": percentile([r.parked - r.sent for r in parked], 50),
            "to_park_p99": percentile([r.parked - r.sent for r in parked], 99),
            "park_start_p50": percentile([r.start - r.parked for r in parked], 50),
            "park_start_p99": percentile([r.start - r.parked for r in parked], 99),
        }
    return {
        **diagnostics,
        "light_p50": percentile(waits, 50),
        "light_p99": percentile(waits, 99),
        "light_max": max(waits),
        "light_completion": max(r.end for r in light) - first_light_sent,
        "a_total": max(r.end for r in heavy) - min(r.sent for r in heavy),
        "a_wait_p50": percentile([r.start - r.sent for r in heavy], 50),
        "runs_per_s": runs_per_s,
        "a_share": sum(r.tenant == "A" for r in window) / len(window),
        "window_runs": float(len(window)),
        "at_once": float(most_at_once(recs)),
        "rr_floor": rr_floor(len(light), slots, runs_per_s),
    }


def rr_floor(light: int, slots: int, runs_per_s: float) -> float:
    """The least the last light run can wait under round robin, at ``runs_per_s`` on ``slots``
    slots: each light tenant's last run is its n-th, so n rounds of the 5 tenants (A's runs among
    them) start first, on ``slots`` slots at a time, each run taking ``slots / runs_per_s``."""
    per_tenant = light / len(LIGHT_TENANTS)
    starts = (len(LIGHT_TENANTS) + 1) * per_tenant
    return math.ceil(starts / slots) * slots / runs_per_s


def cpu_seconds(workers: Sequence[WorkerProcess]) -> float | None:
    """CPU seconds used so far by the workers' processes (main and pool)."""
    try:
        import psutil
    except ImportError:  # pragma: no cover - psutil is in the bench extra
        return None
    total = 0.0
    for worker in workers:
        if worker.proc is None:
            continue
        with contextlib.suppress(psutil.Error):
            main = psutil.Process(worker.proc.pid)
            for proc in [main, *main.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    times = proc.cpu_times()
                    total += times.user + times.system
    return total


class Bench:
    def __init__(self, args: argparse.Namespace, fa: ModuleType, env: dict[str, str],
                 leases: redis.Redis, private: bool) -> None:
        self.args = args
        self.fa = fa
        self.env = env
        self.leases = leases
        self.private = private
        self.recorder: redis.Redis = fa.recorder
        self.problems: list[str] = []

    # -- workers ---------------------------------------------------------------------------

    def start_workers(self, side: str, procs: int) -> list[WorkerProcess]:
        prefetch = self.args.plain_prefetch if side == "plain" else self.args.fair_prefetch
        env = {**self.env, "SF_BENCH_SIDE": side, "SF_BENCH_PREFETCH": str(prefetch)}
        workers = [
            WorkerProcess("benchmarks.fairapp", concurrency=procs, env=env, cwd=str(REPO),
                          loglevel=self.args.loglevel,
                          extra=["-Q", self.fa.QUEUE, "--without-heartbeat"])
            for _ in range(WORKERS)
        ]
        for worker in workers:  # WorkerProcess pins --prefetch-multiplier 1 on the command line
            at = worker.args.index("--prefetch-multiplier")
            worker.args[at + 1] = str(prefetch)
        errors: list[BaseException] = []

        def start(worker: WorkerProcess) -> None:
            try:
                worker.start()  # returns once its log says "ready."
            except BaseException as exc:  # noqa: BLE001 - re-raised below, in this thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(w,)) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            self.stop_workers(workers)
            raise RuntimeError(f"a worker did not start: {errors[0]}")
        names = {w.hostname for w in workers}
        deadline = time.monotonic() + 60
        while True:
            replies = self.fa.app.control.ping(destination=sorted(names), timeout=1.0)
            if names <= {name for reply in replies for name in reply}:
                return workers
            if time.monotonic() > deadline:
                self.stop_workers(workers)
                raise RuntimeError("the workers did not answer a ping within 60 s")

    def stop_workers(self, workers: Sequence[WorkerProcess]) -> None:
        for worker in workers:
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()  # SIGTERM to both first: warm shutdown in parallel
        for worker in workers:
            worker.stop(timeout=30)  # waits; SIGKILL of its own process group after 30 s
            worker.kill()
            self.problems.extend(f"[{worker.hostname}] {line}" for line in worker_problems(worker.log()))
            if self.args.keep_logs:
                print(f"  worker log kept at {worker.log_path}")
            else:
                worker.cleanup()

    def alive(self, workers: Sequence[WorkerProcess]) -> bool:
        return all(w.proc is not None and w.proc.poll() is None for w in workers)

    # -- sending and waiting ---------------------------------------------------------------

    def purge(self) -> int:
        with self.fa.app.connection_for_write() as conn:
            return int(self.fa.app.control.purge(connection=conn) or 0)

    def task_for(self, side: str, case: str) -> Any:
        if side == "plain":
            return self.fa.plain_job
        return self.fa.fair_unique if case == "unique" else self.fa.fair_spread

    def wait_records(self, run: str, expected: set[tuple[str, int]], workers: Sequence[WorkerProcess],
                     timeout: float, on_done: Callable[[], None] = lambda: None) -> list[Rec]:
        key = self.fa.record_key(run)
        deadline = time.monotonic() + timeout
        while True:
            if self.recorder.llen(key) >= len(expected):
                recs = self.read(key)
                if expected <= {(r.tenant, r.n) for r in recs}:
                    on_done()
                    time.sleep(1.0)  # a run that came twice would show within this
                    return self.read(key)
            if not self.alive(workers):
                raise RuntimeError("a worker exited")
            if time.monotonic() > deadline:
                got = self.read(key)
                missing = len(expected - {(r.tenant, r.n) for r in got})
                raise TimeoutError(f"{missing} of {len(expected)} runs not recorded within {timeout:g} s")
            time.sleep(0.05)

    def read(self, key: str) -> list[Rec]:
        out = []
        for raw in self.recorder.lrange(key, 0, -1):
            tenant, n, sent, start, end, pid, parked = raw.decode().split()
            out.append(Rec(tenant, int(n), float(sent), float(start), float(end), int(pid),
                           None if parked == "-" else float(parked)))
        return out

    def warm_up(self, task: Any, workers: Sequence[WorkerProcess], procs: int) -> None:
        run = f"warm-{uuid.uuid4().hex[:8]}"
        expected = set()
        for i in range(WARMUP_PER_SLOT * procs * WORKERS):
            task.apply_async(kwargs={"tenant": "W", "n": i, "lock": f"warm:{run}:{i}", "sent": time.time(),
                                     "run": run})
            expected.add(("W", i))
        self.wait_records(run, expected, workers, 60.0)
        self.recorder.delete(self.fa.record_key(run))

    def measure(self, side: str, case: str, round_no: int) -> Measurement:
        args = self.args
        m = Measurement(side, case, round_no)
        procs = args.plain_procs if side == "plain" else args.fair_procs
        task = self.task_for(side, case)
        run = f"{side}-{case}-{round_no}-{uuid.uuid4().hex[:6]}"
        expected = {("A", i) for i in range(args.tasks)}
        expected |= {(t, i) for t in LIGHT_TENANTS for i in range(args.light)}
        m.expected = len(expected)
        slots = min(WORKERS * procs, args.fair_concurrency if side == "fair" else WORKERS * procs)
        timeout = 60.0 + 6 * len(expected) * SLEEP / max(1, slots)
        workers: list[WorkerProcess] = []
        try:
            workers = self.start_workers(side, procs)
            self.warm_up(task, workers, procs)
            self.purge()
            cpu0 = cpu_seconds(workers)
            t0 = time.monotonic()
            with self.fa.app.producer_or_acquire() as producer:
                for i in range(args.tasks):
                    lock = f"acct:{i % SPREAD_KEYS}" if case == "spread" else f"job:A-{i}"
                    task.apply_async(kwargs={"tenant": "A", "n": i, "lock": lock, "sent": time.time(),
                                             "run": run}, producer=producer)
                for i in range(args.light):
                    for tenant in LIGHT_TENANTS:
                        task.apply_async(kwargs={"tenant": tenant, "n": i, "lock": f"job:{tenant}-{i}",
                                                 "sent": time.time(), "run": run}, producer=producer)
            m.send_seconds = time.monotonic() - t0
            cpu1: list[float | None] = [None]

            def done() -> None:
                cpu1[0] = cpu_seconds(workers)

            m.records = self.wait_records(run, expected, workers, timeout, on_done=done)
            if cpu0 is not None and cpu1[0] is not None:
                m.cpu_s = cpu1[0] - cpu0
        except Exception as exc:  # noqa: BLE001 - reported, and the fair side marked unavailable
            m.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(Exception):
                m.records = self.read(self.fa.record_key(run))
        finally:
            self.stop_workers(workers)
            with contextlib.suppress(Exception):
                self.purge()
            self.recorder.delete(self.fa.record_key(run))
            # the library's keys of this measurement (leases, parked runs, fair-share state)
            delete_matching(self.leases, f"{self.fa.PREFIX}:*")
        seen = Counter((r.tenant, r.n) for r in m.records)
        m.lost = len(expected - set(seen))
        m.duplicated = sum(c - 1 for c in seen.values() if c > 1)
        if m.error is None and m.records:
            m.figures = figures(m.records, slots)
        return m


# -- the report ------------------------------------------------------------------------------


def _median(ms: Sequence[Measurement], key: str) -> float | None:
    values = [m.figures[key] for m in ms if key in m.figures]
    return statistics.median(values) if values else None


def paired(plain: Sequence[Measurement], fair: Sequence[Measurement], key: str,
           fair_over_plain: bool) -> tuple[float, float, float] | None:
    """Median, lowest and highest of the per-round ratios (fair/plain or plain/fair)."""
    by_round = {m.round_no: m for m in plain if m.figures}
    ratios = []
    for f in fair:
        p = by_round.get(f.round_no)
        if p is None or not f.figures or not p.figures.get(key) or not f.figures.get(key):
            continue
        ratios.append(f.figures[key] / p.figures[key] if fair_over_plain else p.figures[key] / f.figures[key])
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


def _best_ratio(plain: Sequence[Measurement]) -> str:
    """Plain Celery's light p99 over its round-robin floor: the most a fair scheduler could gain
    without running each slot faster than plain Celery does."""
    ratios = [m.figures["light_p99"] / m.figures["rr_floor"] for m in plain
              if m.figures.get("rr_floor") and m.figures.get("light_p99")]
    return f"{statistics.median(ratios):.1f} x at best" if ratios else "—"


def _ratio_text(got: tuple[float, float, float] | None, rounds: int) -> str:
    if got is None:
        return "—"
    med, low, high = got
    return f"{med:.2f} x" + (f" ({low:.2f} to {high:.2f})" if rounds > 1 else "")


def case_table(plain: Sequence[Measurement], fair: Sequence[Measurement],
               fair_ok: bool) -> tuple[str, dict[str, str]]:
    ok_fair = [m for m in fair if m.figures]
    rounds = len(ok_fair)

    def cell(ms: Sequence[Measurement], key: str, fmt: Callable[[float], str]) -> str:
        value = _median(ms, key)
        return "n/a" if value is None else fmt(value)

    def ms_(v: float) -> str:
        return f"{v * 1e3:,.0f} ms"

    def s_(v: float) -> str:
        return f"{v:,.2f} s"

    def cpu_cell(ms: Sequence[Measurement]) -> str:
        values = [m.cpu_s / len(m.records) * 1e3 for m in ms
                  if m.cpu_s is not None and m.records and not m.error]
        return f"{statistics.median(values):.2f} ms" if values else "n/a"

    def count_cell(ms: Sequence[Measurement]) -> str:
        if not ms:
            return "n/a"
        return (f"{sum(len(m.records) for m in ms):,} of {sum(m.expected for m in ms):,}; lost "
                f"{sum(m.lost for m in ms)}, twice {sum(m.duplicated for m in ms)}")

    wait_ratio = paired(plain, ok_fair, "light_p99", fair_over_plain=False) if fair_ok else None
    total_ratio = paired(plain, ok_fair, "a_total", fair_over_plain=True) if fair_ok else None
    verdicts = {}
    if wait_ratio is not None:
        verdicts["wait"] = "PASS" if wait_ratio[0] >= BUDGET_WAIT_RATIO else "MISS"
    if total_ratio is not None:
        verdicts["total"] = "PASS" if total_ratio[0] <= BUDGET_TOTAL_RATIO else "MISS"
    f = ok_fair if fair_ok else []
    rows = [
        ("light tenants' wait p50 (sent → started)", cell(plain, "light_p50", ms_), cell(f, "light_p50", ms_),
         _ratio_text(paired(plain, f, "light_p50", False), rounds) if f else "—", "—", "info"),
        ("light tenants' wait p99", cell(plain, "light_p99", ms_), cell(f, "light_p99", ms_),
         _ratio_text(wait_ratio, rounds), f"plain / fair ≥ {BUDGET_WAIT_RATIO:g}",
         verdicts.get("wait", "n/a")),
        ("… its round-robin floor at plain Celery's own run time; best ratio",
         cell(plain, "rr_floor", ms_), "—",
         _best_ratio(plain), "—", "info"),
        ("light tenants' completion",
         cell(plain, "light_completion", s_), cell(f, "light_completion", s_),
         _ratio_text(paired(plain, f, "light_completion", False), rounds) if f else "—", "—", "info"),
        ("backlog parked (first send → last park); runs started by then", "—",
         f"{cell(f, 'backlog_parked', s_)}; {cell(f, 'started_by_then', lambda v: f'{v:,.0f}')}",
         "—", "—", "info"),
        ("light runs parked by a main process", "—",
         cell(f, "light_parked", lambda v: f"{v:.0%}"), "—", "—", "info"),
        ("… sent → parked, p50 / p99", "—",
         f"{cell(f, 'to_park_p50', ms_)} / {cell(f, 'to_park_p99', ms_)}", "—", "—", "info"),
        ("… parked → started, p50 / p99", "—",
         f"{cell(f, 'park_start_p50', ms_)} / {cell(f, 'park_start_p99', ms_)}", "—", "—", "info"),
        ("A's total time (first sent → last finished)", cell(plain, "a_total", s_),
         cell(f, "a_total", s_),
         _ratio_text(total_ratio, rounds), f"fair / plain ≤ {BUDGET_TOTAL_RATIO:.2f}",
         verdicts.get("total", "n/a")),
        ("runs/s", cell(plain, "runs_per_s", lambda v: f"{v:,.0f}"),
         cell(f, "runs_per_s", lambda v: f"{v:,.0f}"),
         _ratio_text(paired(plain, f, "runs_per_s", True), rounds) if f else "—", "—", "info"),
        ("A's share of starts while light runs wait", cell(plain, "a_share", lambda v: f"{v:.0%}"),
         cell(f, "a_share", lambda v: f"{v:.0%}"), "—", "—", "info"),
        ("most runs at once (seen)", cell(plain, "at_once", lambda v: f"{v:.0f}"),
         cell(f, "at_once", lambda v: f"{v:.0f}"), "—", "—", "info"),
        ("workers' CPU per run", cpu_cell(plain), cpu_cell(f), "—", "—", "info"),
        ("every run exactly once", count_cell(plain), count_cell(f), "—", "each once",
         "n/a" if not f else ("PASS" if all(m.lost == 0 and m.duplicated == 0 for m in [*plain, *f])
                              else "MISS")),
    ]
    lines = ["| measure | plain Celery | fair share | paired ratio | budget | verdict |",
             "|---|---:|---:|---:|---|---|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return "\n".join(lines), verdicts


def cumulative(recs: Sequence[Rec], light: bool, t0: float) -> tuple[list[float], list[float]]:
    starts = sorted(r.start - t0 for r in recs if (r.tenant != "A") == light)
    n = len(starts)
    xs = [0.0]
    ys = [0.0]
    for i, s in enumerate(starts, 1):
        xs.append(s)
        ys.append(i / n * 100)
    return xs, ys


def plot(results: dict[tuple[str, str], list[Measurement]], args: argparse.Namespace) -> str | None:
    """Per case, the share of the light tenants' runs and of A's runs started over time, plain vs fair
    (first round with both sides), to docs/img/bench-fair.png."""
    plt = pyplot()
    if plt is None:
        return None
    path = IMAGES / "bench-fair.png"
    fig, axes = plt.subplots(1, len(CASES), figsize=(9.5, 3.6), dpi=110, sharey=True)
    for ax, case in zip(axes, CASES, strict=True):
        fair = {m.round_no: m for m in results[("fair", case)] if m.figures}
        pair = next(((p, fair[p.round_no]) for p in results[("plain", case)]
                     if p.figures and p.round_no in fair), None)
        if pair is None:
            ax.set_title(f"{case}: no paired round")
            continue
        for m, color in zip(pair, ("#868e96", "#d9480f"), strict=True):
            t0 = min(r.sent for r in m.records)
            label = "plain Celery" if m.side == "plain" else "fair share"
            xs, ys = cumulative(m.records, True, t0)
            ax.step(xs, ys, where="post", color=color, label=f"{label}: light tenants")
            xs, ys = cumulative(m.records, False, t0)
            ax.step(xs, ys, where="post", color=color, linestyle="--", label=f"{label}: tenant A")
        ax.set_title(f"{case}: {CASE_TITLES[case]}".replace("`", ""), fontsize=9)
        ax.set_xlabel("seconds since A's first send")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("% of the tenant group's runs started")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"{args.tasks:,} runs of A, then {args.light} each of B-E ({SLEEP * 1e3:g} ms each); "
                 f"round 1", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return f"![share of runs started over time, plain Celery vs fair share](img/{path.name})"


def run(args: argparse.Namespace, url: str, private: bool) -> None:
    prefix = f"sfbench-fair-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    leases_url, recorder_url = (f"{url}/2", f"{url}/3") if private else (url, url)
    broker = args.amqp_url if args.broker == "amqp" else (f"{url}/0" if private else url)
    env = {
        "SF_BENCH_PREFIX": prefix,
        "SF_BENCH_BROKER": broker,
        "SF_BENCH_LEASES": leases_url,
        "SF_BENCH_RECORDER": recorder_url,
        "SF_BENCH_QUEUE": f"{prefix}-queue",
        "SF_BENCH_SLEEP": repr(SLEEP),
        "SF_BENCH_FAIR_N": str(args.fair_concurrency),
        "SF_BENCH_BROKER_PREFIX": "1" if args.broker == "redis" and not private else "0",
    }
    fa, env = import_app("fairapp", env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env["PYTHONPATH"]])  # -A benchmarks.fairapp
    leases = redis.Redis.from_url(leases_url)
    server_version = leases.info("server")["redis_version"]
    fair_problem: str | None = fa.FAIR_PROBLEM
    print(f"redis-server {server_version} at {maybe_sanitize_url(url)} "
          f"({'private, started by this benchmark' if private else 'given by --redis-url'}); broker "
          f"{maybe_sanitize_url(broker)} ({'RabbitMQ' if args.broker == 'amqp' else 'Redis'}), queue "
          f"{fa.QUEUE!r}; key prefix {prefix!r}")
    print(f"celery {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}, "
          f"{os.cpu_count()} CPUs; {machine()}")
    print(f"plain Celery: {WORKERS} workers x {args.plain_procs} processes ({WORKERS * args.plain_procs} "
          f"at once); fair share: {WORKERS} workers x {args.fair_procs} processes, "
          f"fair_concurrency={args.fair_concurrency}; "
          f"prefetch multiplier {args.plain_prefetch} / {args.fair_prefetch}; A sends {args.tasks:,}, then "
          f"{', '.join(LIGHT_TENANTS)} {args.light} each; {SLEEP * 1e3:g} ms per run; {args.rounds} round(s)")
    if fair_problem:
        print(f"fair side NOT AVAILABLE: {fair_problem}; measuring plain Celery only")
    results: dict[tuple[str, str], list[Measurement]] = {(s, c): [] for s in ("plain", "fair") for c in CASES}
    fair_failed: dict[str, str] = {}
    bench = Bench(args, fa, env, leases, private)
    cases = [c for c in CASES if c in args.cases]
    try:
        for round_no in range(1, args.rounds + 1):
            for case in cases:
                for side in ("plain", "fair"):
                    if side == "fair" and (fair_problem or case in fair_failed):
                        continue
                    t0 = time.monotonic()
                    m = bench.measure(side, case, round_no)
                    results[(side, case)].append(m)
                    took = time.monotonic() - t0
                    if m.error:
                        print(f"  round {round_no} {case} {side}: FAILED after {took:.0f} s: {m.error} "
                              f"({len(m.records):,} runs recorded)", flush=True)
                        if side == "fair":
                            fair_failed[case] = m.error
                        continue
                    f = m.figures
                    print(f"  round {round_no} {case:6} {side:5}: light wait p50 "
                          f"{f['light_p50'] * 1e3:,.0f} ms "
                          f"p99 {f['light_p99'] * 1e3:,.0f} ms, light done {f['light_completion']:.2f} s, "
                          f"A total {f['a_total']:.2f} s, {f['runs_per_s']:,.0f} runs/s, A share "
                          f"{f['a_share']:.0%}, at once {f['at_once']:.0f}, lost {m.lost}, twice "
                          f"{m.duplicated}, sent in {m.send_seconds:.2f} s ({took:.0f} s in all)", flush=True)
    finally:
        if args.broker == "amqp":
            with contextlib.suppress(Exception), fa.app.connection_for_write() as conn:
                conn.default_channel.queue_delete(fa.QUEUE)
        if not private:
            deleted = delete_matching(leases, f"{prefix}:*")
            print(f"cleanup: deleted {deleted:,} keys under {prefix}:*")
        leases.close()
        with contextlib.suppress(Exception):
            fa.app.pool.force_close_all()

    fair_ran = not fair_problem and any(m.figures for c in cases for m in results[("fair", c)])
    sections = []
    all_verdicts: dict[str, dict[str, str]] = {}
    for case in cases:
        plain, fair = results[("plain", case)], results[("fair", case)]
        table, verdicts = case_table(plain, fair, fair_ok=case not in fair_failed and not fair_problem)
        all_verdicts[case] = verdicts
        title = f"Case {cases.index(case) + 1} ({case}): {CASE_TITLES[case]}"
        print()
        print(title + ":")
        print()
        print(table)
        sections.append((title, table))
    print()
    if args.plain_prefetch == args.fair_prefetch:
        prefetch_text = (f"`worker_prefetch_multiplier={args.plain_prefetch}` on both sides"
                         + (" (plain Celery's best case for fairness)" if args.plain_prefetch == 1 else ""))
    else:
        prefetch_text = (f"`worker_prefetch_multiplier` {args.plain_prefetch} for plain Celery"
                         + (" (its best case for fairness)" if args.plain_prefetch == 1 else "")
                         + f", {args.fair_prefetch} for fair share")
    broker = "RabbitMQ" if args.broker == "amqp" else "Redis"
    note = (f"Like for like: {WORKERS * args.plain_procs} runs at once on both sides (plain Celery: "
            f"{WORKERS} workers x {args.plain_procs} processes; fair share: {WORKERS} x {args.fair_procs} "
            f"with `fair_concurrency={args.fair_concurrency}`), {prefetch_text}, {broker}, results ignored. "
            f"A sends {args.tasks:,} runs of {SLEEP * 1e3:g} ms, then B, C, D, E {args.light} each; wait = "
            f"body start minus send. Medians of {args.rounds} interleaved round(s); ratios are paired. Each "
            f"freed fair slot is handed on through the broker (the freeing worker's own queue), a few ms "
            f"per run that plain Celery's prefetched message does not pay, and each waiting run is parked "
            f"first, by a main process: while the backlog is parked, the host's CPUs are busy (everything "
            f"here shares them), and part of the light runs' wait is their turn to be parked "
            f"(sent → parked). "
            f"The floor row: round robin starts each light tenant's last run after that many rounds of all "
            f"five tenants, on {args.fair_concurrency} slots, each run taking plain Celery's own time; "
            f"the 20 x budget needs a fair side faster per run than plain Celery. A's share: A's fraction "
            f"of the runs started between the first light send and the last light start (even round "
            f"robin over 5 tenants: 20 %). Case 2's "
            f"fair task uses `on_duplicate=\"queue\"`, so no run is dropped as a duplicate; plain Celery "
            f"has no lock keys, so its case 2 repeats case 1.")
    print(note)
    if fair_problem:
        print(f"\nThe fair side is not available: {fair_problem}. Only plain Celery was measured.")
    for case, err in fair_failed.items():
        print(f"\nThe fair side of case {case!r} is not available (its run failed): {err}")
    if bench.problems:
        print(f"\nworker logs: {len(bench.problems)} warning/error lines, first ones:")
        for line in bench.problems[:12]:
            print(f"  {line}")
    else:
        print("\nworker logs: no warning or error lines")
    if fair_ran:
        for case, verdicts in all_verdicts.items():
            print(f"budget, case {case}: light p99 wait {verdicts.get('wait', 'n/a')}, A's total time "
                  f"{verdicts.get('total', 'n/a')}")
    if args.write_docs:
        if not fair_ran:
            print("--write-docs: nothing written (the fair side did not run)")
            return
        image = plot(results, args)
        command = " ".join(["benchmarks/bench_fair.py", *sys.argv[1:]]).replace(" --write-docs", "")
        parts = [
            "## Fair share between tenants (`benchmarks/bench_fair.py`)",
            f"Alone: `.venv/bin/python {command} --write-docs`. Measured {machine()}.",
        ]
        for title, table in sections:
            parts += [f"{title}:", table]
        parts.append(note)
        if image:
            parts.append(image)
        write_section("fair", "\n\n".join(parts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=2000, help="tenant A's runs (2000)")
    parser.add_argument("--light", type=int, default=20, help="runs of each light tenant B, C, D, E (20)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each plain then fair per case (2)")
    parser.add_argument("--plain-procs", type=int, default=2, help="prefork processes per plain worker (2)")
    parser.add_argument("--fair-procs", type=int, default=4, help="prefork processes per fair worker (4)")
    parser.add_argument("--fair-concurrency", type=int, default=4, help="fair_concurrency (4)")
    parser.add_argument("--plain-prefetch", type=int, default=1, help="worker_prefetch_multiplier, plain (1)")
    parser.add_argument("--fair-prefetch", type=int, default=1, help="worker_prefetch_multiplier, fair (1)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="which cases (both)")
    parser.add_argument("--broker", choices=("amqp", "redis"), default="amqp",
                        help="RabbitMQ (amqp, default) or the Redis broker")
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672//", help="RabbitMQ URL")
    parser.add_argument("--redis-url",
                        help="use this Redis and DB (only keys under a unique prefix are touched)")
    parser.add_argument("--loglevel", default="INFO", help="worker log level (INFO)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' log files")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args()
    with redis_for(args.redis_url) as (url, private):
        run(args, url, private=private)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
