"""The contended case on a real worker: a burst of duplicates per key, under each duplicate policy,
next to celery-once and celery-singleton.

The other benchmarks measure a lease nobody else wants. This one measures what the library is
for: many tasks on few keys at once. N tasks (``--tasks``, default 2,000) over K keys
(``--keys``, default 20; 100 tasks per key) are published in one burst, each task's body
sleeping a short fixed time (``--sleep``, default 20 ms), and drained by one real worker
(``celery worker --pool prefork --concurrency 4``, Celery's default prefetch multiplier,
``--without-gossip --without-mingle --without-heartbeat``), fresh for every measurement so no
variant inherits another's state. Variants (``benchmarks/contendedapp.py``):

- ``SingleFlightTask`` with ``on_duplicate`` =
  - ``raise``: a duplicate fails with ``LockHeld`` without running. Runs: about one per key per
    holder window (a body runs whenever its message is taken while no run of its key is inside
    one), so far fewer than N;
  - ``skip``: the same, but the duplicate ends ``SUCCESS`` with a "skipped" result;
  - ``retry``: a duplicate re-sends itself after a jittered, doubling backoff (capped by the
    holder's lease time left) until it gets the key; ``max_wait`` 3,600 s, so every task runs
    once, one at a time per key, and the drain is paced by the backoff;
  - ``queue``: a duplicate parks in the key's FIFO in Redis and frees its worker slot; each
    release hands the key to the next parked run and re-sends its message. Every task runs, all
    100 per key one at a time, in order;
  - ``join``: a duplicate does not run; when the holder ends, its result is stored as the
    duplicate's own. Runs: about one per key per holder window, like ``raise``, and every
    duplicate ends ``SUCCESS`` with the holder's result (the table counts them);
- ``celery_once.QueueOnce`` (``graceful``, its default timeout) and
  ``celery_singleton.Singleton`` (its defaults), keyed on the same ``key`` argument. Both lock in
  ``apply_async``, in the producer: with the burst published before the worker starts, only the
  first task per key is published (the others get celery-once's ``REJECTED`` or
  celery-singleton's "already queued" ``AsyncResult`` of the first), so K bodies run in all.

Every variant stores its results in the result backend (the private server's DB 2), so "not
terminal" is checked the same way for each, and ``join`` has the backend it needs.

One measurement: publish the burst to the variant's own queue while nothing consumes it (in the
order ``--order``: ``grouped``, the default, sends each key's tasks back to back, as a storm of
duplicates arrives; ``shuffled`` mixes keys at random with a fixed seed; ``interleaved`` sends
key 0, 1, ..., K-1, 0, 1, ... which with K >= 4 puts no two runs of a key in the pool at once and
so is not contended at all), start the worker and wait until every published task is in a ready
state (``SUCCESS``/``FAILURE``/``REVOKED`` in the result backend, read with MGET, only the ones
not yet ready), or until nothing changed for ``--stall`` seconds (60), or ``--timeout`` (600).
After a further ``--grace`` (3 s) the report reads:

- **wall**: first task start to last task end, stamped inside the worker by
  ``task_prerun``/``task_postrun`` receivers (every message counts, also a duplicate turned away);
- **runs/s**: bodies run / wall;
- **overlaps**: the independent recorder (a Redis DB the library never touches) counts each time
  a body started while another body of the same key was inside its own (per key ``INCR`` of an
  "active" counter at the start, ``DECR`` at the end); it must be 0 for every policy;
- **bodies run** and **distinct tasks run** (a task id that ran twice would show as a difference);
- **not terminal**: published tasks whose state is not ready after the drain and the grace
  (``QUEUED``, ``JOINED``, ``RETRY``, ``PENDING`` ... left behind);
- **keys held**: for ``SingleFlightTask`` ``celery_singleflight.held(app)`` (SCAN of the run
  records, leases still held) filtered to the round's keys; for celery-once and
  celery-singleton their lock keys for the round's K keys, named by their own key functions
  (``QueueOnce.get_key``, ``Singleton.generate_lock``) and checked with EXISTS.

The wall time starts at the worker's first task, so the producer's cost (celery-once and
celery-singleton take a lock per ``apply_async``, and refuse duplicates there) shows in the
dispatch rate column instead. ``--rounds`` repeats the variants (interleaved: every variant once
per round); the summary gives medians and, for the correctness columns, totals.

By default a private redis-server is started on a free loopback port (broker db 0, leases and
locks db 1, results db 2, recorder db 3) and stopped afterwards. With ``--redis-url`` that
server and DB are used for everything instead: every key written starts with a unique prefix
(broker and result keys via ``global_keyprefix``; celery-once's keys, which take no prefix, are
``qo_contendedapp.once.<prefix>_...``) and only those keys are deleted at the end (nothing is
flushed). Workers are started by this benchmark and stopped by their own PIDs (SIGTERM, then
SIGKILL of their own process group if anything is left).

The result is a report, not a test: the exit status is 0 whatever it finds. The figures are
written to the "contended" section of docs/benchmarks.md and docs/img/bench-contended.png.

    .venv/bin/python benchmarks/bench_contended.py [--tasks N] [--keys K] [--rounds N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import random
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
from celery import states
from kombu.utils.url import maybe_sanitize_url

import celery_singleflight
from celery_singleflight.testing import WorkerProcess

HERE = Path(__file__).resolve().parent
CONCURRENCY = 4
VARIANTS = ("raise", "skip", "retry", "queue", "join", "once", "singleton")
LABELS = {
    "raise": "SingleFlightTask `raise`",
    "skip": "SingleFlightTask `skip`",
    "retry": "SingleFlightTask `retry`",
    "queue": "SingleFlightTask `queue`",
    "join": "SingleFlightTask `join`",
    "once": "celery-once `QueueOnce` (graceful)",
    "singleton": "celery-singleton `Singleton`",
}
SHORT = {
    "raise": "sf raise", "skip": "sf skip", "retry": "sf retry", "queue": "sf queue", "join": "sf join",
    "once": "celery-once", "singleton": "celery-singleton",
}
POLL = 0.5  # seconds between readiness polls of the result backend
MGET_BATCH = 500


@dataclass
class Measurement:
    round_no: int
    variant: str
    published: int  # messages in the broker after the burst
    refused_at_dispatch: int  # celery-once REJECTED / celery-singleton "already queued" at apply_async
    dispatch_per_s: float
    wall: float  # first task start -> last task end (worker-side stamps)
    bodies: int
    distinct: int
    overlaps: int
    max_active: int
    not_terminal: int
    not_terminal_states: dict[str, int]
    held: int
    states: dict[str, int]
    holder_results: int  # SUCCESS results that name another task as the one that ran (join)
    drained: str  # "all ready", "stalled ...", "timeout ..."
    drain_seconds: float  # worker start -> all ready (or given up)
    stuck: list[str] = field(default_factory=list)  # what is known of tasks left not terminal
    stuck_answered: int = 0  # of those: message handed to a release whose holder ended SUCCESS

    @property
    def runs_per_s(self) -> float:
        return self.bodies / self.wall if self.wall > 0 else 0.0


@dataclass
class Variant:
    name: str
    available: bool
    note: str = ""
    runs: list[Measurement] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def key_order(tasks: int, keys: int, order: str) -> list[int]:
    """The key index of each task of the burst, in publishing order."""
    if order == "grouped":
        return [n * keys // tasks for n in range(tasks)]
    spread = [n % keys for n in range(tasks)]
    if order == "shuffled":
        random.Random(20_000).shuffle(spread)
    return spread


class Bench:
    def __init__(self, ca: ModuleType, args: argparse.Namespace, env: dict[str, str], broker: redis.Redis,
                 locks: redis.Redis, broker_key_prefix: str) -> None:
        self.ca = ca
        self.args = args
        self.env = env
        self.broker = broker
        self.locks = locks
        self.broker_key_prefix = broker_key_prefix
        self.recorder: redis.Redis = ca.recorder
        self.backend = ca.app.backend
        self.problems: list[str] = []
        self.key_of: dict[str, str] = {}  # task id -> its key (argument), for the diagnostics

    def queue(self, variant: str) -> str:
        return f"{self.ca.PREFIX}-ct-{variant}"

    def new_worker(self, variant: str) -> WorkerProcess:
        worker = WorkerProcess("contendedapp", concurrency=CONCURRENCY, env=self.env, cwd=str(HERE),
                               loglevel="INFO", extra=["-Q", self.queue(variant), "--without-heartbeat"])
        # WorkerProcess pins --prefetch-multiplier 1 (right for latency tests); a drain runs with
        # Celery's default (4), as bench_throughput does
        at = worker.args.index("--prefetch-multiplier")
        del worker.args[at:at + 2]
        return worker

    # -- reading the result backend --------------------------------------------------------------

    def metas(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """task id -> its stored meta (absent: nothing stored yet, i.e. PENDING)."""
        out: dict[str, dict[str, Any]] = {}
        client = self.backend.client
        for start in range(0, len(ids), MGET_BATCH):
            batch = ids[start:start + MGET_BATCH]
            raws = client.mget([self.backend.get_key_for_task(t) for t in batch])
            for task_id, raw in zip(batch, raws, strict=True):
                if raw is not None:
                    out[task_id] = self.backend.decode_result(raw)
        return out

    def wait_ready(self, ids: list[str], alive: Callable[[], bool], round_id: str) -> tuple[str, float]:
        """Poll until every task id is ready; stop early when nothing changes for --stall s."""
        t0 = time.monotonic()
        pending = list(ids)
        last_change = t0
        last_seen: tuple[int, int] = (-1, -1)
        while pending:
            metas = self.metas(pending)
            pending = [t for t in pending if metas.get(t, {}).get("status") not in states.READY_STATES]
            bodies = self.bodies_so_far(round_id)
            now = time.monotonic()
            if (len(pending), bodies) != last_seen:
                last_seen, last_change = (len(pending), bodies), now
            if not pending:
                break
            if not alive():
                return "the worker exited", now - t0
            if now - last_change > self.args.stall:
                return f"stalled: nothing changed for {self.args.stall:g} s", now - t0
            if now - t0 > self.args.timeout:
                return f"timeout after {self.args.timeout:g} s", now - t0
            time.sleep(POLL)
        return "all ready", time.monotonic() - t0

    def bodies_so_far(self, round_id: str) -> int:
        pipe = self.recorder.pipeline(transaction=False)
        for k in range(self.args.keys):
            pipe.llen(self.ca.runs_key(round_id, self.key_name(round_id, k)))
        return sum(int(n) for n in pipe.execute())

    @staticmethod
    def key_name(round_id: str, k: int) -> str:
        return f"{round_id}:k{k:03d}"

    # -- keys still held ---------------------------------------------------------------------------

    def held_keys(self, variant: str, round_id: str) -> int:
        task = self.ca.TASKS[variant]
        keys = [self.key_name(round_id, k) for k in range(self.args.keys)]
        if variant in self.ca.POLICIES:
            rendered = {task.render_key(key, 0, round_id) for key in keys}
            return sum(1 for st in celery_singleflight.held(self.ca.app, prefix='ct:"' + round_id)
                       if st.key in rendered)
        if variant == "once":
            names = [task.get_key((key, 0, round_id), {}) for key in keys]
        else:
            names = [task.generate_lock(task.name, (key, 0, round_id), {}) for key in keys]
        return int(self.locks.exists(*names)) if names else 0

    # -- one measurement ---------------------------------------------------------------------------

    def dispatch(self, variant: str, round_id: str) -> tuple[list[str], int, float]:
        """Publish the burst; return (published task ids, refused at dispatch, dispatch rate)."""
        task = self.ca.TASKS[variant]
        queue = self.queue(variant)
        self.broker.delete(f"{self.broker_key_prefix}{queue}")  # our own queue: leftovers of a failed run
        order = key_order(self.args.tasks, self.args.keys, self.args.order)
        ids: list[str] = []
        seen: set[str] = set()
        refused = 0
        t0 = time.perf_counter()
        for i, k in enumerate(order):
            result = task.apply_async((self.key_name(round_id, k), i, round_id), queue=queue)
            if result.id is None or result.id in seen:  # celery-once REJECTED; celery-singleton's duplicate
                refused += 1
                continue
            seen.add(result.id)
            ids.append(result.id)
            self.key_of[result.id] = self.key_name(round_id, k)
        elapsed = time.perf_counter() - t0
        queued = int(self.broker.llen(f"{self.broker_key_prefix}{queue}"))
        if queued != len(ids):
            raise RuntimeError(f"{queued} messages in {queue} after publishing {len(ids)}")
        return ids, refused, len(order) / elapsed

    def read_runs(self, round_id: str) -> tuple[int, int, int]:
        """(bodies run, distinct task ids run, largest 'active' count seen) from the recorder."""
        bodies, max_active = 0, 0
        task_ids: set[str] = set()
        pipe = self.recorder.pipeline(transaction=False)
        for k in range(self.args.keys):
            pipe.lrange(self.ca.runs_key(round_id, self.key_name(round_id, k)), 0, -1)
        for entries in pipe.execute():
            for raw in entries:
                task_id, _start, _end, active = raw.decode().split("|")
                bodies += 1
                task_ids.add(task_id)
                max_active = max(max_active, int(active))
        return bodies, len(task_ids), max_active

    def measure(self, variant: str, round_no: int) -> Measurement:
        round_id = f"r{round_no}-{variant}-{uuid.uuid4().hex[:8]}"
        ids, refused, dispatch_rate = self.dispatch(variant, round_id)
        worker = self.new_worker(variant)
        try:
            worker.start()
            drained, drain_seconds = self.wait_ready(
                ids, lambda: worker.proc is not None and worker.proc.poll() is None, round_id)
            time.sleep(self.args.grace)
            metas = self.metas(ids)
            held = self.held_keys(variant, round_id)
            left = [t for t in ids if metas.get(t, {}).get("status") not in states.READY_STATES]
            stuck, stuck_answered = self.diagnose(variant, round_id, left)
        finally:
            worker.stop()
            worker.kill()  # only the worker's own process group, if anything of it is left
            self.problems.extend(f"[{variant}] {line}" for line in worker_problems(worker.log()))
            if self.args.keep_logs:
                print(f"  worker log kept at {worker.log_path}")
            else:
                worker.cleanup()
        state_counts = collections.Counter(metas.get(t, {}).get("status", states.PENDING) for t in ids)
        not_ready = {s: n for s, n in state_counts.items() if s not in states.READY_STATES}
        holder_results = 0
        for task_id in ids:
            meta = metas.get(task_id, {})
            result = meta.get("result")
            if meta.get("status") == states.SUCCESS and isinstance(result, dict) \
                    and result.get("ran") not in (None, task_id):
                holder_results += 1
        bodies, distinct, max_active = self.read_runs(round_id)
        overlaps = int(self.recorder.get(self.ca.overlaps_key(round_id)) or 0)
        span = dict(self.recorder.zrange(self.ca.span_key(round_id), 0, -1, withscores=True))
        first, last = span.get(b"first"), span.get(b"last")
        wall = (last - first) if first is not None and last is not None else 0.0
        return Measurement(round_no, variant, len(ids), refused, dispatch_rate, wall, bodies, distinct,
                           overlaps, max_active, sum(not_ready.values()), not_ready, held,
                           dict(state_counts), holder_results, drained, drain_seconds, stuck, stuck_answered)

    def diagnose(self, variant: str, round_id: str, task_ids: Sequence[str],
                 limit: int = 10) -> tuple[list[str], int]:
        """One line per task left not terminal (at most ``limit``): its state and meta, whether it
        ran, and what Redis knows of its key (for SingleFlightTask: the key's status, its joined
        list and queue, its entry in the sweeper's waiting index, whether a release took its
        message); and how many of all of them had their message handed to a release whose holder
        ended SUCCESS."""
        out: list[str] = []
        answered = 0
        metas = self.metas(list(task_ids))
        for n, task_id in enumerate(task_ids):
            key = self.key_of.get(task_id, "?")
            meta = metas.get(task_id, {})
            runs = [raw.decode() for raw in self.recorder.lrange(self.ca.runs_key(round_id, key), 0, -1)]
            ran = sum(1 for r in runs if r.startswith(task_id + "|"))
            line = (f"{task_id} key={key!r} state={meta.get('status', 'PENDING')} "
                    f"meta={meta.get('result')!r} stored at {meta.get('date_done')} body ran {ran}x")
            if variant in self.ca.POLICIES:
                task = self.ca.TASKS[variant]
                rendered = task.render_key(key, 0, round_id)
                st = celery_singleflight.status(self.ca.app, rendered)
                layout = task.store.layout
                client = task.store.client
                line += (f"; key {rendered}: held={getattr(st, 'held', None)} "
                         f"holder={getattr(st, 'task_id', None)} outcome={getattr(st, 'outcome', None)} "
                         f"previous={getattr(st, 'previous_task_id', None)}/"
                         f"{getattr(st, 'previous_outcome', None)} "
                         f"joined list={client.llen(layout.joined(rendered))} "
                         f"queue={client.llen(layout.queue(rendered))} "
                         f"settled={client.hlen(layout.settled(rendered))} "
                         f"waiting index score={client.zscore(layout.waiting(), rendered)}")
                handed = [token for token, raw in client.hgetall(layout.settled(rendered)).items()
                          if task_id.encode() in raw]
                line += f"; its message handed to {len(handed)} release(s) (settled hash)"
                hstate = None
                result = meta.get("result")
                holder = result.get("holder") if isinstance(result, dict) else None
                if holder:
                    hmeta = self.metas([holder]).get(holder, {})
                    hstate = hmeta.get("status")
                    hran = sum(1 for r in runs if r.startswith(str(holder) + "|"))
                    line += (f"; its holder {holder}: state={hmeta.get('status', 'PENDING')} stored at "
                             f"{hmeta.get('date_done')}, body ran {hran}x")
                if handed and hstate == states.SUCCESS:
                    answered += 1
            if n < limit:
                out.append(line)
        return out, answered


# -- the report -------------------------------------------------------------------------------------


def _n(value: float) -> str:
    return f"{value:,.0f}"


def states_text(m: Measurement) -> str:
    text = ", ".join(f"{s} {n:,}" for s, n in sorted(m.states.items(), key=lambda kv: -kv[1]))
    if m.holder_results:
        text += f" ({m.holder_results:,} of them with the holder's result)"
    if m.refused_at_dispatch:
        how = ("given the first task's `AsyncResult`" if m.variant == "singleton"
               else "`REJECTED`" if m.variant == "once" else "refused")
        text += f"; {m.refused_at_dispatch:,} never sent ({how} at dispatch)"
    return text


def summary_table(variants: Sequence[Variant], args: argparse.Namespace) -> str:
    lines = [
        "| variant | published | bodies run (distinct tasks) | wall s | runs/s | dispatch calls/s "
        "| ran twice at once | not terminal after drain + grace | keys held after | final states |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for v in variants:
        if not v.available:
            lines.append(f"| {LABELS[v.name]} | {v.note} | | | | | | | | |")
            continue
        if not v.runs:
            lines.append(f"| {LABELS[v.name]} | n/a (failed: {v.failed[0] if v.failed else '?'}) "
                         "| | | | | | | | |")
            continue
        last = v.runs[-1]
        med = statistics.median
        bodies = med([m.bodies for m in v.runs])
        distinct = med([m.distinct for m in v.runs])
        not_terminal = sum(m.not_terminal for m in v.runs)
        nt_text = f"{not_terminal:,}"
        if not_terminal:
            merged: collections.Counter[str] = collections.Counter()
            for m in v.runs:
                merged.update(m.not_terminal_states)
            nt_text += " (" + ", ".join(f"{s} {n:,}" for s, n in merged.items()) + ")"
        drained = [m.drained for m in v.runs if m.drained != "all ready"]
        if drained:
            nt_text += f"; drain: {drained[0]}"
        lines.append(
            f"| {LABELS[v.name]} | {_n(med([m.published for m in v.runs]))} of {args.tasks:,} | "
            f"{_n(bodies)} ({_n(distinct)}) | {med([m.wall for m in v.runs]):.2f} | "
            f"{med([m.runs_per_s for m in v.runs]):,.1f} | {_n(med([m.dispatch_per_s for m in v.runs]))} | "
            f"{sum(m.overlaps for m in v.runs):,} | {nt_text} | {sum(m.held for m in v.runs):,} | "
            f"{states_text(last)}{' (last round)' if len(v.runs) > 1 else ''} |"
        )
    return "\n".join(lines)


def rounds_table(variants: Sequence[Variant]) -> str:
    runs = sorted((m for v in variants for m in v.runs),
                  key=lambda m: (m.round_no, VARIANTS.index(m.variant)))
    lines = ["| round | variant | bodies | wall s | runs/s | drain (worker start → all ready) s | "
             "ran twice at once | largest 'active' seen | not terminal | keys held |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for m in runs:
        lines.append(f"| {m.round_no} | {m.variant} | {m.bodies:,} | {m.wall:.2f} | {m.runs_per_s:,.1f} | "
                     f"{m.drain_seconds:.1f} ({m.drained}) | {m.overlaps} | {m.max_active} | "
                     f"{m.not_terminal} | {m.held} |")
    return "\n".join(lines)


def markdown(variants: Sequence[Variant], args: argparse.Namespace, host: str, setup: str,
             chart: str | None, findings: list[str]) -> str:
    per_key = args.tasks / args.keys
    parts = [
        "## Contended keys, per duplicate policy (`benchmarks/bench_contended.py`)",
        "",
        f"Alone: `.venv/bin/python benchmarks/bench_contended.py` (options: `--help`). Measured {host}.",
        "",
        f"{args.tasks:,} tasks over {args.keys} keys ({per_key:g} per key, order `{args.order}`), "
        f"{args.sleep * 1e3:g} ms each, published in one burst, then drained by one fresh "
        f"`celery worker --pool prefork --concurrency {CONCURRENCY}` (Redis broker and result backend). "
        f"{setup}",
        "",
        "\"Ran twice at once\": a per-key counter in a Redis DB the library never touches; runs/s = "
        "bodies run / (first start to last end). celery-once and celery-singleton lock in `apply_async`: "
        "only each key's first task is sent.",
        "",
        summary_table(variants, args),
    ]
    if chart:
        parts += ["", chart]
    if findings:
        parts += ["", "Found in this run:", ""] + [f"- {f}" for f in findings]
    return "\n".join(parts)


def findings_of(variants: Sequence[Variant], ca: ModuleType) -> list[str]:
    out: list[str] = []
    for v in variants:
        ours = v.name in ca.POLICIES
        for m in v.runs:
            who = f"{LABELS[v.name]} (round {m.round_no})"
            if m.overlaps:
                out.append(f"{who}: {m.overlaps} body start(s) while another run of the same key was "
                           f"inside its body (largest count {m.max_active})")
            if m.not_terminal:
                text = (f"{who}: {m.not_terminal} task(s) not terminal after the drain and the grace "
                        f"({', '.join(f'{s} {n}' for s, n in m.not_terminal_states.items())})")
                if m.stuck_answered:
                    text += (f"; {m.stuck_answered} of them had their message handed to a release (found "
                             "in the key's `settled` hash) by a holder that ended `SUCCESS`, yet their "
                             "stored state is still not ready (details: the benchmark's output)")
                out.append(text)
            if m.held:
                out.append(f"{who}: {m.held} key(s) still held after the drain and grace")
            if m.bodies != m.distinct:
                out.append(f"{who}: {m.bodies - m.distinct} body run(s) of a task id that had already run")
            if ours and v.name in ("retry", "queue") and m.distinct != m.published:
                out.append(f"{who}: {m.distinct} of {m.published} published tasks ran; expected all")
        for failure in v.failed:
            out.append(f"{LABELS[v.name]}: FAILED: {failure}")
    return out


def run(args: argparse.Namespace, url: str, private: bool) -> None:
    started = time.monotonic()
    host = machine()  # the load average at the start
    prefix = f"sfct-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if private:
        broker_url, locks_url, backend_url, recorder_url = f"{url}/0", f"{url}/1", f"{url}/2", f"{url}/3"
    else:
        broker_url = locks_url = backend_url = recorder_url = url
    env = {
        "SF_CT_PREFIX": prefix,
        "SF_CT_BROKER": broker_url,
        "SF_CT_LOCKS": locks_url,
        "SF_CT_BACKEND": backend_url,
        "SF_CT_RECORDER": recorder_url,
        "SF_CT_SLEEP": repr(args.sleep),
        "SF_CT_SHARED": "0" if private else "1",
    }
    ca, env = import_app("contendedapp", env)
    broker = redis.Redis.from_url(broker_url)
    locks = redis.Redis.from_url(locks_url)
    server_version = broker.info("server")["redis_version"]
    broker_key_prefix = ca.transport_options.get("global_keyprefix", "")

    wanted = [v for v in VARIANTS if v not in args.skip]
    variants = [Variant(name, name in ca.TASKS, ca.UNAVAILABLE.get(name, "")) for name in wanted]
    for v in variants:
        if not v.available and not v.note:
            v.note = "not installed"

    setup = (f"Redis {server_version}, Celery {celery.__version__}, kombu {kombu.__version__}, "
             f"celery-once {version_of('celery-once')}, celery-singleton {version_of('celery-singleton')}, "
             f"{args.rounds} round(s).")
    print(f"redis-server {server_version} at {maybe_sanitize_url(url)} "
          f"({'private, started by this benchmark' if private else 'given by --redis-url'}); "
          f"broker {maybe_sanitize_url(broker_url)}, leases/locks {maybe_sanitize_url(locks_url)}, "
          f"results {maybe_sanitize_url(backend_url)}, recorder {maybe_sanitize_url(recorder_url)}; "
          f"key prefix {prefix!r}")
    print(f"python {platform.python_version()}, celery {celery.__version__}, kombu {kombu.__version__}, "
          f"redis-py {redis.__version__}, celery-once {version_of('celery-once')}, "
          f"celery-singleton {version_of('celery-singleton')}; {host}")
    print(f"per measurement: {args.tasks:,} tasks over {args.keys} keys (order {args.order}), body sleeps "
          f"{args.sleep * 1e3:g} ms; a fresh `celery worker --pool prefork --concurrency {CONCURRENCY}` "
          f"drains them; {args.rounds} round(s) of: {', '.join(v.name for v in variants if v.available)}",
          flush=True)
    bench = Bench(ca, args, env, broker, locks, broker_key_prefix)
    try:
        for round_no in range(1, args.rounds + 1):
            for v in variants:
                if not v.available:
                    continue
                t0 = time.monotonic()
                try:
                    m = bench.measure(v.name, round_no)
                except (RuntimeError, TimeoutError) as exc:
                    v.failed.append(str(exc))
                    print(f"  round {round_no} {v.name}: FAILED: {exc}", flush=True)
                    continue
                v.runs.append(m)
                print(f"  round {round_no} {v.name}: {m.bodies:,} bodies in {m.wall:.2f} s "
                      f"({m.runs_per_s:,.1f}/s), overlaps {m.overlaps}, not terminal {m.not_terminal}, "
                      f"held {m.held}, {m.drained} ({time.monotonic() - t0:.0f} s with worker start/stop)",
                      flush=True)
    finally:
        if not private:
            deleted = delete_matching(broker, f"{prefix}:*")
            deleted += delete_matching(broker, f"qo_{ca.once_task_name()}_*")
            print(f"cleanup: deleted {deleted:,} keys under {prefix}:* and qo_{ca.once_task_name()}_*")
        broker.close()
        locks.close()
        ca.recorder.close()
        ca.app.pool.force_close_all()

    findings = findings_of(variants, ca)
    measured = [v for v in variants if v.runs]
    chart = None
    if measured:
        chart = bar_chart(
            "contended", f"Bodies run per second, {args.tasks:,} tasks over {args.keys} keys "
            f"({args.sleep * 1e3:g} ms each, concurrency {CONCURRENCY})",
            [SHORT[v.name] for v in measured],
            [statistics.median([m.runs_per_s for m in v.runs]) for v in measured], "runs/s",
            highlight="sf queue")
    md = markdown(variants, args, host, setup, chart, findings)
    print()
    print(md)
    print()
    print("Per measurement:")
    print()
    print(rounds_table(variants))
    for v in variants:
        for m in v.runs:
            if m.stuck:
                print()
                print(f"{v.name} round {m.round_no}: tasks left not terminal (up to 10):")
                for line in m.stuck:
                    print(f"  {line}")
    print()
    print(f"worker logs: {len(bench.problems)} warning/error lines" + (":" if bench.problems else ""))
    for line, count in distinct_lines(bench.problems)[:20]:
        print(f"  {line}" + (f"  (x {count})" if count > 1 else ""))
    write_section("contended", md)
    print(f"total time {time.monotonic() - started:.0f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per measurement (2000)")
    parser.add_argument("--keys", type=int, default=20, help="keys the tasks are spread over (20)")
    parser.add_argument("--sleep", type=float, default=0.02, help="seconds each body sleeps (0.02)")
    parser.add_argument("--order", choices=("grouped", "shuffled", "interleaved"), default="grouped",
                        help="publishing order of the burst (grouped: each key's tasks back to back)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every variant, interleaved (1)")
    parser.add_argument("--grace", type=float, default=3.0,
                        help="seconds to wait after the drain before counting what is left (3)")
    parser.add_argument("--stall", type=float, default=60.0,
                        help="give a drain up when nothing changed for this many seconds (60)")
    parser.add_argument("--timeout", type=float, default=600.0, help="longest drain, seconds (600)")
    parser.add_argument("--redis-url",
                        help="use this Redis and DB (only keys under a unique prefix are touched)")
    parser.add_argument("--skip", action="append", default=[], choices=VARIANTS,
                        help="leave a variant out (repeatable)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the workers' log files")
    args = parser.parse_args()
    if args.tasks < 1 or args.keys < 1 or args.keys > args.tasks or args.rounds < 1:
        parser.error("need --tasks >= --keys >= 1 and --rounds >= 1")
    with redis_for(args.redis_url) as (url, private):
        run(args, url, private=private)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
