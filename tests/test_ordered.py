"""``ordered=True`` on real workers: runs of a key start in send order, also in a burst across
workers, and a sequence number whose message never arrives is skipped after ``order_timeout``."""

from __future__ import annotations

import time
import uuid
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.order import BOOK
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import wait_for
from .lua_sources import SOURCE

pytestmark = pytest.mark.share_workers  # start_worker may lend a worker an earlier test left idle


def order(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"order:{key}", 0, -1)]


def wait_missing(store: LeaseStore, key: str) -> None:
    """Until the number the runs of ``key`` wait for counts as missing: the server's clock (which
    ORDER_SWEEP reads) is past the start of the wait plus the key's order_timeout, both in its book."""
    client, book = store.client, store.layout.key(BOOK, key)

    def missing() -> bool:
        at, timeout = (int(x) for x in client.hmget(book, "at", "to"))
        seconds, micros = client.time()
        return int(seconds) * 1000 + int(micros) // 1000 >= at + timeout

    wait_for(missing, timeout=10)


@pytest.mark.worker
def test_a_burst_of_200_to_two_workers_starts_in_send_order(sfapp: ModuleType, start_worker: object) -> None:
    """Given 2 workers with 4 processes each on one queue, when 200 runs of one key are sent in
    a burst, then they start exactly in send order, one at a time."""
    first = start_worker(concurrency=4)  # type: ignore[operator]
    start_worker(concurrency=4, queue=first.queue)  # type: ignore[operator]
    results = [sfapp.ordered_run.apply_async(("burst", n), queue=first.queue) for n in range(200)]
    assert [r.get(timeout=120) for r in results] == list(range(200))
    assert order(sfapp, "burst") == list(range(200))
    assert sfapp.recorder.llen("overlaps") == 0
    st = sf.status(sfapp.app, "ord:burst")
    assert st is not None and not st.held and st.queued == 0


@pytest.mark.worker
def test_a_number_that_never_arrives_is_skipped_after_the_timeout(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a sequence number taken but never sent (a failed publish, a purged message) in the
    middle of 9 sends, the runs after it wait order_timeout (2 s), then the gap is skipped with a
    WARNING and they run in order; nothing is left waiting."""
    worker = start_worker(concurrency=4)  # type: ignore[operator]
    q = worker.queue
    key = sfapp.ordered_gap.render_key("gap", 0)
    before = [sfapp.ordered_gap.apply_async(("gap", n), queue=q) for n in range(5)]
    sfapp.ordered_gap.store.order.take(key, "never-sent")  # number 6 is taken, its message lost
    sent = time.time()
    after = [sfapp.ordered_gap.apply_async(("gap", n), queue=q) for n in range(5, 9)]
    assert [r.get(timeout=30) for r in before] == list(range(5))
    assert [r.get(timeout=30) for r in after] == list(range(5, 9))
    assert time.time() - sent >= 2.0  # they waited for the missing one
    assert order(sfapp, "gap") == list(range(9))
    wait_for(lambda: "sequence number(s) 6 never arrived" in worker.log(), timeout=5)
    assert sfapp.recorder.llen("overlaps") == 0


@pytest.mark.worker
def test_sends_by_name_carry_no_number_and_go_by_arrival(sfapp: ModuleType, start_worker: object) -> None:
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    by_name = sfapp.app.send_task("sfapp.ordered_run", ("byname", 7), queue=q)
    assert by_name.get(timeout=20) == 7
    assert order(sfapp, "byname") == [7]


def test_order_scripts_run_twice_answer_the_same(redis_server: RedisServer) -> None:
    """Given the first reply of every order script dropped (the script ran, redis-py sends it
    again), a send still gets one number (no gap), the gate admits a run once and hands on its
    successor's message, and a gap skip is not done twice."""
    with FaultProxy(redis_server.port) as proxy:
        for script in (SOURCE["ORDER_TAKE"], SOURCE["ORDER_GATE"], SOURCE["ORDER_SWEEP"]):
            proxy.add_rule(DROP_REPLY, script=script, first_time_only=True)
        store = LeaseStore(redis_client(proxy.url(2)), KeyLayout(f"ord-{uuid.uuid4().hex[:6]}"))
        assert [store.order.take("k", f"t{n}") for n in (1, 2, 3, 4)] == [1, 2, 3, 4]
        for script in (SOURCE["ORDER_ADVANCE"],):
            proxy.add_rule(DROP_REPLY, script=script, first_time_only=True)
        assert store.order.gate("k", 2, "t2|a", '{"m": 2}', 0.2) == 2  # waits for 1
        assert store.order.gate("k", 1, "t1|a", '{"m": 1}', 0.2) == 1
        assert store.order.gate("k", 1, "t1|a", '{"m": 1}', 0.2) == 1  # the same call again
        assert store.order.gate("k", 1, "t1|b", '{"m": 1}', 0.2) == 4  # another delivery of it
        assert store.order.gate("k", 2, "t2|c", '{"m": 2}', 0.2) == 2  # 1 has not entered the lease yet
        assert store.order.advance("k", 1, "t1|a") == '{"m": 2}'  # hands 2 on
        assert store.order.advance("k", 1, "t1|a") == '{"m": 2}'  # the same call again
        assert store.order.gate("k", 2, "t2|d", '{"m": 2}', 0.2) == 1
        assert store.order.advance("k", 2, "t2|d") == ""
        assert store.order.gate("k", 4, "t4|a", '{"m": 4}', 0.2) == 2  # 3 never comes
        wait_missing(store, "k")
        assert store.order.sweep("k", 0.2) == ('{"m": 4}', 3, 3)
        assert store.order.gate("k", 4, "t4|a", '{"m": 4}', 0.2) == 1
        assert store.order.advance("k", 4, "t4|a") == ""
        assert store.order.sweep("k", 0.2) == ("", None, None)  # nothing waits: not skipped again
        assert store.order.gate("k", 3, "t3|a", '{"m": 3}', 0.2) == 3  # late: by arrival
        assert len(proxy.faults) >= 8


@pytest.mark.worker
def test_a_remembered_run_takes_its_turn_and_leaves_no_gap(sfapp: ModuleType, start_worker: object) -> None:
    """Given an ordered task with an idempotency key, a repeated message (its result remembered)
    ends without taking the lease but still takes its turn: the runs sent after it do not wait
    for order_timeout (60 s here)."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    assert sfapp.ordered_idem.apply_async(("idem", "m1", 0), queue=q).get(timeout=20) == 0
    again = sfapp.ordered_idem.apply_async(("idem", "m1", 1), queue=q)  # remembered: returns 0
    after = [sfapp.ordered_idem.apply_async(("idem", f"m{n}", n), queue=q) for n in (2, 3)]
    assert again.get(timeout=20) == 0
    assert [r.get(timeout=20) for r in after] == [2, 3]
    assert order(sfapp, "idem") == [0, 2, 3]
