"""Crash recovery side by side: from ``kill -9`` of the holder's whole worker to the key's next run.

A lock that outlives its holder is the failure every task lock has to answer for: the host
dies, the OOM killer takes the worker, a deploy kills it with ``-9``. Nothing runs the release
then; the lock stays until something expires it. This benchmark measures, on real workers,
how long a key stays blocked after the worker holding it is killed, for:

- ``SingleFlightTask`` with the library's default lease TTL (30 s) and with ``lock_ttl=5``, each
  with the duplicate waiting the two ways the library offers: ``queue`` (parked in Redis before
  the kill; the queue sweeper in the surviving worker hands the key to it once the dead
  holder's lease has run out) and ``retry`` (re-sending itself with a backoff capped by the
  holder's lease time left, ``max_wait`` 3,600 s);
- ``celery_once.QueueOnce`` with its default timeout and ``celery_singleton.Singleton`` with its
  default lock expiry (both read from the installed libraries at run time, not typed here):
  both lock in ``apply_async``, so the producer (this benchmark) keeps trying to send a
  duplicate every ``--resend`` seconds (0.5), as a caller would, and it runs once one gets
  through;
- the common hand-written lock: ``SET key token NX EX 600`` around a plain task, whose duplicate
  retries every second (``benchmarks/recoveryapp.py``).

One measurement, per variant, on a fresh key and fresh workers: worker A (``celery worker
--pool prefork --concurrency 1``, consuming only the variant's "hold" queue) and worker B
(concurrency 2, only the "dup" queue) are started; the holder task is sent to A and, once its
body has started (the recorder shows it) and held the key for ``--held`` seconds (2), the
duplicate is set up (sent to B and seen parked or retrying; for celery-once and
celery-singleton, a first send seen refused). Then A's whole process group (the main process
and its pool: the group this benchmark started it in) gets ``SIGKILL``, and right after it the
time left on the lock is read: ``PTTL`` of the other locks' keys, and for ``SingleFlightTask``
the lease's own time left (``celery_singleflight.status(...).ttl_left``; its run record's PTTL
is longer by the status retention, also shown). The recorder is then polled for the key's next
body start (stamped by the worker, one host, one clock) for at most ``--window`` seconds (40);
the recovery time is that start minus the moment of the kill. Where the expiry is far longer
than the window, the report says so with the PTTL read, instead of waiting an hour (or
forever). Observation continues ``--after`` seconds (3) past a recovery, to see whether the
killed task itself ran again (it does not: its message was acknowledged when it started, Celery's
default ``acks_late=False``).

By default a private redis-server is started on a free loopback port (broker db 0, leases and
locks db 1, recorder db 3) and stopped afterwards. With ``--redis-url`` that server and DB are
used for everything instead: every key written starts with a unique prefix (celery-once's keys,
which take no prefix, are ``qo_recoveryapp.once.<prefix>_...``), and only those keys are deleted
at the end (nothing is flushed; locks left by the killed holders included). Workers are started
by this benchmark and stopped or killed by their own PIDs and process groups, never by name.

The result is a report, not a test: the exit status is 0 whatever it finds. The figures are
written to the "recovery" section of docs/benchmarks.md and docs/img/bench-recovery.png.

    .venv/bin/python benchmarks/bench_recovery.py [--window S] [--held S] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import kombu
import redis
from benchutil import (
    bar_chart,
    delete_matching,
    distinct_lines,
    import_app,
    machine,
    redis_for,
    version_of,
    worker_problems,
    write_section,
)
from kombu.utils.url import maybe_sanitize_url

import celery_singleflight
from celery_singleflight.testing import WorkerProcess

HERE = Path(__file__).resolve().parent
VARIANTS = ("sf_queue_30", "sf_retry_30", "sf_queue_5", "sf_retry_5", "once", "singleton", "setnx")
SF_VARIANTS = ("sf_queue_30", "sf_retry_30", "sf_queue_5", "sf_retry_5")
DISPATCH_LOCKS = ("once", "singleton")  # lock in apply_async, in the producer
SETUP_TIMEOUT = 30.0


@dataclass
class Result:
    variant: str
    label: str
    waits: str  # how the duplicate waits
    expiry: str  # configured expiry, from the library / task at run time
    left_text: str  # time left on the lock right after the kill
    left_seconds: float | None  # None: no expiry
    recovered: float | None  # seconds from the kill to the next body start; None: not within the window
    holder_again: bool
    observed: float  # seconds observed after the kill
    note: str = ""


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.02)


def _s(seconds: float) -> str:
    return f"{seconds:,.1f} s"


class Bench:
    def __init__(self, ra: ModuleType, args: argparse.Namespace, env: dict[str, str], locks: redis.Redis):
        self.ra = ra
        self.args = args
        self.env = env
        self.locks = locks
        self.recorder: redis.Redis = ra.recorder
        self.problems: list[str] = []

    def runs(self, key: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.recorder.lrange(self.ra.runs_key(key), 0, -1)]

    def waits(self, task_id: str) -> list[str]:
        return [raw.decode() for raw in self.recorder.lrange(self.ra.waits_key(task_id), 0, -1)]

    # -- what each variant is configured with, read from the objects themselves ------------------

    def configured(self, variant: str) -> tuple[str, str]:
        """(how the duplicate waits, the configured expiry)."""
        task = self.ra.TASKS[variant]
        if variant in SF_VARIANTS:
            opts = task.options
            policy = opts.on_duplicate
            waits = ("parked; the surviving worker's sweeper hands it the key"
                     if policy == "queue" else
                     f"backoff capped by the lease time left, max_wait {opts.max_wait:g} s")
            return waits, f"lease TTL {opts.ttl:g} s, renewed every {opts.heartbeat_interval:.3g} s"
        if variant == "once":
            return ("re-sent by the producer (refused: `REJECTED`)",
                    f"timeout {task.default_timeout:,} s (its default)")
        if variant == "singleton":
            expiry = task.lock_expiry if task.lock_expiry is not None else task.singleton_config.lock_expiry
            return ("re-sent by the producer (answered with the dead holder's `AsyncResult`)",
                    "none (its default: `SET NX` without expiry)"
                    if expiry is None else f"{expiry:,} s")
        return (f"`self.retry(countdown={self.ra.SETNX_RECHECK:g})` while the lock is taken",
                f"`SET NX EX {self.ra.SETNX_EX}` ({self.ra.SETNX_EX:,} s)")

    def lock_name(self, variant: str, key: str) -> str:
        task = self.ra.TASKS[variant]
        if variant == "once":
            return str(task.get_key((key, "holder", 0.0), {}))
        if variant == "singleton":
            return str(task.generate_lock(task.name, (key, "holder", 0.0), {}))
        if variant == "setnx":
            return str(self.ra.setnx_lock(key))
        return str(task.store.layout.run(task.render_key(key, "holder", 0.0)))

    def time_left(self, variant: str, key: str) -> tuple[str, float | None]:
        """What is left on the lock, read right after the kill."""
        name = self.lock_name(variant, key)
        pttl = int(self.locks.pttl(name))
        if variant in SF_VARIANTS:
            task = self.ra.TASKS[variant]
            st = celery_singleflight.status(self.ra.app, task.render_key(key, "holder", 0.0))
            left = st.ttl_left if st is not None and st.held else None
            lease = "not held" if left is None else f"lease {_s(left)} left"
            return f"{lease} (record PTTL {pttl / 1000:,.1f} s)", left
        if pttl == -1:
            return "PTTL -1: no expiry", None
        if pttl == -2:
            return "PTTL -2: no lock key", 0.0
        return f"PTTL {pttl / 1000:,.1f} s", pttl / 1000

    # -- one measurement ---------------------------------------------------------------------------

    def new_worker(self, variant: str, role: str, concurrency: int) -> WorkerProcess:
        queue = f"{self.ra.PREFIX}-rc-{variant}-{role}"
        return WorkerProcess("recoveryapp", concurrency=concurrency, env=self.env, cwd=str(HERE),
                             loglevel="INFO", extra=["-Q", queue, "--without-heartbeat"])

    def queue(self, variant: str, role: str) -> str:
        return f"{self.ra.PREFIX}-rc-{variant}-{role}"

    def measure(self, variant: str) -> Result:
        ra, args = self.ra, self.args
        task = ra.TASKS[variant]
        key = f"{variant}-{uuid.uuid4().hex[:8]}"
        waits, expiry = self.configured(variant)
        hold_q, dup_q = self.queue(variant, "hold"), self.queue(variant, "dup")
        worker_a = self.new_worker(variant, "hold", 1)
        worker_b = self.new_worker(variant, "dup", 2)
        try:
            worker_a.start()
            worker_b.start()
            holder = task.apply_async((key, "holder", 3600.0), queue=hold_q)
            holder_id = holder.id
            wait_for(lambda: any(r["task_id"] == holder_id for r in self.runs(key)), SETUP_TIMEOUT,
                     "holder start")
            time.sleep(args.held)
            self.set_up_duplicate(variant, task, key, holder_id, dup_q)
            kill_at = time.time()
            worker_a.kill()  # SIGKILL to A's whole process group: main process and pool
            left_text, left_seconds = self.time_left(variant, key)
            recovered, holder_again, observed, note = self.observe(variant, task, key, holder_id, dup_q,
                                                                   kill_at)
        finally:
            worker_a.kill()
            worker_b.stop()
            worker_b.kill()  # only B's own process group, if anything of it is left
            for worker, name in ((worker_a, "A"), (worker_b, "B")):
                self.problems.extend(f"[{variant} {name}] {line}" for line in worker_problems(worker.log()))
                if args.keep_logs:
                    print(f"  worker {name} log kept at {worker.log_path}")
                else:
                    worker.cleanup()
            # the killed holder's lock (ours expire by themselves; celery-once in an hour, the
            # hand-written one in 10 min, celery-singleton never): our own key, delete it
            self.locks.delete(self.lock_name(variant, key))
        label = self.label(variant)
        return Result(variant, label, waits, expiry, left_text, left_seconds, recovered, holder_again,
                      observed, note)

    def set_up_duplicate(self, variant: str, task: Any, key: str, holder_id: str, dup_q: str) -> None:
        """Before the kill: a duplicate parked or retrying on B, or a send refused by the producer."""
        if variant in DISPATCH_LOCKS:
            sent = task.apply_async((key, "dup", 0.2), queue=dup_q)
            if sent.id is not None and sent.id != holder_id:
                raise RuntimeError(f"{variant}: a duplicate was sent while the holder ran ({sent.id})")
            return
        dup = task.apply_async((key, "dup", 0.2), queue=dup_q)
        if variant in SF_VARIANTS:
            wanted = "queued" if task.options.on_duplicate == "queue" else "retry"
        else:
            wanted = "busy"
        wait_for(lambda: wanted in self.waits(dup.id), SETUP_TIMEOUT, f"duplicate {wanted}")

    def observe(self, variant: str, task: Any, key: str, holder_id: str, dup_q: str,
                kill_at: float) -> tuple[float | None, bool, float, str]:
        """Poll for the key's next body start after the kill; (recovered after s or None, the killed
        task ran again, seconds observed, note)."""
        args = self.args
        deadline = kill_at + args.window
        next_send = 0.0
        sent: str | None = None
        recovered: float | None = None
        holder_again = False
        note = ""
        while True:
            now = time.time()
            if variant in DISPATCH_LOCKS and sent is None and now >= next_send:
                result = task.apply_async((key, "dup", 0.2), queue=dup_q)
                if result.id is not None and result.id != holder_id:
                    sent = result.id
                    note = f"a send got through {time.time() - kill_at:,.1f} s after the kill"
                next_send = now + args.resend
            for run in self.runs(key):
                if run["start"] <= kill_at:
                    continue
                if run["task_id"] == holder_id:
                    holder_again = True
                if recovered is None:
                    recovered = run["start"] - kill_at
                    deadline = min(kill_at + args.window, time.time() + args.after)
            if time.time() >= deadline:
                return recovered, holder_again, time.time() - kill_at, note
            time.sleep(0.05)

    @staticmethod
    def label(variant: str) -> str:
        return {
            "sf_queue_30": "SingleFlightTask `queue`, TTL 30 s",
            "sf_retry_30": "SingleFlightTask `retry`, TTL 30 s",
            "sf_queue_5": "SingleFlightTask `queue`, TTL 5 s",
            "sf_retry_5": "SingleFlightTask `retry`, TTL 5 s",
            "once": "celery-once `QueueOnce`",
            "singleton": "celery-singleton `Singleton`",
            "setnx": "hand-written `SET NX EX 600`",
        }[variant]


def recovered_text(r: Result, window: float) -> str:
    if r.recovered is not None:
        return f"**{r.recovered:,.2f} s**"
    if r.left_seconds is None:
        return "never (no expiry)"
    return f"not within {window:g} s ({r.left_seconds:,.0f} s left)"


def table(results: list[Result], window: float) -> str:
    lines = ["| variant | duplicate waits by | expiry | left after the kill | key taken again after "
             "| killed task ran again |",
             "|---|---|---|---|---:|---|"]
    for r in results:
        again = "yes" if r.holder_again else f"no (observed {r.observed:,.1f} s)"
        lines.append(f"| {r.label} | {r.waits} | {r.expiry} | {r.left_text} | {recovered_text(r, window)} "
                     f"| {again} |")
    return "\n".join(lines)


def markdown(results: list[Result], failed: list[str], args: argparse.Namespace, host: str, setup: str,
             chart: str | None) -> str:
    parts = [
        "## Crash recovery: `kill -9` of the holder's worker (`benchmarks/bench_recovery.py`)",
        "",
        f"Alone: `.venv/bin/python benchmarks/bench_recovery.py` (options: `--help`). Measured {host}.",
        "",
        f"The holder has held its key {args.held:g} s on worker A when A's whole process group gets "
        "`SIGKILL`; a duplicate waits on worker B (for the libraries that lock in `apply_async`, the "
        f"producer re-sends every {args.resend:g} s). Expiries beyond {args.window:g} s are not waited "
        f"out: the PTTL read after the kill says when they end. {setup}",
        "",
        table(results, args.window),
    ]
    if failed:
        parts += ["", *[f"- FAILED: {f}" for f in failed]]
    if chart:
        parts += ["", chart]
    return "\n".join(parts)


def run(args: argparse.Namespace, url: str, private: bool) -> None:
    started = time.monotonic()
    host = machine()  # the load average at the start
    prefix = f"sfrc-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if private:
        broker_url, locks_url, recorder_url = f"{url}/0", f"{url}/1", f"{url}/3"
    else:
        broker_url = locks_url = recorder_url = url
    env = {
        "SF_RC_PREFIX": prefix,
        "SF_RC_BROKER": broker_url,
        "SF_RC_LOCKS": locks_url,
        "SF_RC_RECORDER": recorder_url,
        "SF_RC_SHARED": "0" if private else "1",
    }
    ra, env = import_app("recoveryapp", env)
    locks = redis.Redis.from_url(locks_url)
    server_version = locks.info("server")["redis_version"]
    setup = (f"Redis {server_version}, Celery {celery.__version__}, celery-once {version_of('celery-once')}, "
             f"celery-singleton {version_of('celery-singleton')}; Celery's default `acks_late=False`.")
    print(f"redis-server {server_version} at {maybe_sanitize_url(url)} "
          f"({'private, started by this benchmark' if private else 'given by --redis-url'}); key prefix "
          f"{prefix!r}")
    print(f"python {platform.python_version()}, celery {celery.__version__}, kombu {kombu.__version__}, "
          f"redis-py {redis.__version__}; {host}")
    wanted = [v for v in VARIANTS if v not in args.skip]
    bench = Bench(ra, args, env, locks)
    results: list[Result] = []
    failed: list[str] = []
    try:
        for variant in wanted:
            if variant not in ra.TASKS:
                failed.append(f"{variant}: {ra.UNAVAILABLE.get(variant, 'not installed')}")
                continue
            t0 = time.monotonic()
            try:
                r = bench.measure(variant)
            except (RuntimeError, TimeoutError) as exc:
                failed.append(f"{variant}: {exc}")
                print(f"  {variant}: FAILED: {exc}", flush=True)
                continue
            results.append(r)
            taken = f"{r.recovered:.2f} s" if r.recovered is not None else f"not within {args.window:g} s"
            print(f"  {r.label}: {r.left_text}; taken again after {taken}; killed task ran again: "
                  f"{'yes' if r.holder_again else 'no'} ({time.monotonic() - t0:.0f} s)", flush=True)
    finally:
        if not private:
            deleted = delete_matching(locks, f"{prefix}:*")
            deleted += delete_matching(locks, f"qo_{ra.once_task_name()}_*")
            print(f"cleanup: deleted {deleted:,} keys under {prefix}:* and qo_{ra.once_task_name()}_*")
        locks.close()
        ra.recorder.close()
        ra.locks.close()
        ra.app.pool.force_close_all()

    chart = None
    if results:
        labels = []
        for r in results:
            short = r.label.replace("SingleFlightTask ", "sf ").replace("`", "")
            short = short.replace(" QueueOnce", "").replace(" Singleton", "").replace("hand-written ", "")
            if r.recovered is None:
                left = "never expires" if r.left_seconds is None else f"{r.left_seconds:,.0f} s left"
                short = f"{short}: NOT within {args.window:g} s\n(bar drawn at {args.window:g} s; {left})"
            labels.append(short)
        values = [r.recovered if r.recovered is not None else args.window for r in results]
        chart = bar_chart("recovery", "Seconds from kill -9 of the holder's worker to the key's next run",
                          labels, values, "s", highlight=labels[0])
    md = markdown(results, failed, args, host, setup, chart)
    print()
    print(md)
    print()
    print(f"worker logs: {len(bench.problems)} warning/error lines" + (":" if bench.problems else ""))
    for line, count in distinct_lines(bench.problems)[:20]:
        print(f"  {line}" + (f"  (x {count})" if count > 1 else ""))
    write_section("recovery", md)
    print(f"total time {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--window", type=float, default=40.0,
                        help="longest wait for the key to be taken again after the kill, seconds (40)")
    parser.add_argument("--held", type=float, default=2.0,
                        help="seconds the holder holds the key before the kill (2)")
    parser.add_argument("--after", type=float, default=3.0,
                        help="seconds to keep watching after the key was taken again (3)")
    parser.add_argument("--resend", type=float, default=0.5,
                        help="celery-once/celery-singleton: seconds between the producer's sends (0.5)")
    parser.add_argument("--redis-url",
                        help="use this Redis and DB (only keys under a unique prefix are touched)")
    parser.add_argument("--skip", action="append", default=[], choices=VARIANTS,
                        help="leave a variant out (repeatable)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' log files")
    args = parser.parse_args()
    if args.window <= 0 or args.held < 0:
        parser.error("--window must be > 0 and --held >= 0")
    with redis_for(args.redis_url) as (url, private):
        run(args, url, private=private)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
