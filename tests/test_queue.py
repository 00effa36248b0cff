"""The `queue` policy on real workers: FIFO per key, handoff on release, nothing lost on a kill."""

from __future__ import annotations

import os
import signal
import time
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight import QueueFull, states
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import open_gate, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]


def order(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"order:{key}", 0, -1)]


def test_fifo_50_runs_one_at_a_time_in_dispatch_order(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    """Given a holder on a key and 50 duplicates dispatched in a known order, they are parked
    (their worker slot is freed) and then run one at a time in exactly that order."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]  # one slot holds, one parks
    # the holder runs until all 50 are parked (a single slot parks them, in the order sent)
    holder = sfapp.queued.apply_async(("fifo", 0, 120), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:fifo") >= 1, timeout=15)
    results = [sfapp.queued.apply_async(("fifo", n, 0.005), queue=q) for n in range(1, 51)]
    wait_for(lambda: sf.status(sfapp.app, "q:fifo").queued == 50, timeout=30)  # type: ignore[union-attr]
    open_gate(redis_server, "gate:fifo")
    assert [r.get(timeout=60) for r in [holder, *results]] == list(range(51))
    assert order(sfapp, "fifo") == list(range(51))
    assert sfapp.recorder.llen("overlaps") == 0
    assert set(sfapp.recorder.lrange("retries:fifo", 0, -1)) == {b"0"}  # max_retries untouched
    st = sf.status(sfapp.app, "q:fifo")
    assert st is not None and not st.held and st.queued == 0


def test_two_keys_interleaved_keep_their_own_order(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    q = start_worker(concurrency=3).queue  # type: ignore[operator]  # two holders, one slot parks
    # the holders run until every later run is parked (their gates, below)
    holders = [sfapp.queued.apply_async((k, 0, 120), queue=q) for k in ("ka", "kb")]
    wait_for(lambda: sfapp.recorder.llen("runs:ka") and sfapp.recorder.llen("runs:kb"), timeout=15)
    results = []
    for n in range(1, 16):
        for k in ("ka", "kb"):
            results.append(sfapp.queued.apply_async((k, n, 0.005), queue=q))
    for k in ("ka", "kb"):
        wait_for(lambda k=k: sf.status(sfapp.app, f"q:{k}").queued == 15, timeout=30)  # type: ignore[union-attr]
        open_gate(redis_server, f"gate:{k}")
    for r in [*holders, *results]:
        r.get(timeout=60)
    assert order(sfapp, "ka") == list(range(16))
    assert order(sfapp, "kb") == list(range(16))
    assert sfapp.recorder.llen("overlaps") == 0


def test_holder_killed_while_ten_are_parked_all_still_run_in_order(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a holder and 10 parked runs, when the holder's pool process is SIGKILLed, the worker's
    main process releases the key and hands it to the first parked run: all 10 run, in order,
    none twice."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    holder = sfapp.queued_sleeper.apply_async(("kill",), queue=q)
    pid = int(wait_for(lambda: sfapp.recorder.get("pid:kill"), timeout=15))
    parked = [sfapp.queued.apply_async(("kill", n, 0.01), queue=q) for n in range(1, 11)]
    wait_for(lambda: sf.status(sfapp.app, "q:kill").queued == 10, timeout=15)  # type: ignore[union-attr]
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    assert [r.get(timeout=30) for r in parked] == list(range(1, 11))
    assert order(sfapp, "kill") == list(range(1, 11))
    assert holder.failed()
    assert float(sfapp.recorder.lindex("started:kill", 0)) >= killed_at  # not before the holder died
    assert sfapp.recorder.llen("overlaps") == 0


def test_lost_host_queue_resumes_within_about_one_ttl(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a 3 s TTL, a holder and 3 parked runs, when the whole worker is SIGKILLed (nobody
    releases), a new worker on the same queue runs the parked runs once the lease expires: the
    resume check planned when they parked hands the key on."""
    q = "lost-host-queue"
    first: WorkerProcess = start_worker(concurrency=2, queue=q, env={"SF_TEST_TTL": "3"})  # type: ignore[operator]
    sfapp.queued_sleeper.apply_async(("host",), queue=q)
    wait_for(lambda: sfapp.recorder.get("pid:host"), timeout=15)
    parked = [sfapp.queued.apply_async(("host", n, 0.01), queue=q) for n in range(1, 4)]
    wait_for(lambda: sf.status(sfapp.app, "q:host").queued == 3, timeout=15)  # type: ignore[union-attr]
    first.kill()
    start_worker(concurrency=2, queue=q, env={"SF_TEST_TTL": "3"})  # type: ignore[operator]
    assert [r.get(timeout=30) for r in parked] == [1, 2, 3]
    assert order(sfapp, "host") == [1, 2, 3]


def test_bounded_queue_overflow_fails_with_queue_full(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    # the holder runs until the overflow was refused (its gate, below)
    holder = sfapp.queued_bounded.apply_async(("full", 0, 120), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:full") >= 1, timeout=15)
    waiting = [sfapp.queued_bounded.apply_async(("full", n, 0.01), queue=q) for n in (1, 2)]
    wait_for(lambda: sf.status(sfapp.app, "q:full").queued == 2, timeout=15)  # type: ignore[union-attr]
    overflow = sfapp.queued_bounded.apply_async(("full", 3, 0.01), queue=q)
    with pytest.raises(QueueFull) as info:
        overflow.get(timeout=15)
    assert info.value.queued == 2 and info.value.holder == holder.id
    open_gate(redis_server, "gate:full")
    assert [r.get(timeout=30) for r in waiting] == [1, 2]


@pytest.mark.core
def test_a_parked_run_shows_as_queued_to_its_caller(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    sfapp.queued.apply_async(("state", 0, 120), queue=q)  # runs until the test has looked (its gate)
    wait_for(lambda: sfapp.recorder.llen("runs:state") >= 1, timeout=15)
    parked = sfapp.queued.apply_async(("state", 1, 0.01), queue=q)
    meta = wait_for(lambda: (m := states.read(parked)) and m.state == states.QUEUED and m, timeout=15)
    assert meta == states.SingleFlightMeta(states.QUEUED, key=sfapp.queued.render_key("state", 1),
                                           holder=meta.holder)
    assert meta.holder
    assert not parked.ready()
    open_gate(redis_server, "gate:state")
    assert parked.get(timeout=15) == 1
