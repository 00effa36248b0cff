"""Progress cost of celery_singleflight: round trips, throttling, watcher latency, write rate.

``self.progress(...)`` inside a task is meant to be cheap enough to call in a hot loop and fast
enough to follow live: it is validated (``make_update``), throttled per run to ``progress_rate``
writes a second by a ``ProgressReporter`` whose pending update the process's heartbeat thread
writes when its turn comes, and each write is one Lua round trip (status hash + history stream
entry, which wakes watchers blocked in ``XREAD``). This benchmark checks those promises against
their budgets, without Celery, with the library's real objects wired as ``SingleFlightTask``
wires them: a ``LeaseStore`` lease, added to a ``Heartbeat``; a ``ProgressReporter`` whose
``schedule`` is that heartbeat's ``schedule_flush``; and a writer doing what
``SingleFlightTask._sf_progress_writer`` does minus its Celery parts (result meta, event):
``store.lease.progress(key, slot, token, json.dumps(update.as_dict()), update.state, seq)``, marking the
lease lost and raising ``LeaseLost`` if the write finds the lease gone.

1. Redis round trips per progress write, counted on the client (``send_packed_command`` calls
   of the writing thread, see :class:`RoundTrips`) over 1,000 unthrottled writes, after one
   warm-up write (the first write of a process also pays NOSCRIPT + SCRIPT LOAD; shown apart).
   Budget: 1.
2. Throttling: 1,000 ``make_update`` + ``submit()`` calls at ``rate=10``/s, once in a tight loop
   and once paced 1 ms apart (about 1 s, so the heartbeat's flushes are exercised during the
   loop). Counted: ``store.progress`` calls during the loop, and in total once the pending
   update has been flushed by the heartbeat thread. Budget: during the loop at most one write
   per throttle interval plus the first (``floor(rate x duration) + 1``), and one more in total
   for the final state; the status hash must end with the last update (``current == 1000``).
3. Watcher latency: a watcher in a separate process (multiprocessing ``spawn``, so the writer's
   GIL and threads do not distort it) runs ``StatusReader(store).watch(key)`` while this
   process writes 200 updates 10 ms apart at ``rate=1000`` (never throttled), each carrying
   its send time (``time.time()`` just before ``make_update``) in a field. The watcher records
   receive time minus send time for each; the run is then released (``store.release``) so the
   watch ends with its ``end`` event. The watch has a timeout and the process is joined with
   one, so it always stops. Budget: p50 <= 50 ms.
4. Unthrottled progress writes per second from one client (``rate`` = 1e9), the whole path of a
   ``progress()`` call (``make_update`` + ``submit`` + write), and bare redis-py PINGs per
   second from the same client (the ceiling for any 1-round-trip write), each for half of
   ``--seconds`` in alternating quarters (W P P W) so a noisy machine hits both alike; plus the
   script's own time inside Redis per write (``INFO commandstats``, EVALSHA usec / calls).

Leases use the library's defaults (TTL 30 s, heartbeat interval TTL / 3). Heartbeat renewals
share the client, so round trips are counted per thread and renewals are reported apart.

By default a private redis-server is started on a free loopback port and stopped afterwards.
With ``--redis-url`` that server is used instead: only keys under a unique namespace prefix are
written, and only those are deleted at the end (nothing is flushed).

The result is a report, not a test: the exit status is 0 whatever the verdicts.

    .venv/bin/python benchmarks/bench_progress.py [--seconds N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import platform
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis
from benchutil import delete_matching, machine, redis_for, write_section

from celery_singleflight import Lease
from celery_singleflight.errors import LeaseLost
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.lease import ProgressReply
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.heartbeat import Heartbeat
from celery_singleflight.run.progress import ProgressReporter, ProgressUpdate, make_update

TTL = 30.0  # the library's default lock_ttl
INTERVAL = TTL / 3  # the library's default heartbeat_interval
MAX_BYTES = 8192  # the library's default progress_max_bytes
UNTHROTTLED = 1e9  # a rate no loop reaches: every submit() writes at once

COUNTED_WRITES = 1_000
THROTTLE_RATE = 10.0  # the library's default progress_rate
THROTTLE_CALLS = 1_000
PACED_SLEEP = 0.001  # seconds between two calls of the paced throttle loop
FLUSH_WAIT = 5.0  # seconds to wait for the heartbeat to write the pending update

WATCH_UPDATES = 200
WATCH_RATE = 1_000.0
WATCH_SPACING = 0.010  # seconds between two updates
WATCH_TIMEOUT = 60.0  # the watcher gives up after this; the parent waits a little longer
READY_TIMEOUT = 60.0  # spawning the watcher and importing the library

MAX_TRIPS_PER_WRITE = 1
MAX_P50_MS = 50.0
BATCH = 100  # writes between two looks at the clock


class RoundTrips:
    """Client-side round trips of one ``redis.Redis`` client, per thread.

    Counted at ``Connection.send_packed_command``: redis-py calls it exactly once per request it
    writes, then blocks on the reply before writing anything else, so calls == round trips,
    hidden ones included (SCRIPT LOAD after NOSCRIPT, the handshake of a new connection). The
    heartbeat thread shares the client, so counts are kept per thread. The pool's connection
    class is swapped, so this must run before the client's first command.
    """

    def __init__(self, client: redis.Redis) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, int] = {}
        pool = client.connection_pool
        base: type[Any] = pool.connection_class
        counter = self

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> None:
            counter._add()
            base.send_packed_command(conn, command, check_health)

        pool.connection_class = type(
            f"RoundTripCounting{base.__name__}", (base,), {"send_packed_command": send_packed_command}
        )

    def _add(self) -> None:
        ident = threading.get_ident()
        with self._lock:
            self._by_thread[ident] = self._by_thread.get(ident, 0) + 1

    def total(self) -> int:
        with self._lock:
            return sum(self._by_thread.values())

    def mine(self) -> int:
        """Round trips made by the calling thread."""
        with self._lock:
            return self._by_thread.get(threading.get_ident(), 0)


@dataclass
class Run:
    """One run holding one key, with its reporter and a log of its writes."""

    key: str
    lease: Lease
    reporter: ProgressReporter
    writes: list[tuple[float, float]] = field(default_factory=list)  # perf_counter start, end


def progress_writer(lease: Lease, log: list[tuple[float, float]]) -> Callable[[ProgressUpdate], None]:
    """``Lease.write_progress`` without the result meta and the Celery event, timed."""
    seq = itertools.count(1)

    def write(update: ProgressUpdate) -> None:
        data = update.as_dict()
        started = time.perf_counter()
        try:
            code, _ = lease.store.lease.progress(
                lease.key, lease.slot, lease.token, json.dumps(data), update.state, next(seq))
            ours = code != ProgressReply.NOT_OURS
        except redis.RedisError as exc:
            print(f"warning: could not record progress of key={lease.key!r}: {exc}")
            ours = True  # as the task does: Redis trouble is the heartbeat's to judge
        log.append((started, time.perf_counter()))
        if not ours:
            lease.mark_lost("progress found the lease gone")
            raise LeaseLost(lease.key, lease.lost_reason)

    return write


class Bench:
    """One client, one store and one heartbeat, as one worker process has."""

    def __init__(self, url: str, namespace: str) -> None:
        self.url = url
        self.namespace = namespace
        self.client = redis.Redis.from_url(url)
        self.trips = RoundTrips(self.client)
        self.store = LeaseStore(self.client, KeyLayout(namespace))
        self.heartbeat = Heartbeat(self.store)

    def start(self, key: str, rate: float) -> Run:
        """Acquire ``key`` and wire a reporter the way ``SingleFlightTask`` does."""
        token = uuid.uuid4().hex
        got = self.store.acquire(key, token, TTL, Holder(task_id=token, task_name="bench"))
        if not isinstance(got, Acquired):
            raise RuntimeError(f"could not acquire free key {key!r}: {got}")
        lease = Lease(key=key, token=token, fence=got.fence, ttl=TTL, interval=INTERVAL,
                      task_id=token, task_name="bench", store=self.store, since=got.since)
        self.heartbeat.add(lease)
        writes: list[tuple[float, float]] = []
        lease.reporter = ProgressReporter(rate, progress_writer(lease, writes), self.heartbeat.schedule_flush)
        return Run(key, lease, lease.reporter, writes)

    def finish(self, run: Run, outcome: str = "succeeded") -> bool:
        """End the run as ``SingleFlightTask.__call__`` does: flush pending progress, release."""
        lease = run.lease
        self.heartbeat.discard(lease)
        if not lease.lost:
            run.reporter.flush()
        lease.released = True
        return bool(self.store.release(run.key, lease.token, outcome, fence=lease.fence))

    def evalsha_stats(self) -> tuple[int, int] | None:
        """EVALSHA calls the server has run and the microseconds they took (INFO commandstats),
        or None if refused (ACL)."""
        try:
            stats = self.admin.info("commandstats")
        except redis.ResponseError:
            return None
        entry = stats.get("cmdstat_evalsha")
        return (int(entry["calls"]), int(entry["usec"])) if isinstance(entry, dict) else (0, 0)

    def evalsha_calls(self) -> int | None:
        stats = self.evalsha_stats()
        return None if stats is None else stats[0]

    @property
    def admin(self) -> redis.Redis:
        """An uncounted connection for looking at the server."""
        if not hasattr(self, "_admin"):
            self._admin = redis.Redis.from_url(self.url)
        return self._admin

    def delete_namespace(self) -> int:
        """Delete the keys under ``namespace:`` (ours only) and return how many there were."""
        return delete_matching(self.admin, f"{self.namespace}:*")

    def close(self) -> None:
        self.heartbeat.stop()
        self.client.close()
        self.admin.close()


def update(i: int, total: int, **fields: Any) -> ProgressUpdate:
    """What ``self.progress("loading", current=i, total=total, message=..., **fields)`` builds."""
    return make_update("loading", i, total, f"item {i} of {total}", fields, max_bytes=MAX_BYTES)


# -- 1. round trips per write ----------------------------------------------------------------


@dataclass(frozen=True)
class TripsResult:
    first_write_trips: int
    trips_per_write: float


def measure_trips(bench: Bench) -> TripsResult:
    run = bench.start("trips", UNTHROTTLED)
    before = bench.trips.mine()
    run.reporter.submit(update(0, COUNTED_WRITES))  # the first PROGRESS script call of the process
    first = bench.trips.mine() - before
    before = bench.trips.mine()
    for i in range(1, COUNTED_WRITES + 1):
        if not run.reporter.submit(update(i, COUNTED_WRITES)):
            raise RuntimeError("an unthrottled submit() did not write at once")
    trips = bench.trips.mine() - before
    bench.finish(run)
    return TripsResult(first, trips / COUNTED_WRITES)


# -- 2. throttling ------------------------------------------------------------------------


@dataclass(frozen=True)
class ThrottleResult:
    label: str
    loop_seconds: float
    writes_during: int
    writes_total: int
    budget_during: int
    final_after_ms: float | None  # from the last call to the end of the write of the final state
    longest_gap_ms: float | None  # longest time between two write starts
    current: float | None
    state: str | None
    trips_total: int
    evalsha_server: int | None
    renewals: int

    @property
    def budget_total(self) -> int:
        return self.budget_during + 1


def measure_throttle(bench: Bench, key: str, label: str, pause: float) -> ThrottleResult:
    run = bench.start(key, THROTTLE_RATE)
    trips_before, rounds_before = bench.trips.total(), bench.heartbeat.rounds
    evalsha_before = bench.evalsha_calls()
    start = time.perf_counter()
    last_call = start
    for i in range(1, THROTTLE_CALLS + 1):
        run.reporter.submit(update(i, THROTTLE_CALLS))
        last_call = time.perf_counter()
        if pause:
            time.sleep(pause)
    end = time.perf_counter()
    writes_during = len(run.writes)
    deadline = time.monotonic() + FLUSH_WAIT
    while run.reporter.due is not None and time.monotonic() < deadline:
        time.sleep(0.005)
    time.sleep(0.05)  # let an in-flight flush finish and be logged
    writes = list(run.writes)
    evalsha_after = bench.evalsha_calls()
    trips = bench.trips.total() - trips_before
    renewals = bench.heartbeat.rounds - rounds_before
    status = StatusReader(bench.store).read(key)
    bench.finish(run)  # nothing pending any more: only the release
    loop_seconds = end - start
    starts = [s for s, _ in writes]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    return ThrottleResult(
        label=label,
        loop_seconds=loop_seconds,
        writes_during=writes_during,
        writes_total=len(writes),
        budget_during=math.floor(THROTTLE_RATE * loop_seconds) + 1,
        final_after_ms=(writes[-1][1] - last_call) * 1e3 if len(writes) > writes_during else None,
        longest_gap_ms=max(gaps) * 1e3 if gaps else None,
        current=None if status is None else status.current,
        state=None if status is None else status.state,
        trips_total=trips,
        evalsha_server=(None if evalsha_before is None or evalsha_after is None
                        else evalsha_after - evalsha_before),
        renewals=renewals,
    )


# -- 3. watcher latency -----------------------------------------------------------------------


def watcher_main(url: str, namespace: str, key: str, ready: Any, out: Any) -> None:
    """The watcher process: follow ``key`` and send back (current, latency) per update."""
    client = redis.Redis.from_url(url)
    report: dict[str, Any] = {"samples": [], "end": None, "other": 0, "error": None}
    try:
        reader = StatusReader(LeaseStore(client, KeyLayout(namespace)))
        for event in reader.watch(key, timeout=WATCH_TIMEOUT):
            received = time.time()
            if event.kind == "progress" and event.state == "ready":
                ready.set()
            elif event.kind == "progress" and "sent" in event.fields:
                report["samples"].append((event.current, received - float(event.fields["sent"])))
            elif event.final:
                report["end"] = event.state
            else:
                report["other"] += 1
    except Exception as exc:  # noqa: BLE001 - reported by the parent, whatever it is
        report["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        ready.set()  # never leave the parent waiting for a watcher that died
        out.send(report)
        out.close()
        client.close()


@dataclass(frozen=True)
class LatencyResult:
    latencies_ms: list[float]
    received: int
    in_order: bool
    end_state: str | None
    write_ms_p50: float
    written: int
    released: bool
    error: str | None


def percentile(values: Sequence[float], pct: float) -> float:
    """Nearest-rank percentile (no interpolation): a value that was actually observed."""
    ordered = sorted(values)
    rank = max(1, math.ceil(pct / 100.0 * len(ordered)))
    return ordered[rank - 1]


def measure_latency(bench: Bench) -> LatencyResult:
    ctx = multiprocessing.get_context("spawn")
    key = "watched"
    run = bench.start(key, WATCH_RATE)
    run.reporter.submit(make_update("ready", None, None, None, {}, max_bytes=MAX_BYTES))
    ready = ctx.Event()
    receiver, sender = ctx.Pipe(duplex=False)
    watcher = ctx.Process(target=watcher_main, args=(bench.url, bench.namespace, key, ready, sender),
                          name="bench-progress-watcher", daemon=True)
    watcher.start()
    sender.close()
    released = False
    report: dict[str, Any] = {"samples": [], "end": None, "error": "watcher sent nothing"}
    first_write = len(run.writes)
    try:
        if ready.wait(READY_TIMEOUT):
            time.sleep(0.1)  # let it reach its blocking XREAD
            start = time.perf_counter()
            for i in range(1, WATCH_UPDATES + 1):
                if not run.reporter.submit(update(i, WATCH_UPDATES, sent=time.time())):
                    print(f"warning: update {i} was throttled (rate {WATCH_RATE:g}/s)")
                time.sleep(max(0.0, start + i * WATCH_SPACING - time.perf_counter()))
        else:
            report["error"] = f"the watcher was not ready within {READY_TIMEOUT:g} s"
        released = bench.finish(run)  # the watcher's end event
        if receiver.poll(WATCH_TIMEOUT + 10):
            report = receiver.recv()
    finally:
        watcher.join(timeout=10)
        if watcher.is_alive():  # only our own child, by its handle
            watcher.terminate()
            watcher.join(timeout=5)
        receiver.close()
        if not run.lease.released:
            bench.finish(run, "failed")
    samples: list[tuple[float, float]] = report["samples"]
    currents = [c for c, _ in samples]
    writes = run.writes[first_write:]
    return LatencyResult(
        latencies_ms=[lat * 1e3 for _, lat in samples],
        received=len(samples),
        in_order=currents == sorted(currents),
        end_state=report["end"],
        write_ms_p50=percentile([(e - s) * 1e3 for s, e in writes], 50) if writes else math.nan,
        written=len(writes),
        released=released,
        error=report["error"],
    )


# -- 4. unthrottled write rate ------------------------------------------------------------------


def timed(step: Callable[[int], object], seconds: float) -> float:
    """Calls per second of ``step(i)``, run for about ``seconds``."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(BATCH):
            step(done)
            done += 1
        now = time.perf_counter()
        if now >= deadline:
            return done / (now - start)


@dataclass(frozen=True)
class RateResult:
    writes_per_second: float
    pings_per_second: float
    server_usec_per_write: float | None  # EVALSHA time inside Redis, from INFO commandstats


def measure_rate(bench: Bench, seconds: float) -> RateResult:
    """Progress writes/s and PINGs/s, each for ``seconds`` / 2, in alternating quarters."""
    run = bench.start("rate", UNTHROTTLED)
    submit = run.reporter.submit
    ping = bench.client.ping

    def write(i: int) -> None:
        submit(update(i, 1_000_000_000))

    def ping_once(_: int) -> None:
        ping()

    quarter = seconds / 4
    before = bench.evalsha_stats()
    writes_first = timed(write, quarter)
    after = bench.evalsha_stats()
    pings = timed(ping_once, quarter) + timed(ping_once, quarter)
    writes_second = timed(write, quarter)
    bench.finish(run)
    server = None
    if before is not None and after is not None and after[0] > before[0]:
        server = (after[1] - before[1]) / (after[0] - before[0])
    return RateResult((writes_first + writes_second) / 2, pings / 2, server)


# -- the report ---------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def throttle_rows(t: ThrottleResult) -> list[tuple[str, str, str, str]]:
    server = "n/a" if t.evalsha_server is None else f"{t.evalsha_server}"
    final_ok = t.current == THROTTLE_CALLS
    final_ms = "n/a" if t.final_after_ms is None else f"{t.final_after_ms:.0f} ms"
    gap = "n/a" if t.longest_gap_ms is None else f"{t.longest_gap_ms:.0f} ms"
    current = "n/a" if t.current is None else f"{t.current:g}"
    return [
        (
            f"{t.label}: writes during the loop ({THROTTLE_CALLS:,} calls in {t.loop_seconds * 1e3:,.1f} ms,"
            f" rate {THROTTLE_RATE:g}/s)",
            f"{t.writes_during}",
            f"≤ {t.budget_during} (floor(rate * duration) + 1)",
            verdict(1 <= t.writes_during <= t.budget_during),
        ),
        (
            f"{t.label}: writes in total, pending one flushed by the heartbeat"
            f" (server EVALSHA calls: {server}; client round trips: {t.trips_total},"
            f" renewals among them: {t.renewals})",
            f"{t.writes_total}",
            f"≤ {t.budget_total} (+1 for the final state)",
            verdict(t.writes_total <= t.budget_total and final_ok),
        ),
        (
            f"{t.label}: status hash after the flush (final write landed {final_ms} after the last call;"
            f" longest gap between writes {gap})",
            f"current = {current}, state = {t.state}",
            f"current = {THROTTLE_CALLS}",
            verdict(final_ok),
        ),
    ]


def table(
    trips: TripsResult, throttles: Sequence[ThrottleResult], lat: LatencyResult,
    rate: RateResult, seconds: float,
) -> str:
    rows: list[tuple[str, str, str, str]] = [
        (
            f"round trips per progress write, client ({COUNTED_WRITES:,} unthrottled writes)",
            f"{trips.trips_per_write:.2f}",
            f"{MAX_TRIPS_PER_WRITE}",
            verdict(trips.trips_per_write <= MAX_TRIPS_PER_WRITE),
        ),
        (
            "round trips of the process's first progress write (NOSCRIPT + SCRIPT LOAD + EVALSHA)",
            f"{trips.first_write_trips}",
            "—",
            "info",
        ),
    ]
    for t in throttles:
        rows += throttle_rows(t)
    complete = lat.received == WATCH_UPDATES and lat.in_order and lat.end_state is not None
    if lat.latencies_ms:
        p50, p90, p99 = (percentile(lat.latencies_ms, p) for p in (50, 90, 99))
        rows += [
            (
                f"watcher latency p50 / p90 / p99, send → watcher has the event (other process,"
                f" {WATCH_UPDATES} updates {WATCH_SPACING * 1e3:g} ms apart)",
                f"{p50:.2f} / {p90:.2f} / {p99:.2f} ms (max {max(lat.latencies_ms):.2f})",
                f"p50 ≤ {MAX_P50_MS:g} ms",
                verdict(p50 <= MAX_P50_MS),
            ),
        ]
    else:
        rows.append(("watcher latency", "no samples", f"p50 ≤ {MAX_P50_MS:g} ms", "MISS"))
    rows += [
        (
            "watcher: updates received in order / written, then the end event",
            f"{lat.received} / {lat.written}, in order: {'yes' if lat.in_order else 'NO'},"
            f" end: {lat.end_state or 'none'}",
            f"{WATCH_UPDATES} / {WATCH_UPDATES}, end: succeeded",
            verdict(complete and lat.end_state == "succeeded" and lat.released),
        ),
        (
            "writer side: one progress write (store.progress round trip), p50 during the latency run",
            f"{lat.write_ms_p50:.3f} ms",
            "—",
            "info",
        ),
        (
            f"unthrottled progress() writes/s, 1 client (make_update + submit + write, {seconds:g} s)",
            f"{rate.writes_per_second:,.0f} ({1e6 / rate.writes_per_second:.1f} µs/write)",
            "—",
            "info",
        ),
        (
            "of which inside Redis: PROGRESS script time per write (INFO commandstats EVALSHA usec)",
            "n/a" if rate.server_usec_per_write is None else f"{rate.server_usec_per_write:.1f} µs",
            "—",
            "info",
        ),
        (
            "ceiling: bare redis-py PINGs/s, same client, interleaved",
            f"{rate.pings_per_second:,.0f} ({1e6 / rate.pings_per_second:.1f} µs/PING)",
            "—",
            "info",
        ),
    ]
    lines = [
        "| measure | value | budget | verdict |",
        "|---|---:|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
    ]
    return "\n".join(lines)


def run(url: str, seconds: float, private: bool, write_docs: bool = False) -> None:
    namespace = f"sfbench-progress-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    bench = Bench(url, namespace)
    try:
        version = bench.admin.info("server")["redis_version"]
        print(f"redis-server {version} at {url} "
              f"({'private, started by this benchmark' if private else 'given by --redis-url'}), "
              f"namespace {namespace!r}, {os.cpu_count()} CPUs, TTL {TTL:g} s, "
              f"heartbeat interval {INTERVAL:g} s")
        print(f"python {platform.python_version()}, redis-py {redis.__version__}")
        bench.client.ping()  # connect (and count the handshake) before anything is measured
        trips = measure_trips(bench)
        tight = measure_throttle(bench, "tight", "tight loop", 0.0)
        paced = measure_throttle(bench, "paced", f"paced loop ({PACED_SLEEP * 1e3:g} ms sleeps)", PACED_SLEEP)
        latency = measure_latency(bench)
        rate = measure_rate(bench, seconds)
        rows = table(trips, [tight, paced], latency, rate, seconds)
        note = ("Latency is time.time() in the watcher process when watch() yields the event minus "
                "time.time() in the writer just before make_update(); both on this machine's clock.")
        print()
        print(rows)
        print()
        if latency.error:
            print(f"watcher error: {latency.error}")
        print(note)
        if write_docs:
            write_section("progress", "\n\n".join([
                "## Progress (`benchmarks/bench_progress.py`)",
                f"{machine()}; redis-server {version}. Reproduce with "
                "`.venv/bin/python benchmarks/bench_progress.py --write-docs` (private redis-server; the "
                "library's real `LeaseStore`, `Lease`, `ProgressReporter` and `Heartbeat`, wired as "
                "`SingleFlightTask` wires them).",
                rows, note,
            ]))
    finally:
        deleted = bench.delete_namespace()
        print(f"cleanup: deleted {deleted:,} keys under {namespace}:*")
        bench.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of the write-rate measurement")
    parser.add_argument("--redis-url", help="use this Redis (only keys under a unique prefix are touched)")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args()
    with redis_for(args.redis_url) as (url, private):
        run(url, args.seconds, private=private, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
