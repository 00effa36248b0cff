"""The `coalesce` policy on real workers: one running and one pending run per key, the pending one
carrying the newest arguments; every replaced or dropped run ends SUCCESS, saying into which run."""

from __future__ import annotations

import uuid
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import HOLD, gates_opened_after, let_go, wait_for
from .lua_sources import SOURCE

pytestmark = pytest.mark.share_workers  # start_worker may lend a worker an earlier test left idle

_gates_opened = gates_opened_after("burst", "first")


def payloads(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"payloads:{key}", 0, -1)]


@pytest.mark.worker
def test_burst_of_20_during_a_holder_runs_twice_the_second_with_the_last_payload(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a holder on a key, when 20 duplicates are sent in a burst to a worker with 4
    processes, then the key runs exactly twice: the holder, then the last one sent with its
    payload; the 19 others end SUCCESS coalesced into it, and every AsyncResult is ready.
    (The holder holds until the 19 ended and the last one is pending.)"""
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    holder = sfapp.coalesced.apply_async(("burst", 0, HOLD), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:burst") >= 1, timeout=15)
    burst = [sfapp.coalesced.apply_async(("burst", n, 0.05), queue=q) for n in range(1, 21)]
    # all met the holder: while it holds, one run stays pending (not ready), and a replaced or
    # dropped run is ready only once its replacer is the pending run (the last one sent)
    wait_for(lambda: all(r.ready() for r in burst[:-1]) and burst[-1].state == "QUEUED", timeout=30)
    let_go(sfapp, "burst")
    assert holder.get(timeout=30) == 0
    results = [r.get(timeout=30) for r in burst]
    assert payloads(sfapp, "burst") == [0, 20]
    assert results[-1] == 20
    key = sfapp.coalesced.render_key("burst", 1)
    assert all(sf.is_coalesced(r) and r["key"] == key for r in results[:-1])
    # "into" names the pending run at that moment, which may itself have been replaced since:
    # followed, every chain ends at the run that ran
    by_id = {r.id: result for r, result in zip(burst, results, strict=True)}
    for result in results[:-1]:
        into = result["into"]
        while sf.is_coalesced(by_id[into]):
            into = by_id[into]["into"]
        assert into == burst[-1].id
    assert all(r.ready() and r.successful() for r in burst)
    assert sfapp.recorder.llen("overlaps") == 0
    st = sf.status(sfapp.app, key)
    assert st is not None and not st.held and st.queued == 0


@pytest.mark.worker
@pytest.mark.core
def test_keep_first_runs_the_first_duplicate_and_drops_the_rest(
    sfapp: ModuleType, start_worker: object
) -> None:
    q = start_worker(concurrency=2).queue  # type: ignore[operator]  # one holds, one takes the duplicates
    holder = sfapp.coalesced_first.apply_async(("first", 0, HOLD), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:first") >= 1, timeout=15)
    pending = sfapp.coalesced_first.apply_async(("first", 1), queue=q)
    wait_for(lambda: pending.state == "QUEUED", timeout=15)
    later = [sfapp.coalesced_first.apply_async(("first", n), queue=q) for n in range(2, 6)]
    assert all(sf.is_coalesced(r.get(timeout=15)) and r.get()["into"] == pending.id for r in later)
    let_go(sfapp, "first")  # every duplicate met the holder: the later ones were dropped into pending
    assert holder.get(timeout=30) == 0 and pending.get(timeout=30) == 1
    assert payloads(sfapp, "first") == [0, 1]


def _store(url: str) -> LeaseStore:
    return LeaseStore(redis_client(url), KeyLayout(f"co-{uuid.uuid4().hex[:6]}"))


def test_coalesce_script_run_twice_answers_the_same(redis_server: RedisServer) -> None:
    """Given the reply of every COALESCE call dropped once (the script ran, redis-py sends it
    again), each caller still gets the answer of the first run: the newcomer that replaced the
    pending run learns which run it replaced, and nothing is parked twice."""
    with FaultProxy(redis_server.port) as proxy:
        proxy.add_rule(DROP_REPLY, script=SOURCE["COALESCE"], first_time_only=True)
        store = _store(proxy.url(2))
        token = uuid.uuid4().hex
        assert isinstance(store.acquire("k", token, 10, Holder("holder")), Acquired)
        assert store.newest.coalesce("k", "a", "ha", '{"a": 1}', "last", "100") == ()
        assert store.newest.coalesce("k", "b", "hb", '{"b": 1}', "last", "200") == ('{"a": 1}',)
        assert store.newest.coalesce("k", "c", "hc", '{"c": 1}', "last", "150") == "b"  # sent before b
        assert proxy.faults and len(proxy.faults) == 3
        assert store.handoff.queued("k") == 1
        # its caller has not cleared them yet
        assert store.newest.started("k", "b", 0, "200").owed == ('{"a": 1}',)
        store.newest.answered("k", "b")
        assert store.newest.started("k", "b", 0, "200").owed == ()
        settlement = store.release("k", token)
        assert settlement.handoff == '{"b": 1}'
        # keep="first": the pending run stays
        token2 = uuid.uuid4().hex
        assert store.acquire("k2", token2, 10, Holder("h2")).acquired
        assert store.newest.coalesce("k2", "x", "hx", "{}", "first", "1") == ()
        assert store.newest.coalesce("k2", "y", "hy", "{}", "first", "2") == "x"
        # a free key: acquire again
        assert store.newest.coalesce("free", "z", "hz", "{}", "last", "") is None
