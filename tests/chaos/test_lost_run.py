"""A run lost with its worker ends terminal (``policies/lostruns.py``, ``protocol/started.py``).

A run that waited before it started (here: parked by ``queue``, so ``QUEUED``) and then died with
its whole worker has its result set to FAILURE with ``RunLost`` by another worker's sweeper, about
a second after its lease ran out. A run that never waited is not entered anywhere; one that ends
normally keeps its result and leaves nothing behind.

The first tests drive the protocol and the sweep job directly on the suite's private Redis
servers (fast); the last ones run real workers and SIGKILL one's whole process group.
"""

from __future__ import annotations

import pickle
import time
import uuid
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from celery import Celery

import celery_singleflight as sf
from celery_singleflight import RunLost, constants
from celery_singleflight.policies.lostruns import FailLostRuns
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.started import STARTED, StartedRun, Verdict, verdict
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.lost import watched as _watched
from celery_singleflight.testing import RedisServer

from .conftest import Workers, round3, runs, wait_for

TTL = 3.0


# -- the protocol and the sweep job, on a private Redis -----------------------------------------


@pytest.fixture
def store(lease_redis: RedisServer) -> LeaseStore:
    """A store of a namespace of its own."""
    return LeaseStore(lease_redis.client(4), KeyLayout(f"lost-{uuid.uuid4().hex[:8]}"))


@pytest.fixture
def app(broker_redis: RedisServer) -> Iterator[Celery]:
    """An app with the suite's result backend (no worker: the sweep job runs here)."""
    celery = Celery("lostunit", broker="memory://", backend=f"{broker_redis.url}/1")
    yield celery
    celery.close()


def take(store: LeaseStore, key: str, task_id: str, ttl: float) -> tuple[str, StartedRun]:
    """Take ``key`` as ``task_id`` with the real script: its token and its member."""
    token = uuid.uuid4().hex
    got = store.acquire(key, token, ttl, Holder(task_id, "w1@host", "t.lost"))
    assert isinstance(got, Acquired)
    return token, StartedRun(key, got.slot, task_id, got.fence, "w1@host")


def seen(store: LeaseStore, run: StartedRun) -> tuple[Verdict, float]:
    record, _, now = store.reads.snapshots([(run.key, run.slot)])[0]
    return verdict(record, now, run)


def plain(meta: dict[str, Any], *, when: bool = True) -> dict[str, Any]:
    """A result's meta, comparable: its error as (type, args); ``when=False`` drops ``date_done``."""
    found = dict(meta)
    if isinstance(found.get("result"), BaseException):
        found["result"] = (type(found["result"]).__name__, found["result"].args)
    if not when:
        found.pop("date_done", None)
    return found


def test_the_record_tells_what_became_of_a_started_run(store: LeaseStore) -> None:
    """Given runs taken and ended with the real scripts, the verdict is LIVE while the lease
    holds, ENDED after a release, LOST once it ran out unreleased; and it stays so after later
    runs took the slot (``prev_outcome``, then the ``lost`` fences), or when the record is gone."""
    _, live = take(store, "live", "t-live", 30.0)
    verdict_live, left = seen(store, live)
    assert verdict_live is Verdict.LIVE and 28.0 < left <= 30.0

    token, ended = take(store, "ended", "t-ended", 30.0)
    store.release("ended", token, "succeeded", 30.0, fence=ended.fence)
    assert seen(store, ended) == (Verdict.ENDED, 0.0)

    _, lost = take(store, "lost", "t-lost", 0.05)
    wait_for(lambda: store.time_left("lost") is None, timeout=10)  # its lease ran out
    assert seen(store, lost) == (Verdict.LOST, 0.0)

    # later runs on the slot: the next says how the run before it ended, further ones keep the fence
    for later in ("t-next", "t-after"):
        for key, run in (("ended", ended), ("lost", lost)):
            token, _ = take(store, key, later, 30.0)
            assert seen(store, run)[0] is (Verdict.LOST if run is lost else Verdict.ENDED), (later, key)
            store.release(key, token, "succeeded", 30.0)
    assert seen(store, StartedRun("gone", 0, "t-gone", 7, "w1@host")) == (Verdict.LOST, 0.0)


def test_a_member_is_the_same_text_for_the_same_run() -> None:
    run = StartedRun("sync:{42}", 2, "tid", 2**60 + 1, "w@h")
    assert StartedRun.parse(run.member()) == run
    assert run.member() == StartedRun("sync:{42}", 2, "tid", 2**60 + 1, "w@h").member()
    assert StartedRun.parse("not json") is None and StartedRun.parse('["a", 1]') is None


def test_run_lost_names_the_key_the_task_and_the_worker_and_pickles() -> None:
    error = RunLost("sync:42", "tid-1", "w1@host")
    assert isinstance(error, sf.SingleFlightError)
    assert str(error) == ("task tid-1 on key 'sync:42' was lost with worker w1@host: its lease ran out"
                          " unreleased")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.key, copy.task_id, copy.worker) == ("sync:42", "tid-1", "w1@host")


def test_only_runs_whose_lost_state_would_stay_are_watched() -> None:
    """A task that ignores results has no state to end; one that acknowledges late is delivered
    again (its run is not lost); one without a result backend cannot be told."""
    backend = Celery("lostunit-b", backend="cache+memory://").backend

    def task(**changed: Any) -> Any:
        return SimpleNamespace(**{"ignore_result": False, "acks_late": False, "backend": backend, **changed})

    assert _watched(task())
    assert not _watched(task(ignore_result=True))
    assert not _watched(task(acks_late=True))
    assert not _watched(task(backend=Celery("lostunit-d").backend))


def test_the_sweep_ends_lost_runs_once_and_twice_alike(store: LeaseStore, app: Celery) -> None:
    """Given a lost run (QUEUED in the backend), a lost run whose result is ready, a live, an
    ended run and a malformed member, all due: two sweepers at once, each run twice, set the
    lost one FAILURE with RunLost, leave the ready one, re-plan the live one, drop the others."""
    ids = {name: f"{name}-{uuid.uuid4().hex[:6]}" for name in ("lost", "ready", "live", "ended")}
    _, lost = take(store, "k-lost", ids["lost"], 0.05)
    _, ready = take(store, "k-ready", ids["ready"], 0.05)
    _, live = take(store, "k-live", ids["live"], 30.0)
    token, ended = take(store, "k-ended", ids["ended"], 30.0)
    store.release("k-ended", token, "succeeded", 30.0, fence=ended.fence)
    app.backend.store_result(ids["lost"], {"key": "k-lost", "holder": "h"}, "QUEUED")
    app.backend.store_result(ids["ready"], 41, "SUCCESS")
    for run in (lost, ready, live, ended):
        store.started.enter(run, -1.0)
    index = store.layout.index(STARTED)
    store.client.zadd(index, {"not a member": 0})
    wait_for(lambda: all(store.time_left(k) is None for k in ("k-lost", "k-ready")), timeout=10)  # ran out

    first, second = FailLostRuns(app, store), FailLostRuns(app, store)
    first.sweep_once()
    meta = app.backend.get_task_meta(ids["lost"])
    # a second sweeper that read the member and the QUEUED state before the first one wrote
    app.backend.store_result(ids["lost"], {"key": "k-lost", "holder": "h"}, "QUEUED")
    assert second.fail(lost)
    second.sweep_once()
    first.sweep_once()

    again = app.backend.get_task_meta(ids["lost"])
    assert meta["status"] == again["status"] == "FAILURE"
    assert plain(meta, when=False) == plain(again, when=False)
    error = app.AsyncResult(ids["lost"]).result
    assert isinstance(error, RunLost)
    assert (error.key, error.task_id, error.worker) == ("k-lost", ids["lost"], "w1@host")
    assert app.AsyncResult(ids["ready"]).result == 41
    remaining = {m.decode(): score for m, score in store.client.zrange(index, 0, -1, withscores=True)}
    assert list(remaining) == [live.member()]
    assert remaining[live.member()] / 1000.0 > time.time() + 29.0  # its lease's end, plus the grace


# -- real workers ---------------------------------------------------------------------------------


def started_index(chaos: ModuleType) -> list[str]:
    store = chaos.queued.store
    return [m.decode() for m in store.client.zrange(store.layout.index(STARTED), 0, -1)]


@pytest.mark.worker
@pytest.mark.timeout(120)
def test_a_parked_run_lost_with_its_worker_ends_failure_with_run_lost(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any]
) -> None:
    """Given a ``queue`` run that parked (QUEUED), was handed the key and started (STARTED), when
    its whole worker is SIGKILLed, then another worker's sweeper sets its result to FAILURE with
    RunLost naming the key and the worker, within TTL + 3 s of the kill; a second sweep changes
    nothing."""
    env = {"CHAOS_TTL": str(TTL)}
    victim, standby = workers.start(workers.make(queue, env=env), workers.make(f"{queue}-idle", env=env))
    key, go = "lost", "go:lost"
    rendered = chaos.queued.render_key(key, 0)
    # the holder holds its key until the run behind it parked
    holder = chaos.queued.apply_async((key, 0), {"seconds": 60.0, "until": go}, queue=queue)
    wait_for(lambda: runs(chaos, key), timeout=20)
    parked = chaos.queued.apply_async((key, 1), {"seconds": 60.0}, queue=queue)
    wait_for(lambda: parked.state == "QUEUED", timeout=10)
    assert started_index(chaos) == []  # the holder never waited: not entered
    chaos.recorder.set(go, 1)
    wait_for(lambda: any(r["task_id"] == parked.id for r in runs(chaos, key)), timeout=20)
    assert holder.get(timeout=10) == 0
    assert parked.state == "STARTED"  # marked when it started after waiting (a recovered copy is dropped)
    assert len(started_index(chaos)) == 1

    killed_at = time.time()
    victim.kill()
    ended_at = wait_for(lambda: parked.state == "FAILURE" and time.time(), timeout=TTL + 5, interval=0.05)

    error = chaos.app.AsyncResult(parked.id).result
    figures.update({"ttl_s": TTL, "failure_after_kill_s": round3(ended_at - killed_at)})
    assert isinstance(error, RunLost)
    assert (error.key, error.task_id, error.worker) == (rendered, parked.id, victim.hostname)
    assert ended_at - killed_at <= TTL + 3.0
    # ended by the first look after its lease ran out: the sweep of the key runs waited on (which
    # names its dead holders), or that of the started index, which drops the member when it is due
    wait_for(lambda: started_index(chaos) == [], timeout=constants.LOST_RUN_GRACE + 5)
    meta = chaos.app.backend.get_task_meta(parked.id)
    job = FailLostRuns(chaos.app, chaos.queued.store)
    job.sweep_once()
    job.sweep_once()
    assert plain(chaos.app.backend.get_task_meta(parked.id)) == plain(meta)
    assert standby.proc is not None and standby.proc.poll() is None


@pytest.mark.worker
@pytest.mark.timeout(120)
def test_runs_that_end_normally_keep_their_result_and_leave_nothing(
    chaos: ModuleType, workers: Workers, queue: str
) -> None:
    """Given a plain run and a parked run that both finish, then the plain one is never entered,
    the parked one is while it runs, and once its lease's deadline has passed the sweeper has
    dropped it: both keep SUCCESS."""
    workers.one(queue, env={"CHAOS_TTL": str(TTL)})
    key, go_plain, go_parked = "normal", "go:normal:0", "go:normal:1"
    # each run holds its key until the scenario looked at the started index while it ran
    plain = chaos.queued.apply_async((key, 0), {"seconds": 60.0, "until": go_plain}, queue=queue)
    wait_for(lambda: runs(chaos, key), timeout=20)
    parked = chaos.queued.apply_async((key, 1), {"seconds": 60.0, "until": go_parked}, queue=queue)
    wait_for(lambda: parked.state == "QUEUED", timeout=10)
    assert started_index(chaos) == []
    chaos.recorder.set(go_plain, 1)
    wait_for(lambda: any(r["task_id"] == parked.id for r in runs(chaos, key)), timeout=20)
    assert len(started_index(chaos)) == 1
    chaos.recorder.set(go_parked, 1)
    assert plain.get(timeout=10) == 0 and parked.get(timeout=10) == 1
    ended_at = time.time()

    wait_for(lambda: started_index(chaos) == [], timeout=TTL + 4, interval=0.1)
    assert time.time() - ended_at >= 1.0  # dropped by a look when it was due, not at the end
    assert (plain.state, parked.state) == ("SUCCESS", "SUCCESS")
    assert chaos.queued.store.client.exists(chaos.queued.store.layout.index(STARTED)) == 0
