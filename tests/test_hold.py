"""``hold()`` outside tasks: the same lease, heartbeat, fence and progress, against real workers."""

from __future__ import annotations

import getpass
import os
import socket
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery

import celery_singleflight as sf
from celery_singleflight import ConfigurationError, LeaseLost, LockHeld, RedisUnavailable, hold, signals
from celery_singleflight.testing import RedisServer, WorkerProcess, free_port

from .conftest import HOLD, gates_opened_after, let_go, stays, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

_gates_opened = gates_opened_after("busy", "hc", "hc-busy")


@pytest.fixture
def released() -> Iterator[list[dict[str, Any]]]:
    """The ``lease_released`` signals sent by holds during the test."""
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, lease: Any = None, reason: str = "", **_: Any) -> None:
        if sender == "hold":
            seen.append({"key": lease.key, "reason": reason, "fence": lease.fence})

    signals.lease_released.connect(receiver, weak=False)
    yield seen
    signals.lease_released.disconnect(receiver)


def test_hold_excludes_tasks_on_the_same_key(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a hold on a task's rendered key, when tasks of that key arrive, then a raise-policy
    task fails with LockHeld naming the hold and a skip-policy task is skipped; after the block,
    the task runs."""
    key = sfapp.hold_raise.render_key("x")
    with hold(sfapp.app, key) as lease:
        assert lease.key == key == "k:x"
        refused = sfapp.hold_raise.delay("x", 0.01)
        with pytest.raises(LockHeld) as info:
            refused.get(timeout=15)
        assert info.value.holder is not None and info.value.holder.startswith("hold:")
        me = f"hold:{getpass.getuser()}@{socket.gethostname()}:{os.getpid()}"
        assert info.value.holder == lease.holder == me
        skipped = sfapp.hold_skip.delay("x", 0.01).get(timeout=15)
        assert sf.is_skipped(skipped) and skipped["holder"] == lease.holder
    assert sfapp.recorder.llen("runs:x") == 0
    assert sfapp.hold_raise.delay("x", 0.01).get(timeout=15)["key"] == "x"
    assert sfapp.recorder.llen("runs:x") == 1


def test_hold_waits_for_a_running_task(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a task holding the key (until the test lets it go), when a hold asks with wait=0,
    then LockHeld names the task at once; with wait=10 the hold gets the key after the task ends."""
    running = sfapp.sleeper.delay("busy", HOLD)
    key = sfapp.sleeper.render_key("busy")
    wait_for(lambda: sfapp.recorder.get("pid:busy"), timeout=15)
    started = time.monotonic()
    with pytest.raises(LockHeld) as info, hold(sfapp.app, key, wait=0):
        pytest.fail("the hold must not get a held key")
    assert time.monotonic() - started < 1.0
    assert info.value.holder == running.id and info.value.key == key
    assert info.value.ttl_left is not None and 0 < info.value.ttl_left <= 30
    assert not running.ready()
    let_go(sfapp, "busy")  # the task ends (it looks at its gate every 20 ms) and releases the key
    with hold(sfapp.app, key, wait=10) as lease:
        # the task's body is over (it released the key); Celery stores its result just after
        assert sfapp.recorder.get("pid:busy") and running.get(timeout=5) == "slept"
        assert lease.fence > 0 and not lease.lost


def test_parked_queue_tasks_run_right_after_the_hold(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    """Given queue-policy tasks parked behind a hold, when the block ends, the hold hands the key
    to the first of them at once (not after its 30 s TTL) and they run in dispatch order."""
    key = sfapp.queued.render_key("hq", 0)
    with hold(sfapp.app, key):
        results = [sfapp.queued.delay("hq", n, 0.01) for n in range(3)]
        wait_for(lambda: (st := sf.status(sfapp.app, key)) is not None and st.queued == 3, timeout=15)
    started = time.monotonic()
    assert [r.get(timeout=10) for r in results] == [0, 1, 2]
    assert time.monotonic() - started < 5
    assert sfapp.recorder.llen("overlaps") == 0


def test_wait_gives_up_at_the_deadline(sfapp: ModuleType) -> None:
    """Given a key held by another hold, when a hold waits 0.5 s, then it raises LockHeld after
    about 0.5 s (not at once, not much later)."""
    with hold(sfapp.app, "deadline", holder="first") as first:
        started = time.monotonic()
        with pytest.raises(LockHeld) as info, hold(sfapp.app, "deadline", wait=0.5):
            pytest.fail("the hold must not get a held key")
        waited = time.monotonic() - started
        assert 0.45 <= waited < 1.0
        assert info.value.holder == "first" and not first.lost


def test_fences_grow_across_holds_and_tasks(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given successive holds and a task run on one key, each fence is larger than the last."""
    key = sfapp.hold_raise.render_key("f")
    with hold(sfapp.app, key) as one:
        first = one.fence
    with hold(sfapp.app, key) as two:
        second = two.fence
    task_fence = sfapp.hold_raise.delay("f", 0.01).get(timeout=15)["fence"]
    with hold(sfapp.app, key) as three:
        third = three.fence
    assert first < second < task_fence < third


def test_progress_is_visible_by_key_and_the_outcome_recorded(
    sfapp: ModuleType, released: list[dict[str, Any]]
) -> None:
    """Given a hold reporting progress, status() by key shows it and the holder while held;
    after the block the outcome is succeeded, and after an exception it is failed (and the
    exception propagates)."""
    with hold(sfapp.app, "maint:db") as lease:
        assert lease.progress("vacuum", current=1, total=3, message="tables", step="a") is True
        st = sf.status(sfapp.app, "maint:db")
        assert st is not None and st.held and st.state == "vacuum"
        assert (st.current, st.total, st.percent) == (1, 3, 33.33)
        assert st.message == "tables" and st.fields == {"step": "a"}
        assert st.task_id == lease.holder and st.task_name == "hold" and st.fence == lease.fence
        lease.progress("analyze", current=2, total=3)  # if throttled, the flush at exit writes it
    st = sf.status(sfapp.app, "maint:db")
    assert st is not None and not st.held and st.outcome == "succeeded" and st.current == 2
    events = list(sf.watch(sfapp.app, "maint:db", timeout=2))
    assert [e.state for e in events] == ["vacuum", "analyze", "succeeded"]

    with pytest.raises(RuntimeError, match="disk full"), hold(sfapp.app, "maint:db") as failing:
        failing.progress("vacuum", current=1, total=3)
        raise RuntimeError("disk full")
    st = sf.status(sfapp.app, "maint:db")
    assert st is not None and not st.held and st.outcome == "failed" and st.fence == failing.fence
    assert [r["reason"] for r in released] == ["succeeded", "failed"]
    with pytest.raises(sf.NotInsideRun):
        failing.progress("late")


def test_interrupt_is_recorded_as_terminated(sfapp: ModuleType) -> None:
    """Given Ctrl-C in the block, the key is freed at once with outcome terminated (as a task
    stopped by a signal) and the interrupt propagates."""
    with pytest.raises(KeyboardInterrupt), hold(sfapp.app, "ctrl-c"):
        raise KeyboardInterrupt
    st = sf.status(sfapp.app, "ctrl-c")
    assert st is not None and not st.held and st.outcome == "terminated"


def test_bad_progress_is_refused_at_the_call(sfapp: ModuleType) -> None:
    with hold(sfapp.app, "bad-progress") as lease:
        with pytest.raises(sf.ProgressError, match="more than total"):
            lease.progress("x", current=5, total=3)
        with pytest.raises(sf.ProgressError, match="not JSON-serializable"):
            lease.progress("x", when=object())


def test_heartbeat_keeps_a_short_lease(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """Given ttl=1, when the block runs 3 s, then the lease is held throughout and stays ours."""
    store = sfapp.hold_raise.store
    with hold(sfapp.app, "hb", ttl=1) as lease:
        stays(lambda: store.time_left("hb"), 3)  # three TTLs: only renewals keep it held
        assert not lease.lost and 0 < lease.time_left <= 1
        lease.check()
    assert store.holder_record("hb") == {} and store.time_left("hb") is None


def test_lease_deleted_behind_its_back_is_lost(
    sfapp: ModuleType, redis_server: RedisServer, released: list[dict[str, Any]]
) -> None:
    """Given a held key whose lease is deleted behind the hold's back, then ``lost`` turns true
    within a couple of seconds, check() and progress() raise LeaseLost, and the exit reports
    the outcome lost."""
    with hold(sfapp.app, "gone", ttl=1.5) as lease:
        lease.progress("working")
        redis_server.client(2).delete(sfapp.hold_raise.store.layout.run("gone"))
        wait_for(lambda: lease.lost, timeout=2.5)
        with pytest.raises(LeaseLost, match="gone"):
            lease.check()
        with pytest.raises(LeaseLost):
            lease.progress("still working")
    assert released == [{"key": "gone", "reason": "lost", "fence": lease.fence}]
    st = sf.status(sfapp.app, "gone")
    assert st is not None and not st.held and st.outcome != "succeeded"


def test_long_keys_are_digested_like_rendered_keys(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a key over 256 chars, the hold takes the digested key a task renders, whether it is
    given in full or already digested (as render_key() and held() give it)."""
    long = "y" * 300
    rendered = sfapp.hold_raise.render_key(long)
    full = f"k:{long}"
    assert rendered == sf.digest_key(full) != full
    for given in (full, rendered):
        with hold(sfapp.app, given) as lease:
            assert lease.key == rendered
            with pytest.raises(LockHeld):
                sfapp.hold_raise.delay(long, 0.01).get(timeout=15)


def test_redis_unreachable_raises(redis_server: RedisServer) -> None:
    """Given the lease Redis is down, entering raises RedisUnavailable (no fail-open)."""
    app = Celery("down", broker="memory://", set_as_current=False)
    app.conf.singleflight_redis_url = f"redis://127.0.0.1:{free_port()}/2"
    with pytest.raises(RedisUnavailable) as info, hold(app, "offline"):
        pytest.fail("no lease without Redis")
    assert info.value.key == "offline"


def test_lost_reads_the_leases_own_clock_while_the_heartbeat_is_blocked() -> None:
    """Given a lease whose renewals cannot be answered (its Redis frozen), ``lease.lost`` turns
    true once the TTL passed since the last confirmed renewal, without ``check()`` being called
    and before the blocked heartbeat says anything: a body polling ``if lease.lost:`` stops."""
    with RedisServer() as server:
        app = Celery("frozen", broker="memory://", set_as_current=False)
        app.conf.singleflight_redis_url = f"{server.url}/2"
        lost: list[str] = []

        def receiver(sender: Any = None, lease: Any = None, reason: str = "", **_: Any) -> None:
            lost.append(reason)

        signals.lease_lost.connect(receiver, weak=False)
        try:
            with hold(app, "frozen", ttl=1) as lease:
                assert not lease.lost
                server.pause()
                try:
                    started = time.monotonic()
                    wait_for(lambda: lease.lost, timeout=3)
                    assert time.monotonic() - started < 1.5
                    assert lease.time_left == 0 and lost and "TTL" in lost[0]
                    with pytest.raises(LeaseLost):
                        lease.check()
                finally:
                    server.resume()
        finally:
            signals.lease_lost.disconnect(receiver)


def test_redis_error_on_release_does_not_mask_the_body_error(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Given Redis fails at release, the body's exception still propagates and a warning says
    the key frees when its lease expires."""

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("connection reset")

    with pytest.raises(ValueError, match="body"), hold(sfapp.app, "rel-err", ttl=2) as lease:
        monkeypatch.setattr(lease.lease.store, "release", broken)
        raise ValueError("body")
    assert "could not release key='rel-err'" in caplog.text and "expires" in caplog.text


def test_bad_arguments_are_refused(sfapp: ModuleType) -> None:
    with pytest.raises(ConfigurationError, match="ttl"):
        hold(sfapp.app, "k", ttl=0)
    with pytest.raises(ConfigurationError, match="wait"):
        hold(sfapp.app, "k", wait=-1)
    with pytest.raises(ConfigurationError, match="key"):
        hold(sfapp.app, "")


def test_a_hold_is_one_run_of_a_max_concurrency_key(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given tasks with max_concurrency=3 on a key, a hold counts as one of the three runs: by default
    it takes the first slot and two task runs go on beside it, the third waits (queue) until one
    ends; with slots=3 a hold takes whichever slot is free, and waits only when all three are held."""
    key = sfapp.limited.render_key("hc")
    with hold(sfapp.app, key) as lease:
        assert lease.lease.slot == 0
        results = [sfapp.limited.delay("hc", HOLD) for _ in range(3)]  # until the test let them go
        wait_for(lambda: sfapp.recorder.llen("runs:hc") == 2, timeout=15)
        wait_for(lambda: any(r.state == "QUEUED" for r in results), timeout=15)  # the third, parked
        assert sfapp.recorder.llen("runs:hc") == 2  # the third waits: the hold is the third run
        assert sorted(st.slot for st in sf.status_all(sfapp.app, key)) == [0, 1, 2]
        let_go(sfapp, "hc")
    assert sorted(r.get(timeout=20) for r in results) in ([0, 1, 2], [1, 1, 2], [1, 2, 2])

    busy = sfapp.limited.render_key("hc-busy")
    running = [sfapp.limited.delay("hc-busy", HOLD) for _ in range(3)]  # until the test let them go
    wait_for(lambda: sfapp.recorder.llen("runs:hc-busy") == 3, timeout=15)
    with pytest.raises(LockHeld), hold(sfapp.app, busy, slots=3, wait=0):
        pytest.fail("every slot is held")
    let_go(sfapp, "hc-busy")
    with hold(sfapp.app, busy, slots=3, wait=15) as lease:
        assert lease.lease.slot in (0, 1, 2)
        assert int(sfapp.recorder.get("active:hc-busy") or 0) <= 2  # it got a slot once a run ended
    assert all(isinstance(r.get(timeout=20), int) for r in running)
    assert sfapp.recorder.lrange("overlaps", 0, -1) == []
