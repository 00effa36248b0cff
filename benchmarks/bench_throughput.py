"""End-to-end Celery throughput with a lease per task, next to plain Celery and two other lock libraries.

The budget (PRODUCT.md): end-to-end Celery throughput with a lease per task >= 0.95 x the same
tasks without it, in paired runs. This benchmark runs the no-op task of
``benchmarks/throughputapp.py`` in six variants, same body, same shape ``(i, round_id, target)``,
``ignore_result=True``, Redis broker:

1. plain Celery ``Task`` (the baseline);
1b. plain ``Task`` plus two PINGs to the lease Redis around the body: the floor of any design
   that takes and releases a lock in the worker with two round trips (the budget's
   "2 round trips per acquire + release"), so the report shows how much of the gap is the
   machine's round-trip time and how much is the library;
1c. plain ``Task`` inside redis-py's ``Lock`` (``SET NX PX``, body, release script), a unique
   name per task: the simplest real lock taken in the worker, which records nothing (no holder,
   fence, status or outcome) and renews nothing;
2. ``SingleFlightTask`` with a unique key per task (``lock_key="tp:<round_id>:<i>"``): never
   contended, so it measures the lease's own cost in the worker (acquire, heartbeat
   registration, release);
3. ``celery_once.QueueOnce`` (unique keys, its Redis backend), if installed;
4. ``celery_singleton.Singleton`` (unique keys, its Redis backend), if installed.

3 and 4 take their lock in ``apply_async``, in the producer (this benchmark process), so in the
worker they pay only the unlock; the dispatch rate (messages/s published by this process) is
reported per variant so the cost they move to the producer shows too. ``SingleFlightTask``
takes and releases its lease in the worker, around the body.

One measurement (a variant in a round): publish N messages (``--tasks``, default 3,000) to the
variant's own queue while no worker consumes it (timed: the dispatch rate), then start a fresh
real worker (``celery worker --pool prefork --concurrency 2``, default prefetch multiplier,
``--without-gossip --without-mingle --without-heartbeat``, consuming only that queue), wait
until the recorder's counter reaches N, and stop the worker by its PID (warm shutdown). Each run
``INCR``s the round's counter in the recorder; the run that makes it 1 stamps ``first`` and the
one that makes it N stamps ``last`` (``time.time()`` inside the worker), so the worker's start-up
and shutdown are outside the measured interval and every variant pays the same recorder round
trip. Throughput = N / (last - first). A fresh worker per measurement (rather than one
long-lived worker per variant with ``add_consumer``/``cancel_consumer``) means no variant
inherits another's prefetched messages, pool state or heartbeat threads, and the queue is full
before the first message is taken, so the worker never waits for the producer. One unmeasured
warm-up worker first runs a few tasks of every variant (Lua scripts loaded into the server,
page cache warm).

Rounds are interleaved (plain, two_pings, redis_lock, singleflight, once, singleton; again ...;
``--rounds``, default 7),
so slow drift of a busy machine hits every variant alike. The report: per variant the median
tasks/s with min and max, the median dispatch rate, and the ratio to plain Celery, paired (the
median over rounds of variant/plain of the same round), with the verdict for SingleFlightTask
against the 0.95 budget. Per-task log lines of Celery ("received", "succeeded") are off for every
variant by default (``--task-logs`` keeps them), which makes the fixed per-task cost smaller and
so the ratio stricter.

By default a private redis-server is started on a free loopback port (broker db 0, leases and
locks db 1, recorder db 2) and stopped afterwards. With ``--redis-url`` that server and DB are
used for everything instead: every key written starts with a unique prefix (celery-once's keys,
which take no prefix, are ``qo_throughputapp.once.<prefix>_...``) and only those keys are
deleted at the end (nothing is flushed). Workers are started by this benchmark and stopped by
their own PIDs (SIGTERM, then SIGKILL of their own process group if anything is left).

The result is a report, not a test: the exit status is 0 whatever the verdict.

    .venv/bin/python benchmarks/bench_throughput.py [--tasks N] [--rounds N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import kombu
import psutil
import redis
import traced_tasks
from benchutil import (
    bar_chart,
    delete_matching,
    import_app,
    machine,
    redis_for,
    version_of,
    worker_problems,
    write_section,
)
from kombu.utils.url import maybe_sanitize_url

from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import WorkerProcess

HERE = Path(__file__).resolve().parent
CONCURRENCY = 2
BUDGET_RATIO = 0.95  # wall-clock throughput, paired median, against plain Celery
CPU_BUDGET = 1.10  # worker + redis-server CPU per task, against plain Celery plus two PINGs
WARMUP_TASKS = 50  # per variant, in the unmeasured warm-up worker
VARIANTS = ("plain", "two_pings", "redis_lock", "singleflight", "singleflight_metrics", "once", "singleton")
METRICS_BUDGET = 1.03  # worker + redis-server CPU per task with metrics on, against metrics off
LABELS = {
    "plain": "plain `Task`",
    "two_pings": "plain + 2 PINGs (floor)",
    "redis_lock": "plain in redis-py `Lock`",
    "singleflight": "`SingleFlightTask`",
    "singleflight_metrics": "`SingleFlightTask`, metrics on",
    "once": "celery-once `QueueOnce`",
    "singleton": "celery-singleton `Singleton`",
}
DISTRIBUTIONS = {"once": "celery-once", "singleton": "celery-singleton"}


@dataclass
class Measurement:
    round_no: int
    variant: str
    tasks_per_s: float
    dispatch_per_s: float
    seconds: float  # last - first
    leftover_locks: int | None  # lock keys of this variant still in Redis after the run
    dispatch_commands: float | None = None  # Redis commands per published message (private server)
    worker_commands: float | None = None  # Redis commands per task while the worker ran (private server)
    worker_cpu_ms: float | None = None  # CPU ms per task of the worker's processes, first -> last run
    redis_cpu_ms: float | None = None  # CPU ms per task of the redis-server, same interval (private server)


@dataclass
class Variant:
    name: str
    available: bool
    note: str = ""
    runs: list[Measurement] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def count_matching(client: redis.Redis, pattern: str) -> int:
    return sum(1 for _ in client.scan_iter(match=pattern, count=1_000))


class Bench:
    def __init__(self, ta: ModuleType, args: argparse.Namespace, env: dict[str, str], broker: redis.Redis,
                 locks: redis.Redis, broker_key_prefix: str, private: bool) -> None:
        self.ta = ta
        self.private = private
        self.polls = 0
        self.args = args
        self.env = env
        self.broker = broker
        self.locks = locks
        self.broker_key_prefix = broker_key_prefix
        self.recorder: redis.Redis = ta.recorder
        self.problems: list[str] = []

    def queue(self, variant: str) -> str:
        return f"{self.ta.PREFIX}-tp-{variant}"

    def lock_pattern(self, variant: str) -> str | None:
        """A SCAN pattern matching the held locks of a variant (None: it has none)."""
        prefix = self.ta.PREFIX
        if variant.startswith("singleflight"):
            return f"{prefix}:{{*}}:run"
        if variant == "redis_lock":
            return f"{prefix}:lock:*"
        if variant == "once":
            return f"qo_{self.ta.once_task_name()}_*"
        if variant == "singleton":
            return f"{prefix}:singleton:*"
        return None

    def new_worker(self, queues: Sequence[str], metrics_dir: str = "") -> WorkerProcess:
        env = {**self.env, "SF_TP_METRICS_DIR": metrics_dir}  # metrics on when given a directory
        worker = WorkerProcess("throughputapp", concurrency=CONCURRENCY, env=env, cwd=str(HERE),
                               loglevel="INFO", extra=["-Q", ",".join(queues), "--without-heartbeat"])
        # WorkerProcess pins --prefetch-multiplier 1 (right for latency tests); throughput runs with
        # Celery's default (4), so drop the pin.
        at = worker.args.index("--prefetch-multiplier")
        del worker.args[at:at + 2]
        return worker

    def cpu_seconds(self, worker: WorkerProcess) -> tuple[float, float | None]:
        """CPU seconds used so far by the worker's processes (main and pool) and by the private
        redis-server (``INFO cpu``; None on a shared server)."""
        total = 0.0
        if worker.proc is not None:
            with contextlib.suppress(psutil.Error):
                main = psutil.Process(worker.proc.pid)
                for proc in [main, *main.children(recursive=True)]:
                    with contextlib.suppress(psutil.Error):
                        times = proc.cpu_times()
                        total += times.user + times.system
        server = None
        if self.private:
            info = self.broker.info("cpu")
            server = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
        return total, server

    def run_worker_until(
        self, worker: WorkerProcess, done: Any, timeout: float, what: str, started: Any = None,
    ) -> tuple[tuple[float, float | None], tuple[float, float | None]]:
        """Start ``worker``, wait for ``done()``; return the CPU readings when ``started()`` first
        held (the first run began) and when ``done()`` did (polled every 10 ms)."""
        first = last = (0.0, None)
        try:
            worker.start()
            deadline = time.monotonic() + timeout
            seen_start = started is None
            while not done():
                if worker.proc is None or worker.proc.poll() is not None:
                    raise RuntimeError(f"the worker exited during {what}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{what} not finished within {timeout:g} s")
                if not seen_start and started():
                    first, seen_start = self.cpu_seconds(worker), True
                time.sleep(0.01)
                self.polls += 2 if started is not None else 1
            last = self.cpu_seconds(worker)
        finally:
            worker.stop()
            worker.kill()  # only the worker's own process group, if anything of it is left
            self.problems.extend(worker_problems(worker.log()))
            if self.args.keep_logs:
                print(f"  worker log kept at {worker.log_path}")
            else:
                worker.cleanup()
        return first, last

    def dispatch(self, variant: str, round_id: str, n: int) -> float:
        """Publish n messages of ``variant``; return the dispatch rate (messages/s)."""
        task = self.ta.TASKS[variant]
        queue = self.queue(variant)
        self.broker.delete(f"{self.broker_key_prefix}{queue}")  # our own queue: leftovers of a failed run
        t0 = time.perf_counter()
        for i in range(n):
            task.apply_async((i, round_id, n), queue=queue)
        elapsed = time.perf_counter() - t0
        queued = int(self.broker.llen(f"{self.broker_key_prefix}{queue}"))
        if queued != n:
            raise RuntimeError(f"{queued} messages in {queue} after publishing {n}")
        return n / elapsed

    def warm_up(self, variants: Sequence[str]) -> None:
        round_id = f"warmup-{uuid.uuid4().hex[:8]}"
        ids = {v: f"{round_id}-{v}" for v in variants}
        for v in variants:
            self.dispatch(v, ids[v], WARMUP_TASKS)
        worker = self.new_worker([self.queue(v) for v in variants])

        def done() -> bool:
            return all(int(self.recorder.get(self.ta.count_key(rid)) or 0) >= WARMUP_TASKS
                       for rid in ids.values())

        self.run_worker_until(worker, done, 120.0, "warm-up")

    def commands(self) -> int | None:
        """Commands the (private) server has executed so far, including those inside Lua scripts."""
        if not self.private:
            return None
        stats = self.broker.info("commandstats")
        return sum(int(v["calls"]) for v in stats.values() if isinstance(v, dict))

    def measure(self, variant: str, round_no: int) -> Measurement:
        n = self.args.tasks
        round_id = f"r{round_no}-{variant}-{uuid.uuid4().hex[:8]}"
        c0 = self.commands()
        dispatch_rate = self.dispatch(variant, round_id, n)
        c1 = self.commands()
        metrics_dir = tempfile.mkdtemp(prefix="sftp-metrics-") if variant == "singleflight_metrics" else ""
        worker = self.new_worker([self.queue(variant)], metrics_dir)
        ta = self.ta

        def done() -> bool:
            return bool(self.recorder.exists(ta.last_key(round_id)))

        def started() -> bool:
            return bool(self.recorder.exists(ta.first_key(round_id)))

        self.polls = 0
        what = f"{variant} round {round_no}"
        try:
            cpu_first, cpu_last = self.run_worker_until(worker, done, 60.0 + n / 20, what, started)
        finally:
            if metrics_dir:
                shutil.rmtree(metrics_dir, ignore_errors=True)
        c2 = self.commands()
        count = int(self.recorder.get(ta.count_key(round_id)) or 0)
        if count != n:
            raise RuntimeError(f"{variant} round {round_no}: {count} runs counted, expected {n}")
        first = float(self.recorder.get(ta.first_key(round_id)) or 0)
        last = float(self.recorder.get(ta.last_key(round_id)) or 0)
        pattern = self.lock_pattern(variant)
        if variant.startswith("singleflight"):  # run records outlive their runs: count the held ones
            leftover = len(StatusReader(LeaseStore(self.locks, KeyLayout(ta.PREFIX))).held())
        else:
            leftover = count_matching(self.locks, pattern) if pattern else None
        per_dispatch = per_task = None
        if c0 is not None and c1 is not None and c2 is not None:
            per_dispatch = (c1 - c0 - 3) / n  # minus DEL, the LLEN check and one INFO
            per_task = (c2 - c1 - self.polls - 1) / n  # minus this process's polls and one INFO
        worker_cpu = (cpu_last[0] - cpu_first[0]) / n * 1e3
        redis_cpu = None
        if cpu_first[1] is not None and cpu_last[1] is not None:
            redis_cpu = (cpu_last[1] - cpu_first[1]) / n * 1e3
        return Measurement(round_no, variant, n / (last - first), dispatch_rate, last - first, leftover,
                           per_dispatch, per_task, worker_cpu, redis_cpu)


def _rate(value: float) -> str:
    return f"{value:,.0f}"


def median_ratio(variant: Variant, baseline: Variant, pick: str) -> tuple[float, list[float]] | None:
    base = {m.round_no: getattr(m, pick) for m in baseline.runs}
    ratios = [getattr(m, pick) / base[m.round_no] for m in variant.runs if m.round_no in base]
    if not ratios:
        return None
    return statistics.median(ratios), ratios


def cpu_per_thousand(m: Measurement) -> float | None:
    """CPU seconds per 1,000 tasks: the worker's processes plus the redis-server (leases, broker
    and results all live on it here), from the first run to the last."""
    if m.worker_cpu_ms is None or m.redis_cpu_ms is None:
        return None
    return m.worker_cpu_ms + m.redis_cpu_ms  # ms per task == s per 1,000 tasks


def paired_cpu_ratio(variant: Variant, floor: Variant) -> tuple[float, list[float]] | None:
    base = {m.round_no: cpu_per_thousand(m) for m in floor.runs}
    ratios = []
    for m in variant.runs:
        mine, theirs = cpu_per_thousand(m), base.get(m.round_no)
        if mine is not None and theirs:
            ratios.append(mine / theirs)
    return (statistics.median(ratios), ratios) if ratios else None


def cpu_table(variants: Sequence[Variant]) -> str:
    """CPU per task, the budget's steadier measure: worker + redis-server CPU per 1,000 tasks."""
    floor = next((v for v in variants if v.name == "two_pings" and v.runs), None)
    bare_lock = next((v for v in variants if v.name == "redis_lock" and v.runs), None)
    lines = [
        "| variant | worker CPU ms/task | redis-server CPU ms/task | CPU s per 1,000 tasks | ratio to floor "
        "| ratio to `Lock` | budget | verdict |",
        "|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for v in variants:
        measured = [m for m in v.runs if cpu_per_thousand(m) is not None]
        if not measured:
            continue
        worker = statistics.median(m.worker_cpu_ms or 0.0 for m in measured)
        redis_ms = statistics.median(m.redis_cpu_ms or 0.0 for m in measured)
        total = statistics.median(cpu_per_thousand(m) or 0.0 for m in measured)
        got = paired_cpu_ratio(v, floor) if floor is not None else None
        ratio = "—" if got is None or v.name == "two_pings" else f"{got[0]:.3f}"
        to_lock = paired_cpu_ratio(v, bare_lock) if bare_lock is not None else None
        lock_ratio = "—" if to_lock is None or v.name == "redis_lock" else f"{to_lock[0]:.3f}"
        if v.name == "singleflight":
            budget = f"≤ {CPU_BUDGET:g} x floor"
            verdict = "n/a" if got is None else ("PASS" if got[0] <= CPU_BUDGET else "MISS")
        else:
            budget, verdict = "—", "floor" if v.name == "two_pings" else "comparison"
        lines.append(f"| {LABELS[v.name]} | {worker:.3f} | {redis_ms:.3f} | {total:.3f} | {ratio} "
                     f"| {lock_ratio} | {budget} | {verdict} |")
    return "\n".join(lines)


def metrics_table(variants: Sequence[Variant], counted: dict[str, tuple[int, int]]) -> str:
    """Metrics on against off: the same task and worker, paired per round (the 3 % budget)."""
    named = {v.name: v for v in variants if v.runs}
    if not {"singleflight", "singleflight_metrics"} <= named.keys():
        return ""
    off, on = named["singleflight"], named["singleflight_metrics"]
    cpu = paired_cpu_ratio(on, off)
    rate = median_ratio(on, off, "tasks_per_s")
    lines = ["| measure | metrics off | metrics on | ratio on / off (paired median, range) | budget "
             "| verdict |",
             "|---|---:|---:|---|---|---|"]
    if cpu is not None:
        medians = [statistics.median(cpu_per_thousand(m) or 0.0 for m in v.runs) for v in (off, on)]
        verdict = "PASS" if cpu[0] <= METRICS_BUDGET else "MISS"
        lines.append(f"| worker + redis-server CPU s per 1,000 tasks | {medians[0]:.3f} | {medians[1]:.3f} "
                     f"| {cpu[0]:.3f} ({min(cpu[1]):.3f} - {max(cpu[1]):.3f}) | ≤ {METRICS_BUDGET:g} "
                     f"| {verdict} |")
    if rate is not None:
        medians = [statistics.median(m.tasks_per_s for m in v.runs) for v in (off, on)]
        lines.append(f"| tasks/s | {_rate(medians[0])} | {_rate(medians[1])} "
                     f"| {rate[0]:.3f} ({min(rate[1]):.3f} - {max(rate[1]):.3f}) | — | — |")
    if "singleflight" in counted and "singleflight_metrics" in counted:
        child_off, child_on = counted["singleflight"][0], counted["singleflight_metrics"][0]
        lines.append(f"| instructions per task, pool child (callgrind) | {child_off:,} | {child_on:,} "
                     f"| {child_on / child_off:.3f} | — | — |")
    return "\n".join(lines)


def instructions_table(counted: dict[str, tuple[int, int]]) -> str:
    """Instructions per task, the steadiest measure: the pool child running the task through
    Celery's tracer, and the redis-server's work for it (callgrind; see ``traced_tasks.py``)."""
    if not counted:
        return ""
    floor = sum(counted.get("two_pings", (0, 0)))
    bare_lock = sum(counted.get("redis_lock", (0, 0)))
    lines = [
        "Instructions per task (callgrind: a pool child running the task through Celery's tracer, "
        "and the redis-server's work for it):",
        "",
        "| variant | pool child | redis-server | both | ratio to floor | ratio to `Lock` |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, (child, server) in counted.items():
        both = child + server
        to_floor = f"{both / floor:.3f}" if floor and name != "two_pings" else "—"
        to_lock = f"{both / bare_lock:.3f}" if bare_lock and name != "redis_lock" else "—"
        lines.append(f"| {LABELS[name]} | {child:,} | {server:,} | {both:,} | {to_floor} | {to_lock} |")
    return "\n".join(lines)


def summary_table(variants: Sequence[Variant]) -> str:
    baseline = next(v for v in variants if v.name == "plain")
    floor = next((v for v in variants if v.name == "two_pings" and v.runs), None)
    lines = [
        "| variant | rounds | tasks/s median | min - max | ratio to plain (per round) | ratio to floor "
        "| dispatch msgs/s median (ratio) | budget | verdict |",
        "|---|---:|---:|---:|---|---:|---:|---|---|",
    ]
    for v in variants:
        if not v.available:
            lines.append(f"| {LABELS[v.name]} | 0 | {v.note} | | | | | | |")
            continue
        if not v.runs:
            lines.append(f"| {LABELS[v.name]} | 0 | n/a (failed) | | | | | | |")
            continue
        tps = [m.tasks_per_s for m in v.runs]
        disp = [m.dispatch_per_s for m in v.runs]
        got = median_ratio(v, baseline, "tasks_per_s")
        dgot = median_ratio(v, baseline, "dispatch_per_s")
        fgot = median_ratio(v, floor, "tasks_per_s") if floor and v.name != "two_pings" else None
        floor_text = "—" if fgot is None else f"{fgot[0]:.3f}"
        if v.name == "plain":
            ratio_text, dratio_text = "1 (baseline)", ""
        else:
            ratio_text = (f"{got[0]:.3f} ({', '.join(f'{r:.3f}' for r in got[1])})" if got else "n/a")
            dratio_text = f" ({dgot[0]:.2f})" if dgot else ""
        if v.name == "singleflight":
            budget = f"≥ {BUDGET_RATIO:g} x plain"
            verdict = "n/a" if got is None else ("PASS" if got[0] >= BUDGET_RATIO else "MISS")
        else:
            budget, verdict = "—", ("baseline" if v.name == "plain" else "comparison")
        lines.append(
            f"| {LABELS[v.name]} | {len(v.runs)} | {_rate(statistics.median(tps))} | "
            f"{_rate(min(tps))} - {_rate(max(tps))} | {ratio_text} | {floor_text} | "
            f"{_rate(statistics.median(disp))}{dratio_text} | {budget} | {verdict} |"
        )
    return "\n".join(lines)


def floor_sentence(variants: Sequence[Variant]) -> str:
    """What the machine's two round trips take of plain Celery's throughput (the 2-PING floor,
    which no 2-round-trip lease can beat), and what each lock in the worker takes on top."""
    named = {v.name: v for v in variants if v.runs}
    if not {"plain", "two_pings", "singleflight"} <= named.keys():
        return ""
    plain, floor = named["plain"], named["two_pings"]
    floor_ratio = median_ratio(floor, plain, "tasks_per_s")
    ours = median_ratio(named["singleflight"], floor, "tasks_per_s")
    lock = median_ratio(named["redis_lock"], floor, "tasks_per_s") if "redis_lock" in named else None
    if floor_ratio is None or ours is None:
        return ""
    text = (f"The 2-PING floor (two round trips to the lease Redis and nothing else) reached "
            f"{floor_ratio[0]:.3f} of plain Celery's tasks/s (paired median; per round "
            f"{min(floor_ratio[1]):.3f} to {max(floor_ratio[1]):.3f}): on this machine the round trips "
            f"alone take {1 - floor_ratio[0]:.1%} of the tasks/s, against the {1 - BUDGET_RATIO:.0%} the "
            f"budget allows in all. SingleFlightTask reached {ours[0]:.3f} of the floor")
    if lock is not None:
        text += f", a plain task inside redis-py's `Lock` {lock[0]:.3f}"
    return text + "."


def rounds_table(variants: Sequence[Variant]) -> str:
    runs = sorted((m for v in variants for m in v.runs), key=lambda m: m.round_no)
    lines = ["| round | variant | tasks/s | first → last s | dispatch msgs/s | locks left in Redis "
             "| Redis commands per message: dispatch / worker |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for m in runs:
        left = "—" if m.leftover_locks is None else f"{m.leftover_locks:,}"
        cmds = ("n/a (shared server)" if m.dispatch_commands is None or m.worker_commands is None
                else f"{m.dispatch_commands:.1f} / {m.worker_commands:.1f}")
        lines.append(f"| {m.round_no} | {m.variant} | {_rate(m.tasks_per_s)} | {m.seconds:.3f} | "
                     f"{_rate(m.dispatch_per_s)} | {left} | {cmds} |")
    return "\n".join(lines)


#: what the page says below the tables (the console also prints the floor, the notes and every round)
DOC_NOTE = ("Floor: a plain task plus two PINGs, the least any 2-round-trip lease costs. redis-py `Lock`: "
            "a bare lock (no record, no heartbeat). `SingleFlightTask`: a unique key per task. celery-once "
            "and celery-singleton lock in `apply_async`: their cost shows in the dispatch rate. Medians; "
            "ratios are paired. CPU: the worker's processes (/proc) and the redis-server (`INFO cpu`).")


def run(args: argparse.Namespace, url: str, private: bool) -> None:
    started = time.monotonic()
    prefix = f"sftp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if private:
        broker_url, locks_url, recorder_url = f"{url}/0", f"{url}/1", f"{url}/2"
    else:
        broker_url = locks_url = recorder_url = url
    env = {
        "SF_TP_PREFIX": prefix,
        "SF_TP_BROKER": broker_url,
        "SF_TP_LOCKS": locks_url,
        "SF_TP_RECORDER": recorder_url,
        "SF_TP_BROKER_PREFIX": "0" if private else "1",
        "SF_TP_TASK_LOGS": "1" if args.task_logs else "0",
    }
    ta, env = import_app("throughputapp", env)
    broker = redis.Redis.from_url(broker_url)
    locks = redis.Redis.from_url(locks_url)
    server_version = broker.info("server")["redis_version"]
    broker_key_prefix = ta.transport_options.get("global_keyprefix", "")

    wanted = [v for v in VARIANTS if v not in args.skip]
    variants = [Variant(name, name in ta.TASKS, ta.UNAVAILABLE.get(name, "")) for name in wanted]
    for v in variants:
        if not v.available and not v.note:
            v.note = "not installed"
    active = [v.name for v in variants if v.available]

    try:
        load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on Linux
        load = "n/a"
    print(f"redis-server {server_version} at {maybe_sanitize_url(url)} "
          f"({'private, started by this benchmark' if private else 'given by --redis-url'}); "
          f"broker {maybe_sanitize_url(broker_url)}, leases/locks {maybe_sanitize_url(locks_url)}, "
          f"recorder {maybe_sanitize_url(recorder_url)}; key prefix {prefix!r}")
    print(f"python {platform.python_version()}, celery {celery.__version__}, kombu {kombu.__version__}, "
          f"redis-py {redis.__version__}, hiredis {version_of('hiredis')}, "
          f"celery-once {version_of('celery-once')}, celery-singleton {version_of('celery-singleton')}; "
          f"{os.cpu_count()} CPUs, load average {load} (1/5/15 min) at start")
    print(f"per measurement: {args.tasks:,} messages published to the variant's queue, then a fresh "
          f"`celery worker --pool prefork --concurrency {CONCURRENCY} --without-gossip --without-mingle "
          f"--without-heartbeat` (prefetch multiplier: Celery's default) drains it; "
          f"{args.rounds} round(s), variants interleaved in each: {', '.join(active)}; per-task log lines "
          f"{'ON' if args.task_logs else 'off'}; results ignored, acks early")
    bench = Bench(ta, args, env, broker, locks, broker_key_prefix, private)
    try:
        if active:
            t0 = time.monotonic()
            bench.warm_up(active)
            print(f"warm-up worker: {WARMUP_TASKS} tasks of each variant in {time.monotonic() - t0:.1f} s",
                  flush=True)
        for round_no in range(1, args.rounds + 1):
            for v in variants:
                if not v.available:
                    continue
                try:
                    m = bench.measure(v.name, round_no)
                except (RuntimeError, TimeoutError) as exc:
                    v.failed.append(str(exc))
                    print(f"  round {round_no} {v.name}: FAILED: {exc}", flush=True)
                    continue
                v.runs.append(m)
                print(f"  round {round_no} {v.name}: {_rate(m.tasks_per_s)} tasks/s, dispatch "
                      f"{_rate(m.dispatch_per_s)} msgs/s", flush=True)
    finally:
        if not private:
            deleted = delete_matching(broker, f"{prefix}:*")
            deleted += delete_matching(broker, f"qo_{ta.once_task_name()}_*")
            print(f"cleanup: deleted {deleted:,} keys under {prefix}:* and qo_{ta.once_task_name()}_*")
        broker.close()
        locks.close()
        ta.recorder.close()
        ta.app.pool.force_close_all()

    summary, cpu, per_round = summary_table(variants), cpu_table(variants), rounds_table(variants)
    floor_text = floor_sentence(variants)
    instructions, counted = "", {}
    if args.callgrind:
        print("instructions per task under callgrind (a few minutes):", flush=True)
        counted = traced_tasks.instructions_per_task()
        instructions = instructions_table(counted)
    metrics = metrics_table(variants, counted)
    heading = (f"Throughput, {args.tasks:,} no-op tasks per measurement (N / (last end - first start)), "
               f"{args.rounds} interleaved round(s):")
    notes = ("celery-once and celery-singleton take their lock in `apply_async`, in the producer (this "
             "process), so their worker-side cost is only the unlock; their lock round trip shows in the "
             "dispatch rate instead. SingleFlightTask and plain Celery publish the same way; the lease is "
             "taken and released in the worker. CPU is read from /proc (psutil) for the worker's processes "
             "and from `INFO cpu` for the redis-server (broker, results and leases), when the first run "
             "starts and when the last ends. \"locks left in Redis\" counts the variant's held locks after "
             "its worker drained the queue (0: every run released its lock). Redis commands are counted by "
             "the private server (INFO commandstats, including commands inside Lua scripts; the worker "
             "figure includes its start-up and shutdown, spread over the N tasks).")
    print()
    print(heading)
    print()
    print(summary)
    print()
    if floor_text:
        print(floor_text)
        print()
    print("CPU per task (steadier than wall-clock rates on a shared machine):")
    print()
    print(cpu)
    print()
    if instructions:
        print(instructions)
        print()
    if metrics:
        print("Metrics on and off (the same task; a worker with singleflight_metrics = True):")
        print()
        print(metrics)
        print()
    print("Per measurement:")
    print()
    print(per_round)
    print()
    print(notes)
    for v in variants:
        for failure in v.failed:
            print(f"{v.name}: FAILED: {failure}")
    print()
    print(f"worker logs: {len(bench.problems)} warning/error lines" + (":" if bench.problems else ""))
    for line in bench.problems[:10]:
        print(f"  {line}")
    if args.write_docs:
        measured = [v for v in variants if any(cpu_per_thousand(m) is not None for m in v.runs)]
        chart = bar_chart(
            "throughput-cpu", "worker + redis-server CPU seconds per 1,000 no-op tasks (median)",
            [LABELS[v.name].replace("`", "") for v in measured],
            [statistics.median(cpu_per_thousand(m) or 0.0 for m in v.runs) for v in measured], "s",
            highlight=LABELS["singleflight"].replace("`", ""),
        )
        write_section("throughput", "\n\n".join(filter(None, [
            "## End-to-end throughput and CPU per task (`benchmarks/bench_throughput.py`)",
            f"Alone: `.venv/bin/python benchmarks/bench_throughput.py --rounds "
            f"{args.rounds}{' --callgrind' if args.callgrind else ''}` (private redis-server "
            f"{server_version}; `celery worker --pool prefork "
            f"--concurrency {CONCURRENCY}`, a fresh one per measurement). Measured {machine()}.",
            heading, summary, "CPU per task:", cpu, chart, instructions, DOC_NOTE,
            metrics and "### Metrics on and off", metrics and (
                "The same `SingleFlightTask`, drained by a worker with `singleflight_metrics = True` "
                "(counting into its multiprocess directory) and by one without, in the same rounds:"),
            metrics,
        ])))
    print(f"total time {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=3000, help="messages per measurement (3000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds per variant (7)")
    parser.add_argument("--redis-url",
                        help="use this Redis and DB (only keys under a unique prefix are touched)")
    parser.add_argument("--skip", action="append", default=[], choices=[v for v in VARIANTS if v != "plain"],
                        help="leave a variant out (repeatable)")
    parser.add_argument("--task-logs", action="store_true",
                        help="keep Celery's per-task INFO log lines (received/succeeded) in the workers")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' log files")
    parser.add_argument("--write-docs", action="store_true", help="write the figures into docs/benchmarks.md")
    parser.add_argument("--callgrind", action="store_true",
                        help="also count instructions per task (pool child and redis-server) under valgrind")
    args = parser.parse_args()
    if args.tasks < 2 or args.rounds < 1:
        parser.error("--tasks must be >= 2 and --rounds >= 1")
    with redis_for(args.redis_url) as (url, private):
        run(args, url, private=private)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
