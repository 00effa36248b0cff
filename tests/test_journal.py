"""The journal of waiting runs, the epoch that tells a lease Redis lost its data, and what a
worker's recovery does with each journaled run (celery_singleflight.run.journal,
protocol.epoch, worker.recovery), on private Redis servers.

The whole path (workers, a killed lease Redis) is tests/chaos/test_redis_data_loss.py.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import tempfile
import time
import uuid
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.backends.base import DisabledBackend
from celery.canvas import Signature

from celery_singleflight import WaitingLost
from celery_singleflight.config.options import app_options
from celery_singleflight.policies.lostruns import LostRuns
from celery_singleflight.policies.recovered import Recovered, already_placed
from celery_singleflight.protocol.journaled import JOURNALED
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.protocol.started import STARTED
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.journal import HEADER_RECOVERED, HEADER_RECOVERED_HANDOFF, Journal, new_mark
from celery_singleflight.run.messages import HEADER_HANDOFF, HEADER_SEQ
from celery_singleflight.testing import RedisServer
from celery_singleflight.worker.recovery import Recovery

from .conftest import wait_for

PROCESSES, APPENDS = 6, 150
PACE = 25  # appends of each process between two rewrites it waits for


def _rewritten(rewrites: Any, times: int) -> bool:
    return bool(rewrites.value >= times)


def _append_many(directory: str, worker: int, rewrites: Any) -> None:
    journal = Journal(directory, "w@host")
    for i in range(APPENDS):
        if i and i % PACE == 0:
            # the rewrites fall between the appends: go on once the journal was rewritten again
            wait_for(functools.partial(_rewritten, rewrites, i // PACE), timeout=30, interval=0.002)
        journal.append({"kind": "park", "namespace": "sf", "key": f"k{worker}", "task_id": f"{worker}-{i}",
                        "task": "t", "message": "x" * 3000, "at": float(i)})


def test_appends_from_many_processes_while_the_journal_is_rewritten_are_all_kept(tmp_path: Path) -> None:
    """Given six processes appending 150 entries of 3 kB each while another process drops lines
    again and again, then every entry appended and not dropped is there, whole, in its order."""
    directory = str(tmp_path / "journal")
    ctx = multiprocessing.get_context("fork")
    shared = ctx.Value("i", 0)  # rewrites done, which the appenders pace themselves on
    procs = [ctx.Process(target=_append_many, args=(directory, w, shared)) for w in range(PROCESSES)]
    for proc in procs:
        proc.start()
    journal, dropped, rewrites = Journal(directory, "w@host"), set(), 0
    while any(proc.is_alive() for proc in procs):
        entries = journal.entries()
        gone = [e.line for e in entries if e.task_id.endswith("7")]
        rewrites += journal.drop(gone) > 0
        shared.value = rewrites
        dropped |= {e.task_id for e in entries if e.task_id.endswith("7")}
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0
    assert rewrites >= 2, "the rewrites did not overlap the appends"
    raw = Path(journal.path).read_text().splitlines()
    entries = journal.entries()
    assert len(raw) == len(entries), "a torn or merged line"
    expected = {f"{w}-{i}" for w in range(PROCESSES) for i in range(APPENDS)} - dropped
    assert {e.task_id for e in entries} == expected
    for w in range(PROCESSES):  # each process's lines in the order it wrote them
        mine = [int(e.task_id.split("-")[1]) for e in entries if e.key == f"k{w}"]
        assert mine == sorted(mine)


def test_a_torn_line_is_skipped_and_dropped_at_the_next_rewrite(tmp_path: Path) -> None:
    journal = Journal(str(tmp_path), "w@host")
    journal.append({"kind": "park", "namespace": "sf", "key": "k", "task_id": "a", "task": "t",
                    "message": "{}", "at": 1.0})
    with open(journal.path, "a") as out:
        out.write('{"kind": "park", "namesp')  # a crash in the middle of a write
    journal.append({"kind": "join", "namespace": "sf", "key": "k", "task_id": "b", "task": "t",
                    "message": "{}", "at": 2.0})
    assert [e.task_id for e in journal.entries()] == ["a", "b"]  # b's line starts on a line of its own
    first = journal.entries()[0]
    assert journal.drop([first.line]) == 2  # a's line and the torn one
    assert [e.task_id for e in journal.entries()] == ["b"]
    assert Path(journal.path).read_text().count("\n") == 1


def test_a_short_write_goes_on_where_it_stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a disk that takes a few bytes per write, the whole line is written all the same."""
    journal = Journal(str(tmp_path), "w@host")
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data[:7])))
    journal.append({"kind": "park", "namespace": "sf", "key": "k", "task_id": "a", "task": "t",
                    "message": "{}" * 40, "at": 1.0})
    monkeypatch.undo()
    journal.append({"kind": "park", "namespace": "sf", "key": "k", "task_id": "b", "task": "t",
                    "message": "{}", "at": 2.0})
    assert [e.task_id for e in journal.entries()] == ["a", "b"]


def test_the_default_journal_directory_is_the_users_and_the_apps_own() -> None:
    """Two users, or two apps of one user, with the same worker node name do not share a journal."""
    def journal_dir(main: str) -> str:
        return str(app_options(Celery(main, broker="redis://127.0.0.1:1/0")).journal_dir)

    found = journal_dir("appone")
    assert os.path.dirname(found) == tempfile.gettempdir()
    assert os.path.basename(found) == f"celery-singleflight-{os.getuid()}-appone"
    assert journal_dir("apptwo") != found


# -- the epoch ------------------------------------------------------------------------------------


def test_the_epoch_tells_a_restart_empty_and_an_older_snapshot_from_a_restart_that_kept_the_data() -> None:
    """Given a worker's looks at the epoch, when Redis restarts empty, the next look has another
    life; when it comes back from a snapshot taken before the last look, the count is not
    larger than the last one seen; when it comes back from a snapshot taken after the last look
    (the data is whole), the life is the same and the count larger."""
    with RedisServer() as server:
        store = LeaseStore(server.client(2), KeyLayout("ep"))
        life, count = store.epoch.look("L1")
        assert (life, count) == ("L1", 1) and store.epoch.look("ignored") == ("L1", 2)

        server.kill()
        server.start()  # no snapshot: empty
        assert store.epoch.look("L2") == ("L2", 1)

        store.epoch.look("x")
        server.client().save()  # the snapshot holds count 2
        store.epoch.look("x")
        last = store.epoch.look("x")
        assert last == ("L2", 4)
        server.kill()
        server.start()  # back from the snapshot: older data
        life, count = store.epoch.look("x")
        assert life == "L2" and count <= last[1]

        server.client().save()  # a restart that kept everything: not a loss
        server.kill()
        server.start()
        again = store.epoch.look("x")
        assert again == ("L2", count + 1)


def test_a_look_run_twice_counts_twice_and_answers_a_larger_count() -> None:
    """A lost reply sent again by redis-py: the caller keeps the second answer, still larger than
    the last it saw, so a replay is never taken for a loss."""
    with RedisServer() as server:
        store = LeaseStore(server.client(2), KeyLayout("ep"))
        first = store.epoch.look("L")
        again = store.epoch.look("L")
        assert again[0] == first[0] and again[1] == first[1] + 1


# -- what the recovery does with each journaled run ------------------------------------------------


def _message(app: Any, name: str, task_id: str, **headers: Any) -> str:
    sig = app.signature(name, args=("k", 1), options={"task_id": task_id, "headers": headers})
    return json.dumps(dict(sig))


@pytest.fixture
def recovery(sfapp: ModuleType, tmp_path: Path, redis_server: RedisServer,
             monkeypatch: pytest.MonkeyPatch) -> tuple[Recovery, list[dict[str, Any]]]:
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(dict(self)))
    return Recovery(sfapp.app, Journal(str(tmp_path), "w@host")), sent


def _journal(recovery: Recovery, kind: str, task_id: str, task: str = "sfapp.queued", message: str = "",
             **extra: Any) -> None:
    recovery.journal.append({"kind": kind, "namespace": "sf", "key": "q:k", "task_id": task_id, "task": task,
                             "message": message or _message(recovery.app, task, task_id, **{
                                 HEADER_HANDOFF: "h", HEADER_SEQ: 4, "mine": 1}),
                             "at": 1.0, **extra})


def test_after_a_loss_only_runs_that_still_wait_are_sent_again_and_the_unsendable_end_failure(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType
) -> None:
    """Given journaled runs: one still parked in Redis, one gone from Redis whose result is
    QUEUED, one gone that ended SUCCESS, one of a task this worker does not have and one whose
    message is unreadable (both QUEUED); when the worker first looks (its start: any loss is
    possible), then the parked one stays journaled, the QUEUED one is sent again (same task id,
    without its hand-off token and sequence number, with the recovered header), the finished one
    is forgotten, and the two that cannot be sent end FAILURE with WaitingLost."""
    job, sent = recovery
    app, store = sfapp.app, sfapp.queued.store
    backend = app.backend
    parked, lost, ran, foreign, broken = (f"{name}-{uuid.uuid4().hex[:6]}" for name in
                                          ("parked", "lost", "ran", "foreign", "broken"))
    store.acquire("q:k", "holder-token", 30, Holder("holder"))
    assert store.handoff.park("q:k", parked, "h1", _message(app, "sfapp.queued", parked), None) is not None
    for task_id in (parked, lost, foreign, broken):
        backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    backend.mark_as_done(ran, 7)
    _journal(job, "park", parked)
    _journal(job, "park", lost)
    _journal(job, "park", ran)
    _journal(job, "park", foreign, task="gone.task")
    _journal(job, "pending", broken, message="{not json")

    assert job.sweep_once() == 1
    assert [s["options"]["task_id"] for s in sent] == [lost]
    headers = sent[0]["options"]["headers"]
    # 0: no number, by arrival; the hand-off token it was parked with, to mark adopted at its take
    assert headers == {"mine": 1, HEADER_SEQ: 0, HEADER_RECOVERED: "park", HEADER_RECOVERED_HANDOFF: "h"}
    assert [e.task_id for e in job.journal.entries()] == [parked]
    for task_id in (foreign, broken):
        result = app.AsyncResult(task_id)
        assert result.state == "FAILURE" and isinstance(result.result, WaitingLost)
        assert result.result.key == "q:k" and result.result.task_id == task_id
    assert "not registered" in str(app.AsyncResult(foreign).result)
    assert "unreadable" in str(app.AsyncResult(broken).result)


def test_a_run_journaled_twice_by_two_workers_is_sent_again_once(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, tmp_path: Path
) -> None:
    """Given a run that waited for its turn (journaled by one worker), then parked (journaled by
    another: its state is QUEUED), when both recover after a loss, then only the worker with its
    parked line sends it again; the other drops its line."""
    job, sent = recovery
    other = Recovery(sfapp.app, Journal(str(tmp_path), "other@host"))
    task_id = f"twice-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "order", task_id, seq=4)
    _journal(other, "park", task_id)
    assert job.sweep_once() == 0 and job.journal.entries() == []
    assert other.sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]


def test_while_redis_keeps_its_data_runs_gone_from_it_are_dropped_without_being_sent(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType
) -> None:
    """Given a worker that has looked once, when a journaled run is no longer parked (it was
    handed the key and runs: its result is still QUEUED) and Redis kept its data, then the
    compaction drops its line and sends nothing."""
    job, sent = recovery
    job.sweep_once()  # the first look
    task_id = f"adopted-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "park", task_id)
    job.compact_at = 0.0
    assert job.sweep_once() == 0
    assert sent == [] and job.journal.entries() == []


def test_a_loss_seen_by_the_epoch_sends_the_lost_runs_again(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, redis_server: RedisServer
) -> None:
    """Given a worker that has looked once and a run it parked, when the lease Redis loses
    everything (the epoch with it), then the next sweep sends the run again at once."""
    job, sent = recovery
    store = sfapp.queued.store
    store.acquire("q:k", "holder-token", 30, Holder("holder"))
    task_id = f"parked-{uuid.uuid4().hex[:6]}"
    assert store.handoff.park("q:k", task_id, "h1", _message(sfapp.app, "sfapp.queued", task_id), None)
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "park", task_id)
    assert job.sweep_once() == 0 and sent == []  # first look: it still waits
    redis_server.client(2).flushdb()
    assert job.sweep_once() == 1
    assert [s["options"]["task_id"] for s in sent] == [task_id] and job.journal.entries() == []


def test_a_run_whose_send_keeps_failing_ends_failure_after_three_sweeps(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    job, _ = recovery

    def refuse(self: Signature, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("broker down")

    monkeypatch.setattr(Signature, "apply_async", refuse)
    task_id = f"unsendable-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "park", task_id)
    for _ in range(2):
        job.sweep_once()
        assert sfapp.app.AsyncResult(task_id).state == "QUEUED"
        assert [e.task_id for e in job.journal.entries()] == [task_id]
    job.sweep_once()
    result = sfapp.app.AsyncResult(task_id)
    assert result.state == "FAILURE" and "broker down" in str(result.result)
    assert job.journal.entries() == []


def test_a_lost_delayed_run_gets_its_copy_in_redis_back_under_its_token(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType
) -> None:
    """Given a delayed run (RETRY) whose copy in Redis was lost, when the worker recovers, then
    its copy is kept again under its countdown message's token (that message still claims it;
    a sweeper sends the copy only if it never starts), and nothing is sent now."""
    job, sent = recovery
    store = sfapp.queued.store
    task_id = f"delayed-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.mark_as_retry(task_id, ValueError("delayed"))
    _journal(job, "delay", task_id, due=1.0, token="tok-1")
    assert job.sweep_once() == 1 and sent == []
    assert store.delayed.waiting("q:k", task_id)
    assert store.delayed.claim("q:k", task_id, "tok-1", "w#1", "lease")  # the countdown message runs
    assert job.journal.entries() == []


def test_a_loss_seen_once_is_acted_on_even_if_redis_fails_right_after(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sweep that sees the loss cannot read Redis further (it failed again); the next sweep
    sees the epoch intact since, and still recovers rather than compacts."""
    job, sent = recovery
    task_id = f"lost-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    job.sweep_once()  # first look (nothing journaled yet)
    _journal(job, "park", task_id)
    redis_server.client(2).flushdb()
    failing = monkeypatch.context()
    with failing as patch:
        patch.setattr(Recovery, "waiting", lambda *a: (_ for _ in ()).throw(redis.ConnectionError("gone")))
        assert job.sweep_once() == 0
    assert sent == [] and [e.task_id for e in job.journal.entries()] == [task_id]
    assert job.sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]


def test_a_delayed_run_journaled_without_its_token_is_left_to_its_countdown_message(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType
) -> None:
    """A copy under another token would make the countdown message (and its re-sends) stale."""
    job, sent = recovery
    task_id = f"delayed-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.mark_as_retry(task_id, ValueError("delayed"))
    _journal(job, "delay", task_id, due=1.0)
    assert job.sweep_once() == 0 and sent == []
    assert not sfapp.queued.store.delayed.waiting("q:k", task_id) and job.journal.entries() == []


def test_a_restarted_worker_sends_again_only_if_redis_lost_data_while_it_was_down(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    """Given a worker node that saw the namespace's epoch, then stopped with a run journaled that
    no longer waits in Redis (QUEUED: a handed-off run still running shows that state), when it
    starts again and Redis kept its data, the line is dropped without a send; when Redis lost its
    data meanwhile (a new life), the run is sent again. A run journaled in this life before the
    first look is never taken for lost."""
    job, sent = recovery
    job.sweep_once()  # the first look: the life is kept beside the journal
    task_id = f"handed-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "park", task_id)
    again = Recovery(sfapp.app, Journal(str(tmp_path), "w@host"))  # the same node, restarted
    assert again.sweep_once() == 0 and sent == [] and again.journal.entries() == []
    _journal(again, "park", task_id)
    redis_server.client(2).delete("sf:epoch")  # Redis lost its data while the node was down
    restarted = Recovery(sfapp.app, Journal(str(tmp_path), "w@host"))
    assert restarted.sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]
    fresh = Recovery(sfapp.app, Journal(str(tmp_path / "new"), "n@host"))  # no earlier life
    fresh.journal.append({"kind": "park", "namespace": "sf", "key": "q:k", "task_id": task_id,
                          "task": "sfapp.queued", "message": _message(sfapp.app, "sfapp.queued", task_id),
                          "at": time.time()})
    assert fresh.sweep_once() == 0 and len(sent) == 1 and fresh.journal.entries() == []


def _restarted(job: Recovery) -> Recovery:
    """The same worker node, started again (what it kept is read from its journal's directory)."""
    return Recovery(job.app, Journal(job.journal.directory, "w@host"))


def _lost_run(sfapp: ModuleType, job: Recovery, name: str) -> str:
    """A run journaled as parked that no longer waits in Redis, its result still QUEUED."""
    task_id = f"{name}-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    _journal(job, "park", task_id)
    return task_id


def test_a_loss_not_yet_settled_when_the_worker_stops_is_seen_again_at_its_restart(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a worker that saw the lease Redis lose its data but could not settle its journal yet
    (Redis failed again right after), when it stops and starts again, then its first look still
    finds the loss and sends the run again; once settled, a further restart sends nothing."""
    job, sent = recovery
    job.sweep_once()  # the first look: the epoch is kept
    task_id = _lost_run(sfapp, job, "lost")
    redis_server.client(2).flushdb()
    with monkeypatch.context() as patch:
        patch.setattr(Recovery, "waiting", lambda *a: (_ for _ in ()).throw(redis.ConnectionError("gone")))
        assert job.sweep_once() == 0  # the loss is seen, the journal not settled; then the worker stops
    assert sent == [] and [e.task_id for e in job.journal.entries()] == [task_id]
    again = _restarted(job)
    assert again.sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]
    _journal(again, "park", task_id)  # it parked again (QUEUED), then was handed the key and runs
    assert _restarted(again).sweep_once() == 0 and len(sent) == 1
    assert again.journal.entries() == []


def test_a_run_whose_send_failed_before_the_worker_stopped_is_sent_by_the_restarted_worker(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job, sent = recovery
    job.sweep_once()
    task_id = _lost_run(sfapp, job, "unsent")
    redis_server.client(2).flushdb()
    with monkeypatch.context() as patch:
        patch.setattr(Signature, "apply_async",
                      lambda *a, **kw: (_ for _ in ()).throw(ConnectionError("down")))
        assert job.sweep_once() == 0 and job.owed  # the broker refused it; then the worker stops
    assert _restarted(job).sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]


def test_a_restore_from_an_older_snapshot_while_the_worker_was_down_is_a_loss(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType, redis_server: RedisServer,
) -> None:
    """Given a worker node that looked twice, then stopped with a run journaled that no longer
    waits in Redis, when Redis comes back from a snapshot taken before its last look (the same
    life, a smaller count), then the restarted worker takes it for a loss and sends the run again."""
    job, sent = recovery
    job.sweep_once()
    job.sweep_once()
    life, count = job.seen["sf"]
    task_id = _lost_run(sfapp, job, "restored")
    redis_server.client(2).set("sf:epoch", f"{life} {count - 2}")  # the snapshot's count
    assert _restarted(job).sweep_once() == 1 and [s["options"]["task_id"] for s in sent] == [task_id]


def test_a_snapshot_taken_after_the_last_look_loses_runs_parked_since_and_their_marks_say_so(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType,
) -> None:
    """Given a worker that looked at the epoch, then Redis saved a snapshot, then the worker parked
    a run (its mark beside it) and another run it had parked before the snapshot was handed on;
    when Redis comes back from that snapshot, the epoch reads as intact (the count still grows),
    but the compaction finds the new run gone with its mark: it is sent again. The run handed on
    (its mark is there: the data that had it waiting is there) is dropped, not sent."""
    job, sent = recovery
    app = sfapp.app
    with RedisServer() as server:
        store = LeaseStore(server.client(2), KeyLayout("sf"))
        job.stores["sf"] = store
        store.acquire("q:k", "holder-token", 30, Holder("holder"))
        handed, parked = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("handed", "parked"))
        for task_id in (handed, parked):
            app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
        mark = new_mark()
        assert store.handoff.park("q:k", handed, "h1", _message(app, "sfapp.queued", handed), None, mark=mark)
        _journal(job, "park", handed, mark=mark)
        job.sweep_once()  # the first look: both lines kept (one waits; the other is this life's)
        server.client().save()  # the snapshot: after the worker's look, with `handed` parked
        mark = new_mark()
        assert store.handoff.park("q:k", parked, "h2", _message(app, "sfapp.queued", parked), None, mark=mark)
        _journal(job, "park", parked, mark=mark)
        store.release("q:k", "holder-token")  # `handed` is handed the key (its message is sent)
        server.kill()
        server.start()  # back from the snapshot: `parked` is gone, and `handed` parked again
        assert store.epoch.look("x")[1] > job.seen["sf"][1]  # the epoch cannot tell
        job.compact_at = 0.0
        assert job.sweep_once() == 1
        assert [s["options"]["task_id"] for s in sent] == [parked]
        assert [e.task_id for e in job.journal.entries()] == [handed]  # still parked (in the snapshot)


def test_a_run_handed_on_leaves_its_mark_until_the_worker_drops_its_line(
    recovery: tuple[Recovery, list[dict[str, Any]]], sfapp: ModuleType,
) -> None:
    """Given a run parked with its mark and then handed on, when the worker compacts its journal,
    the line is dropped and so is the mark (nothing stays behind in Redis)."""
    job, sent = recovery
    store = sfapp.queued.store
    job.sweep_once()
    store.acquire("q:m", "holder-token", 30, Holder("holder"))
    task_id, mark = f"handed-{uuid.uuid4().hex[:6]}", new_mark()
    assert store.handoff.park("q:m", task_id, "h1", _message(sfapp.app, "sfapp.queued", task_id), None,
                              mark=mark)
    job.journal.append({"kind": "park", "namespace": "sf", "key": "q:m", "task_id": task_id,
                        "task": "sfapp.queued", "message": "{}", "at": 1.0, "mark": mark})
    assert store.client.zscore(store.layout.key(JOURNALED, "q:m"), mark) is not None
    store.release("q:m", "holder-token")  # it is handed the key, and its message takes it
    assert isinstance(store.acquire("q:m", "its-token", 30, Holder(task_id), handoff="h1"), Acquired)
    job.compact_at = 0.0
    assert job.sweep_once() == 0 and sent == [] and job.journal.entries() == []
    assert store.client.zscore(store.layout.key(JOURNALED, "q:m"), mark) is None


# -- the start of a run sent again ------------------------------------------------------------------


def _run(task: Any, task_id: str, headers: dict[str, Any], **parts: Any) -> Any:
    """What the stages see of a run of ``task`` (a worker's request with ``headers``)."""
    request = SimpleNamespace(id=task_id, hostname="w@host", headers=headers, ignore_result=False)
    return SimpleNamespace(task=task, request=request, task_id=task_id, key="q:k", args=("k", 1), kwargs={},
                           eager=False, handoff="", guard=None, lease=None, claim=None, notes={},
                           provisional=[], **parts)


def test_a_recovered_run_whose_state_cannot_be_read_goes_on_rather_than_be_lost(sfapp: ModuleType) -> None:
    """Given a run sent again of a task without a result backend, with ``ignore_result``, or
    whose backend fails, when it starts, then it goes on (at least once); a STARTED one does not."""
    task_id = f"rec-{uuid.uuid4().hex[:6]}"

    class Failing:
        def get_task_meta(self, task_id: str) -> dict[str, Any]:
            raise ConnectionError("backend down")

    def task(**changed: Any) -> Any:
        return SimpleNamespace(**{"name": "sfapp.queued", "backend": sfapp.app.backend,
                                  "ignore_result": False, "status_all": lambda *a, **kw: [],
                                  "store": sfapp.queued.store, **changed})

    for kept_none in (task(backend=DisabledBackend(sfapp.app)), task(ignore_result=True),
                      task(backend=Failing())):
        assert already_placed(_run(kept_none, task_id, {HEADER_RECOVERED: "park"})) is None
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "STARTED")
    assert already_placed(_run(task(), task_id, {HEADER_RECOVERED: "park"})) == "is STARTED already"


def test_a_recovered_run_that_takes_its_key_makes_its_earlier_hand_off_message_a_copy(
    sfapp: ModuleType,
) -> None:
    """Given a run sent again whose hand-off message (token ``h1``) may still be on its way, when
    it takes its key and ends, then that message, arriving, is another copy: it does not run."""
    store, task_id = sfapp.queued.store, f"rec-{uuid.uuid4().hex[:6]}"
    got = store.acquire("q:k", "recovered-token", 30, Holder(task_id))
    assert isinstance(got, Acquired)
    run = _run(sfapp.queued, task_id, {HEADER_RECOVERED: "park", HEADER_RECOVERED_HANDOFF: "h1"})
    run.guard, run.lease = SimpleNamespace(store=store), SimpleNamespace(fence=got.fence)
    assert Recovered().on_start(run) is None
    store.release("q:k", "recovered-token", "succeeded", 30.0, fence=got.fence)
    late = store.acquire("q:k", "handoff-token", 30, Holder(task_id), handoff="h1")
    assert isinstance(late, Held) and late.copy


def test_a_run_that_waited_is_marked_started_and_watched_when_it_starts(sfapp: ModuleType) -> None:
    """Given a run sent again by the recovery (QUEUED), when it starts under its lease, then its
    state is STARTED (a recovered copy of it is dropped) and it is in the started index (it ends
    FAILURE RunLost if lost with its worker); its own end replaces STARTED."""
    store, task_id = sfapp.queued.store, f"rec-{uuid.uuid4().hex[:6]}"
    sfapp.app.backend.store_result(task_id, {"key": "q:k"}, "QUEUED")
    got = store.acquire("q:k", "token", 30, Holder(task_id))
    assert isinstance(got, Acquired)
    run = _run(sfapp.queued, task_id, {HEADER_RECOVERED: "park"}, options=sfapp.queued.options)
    run.guard = SimpleNamespace(store=store)
    run.lease = SimpleNamespace(slot=got.slot, fence=got.fence, time_left=30.0)
    assert LostRuns().on_start(run) is None
    meta = sfapp.app.backend.get_task_meta(task_id)
    assert meta["status"] == "STARTED" and meta["result"]["key"] == "q:k"
    members = store.client.zrange(store.layout.index(STARTED), 0, -1)
    assert any(task_id in member.decode() for member in members)
    sfapp.app.backend.mark_as_done(task_id, 1)
    assert sfapp.app.AsyncResult(task_id).state == "SUCCESS"
