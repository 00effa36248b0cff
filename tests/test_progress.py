"""Progress and status by key, watched from another process while a real worker runs the task."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight import NotInsideRun
from celery_singleflight import states as sf_states
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import HOLD, gates_opened_after, let_first_step_go, stays, wait_for
from .test_observers import flower, flower_state  # noqa: F401 - the flower fixture

pytestmark = pytest.mark.worker

#: the runs' held steps and the steps after (which then end at once)
_HELD = ("w", "st", "late", "rv", "fl", "fl-rv", "dup")
_gates_opened = gates_opened_after(*_HELD, *(f"{name}:first" for name in _HELD))


def follow(sfapp: ModuleType, name: str, events: Iterator[sf.WatchEvent], until: int) -> list[sf.WatchEvent]:
    """Every event of a watch of the run on ``name``: once it has yielded the progress at step
    ``until`` (the run is held there), the run is let go and the rest comes live."""
    seen: list[sf.WatchEvent] = []
    for event in events:
        seen.append(event)
        if event.kind == "progress" and event.current == until:
            break
    let_first_step_go(sfapp, name)
    return [*seen, *events]


def test_watch_by_key_from_another_process(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a task reporting 5 steps, a watcher in this process (not the worker) sees every
    update in order, live, and then the run's end; the status record then says succeeded."""
    result = sfapp.reporting.delay("w", 5, 0.2, first=HOLD)  # its first step until the watcher has it
    key = sfapp.reporting.render_key("w")
    wait_for(lambda: sf.status(sfapp.app, key), timeout=15)
    events = follow(sfapp, "w", sf.watch(sfapp.app, key, timeout=20), until=0)
    progress = [e for e in events if e.kind == "progress"]
    assert [e.current for e in progress] == [0, 1, 2, 3, 4, 5]
    assert progress[0].state == "loading" and progress[-1].state == "finishing"
    assert progress[2].message == "step 2" and progress[2].fields == {"name": "w"}
    assert progress[2].percent == 40.0
    assert events[-1].kind == "end" and events[-1].state == "succeeded"
    assert result.get(timeout=5) == 5
    final = sf.status(sfapp.app, key)
    assert final is not None and not final.held and final.outcome == "succeeded"
    assert final.task_id == result.id and final.current == 5


@pytest.mark.core
def test_status_record_while_running(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    result = sfapp.reporting.delay("st", 4, 0.4, first=HOLD)  # its first step until the test read it
    key = sfapp.reporting.render_key("st")
    st = wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.current is not None and s, timeout=15)
    assert st.held and st.task_id == result.id and st.task_name == "sfapp.reporting"
    assert st.state == "loading" and st.total == 4
    assert st.pid and st.host and st.worker and st.fence
    assert st.started is not None and st.updated is not None and st.updated >= st.started
    assert 0 < st.ttl_left <= 30
    assert st.queued == 0
    assert [s.key for s in sf.held(sfapp.app, prefix="job:")] == [key]
    assert sf.held(sfapp.app, prefix="other:") == []
    # the caller holding the AsyncResult sees the same progress in the result backend
    # (state and meta from one read: states.read, so a run ending in between cannot pair them wrong)
    meta = wait_for(lambda: (m := sf_states.read(result)) and m.progress_state == "loading" and m, timeout=5)
    assert meta.key == key
    let_first_step_go(sfapp, "st")
    result.get(timeout=15)


def test_a_watcher_that_starts_late_replays_the_history(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    # its step 2 holds until the watcher, started then, replayed the steps before
    result = sfapp.reporting.delay("late", 3, 0.3, first=HOLD, at=2)
    key = sfapp.reporting.render_key("late")
    wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.current == 2, timeout=15)
    events = follow(sfapp, "late", sf.watch(sfapp.app, key, timeout=15), until=2)
    assert [e.current for e in events if e.kind == "progress"] == [0, 1, 2, 3]
    result.get(timeout=5)


@pytest.mark.core
def test_terminal_outcome_of_a_failed_run(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    with pytest.raises(RuntimeError):
        sfapp.fails_after_progress.delay("f").get(timeout=15)
    st = sf.status(sfapp.app, sfapp.fails_after_progress.render_key("f"))
    assert st is not None and not st.held and st.outcome == "failed" and st.current == 1


@pytest.mark.core
def test_terminal_outcome_of_a_revoked_run(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    result = sfapp.reporting.delay("rv", 50, 0.2, first=HOLD)  # its first step until revoked
    key = sfapp.reporting.render_key("rv")
    wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.current is not None, timeout=15)
    result.revoke(terminate=True)
    # the child, stopped with SIGTERM, records "terminated" on its way out; the worker's main process,
    # which knows it was a revoke, then corrects it to "revoked"
    st = wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.outcome == "revoked" and s, timeout=10)
    assert not st.held


def test_status_has_no_arguments_unless_the_task_opts_in(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    sfapp.without_args.delay("na", secret="hunter2").get(timeout=15)
    sfapp.with_args.delay("wa", secret="hunter2").get(timeout=15)
    db = redis_server.client(2)
    hidden = db.get(sfapp.without_args.store.layout.run(sfapp.without_args.render_key("na")))
    assert hidden and b"hunter2" not in hidden
    shown = sf.status(sfapp.app, sfapp.with_args.render_key("wa"))
    assert shown is not None and shown.args == {"args": ["wa"], "kwargs": {"secret": "hunter2"}}


def test_throttle_coalesces_a_tight_loop_and_writes_the_last_state(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    """Given 1,000 progress() calls in a tight loop at a 5/s rate, then only a handful are
    written, and the last one (1000/1000) is what the status says."""
    writes_seen_by_task = sfapp.chatty.delay("tight", 1000).get(timeout=30)
    assert writes_seen_by_task <= 3
    st = sf.status(sfapp.app, sfapp.chatty.render_key("tight"))
    assert st is not None and st.current == 1000 and st.total == 1000


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("negative", "must not be negative"),
        ("inconsistent", "more than total"),
        ("not-json", "'when' is not JSON-serializable"),
        ("too-big", "more than the limit"),
        ("empty-state", "non-empty string"),
    ],
)
def test_bad_progress_values_get_a_clear_error(
    sfapp: ModuleType, shared_worker: WorkerProcess, case: str, needle: str
) -> None:
    outcome = sfapp.bad_progress.delay(f"bad-{case}", case).get(timeout=15)
    assert outcome["error"] == "ProgressError"
    assert needle in outcome["message"]


def test_progress_after_the_lease_was_lost_raises_lease_lost(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    """Given a holder whose lease is deleted behind its back (a new holder could now own the key),
    then its next progress() is refused by the owner check and raises LeaseLost."""
    result = sfapp.progress_after_loss.delay("pl")
    wait_for(lambda: sfapp.recorder.get("started:pl"), timeout=15)
    key = sfapp.progress_after_loss.render_key("pl")
    redis_server.client(2).delete(sfapp.progress_after_loss.store.layout.run(key))
    assert result.get(timeout=15) == {"error": "LeaseLost"}


def test_progress_outside_a_run_is_a_clear_error(sfapp: ModuleType) -> None:
    with pytest.raises(NotInsideRun, match="only available while the task body runs"):
        sfapp.reporting.progress("x")


def test_unknown_key_has_no_status(sfapp: ModuleType) -> None:
    assert sf.status(sfapp.app, "never:used") is None
    assert list(sf.watch(sfapp.app, "never:used", timeout=1)) == []


def test_flower_shows_progress_then_the_true_final_state(
    sfapp: ModuleType, start_worker: object, flower: str  # noqa: F811 - the fixture
) -> None:
    """Given a worker sending events and a real Flower, a task calling self.progress is PROGRESS
    in Flower while it runs, SUCCESS after; a revoked one ends REVOKED, not PROGRESS."""
    q = start_worker(concurrency=2, extra=("-E",)).queue  # type: ignore[operator]
    # each run's first step holds until Flower showed it PROGRESS
    done = sfapp.reporting.apply_async(("fl", 6, 0.3), {"first": HOLD}, queue=q)
    wait_for(lambda: flower_state(flower, done.id) == "PROGRESS", timeout=20, interval=0.1)
    let_first_step_go(sfapp, "fl")
    done.get(timeout=20)
    wait_for(lambda: flower_state(flower, done.id) == "SUCCESS", timeout=10, interval=0.2)

    revoked = sfapp.reporting.apply_async(("fl-rv", 100, 0.1), {"first": HOLD}, queue=q)
    wait_for(lambda: flower_state(flower, revoked.id) == "PROGRESS", timeout=20, interval=0.1)
    revoked.revoke(terminate=True)
    wait_for(lambda: flower_state(flower, revoked.id) == "REVOKED", timeout=10, interval=0.2)
    # a late progress event must not turn it back: nothing marks the last event the killed run sent,
    # so this is an observation window (as long as the second it always was)
    stays(lambda: flower_state(flower, revoked.id) == "REVOKED", 1.0, interval=0.2)


def test_duplicates_are_counted_and_shown_to_watchers(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    """Given a reporting holder, a skipped duplicate is counted on the holder's status and a
    live watcher sees a `duplicate` event naming it; the holder's run is unaffected."""
    # its first step holds until the duplicate met it and a watcher follows it
    holder = sfapp.reporting.delay("dup", 4, 0.3, first=HOLD)
    key = sfapp.reporting.render_key("dup")
    wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.current is not None, timeout=15)
    dup = sfapp.reporting_skip.delay("dup")
    assert sf.is_skipped(dup.get(timeout=15))
    events = follow(sfapp, "dup", sf.watch(sfapp.app, key, timeout=15), until=0)
    dups = [e for e in events if e.kind == "duplicate"]
    assert len(dups) == 1 and dups[0].state == "skipped" and dups[0].fields["task_id"] == dup.id
    assert events[-1].kind == "end" and events[-1].state == "succeeded"
    final = sf.status(sfapp.app, key)
    assert final is not None and final.duplicates == 1
    holder.get(timeout=5)


def test_a_long_key_listed_by_held_can_be_read_and_released(sfapp: ModuleType) -> None:
    """Given a key longer than 256 characters (stored as its digest), the name held() lists
    is the name status() and force_release() accept."""
    from celery_singleflight import digest_key
    from celery_singleflight.protocol.replies import Holder

    store = sfapp.reporting.store
    key = digest_key("x:" + "a" * 300)
    store.acquire(key, "tok", 30, Holder("tid-long", "w", "t"))
    listed = [s.key for s in sf.held(sfapp.app, prefix="x:")]
    assert listed == [key]
    st = sf.status(sfapp.app, listed[0])
    assert st is not None and st.task_id == "tid-long"
    assert sf.force_release(sfapp.app, listed[0], by="test") == "tid-long"


def test_a_lost_run_records_lost_as_its_outcome(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    """Given a run whose lease was deleted behind its back, its status ends as `lost` (not stuck
    on its last progress state), and a watcher's last event says so."""
    result = sfapp.progress_after_loss.delay("lostrec")
    wait_for(lambda: sfapp.recorder.get("started:lostrec"), timeout=15)
    key = sfapp.progress_after_loss.render_key("lostrec")
    wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.state == "working", timeout=10)
    redis_server.client(2).delete(sfapp.progress_after_loss.store.layout.run(key))
    result.get(timeout=15)
    st = wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.outcome and s, timeout=10)
    assert st.outcome == "lost" and st.state == "lost" and not st.held


@pytest.mark.core
def test_progress_and_the_lease_work_in_a_body_run_by_apply(redis_server: RedisServer) -> None:
    """``task.apply()`` (eager) runs the body under its lease with ``self.progress()`` and
    ``self.lease``, on every Celery allowed (5.3 pushes a fresh request for the body)."""
    from celery import Celery

    app = Celery("eager-progress", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.singleflight_redis_url = f"{redis_server.url}/2"

    @app.task(bind=True, base=sf.SingleFlightTask, name="eager.report", shared=False, lock_key="eager:<n>")
    def report(self: Any, n: int) -> int:
        self.progress("half", current=1, total=2)
        return int(self.lease.fence > 0)

    assert report.apply((1,)).get() == 1
    st = report.status(1)
    assert st is not None and st.outcome == "succeeded" and (st.current, st.total) == (1, 2)
