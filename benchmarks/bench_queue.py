"""Handoff latency of the ``queue`` policy on a real worker, next to ``retry`` and a fixed re-check.

With ``on_duplicate="queue"`` a duplicate parks itself in its key's FIFO and frees its worker
slot; when the holder releases, the release script hands the lease to the first parked run and
the releaser re-sends that run's message to the broker. The budget (from the issue): release ->
next parked run starting, through the broker, p50 <= 20 ms and p99 <= 100 ms on loopback. This
benchmark measures it on one real ``celery worker`` (prefork, concurrency 2: one slot holds the
key while the other takes the duplicate, which parks and frees it again; prefetch multiplier 1,
Redis broker) consuming a dedicated queue of ``benchmarks/queueapp.py``, side by side with the
two ways of waiting it replaces:

- ``retry``: the library's own ``on_duplicate="retry"``: the duplicate re-sends itself with a
  countdown, exponential backoff with jitter (0.1 s, 0.2 s, 0.4 s, ... capped by the holder's
  time left), ``max_wait`` 1 h so it never gives up here;
- fixed 10 s re-check, what Rotor does: a plain Celery task (no SingleFlightTask) takes its own
  lock with ``SET NX PX`` and, if that is taken, ``self.retry(countdown=10)``; it releases with a
  compare-and-delete script. Its latency is the 10 s minus however long the holder still had to
  run, so a few rounds (3 by default, about 10 s each) say all there is to say.

One round, each on a fresh key: dispatch a holder that runs for 0.3 s; once it has started
(the recorder shows its ``start``), dispatch a duplicate of it on the same key; wait until the
duplicate has run. Both write ``time.time()`` stamps to a recorder Redis DB from inside the
worker (one host, one clock; see ``queueapp.py``). The latency of a round is

    duplicate's body start - holder's release

where the release is stamped by a ``celery_singleflight.signals.lease_released`` receiver (the
re-check task: right after its compare-and-delete). The library sends that signal at the very
end of ``_sf_release``, after the release script *and* after the handoff message was sent, so a
second table measures the same rounds from the end of the holder's body instead (just before
the release script runs), which includes the release round trip and the handoff send. A round
counts only if the duplicate really found the key busy (a ``duplicate`` signal, or a re-check);
rounds are sequential, so the worker is otherwise idle. Warm-up runs of every task on both pool
processes come first (connections, script loads) and are not counted.

``--trace`` additionally stamps, per run, the handoff publish (``before_task_publish`` and
``after_task_publish`` in the holder's pool process), receipt by the worker's main process
(``task_received``) and the start in a pool process (``task_prerun``), and prints where the
``queue`` handoff's time goes. The stamps are extra Redis writes on the measured path (~0.1 ms
each), so the headline figures come from untraced runs.
``--worker-arg`` (repeatable) and ``--transport-options`` (JSON) change the worker and kombu
settings for experiments, e.g. ``--worker-arg=-Ofair`` or ``--transport-options
'{"polling_interval": 0.1}'``.

By default a private redis-server is started on a free loopback port (broker db 0, leases db 2,
recorder db 3) and stopped afterwards. With ``--redis-url`` that server and DB are used for
everything instead: every key written (lease namespace, recorder, locks, and the broker's own
keys via kombu's ``global_keyprefix``) starts with a unique prefix, and only keys under that
prefix are deleted at the end (nothing is flushed). The worker is started by this benchmark and
stopped by its own PID (SIGTERM, then SIGKILL of its own process group if needed).

The result is a report, not a test: the exit status is 0 whatever the verdicts.

    .venv/bin/python benchmarks/bench_queue.py [--rounds N] [--recheck-rounds N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import celery
import kombu
import redis
from benchutil import delete_matching, import_app, machine, redis_for, write_section
from kombu.utils.url import maybe_sanitize_url

from celery_singleflight.testing import WorkerProcess

HERE = Path(__file__).resolve().parent
HOLD_SECONDS = 0.3  # how long each holder runs
CONCURRENCY = 2  # one slot holds, the other takes the duplicate (which parks and frees it)
RECHECK_SECONDS = 10.0  # Rotor's fixed re-check
ROUND_TIMEOUT = 30.0  # seconds a queue/retry round may take before it is given up
BUDGET_P50_MS = 20.0
BUDGET_P99_MS = 100.0
WARMUP_RUNS = 4  # uncontended runs per task, spread over the pool processes


@dataclass
class Round:
    latency: float  # duplicate start - holder release (lease_released signal / after delete)
    from_end: float  # duplicate start - end of the holder's body (before the release)
    attempts: int  # how many times the duplicate found the key busy
    stamps: dict[str, dict[str, float]]  # role -> stamp name -> time.time()


@dataclass
class Series:
    label: str
    policy: str
    rounds: list[Round] = field(default_factory=list)
    not_busy: int = 0  # the duplicate never found the key busy: not a handoff, not counted
    failed: list[str] = field(default_factory=list)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def wait_for(check: Callable[[], Any], timeout: float, what: str, alive: Callable[[], bool]) -> Any:
    """Poll ``check`` until it returns something truthy; raise TimeoutError after ``timeout``.

    Polling only decides when the next round may start: every timestamp measured is written by
    the worker itself, so the poll interval does not show in the figures.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if not alive():
            raise RuntimeError(f"the worker exited while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout:g} s")
        time.sleep(0.005)


class Bench:
    def __init__(self, qa: ModuleType, worker: WorkerProcess, hold: float) -> None:
        self.qa = qa
        self.worker = worker
        self.hold = hold
        self.recorder: redis.Redis = qa.recorder

    def alive(self) -> bool:
        return self.worker.proc is not None and self.worker.proc.poll() is None

    def stamps(self, task_id: str) -> dict[str, float]:
        raw = self.recorder.hgetall(self.qa.record_key(task_id))
        return {k.decode(): float(v) for k, v in raw.items()}

    def released(self, task_id: str) -> bool:
        return bool(self.recorder.hexists(self.qa.record_key(task_id), "released"))

    def warm_up(self, tasks: Sequence[Any]) -> None:
        """Uncontended runs of every task (both pool processes): connections and script loads."""
        ids: list[str] = []
        for task in tasks:
            for n in range(WARMUP_RUNS):
                key = f"warmup-{task.name}-{n}-{uuid.uuid4().hex[:8]}"
                ids.append(task.apply_async((key, "warmup", 0.05)).id)
        for task_id in ids:
            wait_for(lambda t=task_id: self.released(t), ROUND_TIMEOUT, "warm-up run", self.alive)

    def one_round(self, task: Any, timeout: float) -> Round | None:
        key = f"r-{uuid.uuid4().hex}"
        holder = task.apply_async((key, "holder", self.hold)).id
        wait_for(lambda: self.recorder.hexists(self.qa.record_key(holder), "start"), timeout,
                 "holder start", self.alive)
        dup = task.apply_async((key, "dup", 0.0)).id
        wait_for(lambda: self.released(dup), timeout, "duplicate run", self.alive)
        wait_for(lambda: self.released(holder), timeout, "holder release", self.alive)
        attempts = self.recorder.llen(self.qa.dup_key(dup))
        if not attempts:
            return None
        h, d = self.stamps(holder), self.stamps(dup)
        return Round(d["start"] - h["released"], d["start"] - h["end"], attempts, {"holder": h, "dup": d})

    def series(self, label: str, policy: str, task: Any, rounds: int, timeout: float,
               progress: bool = False) -> Series:
        out = Series(label, policy)
        for n in range(rounds):
            try:
                got = self.one_round(task, timeout)
            except (TimeoutError, RuntimeError) as exc:
                out.failed.append(str(exc))
                if not self.alive():
                    break
                continue
            if got is None:
                out.not_busy += 1
            else:
                out.rounds.append(got)
                if progress:
                    print(f"  {label} round {n + 1}/{rounds}: {got.latency * 1e3:,.1f} ms", flush=True)
        return out


def _ms(value: float) -> str:
    return f"{value * 1e3:,.1f}"


def verdict(series: Series) -> str:
    if series.policy != "queue":
        return "baseline"
    lat = [r.latency for r in series.rounds]
    if not lat:
        return "n/a (no rounds)"
    misses = []
    if percentile(lat, 50) * 1e3 > BUDGET_P50_MS:
        misses.append("p50")
    if percentile(lat, 99) * 1e3 > BUDGET_P99_MS:
        misses.append("p99")
    return "PASS" if not misses else f"MISS ({', '.join(misses)})"


def table(all_series: Sequence[Series], pick: Callable[[Round], float], with_budget: bool) -> str:
    head = "| policy | rounds | p50 ms | p90 ms | p99 ms | max ms |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if with_budget:
        head += " budget | verdict |"
        rule += "---|---|"
    lines = [head, rule]
    for s in all_series:
        values = [pick(r) for r in s.rounds]
        if values:
            figures = [_ms(percentile(values, q)) for q in (50, 90, 99)] + [_ms(max(values))]
        else:
            figures = ["n/a"] * 4
        row = f"| {s.label} | {len(values)} | {' | '.join(figures)} |"
        if with_budget:
            budget = (f"p50 ≤ {BUDGET_P50_MS:g} ms, p99 ≤ {BUDGET_P99_MS:g} ms" if s.policy == "queue"
                      else "— (comparison)")
            row += f" {budget} | {verdict(s)} |"
        lines.append(row)
    return "\n".join(lines)


def breakdown(series: Series) -> str:
    """Where the time goes from the end of the holder's body to the duplicate's start (--trace)."""
    steps = [
        ("holder body end → handoff about to be published (release script, message rebuilt)",
         "holder", "end", "dup", "publishing"),
        ("handoff about to be published → published (apply_async: LPUSH to the broker)",
         "dup", "publishing", "dup", "published"),
        ("handoff published → lease_released signal in the holder", "dup", "published",
         "holder", "released"),
        ("handoff published → received by the worker's main process (BRPOP)", "dup", "published",
         "dup", "received"),
        ("received → task_prerun in a pool process (main → child)", "dup", "received", "dup", "prerun"),
        ("task_prerun → body start (lease adopted in __call__)", "dup", "prerun", "dup", "start"),
        ("holder body end → duplicate body start (total)", "holder", "end", "dup", "start"),
    ]
    lines = [f"Breakdown for {series.label} ({len(series.rounds)} rounds):", "",
             "| step | p50 ms | p90 ms | max ms |", "|---|---:|---:|---:|"]
    for label, role_a, stamp_a, role_b, stamp_b in steps:
        values = [r.stamps[role_b][stamp_b] - r.stamps[role_a][stamp_a] for r in series.rounds
                  if stamp_a in r.stamps[role_a] and stamp_b in r.stamps[role_b]]
        if values:
            lines.append(f"| {label} | {_ms(percentile(values, 50))} | {_ms(percentile(values, 90))} | "
                         f"{_ms(max(values))} |")
        else:
            lines.append(f"| {label} | n/a | n/a | n/a |")
    return "\n".join(lines)


def worker_problems(log: str) -> list[str]:
    wanted = ("ERROR", "CRITICAL", "Traceback", "WARNING/MainProcess")
    return [line for line in log.splitlines() if any(w in line for w in wanted)]


def run(args: argparse.Namespace, url: str, private: bool) -> None:
    prefix = f"sfbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if private:
        broker, leases, recorder = f"{url}/0", f"{url}/2", f"{url}/3"
    else:
        broker = leases = recorder = url
    env = {
        "SF_BENCH_PREFIX": prefix,
        "SF_BENCH_BROKER": broker,
        "SF_BENCH_LEASES": leases,
        "SF_BENCH_RECORDER": recorder,
        "SF_BENCH_QUEUE": f"{prefix}-queue",
        "SF_BENCH_RECHECK": repr(RECHECK_SECONDS),
        "SF_BENCH_BROKER_PREFIX": "0" if private else "1",
        "SF_BENCH_TRACE": "1" if args.trace else "0",
        "SF_BENCH_TRANSPORT_OPTIONS": args.transport_options or "",
    }
    qa, env = import_app("queueapp", env)
    admin = redis.Redis.from_url(url)
    server_version = admin.info("server")["redis_version"]
    worker = WorkerProcess("queueapp", concurrency=CONCURRENCY, env=env, cwd=str(HERE),
                           loglevel=args.loglevel, extra=["-Q", qa.QUEUE, *args.worker_arg])
    print(f"redis-server {server_version} at {maybe_sanitize_url(url)} "
          f"({'private, started by this benchmark' if private else 'given by --redis-url'}); "
          f"broker {maybe_sanitize_url(broker)}, leases {maybe_sanitize_url(leases)}, "
          f"recorder {maybe_sanitize_url(recorder)}; key prefix {prefix!r}")
    print(f"python {platform.python_version()}, celery {celery.__version__}, kombu {kombu.__version__}, "
          f"redis-py {redis.__version__}, {os.cpu_count()} CPUs")
    command = ["celery", "worker", "--pool", "prefork", "--concurrency", str(CONCURRENCY),
               "--prefetch-multiplier", "1", "--without-gossip", "--without-mingle", "-Q", qa.QUEUE,
               *args.worker_arg]
    print(f"worker: 1 x `{' '.join(command)}` (loglevel {args.loglevel}); broker transport: Redis "
          f"(kombu), transport options {json.dumps(qa.transport_options)}; acks early "
          f"(task_acks_late off); results ignored")
    print(f"holder runs {HOLD_SECONDS if args.hold is None else args.hold:g} s; duplicate dispatched once "
          f"the holder has started; rounds sequential, fresh key each; trace stamps "
          f"{'ON (extra Redis writes on the path)' if args.trace else 'off'}")
    all_series: list[Series] = []
    worker.start()
    try:
        print(f"worker ready (pid {worker.proc.pid if worker.proc else '?'}, pool processes "
              f"{worker.children()})", flush=True)
        bench = Bench(qa, worker, HOLD_SECONDS if args.hold is None else args.hold)
        bench.warm_up([qa.via_queue, qa.via_retry, qa.via_recheck])
        # a few unmeasured contended rounds: the first park/handoff of each pool process loads scripts
        bench.series("warm-up", "queue", qa.via_queue, 4, ROUND_TIMEOUT)
        bench.series("warm-up", "retry", qa.via_retry, 2, ROUND_TIMEOUT)
        t0 = time.monotonic()
        all_series.append(bench.series("`queue`", "queue", qa.via_queue, args.rounds, ROUND_TIMEOUT))
        all_series.append(bench.series("`retry` (default backoff, max_wait 3600 s)", "retry", qa.via_retry,
                                       args.rounds, ROUND_TIMEOUT))
        print(f"queue and retry: {2 * args.rounds} rounds in {time.monotonic() - t0:.1f} s; now "
              f"{args.recheck_rounds} fixed {RECHECK_SECONDS:g} s re-check rounds "
              f"(about {RECHECK_SECONDS:g} s each)", flush=True)
        if args.recheck_rounds:
            all_series.append(bench.series(f"fixed {RECHECK_SECONDS:g} s re-check (Rotor-style)", "recheck",
                                           qa.via_recheck, args.recheck_rounds,
                                           RECHECK_SECONDS + ROUND_TIMEOUT, progress=True))
    finally:
        worker.stop()
        worker.kill()  # only the worker's own process group, if anything of it is left
        log = worker.log()
        if not private:
            deleted = delete_matching(admin, f"{prefix}:*")
            print(f"cleanup: deleted {deleted:,} keys under {prefix}:*")
        admin.close()
        qa.app.pool.force_close_all()

    latency_table = table(all_series, lambda r: r.latency, with_budget=True)
    from_end_table = table(all_series, lambda r: r.from_end, with_budget=False)
    print()
    print("Release → duplicate body start (release = lease_released signal; re-check: after its delete):")
    print()
    print(latency_table)
    print()
    print("Same rounds, from the end of the holder's body (before the release script runs):")
    print()
    print(from_end_table)
    print()
    if args.write_docs:
        write_section("queue", "\n\n".join([
            "## Hand-off latency: release to the next run (`benchmarks/bench_queue.py`)",
            f"{machine()}. Reproduce with `.venv/bin/python benchmarks/bench_queue.py --write-docs` "
            f"({args.rounds} rounds per policy; one real worker, Redis broker; the holder runs "
            f"{HOLD_SECONDS if args.hold is None else args.hold:g} s, the duplicate is sent while it holds "
            "the key). `queue` hands the key to the parked run in the release script and sends its "
            "message at once; `retry` re-sends after its backoff; the fixed re-check row is a duplicate "
            f"that simply tries again after {RECHECK_SECONDS:g} s, for comparison.",
            "Release → duplicate body start:", latency_table,
            "Same rounds, from the end of the holder's body (before the release script runs):",
            from_end_table,
        ]))
    for s in all_series:
        attempts = [r.attempts for r in s.rounds]
        extra = (f"; duplicate found the key busy {min(attempts)} to {max(attempts)} times per round "
                 f"(median {statistics.median(attempts):g})" if attempts else "")
        notes = f"{s.label}: {len(s.rounds)} round(s) counted, {s.not_busy} not counted (key not busy)"
        if s.failed:
            notes += f", {len(s.failed)} failed (first: {s.failed[0]})"
        print(notes + extra)
    if args.recheck_rounds:
        print(f"The fixed re-check row has only {args.recheck_rounds} round(s) on purpose: its latency "
              f"is {RECHECK_SECONDS:g} s minus the holder's remaining run time, so its p90/p99 are "
              f"interpolated from those few values. Percentiles everywhere interpolate linearly "
              f"between closest ranks (p99 of 50 rounds lies between the two largest).")
    if args.trace:
        for s in all_series:
            if s.policy == "queue" and s.rounds:  # retry re-sends are not handoffs
                print()
                print(breakdown(s))
    problems = worker_problems(log)
    print()
    print(f"worker log: {len(problems)} warning/error lines" + (":" if problems else ""))
    for line in problems[:10]:
        print(f"  {line}")
    if args.keep_log:
        print(f"worker log kept at {worker.log_path}")
    else:
        worker.log_path.unlink(missing_ok=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=50, help="rounds for queue and for retry (50)")
    parser.add_argument("--recheck-rounds", type=int, default=3,
                        help="rounds for the fixed 10 s re-check (3, about 10 s each)")
    parser.add_argument("--redis-url",
                        help="use this Redis and DB (only keys under a unique prefix are touched)")
    parser.add_argument("--trace", action="store_true", help="stamp and print where the time goes")
    parser.add_argument("--hold", type=float, default=None, help=f"holder run time, s ({HOLD_SECONDS:g})")
    parser.add_argument("--worker-arg", action="append", default=[],
                        help="extra `celery worker` argument (repeatable), e.g. --worker-arg=-Ofair")
    parser.add_argument("--transport-options", default="",
                        help='extra kombu transport options as JSON, e.g. \'{"polling_interval": 0.1}\'')
    parser.add_argument("--loglevel", default="INFO", help="worker log level (INFO)")
    parser.add_argument("--keep-log", action="store_true", help="keep the worker's log file")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args()
    with redis_for(args.redis_url) as (url, private):
        run(args, url, private=private)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
