"""Fair share on real workers: at most ``fair_concurrency`` at once, freed slots handed round robin
across fair keys (weights), waiting runs parked by the main process, nothing lost on a kill."""

from __future__ import annotations

import json
import os
import signal
import time
import uuid
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight import QueueTimeout, RunLost, constants, states
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.fair import FAIR_SINCE, Admitted, Waiting
from celery_singleflight.protocol.handoff import WAITING
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import HOLD, wait_for
from .lua_sources import SOURCE
from .test_cli import run_cli

pytestmark = pytest.mark.share_workers  # start_worker may lend a worker an earlier test left idle



def parked_for(store: LeaseStore, gate: str) -> float:
    """Seconds since the last run parked at ``gate``, by the server's clock."""
    client = store.ctx.client
    [(_, at_ms)] = client.zrange(store.ctx.layout.key(FAIR_SINCE, gate), -1, -1, withscores=True)
    seconds, micros = client.time()
    return seconds + micros / 1e6 - at_ms / 1000


def started(sfapp: ModuleType) -> list[tuple[str, int, float]]:
    out = []
    for raw in sfapp.recorder.lrange("fair:started", 0, -1):
        tenant, n, at = raw.decode().split(":")
        out.append((tenant, int(n), float(at)))
    return out


@pytest.mark.worker
def test_a_light_tenant_is_served_in_turn_behind_a_heavy_burst(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given tenant A's 40 runs sent first and tenant B's 5 after them, B's runs start in turn
    with A's (round robin), not after all of A's; never more than 2 run at once; every run runs once."""
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    # A's first two hold both slots until B's five are parked too: the order is the fair queue's,
    # not how many of A's 0.05 s runs went by while this process was sending B's
    heavy = [sfapp.fair_job.apply_async(("A", n, 30.0), {"until": "fair:burst:go"}, queue=q) if n < 2
             else sfapp.fair_job.apply_async(("A", n, 0.05), queue=q) for n in range(40)]
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
    light = [sfapp.fair_job.apply_async(("B", n, 0.05), queue=q) for n in range(5)]
    wait_for(lambda: all(r.state == states.QUEUED for r in light), timeout=15)
    sfapp.recorder.set("fair:burst:go", "1")
    assert [r.get(timeout=60) for r in light] == [f"B:{n}" for n in range(5)]
    assert [r.get(timeout=60) for r in heavy] == [f"A:{n}" for n in range(40)]
    runs = started(sfapp)
    sent = [("A", n) for n in range(40)] + [("B", n) for n in range(5)]
    assert sorted((t, n) for t, n, _ in runs) == sorted(sent)
    assert max(int(m) for m in sfapp.recorder.lrange("fair:max", 0, -1)) <= 2
    order = [t for t, _, _ in runs]
    last_b = max(i for i, t in enumerate(order) if t == "B")
    # round robin: B's five are served within the next ~2 rounds of A's, not after A's 40
    assert last_b < 20, order
    b_runs = [n for t, n, _ in runs if t == "B"]  # each tenant's own runs in send order (2 slots: +-1)
    assert sorted(b_runs) == list(range(5)) and all(abs(n - i) <= 1 for i, n in enumerate(b_runs)), b_runs


@pytest.mark.worker
def test_a_copy_of_a_running_runs_message_is_dropped(sfapp: ModuleType, start_worker: object) -> None:
    """Given a fair run holding its slot and the other slot held too, when a second copy of its
    message arrives (a broker's redelivery, or a hand-on sent twice), then the copy is dropped:
    the running run's state is not overwritten with a FAILURE, and it ends with its own result,
    having run once."""
    worker = start_worker(concurrency=4)  # type: ignore[operator]
    q = worker.queue
    # both run until the test has looked (30 s at most)
    go = {"until": "fair:copy:go"}
    running = sfapp.fair_job.apply_async(("A", 0, 30.0), go, queue=q)
    other = sfapp.fair_job.apply_async(("B", 0, 30.0), go, queue=q)
    wait_for(lambda: sfapp.recorder.llen("fair:started") == 2, timeout=15)
    copy = sfapp.fair_job.apply_async(("A", 0, 30.0), go, queue=q, task_id=running.id)
    assert copy.id == running.id
    wait_for(lambda: "copy of its message is dropped" in worker.log() or "LockHeld" in worker.log(),
             timeout=15)
    assert running.state != "FAILURE"
    sfapp.recorder.set("fair:copy:go", "1")
    assert running.get(timeout=15) == "A:0" and other.get(timeout=15) == "B:0"
    assert sum(1 for s in sfapp.recorder.lrange("fair:started", 0, -1) if s.startswith(b"A:0:")) == 1


@pytest.mark.worker
def test_weight_two_gets_twice_the_share(sfapp: ModuleType, start_worker: object) -> None:
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    # both slots held until all 24 are parked ("while both wait"), not for a time that hopes so
    first = [sfapp.fair_job.apply_async(("block", n, 30.0), {"until": "fair:block:go"}, queue=q)
             for n in range(2)]
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
    results = [sfapp.fair_job.apply_async((t, n, 0.02), queue=q)
               for n in range(12) for t in ("single", "double")]
    wait_for(lambda: all(r.state == states.QUEUED for r in results), timeout=15)
    sfapp.recorder.set("fair:block:go", "1")
    for r in [*first, *results]:
        r.get(timeout=60)
    order = [t for t, _, _ in started(sfapp) if t in ("single", "double")]
    window = order[:12]
    assert window.count("double") >= 7, order  # about 8 of 12 while both wait


@pytest.mark.worker
def test_waiting_runs_are_queued_with_position_and_eta(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    """Waiting runs are QUEUED with their position; the gate's status and ``celery singleflight
    show`` list them live, in order, with their fair key."""
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    # the two holders run until the test has looked (30 s at most), however slow the CLI is
    first = [sfapp.fair_job.apply_async(("pos", n, 30.0), {"until": "fair:pos:go"}, queue=q)
             for n in range(2)]
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
    waiting = [sfapp.fair_job.apply_async(("pos", n, 0.01), queue=q) for n in range(2, 6)]
    wait_for(lambda: all(r.state == states.QUEUED for r in waiting), timeout=15)
    positions = [r.info["position"] for r in waiting]
    assert positions == [1, 2, 3, 4]
    assert all(r.info["fair_key"] == "pos" for r in waiting)
    gate = sfapp.fair_job.fair_status()
    assert gate.gate == "fair:sfapp.fair_job" and gate.slots == 2 and len(gate.running) == 2
    assert [(w.task_id, w.fair_key, w.position) for w in gate.waiting] == \
        [(r.id, "pos", n) for n, r in enumerate(waiting, 1)]
    shown = run_cli(redis_server, "show", "fair:sfapp.fair_job", "--json")
    assert shown.returncode == 0, shown.stderr
    assert [w["task_id"] for w in json.loads(shown.stdout)["waiting"]] == [r.id for r in waiting]
    text = run_cli(redis_server, "show", "fair:sfapp.fair_job").stdout
    assert f"1. {waiting[0].id} [pos]" in text
    sfapp.recorder.set("fair:pos:go", "1")
    for r in [*first, *waiting]:
        r.get(timeout=30)


@pytest.mark.worker
def test_a_run_that_waits_past_queue_timeout_ends_failure(sfapp: ModuleType, start_worker: object) -> None:
    """Given queue_timeout=1 and the only slot held for 6 s, a waiting run ends FAILURE with
    QueueTimeout (its fair key and wait in it) about a second after it parked, taken out of the
    queue by the sweeper, not at its turn; it never runs, and the queue_timeout signal names it."""
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    first = sfapp.fair_timed.apply_async(("t", 0, 6.0), queue=q)
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 1, timeout=15)
    sent = time.monotonic()
    late = sfapp.fair_timed.apply_async(("t", 1, 0.01), queue=q)
    with pytest.raises(QueueTimeout) as caught:
        late.get(timeout=30)
    assert time.monotonic() - sent < 4.5  # the holder still runs: it did not wait for its turn
    assert caught.value.waited > 1.0 and caught.value.timeout == 1.0 and caught.value.fair_key == "t"
    assert first.get(timeout=30) == "t:0"
    assert [n for _, n, _ in started(sfapp)] == [0]
    assert sfapp.fair_timed.fair_status().waiting == []


@pytest.mark.worker
def test_waiting_runs_hold_no_pool_process(sfapp: ModuleType, start_worker: object) -> None:
    """Given a worker of 2 pool processes both running (fair_concurrency=2), 12 more runs are
    parked by its main process at once (QUEUED, in order), not left in the broker until a pool
    process frees: the backlog drains at parking speed."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    # both pool processes run until the test has looked (30 s at most): a run left in the broker
    # until a pool process frees could not be QUEUED before that
    first = [sfapp.fair_job.apply_async(("busy", n, 30.0), {"until": "fair:busy:go"}, queue=q)
             for n in range(2)]
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
    waiting = [sfapp.fair_job.apply_async(("busy", n, 0.01), queue=q) for n in range(2, 14)]
    wait_for(lambda: all(r.state == states.QUEUED for r in waiting), timeout=15)
    assert sfapp.recorder.llen("fair:started") == 2  # both pool processes still on the first two
    assert [r.info["position"] for r in waiting] == list(range(1, 13))
    sfapp.recorder.set("fair:busy:go", "1")
    for r in [*first, *waiting]:
        r.get(timeout=30)
    ran = [n for _, n, _ in started(sfapp)][2:]
    assert sorted(ran) == list(range(2, 14))
    # handed on in send order. Each slot starts the runs handed to it in that order, but the two
    # slots' processes run side by side: one the machine holds back for a few runs' time (20 ms
    # each) is passed by the other's next runs. So the start order is near the send order: at
    # most 6 of its 66 pairs swapped (a gate handing on last-in-first-out swaps all 66, one in
    # no order about 33: 6 or fewer by chance is less likely than 1 in 10,000)
    swapped = sum(1 for i, a in enumerate(ran) for b in ran[i + 1:] if a > b)
    assert swapped <= 6, ran


@pytest.mark.worker
def test_a_freed_slot_is_handed_on_past_the_task_queues_backlog(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given both fair slots held, a run of tenant B parked, and 80 other messages of 0.2 s sent
    to the task's queue behind it, when a slot frees, B's run starts within a couple of seconds:
    the hand-on goes to the worker's own queue, which nothing else fills. Sent to the task's
    queue it would wait behind most of the backlog (16 s of runs on 3 processes)."""
    worker = start_worker(concurrency=3, extra=("--prefetch-multiplier", "1"))  # type: ignore[operator]
    q = worker.queue
    # both slots held until the whole backlog is in the queue (HOLD s at most)
    go = "fair:backlog:go"
    holders = [sfapp.fair_job.apply_async(("A", n, HOLD), {"until": go}, queue=q) for n in range(2)]
    try:
        wait_for(lambda: sfapp.recorder.llen("fair:started") == 2, timeout=15)
        light = sfapp.fair_job.apply_async(("B", 0, 0.01), queue=q)
        wait_for(lambda: light.state == states.QUEUED, timeout=15)
        tag = uuid.uuid4().hex[:8]
        for n in range(80):
            sfapp.sleeper.apply_async((f"backlog-{tag}-{n}", 0.2), queue=q)
        freed_at = time.time()  # both holders end within one look (0.05 s) of their go
    finally:
        sfapp.recorder.set(go, "1")
    assert light.get(timeout=60) == "B:0"
    assert [r.get(timeout=30) for r in holders] == ["A:0", "A:1"]
    starts = {(t, n): at for t, n, at in started(sfapp)}
    late = starts[("B", 0)] - freed_at
    assert late < 2.5, f"B's run started {late:.2f}s after the first slot freed"
    assert len(sfapp.recorder.lrange(f"runs:backlog-{tag}-79", 0, -1)) == 0  # the backlog was still there


@pytest.mark.worker
def test_a_worker_killed_with_runs_parked_loses_none(sfapp: ModuleType, start_worker: object) -> None:
    """Given two running runs (one of them handed its slot after it waited) and eight parked,
    when the whole worker is SIGKILLed, a new worker runs every parked run exactly once (the
    gate's slots are handed on when the dead runs' leases run out), and the run that had waited
    and died mid-way ends FAILURE (RunLost), not QUEUED."""
    q = "fair-killed-worker"
    env = {"SF_TEST_TTL": "3"}
    first = start_worker(concurrency=2, queue=q, env=env)  # type: ignore[operator]
    # run 0 holds its slot until run 2 is parked behind it (HOLD s at most), then hands it on
    go = "fair:killed:go"
    sfapp.fair_job.apply_async(("k", 0, HOLD), {"until": go}, queue=q)
    sfapp.fair_job.apply_async(("k", 1, 30.0), queue=q)
    try:
        wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
        waited = sfapp.fair_job.apply_async(("k", 2, 30.0), queue=q)
        parked = [sfapp.fair_job.apply_async(("k", n, 0.01), queue=q) for n in range(3, 11)]
        wait_for(lambda: all(r.state == states.QUEUED for r in (waited, *parked)), timeout=15)
    finally:
        sfapp.recorder.set(go, "1")
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 3, timeout=15)  # run 2 was handed run 0's slot
    first.kill()
    start_worker(concurrency=2, queue=q, env=env)  # type: ignore[operator]
    assert [r.get(timeout=40) for r in parked] == [f"k:{n}" for n in range(3, 11)]
    runs = [n for _, n, _ in started(sfapp)]
    assert sorted(runs) == list(range(11)) and len(runs) == 11
    with pytest.raises(RunLost):
        waited.get(timeout=30)


def _store(url: str) -> LeaseStore:
    return LeaseStore(redis_client(url), KeyLayout(f"fair-{uuid.uuid4().hex[:6]}"))


def _hand_on(store: LeaseStore, gate: str, token: str, slots: int) -> str:
    """Release ``token``'s slot of the gate: the task id of the run it was handed to."""
    settlement = store.release(gate, token, "succeeded", 10, slots=slots)
    assert settlement.handoff is not None
    return str(json.loads(settlement.handoff)["id"])


def test_fair_enter_run_twice_answers_the_same(redis_server: RedisServer) -> None:
    """Given the reply of every FAIR_ENTER dropped once (the script ran; redis-py sends it again),
    a run is reserved or parked once, at one place: the queue holds each run once, in fair order,
    and every release hands the next slot to the next fair key in turn."""
    with FaultProxy(redis_server.port) as proxy:
        proxy.add_rule(DROP_REPLY, script=SOURCE["FAIR_ENTER"], first_time_only=True)
        store = _store(proxy.url(2))
        gate, fair = "fair:t", store.fair

        def enter(task_id: str, tenant: str) -> Admitted | Waiting:
            message = json.dumps({"id": task_id})
            return fair.enter(gate, 1, task_id, f"tok-{task_id}", message, tenant, 1.0, 10)

        assert enter("a0", "A") == Admitted(0)
        assert isinstance(store.acquire(gate, "run-a0", 10, Holder("a0"), handoff="tok-a0"), Acquired)
        for n in range(1, 5):
            assert enter(f"a{n}", "A").position == n  # type: ignore[union-attr]
        assert enter("b1", "B").position == 2  # type: ignore[union-attr]  # after A's next, not after all of A's
        assert enter("b2", "B").position == 4  # type: ignore[union-attr]
        assert len(proxy.faults) == 7
        assert [w.task_id for w in fair.waiters(gate, 1)] == ["a1", "b1", "a2", "b2", "a3", "a4"]
        served, token = [], "run-a0"
        for _ in range(6):
            served.append(_hand_on(store, gate, token, 1))
            token = f"run-{served[-1]}"
            assert isinstance(store.acquire(gate, token, 10, Holder(served[-1]), handoff=f"tok-{served[-1]}"),
                              Acquired)
        assert served == ["a1", "b1", "a2", "b2", "a3", "a4"]
        assert store.handoff.queued(gate) == 0


def test_a_gate_with_runs_parked_stays_in_the_waiting_index_with_one_write_per_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given both slots held, a burst of 20 runs parked by one process enters the gate in the
    waiting index once, not 20 times (a run parked behind others finds it there); the gate stays
    there while its holders' leases are live (a holder that dies is ended at the look after its
    lease ran out); once the queue empties and its holders release, the sweeper drops the gate,
    and the next run parked behind new holders enters it again at once (within the same second),
    so that a dead holder's slot is still handed on. (The freshness window is made long: a loaded
    machine must not take the burst past it.)"""
    monkeypatch.setattr(constants, "FAIR_INDEXED_FRESH", 60.0)
    with RedisServer() as server:
        store = _store(f"{server.url}/2")
        client, gate, fair = store.ctx.client, "fair:t", store.fair
        index = store.ctx.layout.index(WAITING)
        writes: list[str] = []
        zadd = client.zadd

        def counted(name: str, mapping: dict[str, int], **kw: object) -> object:
            writes.extend(mapping)
            return zadd(name, mapping, **kw)  # type: ignore[arg-type]

        client.zadd = counted  # type: ignore[method-assign]

        def admit(*holders: str) -> dict[str, Acquired]:
            taken: dict[str, Acquired] = {}
            for holder in holders:
                assert isinstance(fair.enter(gate, 2, holder, f"tok-{holder}", "{}", "A", 1.0, 10), Admitted)
                took = store.acquire(gate, f"run-{holder}", 10, Holder(holder), handoff=f"tok-{holder}",
                                     slots=2)
                assert isinstance(took, Acquired)
                taken[holder] = took
            return taken

        first = admit("h0", "h1")
        for n in range(20):
            parked = fair.enter(gate, 2, f"w{n}", f"tok-w{n}", json.dumps({"id": f"w{n}"}), "A", 1.0, 10)
            assert isinstance(parked, Waiting) and parked.position == n + 1
        assert writes == [gate] and client.zscore(index, gate) is not None
        # the queue empties (each run taken out, as for queue_timeout); the sweeper drops the gate
        # (a run taken out is found again until it is ended: a second look finds the same 20)
        wait_for(lambda: len(fair.timed_out(gate, 2, 0.0)) == 20, timeout=10)
        assert store.handoff.queued(gate) == 0
        assert store.handoff.resume(gate, 10, 2) is None
        assert client.zscore(index, gate) is not None  # h0 and h1 hold: looked at again
        for holder, took in first.items():
            assert store.release(gate, f"run-{holder}", fence=took.fence, slot=took.slot, slots=2,
                                 task_id=holder)
        assert store.handoff.resume(gate, 10, 2) is None
        assert client.zscore(index, gate) is None
        admit("h2", "h3")
        writes.clear()  # the look that kept the gate wrote it too
        assert isinstance(fair.enter(gate, 2, "late", "tok-late", json.dumps({"id": "late"}), "A", 1.0, 10),
                          Waiting)
        assert writes == [gate] and client.zscore(index, gate) is not None


def test_a_sweeper_that_dies_after_taking_a_run_out_leaves_it_to_the_next(redis_server: RedisServer) -> None:
    """Given a run past its queue_timeout taken out of the queue (the reply of FAIR_TIMEOUT lost
    once, then its caller gone before it ended the run), the next sweep finds it again until it is
    ended, and a run a release reserved a slot for is not taken out."""
    with FaultProxy(redis_server.port) as proxy:
        proxy.add_rule(DROP_REPLY, script=SOURCE["FAIR_TIMEOUT"], first_time_only=True)
        store = _store(proxy.url(2))
        gate, fair = "fair:t", store.fair
        assert fair.enter(gate, 1, "h", "tok-h", "{}", "A", 1.0, 10) == Admitted(0)
        assert isinstance(store.acquire(gate, "run-h", 10, Holder("h"), handoff="tok-h"), Acquired)
        for task_id in ("w1", "w2"):
            assert isinstance(fair.enter(gate, 1, task_id, f"tok-{task_id}", json.dumps({"id": task_id}),
                                         "A", 1.0, 10), Waiting)
        assert _hand_on(store, gate, "run-h", 1) == "w1"  # w1's slot is reserved: it stays
        # w2 has waited 50 ms by the server's clock (the one queue_timeout is judged by): one
        # sweep then takes it out, and that sweep's reply is the one lost
        wait_for(lambda: parked_for(store, gate) >= 0.05, timeout=10, interval=0.005)
        first = fair.timed_out(gate, 1, 0.01)
        assert [(t, f) for t, _, f in first] == [("w2", "A")] and first[0][1] >= 0.05
        assert len(proxy.faults) == 1
        assert [t for t, _, _ in fair.timed_out(gate, 1, 0.01)] == ["w2"]  # not ended yet: found again
        fair.ended_timeout(gate, "w2")
        assert fair.timed_out(gate, 1, 0.01) == []
        assert [w.task_id for w in fair.waiters(gate, 1)] == ["w1"]


@pytest.mark.worker
def test_a_killed_pool_process_frees_its_fair_slot_at_once(sfapp: ModuleType, start_worker: object) -> None:
    """Given both slots held by 30 s runs (TTL 30 s) and a run parked, when one holder's pool
    process is SIGKILLed, the worker's main process releases its gate slot and the parked run
    starts within seconds, not after the lease runs out."""
    q = start_worker(concurrency=3).queue  # type: ignore[operator]
    for n in range(2):
        sfapp.fair_job.apply_async(("kp", n, 30.0), queue=q)
    wait_for(lambda: sfapp.recorder.llen("fair:started") >= 2, timeout=15)
    parked = sfapp.fair_job.apply_async(("kp", 2, 0.01), queue=q)
    wait_for(lambda: parked.state == states.QUEUED, timeout=15)
    running = sfapp.fair_job.fair_status().running
    assert len(running) == 2 and all(r.pid for r in running)
    killed = time.monotonic()
    os.kill(running[0].pid, signal.SIGKILL)
    assert parked.get(timeout=15) == "kp:2"
    assert time.monotonic() - killed < 10


@pytest.mark.worker
def test_a_lease_redis_that_does_not_answer_holds_up_no_message(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    """Given the lease Redis cut off from the worker, a fair run's message still reaches a pool
    process, which follows on_redis_error (fail_closed: RETRY, re-sent); once Redis is back the run
    runs, once. The main process does not park what it cannot see."""
    with FaultProxy(redis_server.port) as proxy:
        env = {"SF_TEST_LEASE_REDIS": proxy.url(2), "SF_TEST_REDIS_RETRY": "1"}
        q = start_worker(concurrency=2, env=env).queue  # type: ignore[operator]
        proxy.cut()
        result = sfapp.fair_job.apply_async(("cut", 0, 0.01), queue=q)
        wait_for(lambda: result.state == "RETRY", timeout=30)
        proxy.heal()
        assert result.get(timeout=30) == "cut:0"
    assert [n for t, n, _ in started(sfapp) if t == "cut"] == [0]


def test_a_weight_set_at_run_time_places_the_next_runs(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """``limit FAIR_KEY --task NAME --weight W`` (and ``set_fair_weight``) gives a fair key its
    share at the gate from its next parked run on, until cleared; bad input is refused."""
    gate, fair = "fair:sfapp.fair_job", sfapp.fair_job.store.fair
    shown = run_cli(redis_server, "limit", "heavy", "--task", "sfapp.fair_job", "--weight", "3", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout) == {"task": "sfapp.fair_job", "fair_key": "heavy", "weight": 3.0}
    assert sfapp.fair_job.fair_status().weights == {"heavy": 3.0}
    assert fair.enter(gate, 2, "h0", "t-h0", "{}", "heavy", 1.0, 10) == Admitted(0)
    assert fair.enter(gate, 2, "h1", "t-h1", "{}", "heavy", 1.0, 10) == Admitted(1)
    for n in range(6):
        fair.enter(gate, 2, f"l{n}", f"t-l{n}", "{}", "light", 1.0, 10)
        fair.enter(gate, 2, f"w{n}", f"t-w{n}", "{}", "heavy", 1.0, 10)
    order = [w.fair_key for w in fair.waiters(gate, 2)]
    assert order[:8].count("heavy") == 6, order  # three for one while both wait
    sf.set_fair_weight(sfapp.fair_job, "heavy", None)
    assert sfapp.fair_job.fair_status().weights == {}
    with pytest.raises(sf.ConfigurationError):
        sf.set_fair_weight(sfapp.fair_job, "heavy", 0)
    with pytest.raises(sf.ConfigurationError):
        sf.set_fair_weight(sfapp.queued, "heavy", 2.0)
    refused = run_cli(redis_server, "limit", "heavy", "--weight", "2")
    assert refused.returncode == 2 and "--task" in refused.stderr


def test_a_sweep_names_only_the_slots_a_key_has_so_a_parked_run_is_sent_once(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The source of the second copy of a fair run's message. Given the app's sweeper (its
    namespace's largest key has 3 slots) and a 2-slot fair gate with both slots held and runs
    parked, and a 1-slot queue key held with a run parked: the sweeper's look hands nothing on
    (it names the gate's 2 slots and the queue key's 1, not 3: a third slot nobody has would be
    free to it, and the parked run's message would go out twice, once now and once at the real
    release); each holder's release then hands its slot to the first parked run, once."""
    from celery_singleflight.worker import sweeper
    from celery_singleflight.worker.registry import guarded_tasks

    sent: list[str] = []
    monkeypatch.setattr(sweeper, "settle", lambda app, found, ending: sent.append(found.handoff or ""))
    store, gate, ttl = sfapp.fair_job.store, "fair:sfapp.fair_job", 30
    client, index = store.client, store.ctx.layout.index(WAITING)
    for holder in ("h0", "h1"):
        assert isinstance(store.fair.enter(gate, 2, holder, f"tok-{holder}", "{}", "A", 1.0, ttl), Admitted)
        taken = store.acquire(gate, f"run-{holder}", ttl, Holder(holder), handoff=f"tok-{holder}", slots=2)
        assert isinstance(taken, Acquired)
    for waiting in ("w1", "w2"):
        message = json.dumps(dict(sfapp.fair_job.s("A", 1).set(task_id=waiting)))
        parked = store.fair.enter(gate, 2, waiting, f"tok-{waiting}", message, "A", 1.0, ttl)
        assert isinstance(parked, Waiting)
    key = f"phantom-{uuid.uuid4().hex[:6]}"
    queue_key = sfapp.queued.render_key(key, 0)
    assert isinstance(store.acquire(queue_key, "run-q", ttl, Holder("q")), Acquired)
    message = json.dumps(dict(sfapp.queued.s(key, 1).set(task_id="d1")))
    assert store.handoff.park(queue_key, "d1", "hd1", message, None) is not None
    client.zadd(index, {gate: 0, queue_key: 0})  # both due now
    (job,) = [j for j in sweeper.hand_on_sweeps(sfapp.app, guarded_tasks(sfapp.app))
              if isinstance(j, sweeper.HandOn) and j.store.ctx.layout.namespace == store.ctx.layout.namespace]
    assert job.slots >= 3
    job.sweep_once()
    assert sent == []  # nothing handed on: every slot each key has is held
    released = store.release(gate, "run-h0", "succeeded", ttl, slots=2).handoff
    assert released is not None and json.loads(released)["options"]["task_id"] == "w1"
    released = store.release(queue_key, "run-q", "succeeded", ttl).handoff
    assert released is not None and json.loads(released)["options"]["task_id"] == "d1"
