"""A holder's pool process released its key and was killed before it answered the runs joined
to it (between two lines): the worker's main process answers them, and only them.

Found by the many-workers test on a Redis Cluster (tests/chaos/test_cluster_many_workers.py): a
joined run stayed JOINED for good. The release had moved it from the key's join list into the
record of what that release handed over, where no sweep looks.
"""

from __future__ import annotations

import json
import subprocess
import uuid
from types import ModuleType

import pytest
from billiard.exceptions import WorkerLostError
from celery.result import AsyncResult

from celery_singleflight import LeaseLost, constants
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import LeaseStore
from celery_singleflight.worker.bootstep import release_for_ended_child
from celery_singleflight.worker.sweeper import Sweeper, sweeps_for

from .conftest import wait_for


def released_for(store: LeaseStore, key: str, token: str) -> float:
    """Seconds since the release of ``token`` took the joined runs of ``key`` (the server's clock)."""
    taken, now_ms = store.handoff.taken_joined(key)
    return (now_ms - taken[token]) / 1000.0


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("with_parked", [False, True], ids=["ended", "handed-to-a-parked-run"])
def test_joined_runs_a_killed_releaser_never_answered_are_answered_by_the_main_process(
    sfapp: ModuleType, with_parked: bool
) -> None:
    task = sfapp.app.tasks[sfapp.joined.name]  # the registered task, as the worker's signal sends it
    store = task.store
    key = task.render_key("orphan", "v")
    holder_id, token = f"holder-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    got = store.acquire(key, token, 30.0, Holder(task_id=holder_id, pid=dead_pid()))
    assert isinstance(got, Acquired)
    joiner = str(uuid.uuid4())
    task.backend.store_result(joiner, {"key": key, "holder": holder_id}, "JOINED")
    message = json.dumps(dict(task.s("orphan", "w").set(task_id=joiner)))
    assert store.handoff.join(key, message) is not None
    if with_parked:
        parked = json.dumps(dict(sfapp.queued.s("x", 1).set(task_id=str(uuid.uuid4()))))
        store.handoff.park(key, "parked-1", uuid.uuid4().hex, parked, None)
    # the pool process releases (taking the joined run) and is killed before it answers it
    settlement = store.release(key, token, "succeeded", 30.0, fence=got.fence, task_id=holder_id)
    assert settlement.ours and list(settlement.joined) == [message]
    assert (store.record(key).get("reserved") == "1") is with_parked
    assert AsyncResult(joiner, app=sfapp.app).state == "JOINED"

    lost = WorkerLostError("Worker exited prematurely: signal 9 (SIGKILL)")
    release_for_ended_child(task, holder_id, ("orphan", "v"), {}, "worker-lost", doomed=False, error=lost)
    answered = AsyncResult(joiner, app=sfapp.app)
    assert answered.state == "FAILURE" and isinstance(answered.result, WorkerLostError)

    # an answered run is not answered again (a run that did answer it is never overwritten)
    task.backend.mark_as_done(joiner, {"value": "from the holder"})
    release_for_ended_child(task, holder_id, ("orphan", "v"), {}, "worker-lost", doomed=False, error=lost)
    assert AsyncResult(joiner, app=sfapp.app).result == {"value": "from the holder"}


def test_the_sweeper_answers_them_when_the_whole_worker_died(sfapp: ModuleType) -> None:
    """The whole worker was killed right after the release (no main process left to answer):
    the handed-on parked run's reservation runs out, and the sweeper that sends it again also
    answers the joined runs that release took."""
    task = sfapp.app.tasks[sfapp.joined.name]
    store = task.store
    key = task.render_key("orphan-host", "v")
    holder_id, token = f"holder-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    got = store.acquire(key, token, 30.0, Holder(task_id=holder_id, pid=dead_pid()))
    assert isinstance(got, Acquired)
    joiner = str(uuid.uuid4())
    task.backend.store_result(joiner, {"key": key, "holder": holder_id}, "JOINED")
    assert store.handoff.join(key, json.dumps(dict(task.s("orphan-host", "w").set(task_id=joiner))))
    parked_run = sfapp.queued.s("orphan-host", 1).set(task_id=str(uuid.uuid4()), queue="nowhere")
    parked = json.dumps(dict(parked_run))
    store.handoff.park(key, "parked-1", uuid.uuid4().hex, parked, None)
    store.release(key, token, "succeeded", 0.2, fence=got.fence, task_id=holder_id)  # reserved 0.2 s
    wait_for(lambda: store.time_left(key) is None)  # the reservation ran out (the server's clock)
    store.client.zadd(store.layout.waiting(), {key: 0})  # due now
    assert Sweeper(sfapp.app, sweeps_for(sfapp.app)).sweep_once() == 1
    answered = AsyncResult(joiner, app=sfapp.app)
    assert answered.state == "FAILURE" and isinstance(answered.result, LeaseLost)


def test_the_sweeper_answers_them_when_the_whole_worker_died_with_nothing_parked(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole worker was killed right after the release, and nothing was parked: no hand-off
    reveals the loss (found by the model of the protocol: the joined run stayed JOINED). The
    key's look, planned when the run joined, answers it once the release is ANSWER_GRACE old,
    and looks again until then."""
    monkeypatch.setattr(constants, "ANSWER_GRACE", 0.5)
    task = sfapp.app.tasks[sfapp.joined.name]
    store = task.store
    key = task.render_key("orphan-alone", "v")
    holder_id, token = f"holder-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    got = store.acquire(key, token, 30.0, Holder(task_id=holder_id, pid=dead_pid()))
    assert isinstance(got, Acquired)
    joiner = str(uuid.uuid4())
    task.backend.store_result(joiner, {"key": key, "holder": holder_id}, "JOINED")
    assert store.handoff.join(key, json.dumps(dict(task.s("orphan-alone", "w").set(task_id=joiner))))
    settlement = store.release(key, token, "succeeded", 30.0, fence=got.fence, task_id=holder_id)
    assert len(settlement.joined) == 1  # taken, and never answered: the worker is gone
    sweeper = Sweeper(sfapp.app, sweeps_for(sfapp.app))
    store.client.zadd(store.layout.waiting(), {key: 0})  # its look is due now
    sweeper.sweep_once()
    assert AsyncResult(joiner, app=sfapp.app).state == "JOINED"  # a live releaser may still answer
    assert store.client.zscore(store.layout.waiting(), key) is not None  # looked at again
    wait_for(lambda: released_for(store, key, token) >= constants.ANSWER_GRACE)  # as the sweeper counts
    store.client.zadd(store.layout.waiting(), {key: 0})
    sweeper.sweep_once()
    answered = AsyncResult(joiner, app=sfapp.app)
    assert answered.state == "FAILURE" and isinstance(answered.result, LeaseLost)
    assert list(store.handoff.taken_joined(key)[0]) == [token]  # kept for a replay of that release


def test_a_joined_run_its_releaser_answered_is_left_as_it_is(sfapp: ModuleType,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweeper's look after the grace answers only runs still waiting."""
    monkeypatch.setattr(constants, "ANSWER_GRACE", 0.0)
    task = sfapp.app.tasks[sfapp.joined.name]
    store = task.store
    key = task.render_key("orphan-answered", "v")
    token = uuid.uuid4().hex
    got = store.acquire(key, token, 30.0, Holder(task_id="holder", pid=dead_pid()))
    assert isinstance(got, Acquired)
    joiner = str(uuid.uuid4())
    assert store.handoff.join(key, json.dumps(dict(task.s("orphan-answered", "w").set(task_id=joiner))))
    store.release(key, token, "succeeded", 30.0, fence=got.fence, task_id="holder")
    task.backend.mark_as_done(joiner, {"value": "from the holder"})
    store.client.zadd(store.layout.waiting(), {key: 0})
    Sweeper(sfapp.app, sweeps_for(sfapp.app)).sweep_once()
    assert AsyncResult(joiner, app=sfapp.app).result == {"value": "from the holder"}
