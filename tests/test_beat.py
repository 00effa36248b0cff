"""Beat: a periodic task with a lock key never overlaps itself, and every tick is accounted for.

One scenario, run once for the module: a real ``celery beat`` process sends ``report_skip``
(``on_duplicate="skip"``) and ``report_queue`` (``on_duplicate="queue"``, ``max_queued=1``) every
second to a real prefork worker (3 processes); each run works for 3 s. Beat is stopped (SIGTERM, by
its PID) once it has sent 8 ticks of each, then the worker is stopped warm, so every run it started
finishes. The tests then compare four independent sources: beat's log, the ids beat published (a
receiver in the beat process), the worker's log and the recorder written by the runs themselves
(beatapp.py), plus the result backend, the broker and the library's status.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery.result import AsyncResult

import celery_singleflight as sf
from celery_singleflight import QueueFull, is_skipped
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import TESTS, wait_for, worker_env

pytestmark = [pytest.mark.worker, pytest.mark.timeout(45)]  # the scenario takes ~15 s

SKIP = "beatapp.report_skip"
QUEUE = "beatapp.report_queue"
TICKS = 8  # ticks of each task before beat is stopped (one a second)
RUN_SECONDS = 3.0
SKIP_KEY = f"report:{SKIP}"
QUEUE_KEY = f"report:{QUEUE}"


@dataclass
class TaskRecord:
    """Everything known about one periodic task after the scenario, from each source."""

    name: str
    logged_ticks: int = 0  # beat's "Scheduler: Sending due task" lines
    sent: list[str] = field(default_factory=list)  # ids beat published (after_task_publish)
    received: set[str] = field(default_factory=set)  # ids in the worker's "received" lines
    runs: list[str] = field(default_factory=list)  # ids whose body started (recorder)
    ended: list[str] = field(default_factory=list)  # ids whose body finished (recorder)
    spans: list[dict[str, Any]] = field(default_factory=list)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # (id, outcome) from the signal
    skipped_counter: int = 0  # skipped:<task>, INCRed by the signal receiver
    in_broker: set[str] = field(default_factory=set)  # ids whose message is still in the broker
    states: dict[str, str] = field(default_factory=dict)  # result backend state per tick id
    results: dict[str, Any] = field(default_factory=dict)
    status: sf.KeyStatus | None = None
    library_queue: list[str] = field(default_factory=list)  # ids parked in the key's FIFO
    beat_header: dict[str, Any] = field(default_factory=dict)  # celery_beat_task, as each run saw it

    @property
    def ticks(self) -> set[str]:
        """Every tick id seen anywhere: only beat sends these tasks (a parked run is re-sent with
        its own id), so a received or waiting id is a tick even if beat was stopped between
        publishing it and recording it."""
        return set(self.sent) | self.received | self.in_broker


@dataclass
class BeatRun:
    skip: TaskRecord
    queue: TaskRecord
    overlaps: list[str]
    active: dict[str, int]
    worker_log: str
    beat_log: str
    seconds: float


def load_beatapp(redis_server: RedisServer) -> ModuleType:
    os.environ["SF_TEST_REDIS"] = redis_server.url
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module("beatapp")


def ids_in_broker(redis_server: RedisServer, queue: str) -> Counter[str]:
    """Task ids (with their task names) of the messages still in the broker: waiting in the queue's
    lists (one per priority) or delivered but not acknowledged."""
    client = redis_server.client(4)
    found: Counter[str] = Counter()
    messages: list[dict[str, Any]] = []
    for name in client.scan_iter(match=f"{queue}*"):
        if client.type(name) == b"list":
            messages += [json.loads(raw) for raw in client.lrange(name, 0, -1)]
    messages += [json.loads(raw)[0] for raw in client.hvals("unacked")]
    for message in messages:
        headers = message.get("headers") or {}
        found[f"{headers.get('task')}|{headers.get('id')}"] += 1
    return found


def collect(beatapp: ModuleType, redis_server: RedisServer, queue: str, worker_log: str,
            beat_log: str) -> dict[str, TaskRecord]:
    rec = beatapp.recorder
    broker = ids_in_broker(redis_server, queue)
    records = {}
    for name, key in ((SKIP, SKIP_KEY), (QUEUE, QUEUE_KEY)):
        entry = re.escape(name.split(".")[-1].replace("_", "-"))
        r = TaskRecord(name)
        r.logged_ticks = len(re.findall(rf"Scheduler: Sending due task {entry} \({re.escape(name)}\)",
                                        beat_log))
        r.sent = [x.decode() for x in rec.lrange(f"sent:{name}", 0, -1)]
        r.received = set(re.findall(rf"Task {re.escape(name)}\[([0-9a-f-]+)\] received", worker_log))
        r.runs = [x.decode() for x in rec.lrange(f"runs:{name}", 0, -1)]
        r.ended = [x.decode() for x in rec.lrange(f"ended:{name}", 0, -1)]
        r.spans = [json.loads(x) for x in rec.lrange(f"spans:{name}", 0, -1)]
        r.duplicates = [tuple(x.decode().split("|", 1)) for x in rec.lrange(f"duplicates:{name}", 0, -1)]
        r.skipped_counter = int(rec.get(f"skipped:{name}") or 0)
        r.in_broker = {k.split("|", 1)[1] for k in broker if k.startswith(f"{name}|")}
        for task_id in r.ticks:
            result = AsyncResult(task_id, app=beatapp.app)
            r.states[task_id] = result.state
            r.results[task_id] = result.result
        r.status = sf.status(beatapp.app, key)
        r.beat_header = {i: json.loads(rec.hget("from_beat", i) or "null") for i in r.runs}
        store = beatapp.app.tasks[name].store
        queued = store.client.lrange(store.layout.queue(key), 0, -1)
        r.library_queue = [x.decode().split("|")[0] for x in queued]
        records[name] = r
    return records


@pytest.fixture(scope="module")
def beat_run(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BeatRun]:
    """Run the scenario once: worker, then beat for TICKS ticks, then stop beat, then the worker."""
    for db in (4, 5, 6, 7):
        redis_server.client(db).flushdb()
    beatapp = load_beatapp(redis_server)
    tmp = tmp_path_factory.mktemp("beat")
    queue = f"beat-{uuid.uuid4().hex[:12]}"
    env = worker_env(redis_server, SF_BEAT_QUEUE=queue, SF_BEAT_SECONDS=str(RUN_SECONDS), SF_BEAT_EVERY="1")
    worker = WorkerProcess("beatapp", concurrency=3, cwd=str(TESTS), env=env, extra=("-Q", queue))
    beat: subprocess.Popen[bytes] | None = None
    beat_log_path = tmp / "beat.log"
    began = time.monotonic()
    try:
        worker.start(beatapp.app, timeout=15)
        with beat_log_path.open("wb") as out:
            beat = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "beatapp", "beat",
                 "--schedule", str(tmp / "beat-schedule"), "--pidfile", str(tmp / "beat.pid"),
                 "--loglevel", "INFO"],
                stdout=out, stderr=subprocess.STDOUT, cwd=str(TESTS), start_new_session=True,
                env={**os.environ, **env, "SF_BEAT_SCHEDULE": "1"},
            )

        def ticks_sent() -> bool:
            assert beat is not None and beat.poll() is None, f"beat exited:\n{read(beat_log_path)}"
            return read(beat_log_path).count(f"Sending due task report-skip ({SKIP})") >= TICKS

        wait_for(ticks_sent, timeout=TICKS + 6, interval=0.05)
        stop_beat(beat)
        assert worker.stop(timeout=RUN_SECONDS + 8) == 0, worker.log()  # warm: running tasks finish
        worker_log, beat_log = worker.log(), read(beat_log_path)
        records = collect(beatapp, redis_server, queue, worker_log, beat_log)
        rec = beatapp.recorder
        run = BeatRun(
            skip=records[SKIP], queue=records[QUEUE],
            overlaps=[x.decode() for x in rec.lrange("overlaps", 0, -1)],
            active={name: int(rec.get(f"active:{name}") or 0) for name in (SKIP, QUEUE)},
            worker_log=worker_log, beat_log=beat_log, seconds=time.monotonic() - began,
        )
        print(summary(run))  # the figures docs/beat.md quotes (pytest -s shows them)
        yield run
    finally:
        if beat is not None:
            stop_beat(beat)
        worker.stop(timeout=5)  # a no-op if it already exited; SIGKILLs its own process group on timeout
        if worker.log_path.exists():  # keep the log beside beat's, not in /tmp
            (tmp / "worker.log").write_bytes(worker.log_path.read_bytes())
            worker.log_path.unlink()


def read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def stop_beat(beat: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the beat process we started (by its PID), SIGKILL if it does not exit."""
    if beat.poll() is None:
        beat.terminate()
        try:
            beat.wait(timeout=10)
        except subprocess.TimeoutExpired:
            beat.kill()
            beat.wait(timeout=10)


def summary(run: BeatRun) -> str:
    lines = [f"beat scenario: {run.seconds:.1f}s, overlaps={len(run.overlaps)}"]
    for r in (run.skip, run.queue):
        outcomes = Counter(o for _, o in r.duplicates)
        lines.append(
            f"{r.name}: ticks logged={r.logged_ticks} published={len(r.sent)} received={len(r.received)}"
            f" runs={len(r.runs)} completed={len(r.ended)} duplicates={dict(outcomes)}"
            f" skipped(counter)={r.skipped_counter} left in broker={len(r.in_broker)}"
            f" parked at end={len(r.library_queue)} states={dict(Counter(r.states.values()))}"
            f" celery_beat_task header seen by runs={dict(Counter(map(str, r.beat_header.values())))}"
            f" last run's KeyStatus.duplicates={r.status.duplicates if r.status else None}"
            f" (skip results naming it: {naming(r)})"
        )
    return "\n".join(lines)


def naming(r: TaskRecord) -> int:
    """How many skip results name the key's last run (the one its status describes) as holder."""
    last = r.status.task_id if r.status else None
    return sum(1 for res in r.results.values() if is_skipped(res) and res["holder"] == last)


def assert_no_overlap(r: TaskRecord) -> None:
    spans = sorted(r.spans, key=lambda s: s["start"])
    for before, after in itertools.pairwise(spans):
        assert after["start"] >= before["end"], f"{r.name}: {after['id']} started while {before['id']} ran"


# -- no overlap ---------------------------------------------------------------------------------


# about 25 s with its fixture: beat must send 8 ticks of a 1 s schedule to 3 s runs
def test_periodic_runs_never_overlap(beat_run: BeatRun) -> None:
    """Given a 3 s task on a 1 s beat schedule with a per-task lock key,
    when beat has sent 8 ticks of each task to a worker with 3 free processes,
    then no run of either task ever started while another run of it was working (the recorder's
    counter and the runs' own spans agree), and the skip task completed at least 2 runs."""
    assert beat_run.overlaps == []
    assert beat_run.active == {SKIP: 0, QUEUE: 0}
    for r in (beat_run.skip, beat_run.queue):
        assert sorted(r.runs) == sorted(r.ended), f"{r.name}: a run did not finish"
        assert_no_overlap(r)
    assert len(beat_run.skip.ended) >= 2
    assert len(beat_run.queue.ended) >= 2


# -- skip: every tick ran or was skipped, and each skip is counted and logged ---------------------


def test_every_skip_tick_either_ran_or_was_skipped(beat_run: BeatRun) -> None:
    """Given the skip task's ticks,
    when the scenario is over,
    then each tick beat sent is exactly one of: a run, a skipped duplicate, or a message still in
    the broker (sent as beat stopped and never taken by the stopping worker); and the ticks beat
    logged equal runs + skipped, up to 2: a tick can still be in the broker (above), and SIGTERM can
    land between beat's log line and the publish that follows it."""
    r = beat_run.skip
    skipped = {task_id for task_id, outcome in r.duplicates if outcome == "skipped"}
    runs = set(r.runs)
    assert len(runs) == len(r.runs), "a tick ran twice"
    assert not runs & skipped and not (runs | skipped) & r.in_broker
    assert r.ticks == runs | skipped | r.in_broker
    assert r.logged_ticks - 1 <= len(r.ticks) <= r.logged_ticks
    assert 0 <= r.logged_ticks - (len(r.runs) + len(skipped)) <= 2
    assert {outcome for _, outcome in r.duplicates} <= {"skipped"}


def test_skipped_ticks_are_counted(beat_run: BeatRun) -> None:
    """Given ticks that arrived while the previous run still held the key,
    when the worker turned them away,
    then the duplicate signal fired once per skipped tick (the receiver's counter), the result
    backend shows each as SUCCESS with a skip result naming the holder, and the last run's
    KeyStatus.duplicates counts the skips that named it."""
    r = beat_run.skip
    skipped = [task_id for task_id, outcome in r.duplicates if outcome == "skipped"]
    assert r.skipped_counter == len(skipped) > 0
    assert len(set(skipped)) == len(skipped)
    for task_id in skipped:
        assert r.states[task_id] == "SUCCESS"
        result = r.results[task_id]
        assert is_skipped(result) and result["key"] == SKIP_KEY and result["holder"] in r.runs
    for task_id in r.runs:
        assert r.states[task_id] == "SUCCESS" and r.results[task_id] == "reported"
    st = r.status
    assert st is not None and not st.held and st.outcome == "succeeded" and st.task_id == r.runs[-1]
    naming_last = naming(r)
    # a tick that saw the holder just before it released is skipped but cannot be noted on a key
    # that is already free: at most one such race per run
    assert naming_last - 1 <= st.duplicates <= naming_last


def test_each_skipped_tick_is_logged(beat_run: BeatRun) -> None:
    """Given the skipped ticks,
    then the worker log has the library's duplicate line for each: its id, the key, the holder and
    "skipped"."""
    r = beat_run.skip
    lines = [line for line in beat_run.worker_log.splitlines() if "duplicate" in line]
    for task_id, _ in r.duplicates:
        holder = r.results[task_id]["holder"]
        pattern = re.compile(
            rf"duplicate {re.escape(SKIP)}\[{task_id}\] key='{re.escape(SKIP_KEY)}' held by {holder}"
            r" \(\d+\.\ds left\): skipped"
        )
        assert any(pattern.search(line) for line in lines), f"no log line for skipped tick {task_id}"


# -- queue: every tick ran, waits, or was refused ---------------------------------------------------


def test_queue_ticks_run_wait_or_are_refused_nothing_lost(beat_run: BeatRun) -> None:
    """Given the queue task (max_queued=1) on the same schedule,
    when ticks arrive while a run holds the key,
    then one waits (parked, QUEUED) and runs when the key is handed on, the others fail with
    QueueFull; at the end every tick beat sent has run, failed with QueueFull, or is still waiting
    (parked in the key's queue, or its message in the broker): none is silently lost, and the
    parked one ran after its holder, never beside it."""
    r = beat_run.queue
    refused = {task_id for task_id, outcome in r.duplicates if outcome == "queue-full"}
    parked = {task_id for task_id, outcome in r.duplicates if outcome == "queued"}
    assert {o for _, o in r.duplicates} <= {"queued", "queue-full"}
    assert refused and parked, r.duplicates
    runs = set(r.runs)
    assert len(runs) == len(r.runs), "a tick ran twice"
    waiting = set(r.library_queue) | r.in_broker
    assert len(r.library_queue) <= 1
    assert r.ticks == runs | refused | waiting
    assert not runs & refused and not refused & waiting
    assert parked <= runs | waiting, "a parked tick neither ran nor still waits"
    assert parked & runs, "no parked tick ran (the catch-up run)"
    for task_id in r.ticks:
        state = r.states[task_id]
        if task_id in runs:
            assert state == "SUCCESS" and r.results[task_id] == "reported"
        elif task_id in refused:
            assert state == "FAILURE" and isinstance(r.results[task_id], QueueFull)
        else:
            assert state in ("PENDING", "QUEUED"), (task_id, state)
    assert r.status is not None and r.status.queued == len(r.library_queue)
    assert r.logged_ticks - 1 <= len(r.ticks) <= r.logged_ticks
