"""The lease against a real Redis: ownership, contention, fencing, heartbeat."""

from __future__ import annotations

import multiprocessing
import threading
import time
import uuid

import pytest
import redis

from celery_singleflight import Acquired, Held, Holder, KeyLayout, Lease, LeaseStore
from celery_singleflight.heartbeat import Heartbeat
from celery_singleflight.testing import RedisServer

from .conftest import wait_for


def _store(server: RedisServer, namespace: str = "t") -> LeaseStore:
    return LeaseStore(server.client(2), KeyLayout(namespace))


def _token() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def store(redis_server: RedisServer) -> LeaseStore:
    redis_server.client(2).flushdb()
    return _store(redis_server)


def test_acquire_then_duplicate_learns_holder_and_time_left(store: LeaseStore) -> None:
    """Given a held key, a second acquire is told who holds it and for how long."""
    first = store.acquire("sync:1", _token(), 10, Holder("task-a"))
    second = store.acquire("sync:1", _token(), 10, Holder("task-b"))
    assert isinstance(first, Acquired)
    assert isinstance(second, Held)
    assert second.holder == "task-a"
    assert 9 < second.ttl_left <= 10


def test_only_the_owner_token_can_release_or_renew(store: LeaseStore) -> None:
    """Nobody but the holder can release the lease: not even the same task id with another token."""
    token = _token()
    store.acquire("k", token, 10, Holder("task-a"))
    assert store.release("k", _token()).ours is False
    assert store.holder_record("k")["task_id"] == "task-a"
    assert store.release("k", token).ours is True
    assert store.holder_record("k") == {}
    assert store.release("k", token).ours is False  # a late second release cannot free a new holder


def test_expired_holder_cannot_release_the_next_owner(store: LeaseStore) -> None:
    """The celery-once bug: an expired holder's release must not delete the next owner's lease."""
    old = _token()
    store.acquire("k", old, 0.05, Holder("old"))
    time.sleep(0.1)
    new = _token()
    assert isinstance(store.acquire("k", new, 10, Holder("new")), Acquired)
    assert store.release("k", old).ours is False
    assert store.holder_record("k")["task_id"] == "new"


def test_a_redelivery_parked_behind_its_own_run_is_dropped_when_that_run_releases(
    store: LeaseStore,
) -> None:
    """Given a run whose redelivery parked a copy of itself (ahead of an ordinary parked run),
    when the run releases, then the copy is dropped and the key goes to the ordinary one."""
    token = _token()
    store.acquire("k", token, 10, Holder("run-a"))
    assert store.park("k", "run-b", "hb", "message-b", None, 0.5) is not None
    parked = store.park("k", "run-a", "own-a", "copy-of-a", None, 0.5)
    assert parked is not None and not isinstance(parked, int) and parked.position == 1
    # a third delivery keeps the first copy (its handoff token and message stay as they were)
    store.park("k", "run-a", "own-a2", "another-copy", None, 0.5)
    assert store.client.lrange(store.queue_key("k"), 0, -1) == [b"run-a|own-a", b"run-b|hb"]
    released = store.release("k", token)
    assert released.ours and released.handoff == "message-b"
    assert store.client.lrange(store.queue_key("k"), 0, -1) == [b"run-b|hb"]
    assert set(store.client.hkeys(store.parked_key("k"))) == {b"run-b", b"r:run-b"}


def test_a_redelivery_copy_runs_when_its_own_run_dies_without_releasing(store: LeaseStore) -> None:
    """Given a run whose redelivery parked a copy of itself, when the run's lease expires (its
    worker died), then the sweeper's resume hands the key to the copy, ahead of other parked runs,
    even with a bounded queue that is full."""
    store.acquire("k", _token(), 0.2, Holder("run-a"))
    assert store.park("k", "run-b", "hb", "message-b", 1, 0.5) is not None
    assert store.park("k", "run-a", "own-a", "copy-of-a", 1, 0.5) is not None
    time.sleep(0.3)
    resumed = store.resume("k", 10, 0.5)
    assert resumed is not None and resumed.handoff == "copy-of-a"
    assert store.holder_record("k")["task_id"] == "run-a" and store.holder_record("k")["token"] == "own-a"
    adopted = store.acquire("k", _token(), 10, Holder("run-a"), handoff="own-a")
    assert isinstance(adopted, Acquired)
    assert store.client.lrange(store.queue_key("k"), 0, -1) == [b"run-b|hb"]


def test_a_redelivery_copy_is_dropped_by_its_runs_late_release(store: LeaseStore) -> None:
    """Given a run whose lease expired (frozen past its TTL) and whose redelivery parked a copy,
    when the run ends and releases late (not ours any more), then the copy is dropped: the run
    ended, so it is not repeated."""
    token = _token()
    store.acquire("k", token, 0.2, Holder("run-a"))
    store.park("k", "run-a", "own-a", "copy-of-a", None, 0.5)
    time.sleep(0.3)
    assert store.release("k", token, task_id="run-a").ours is False
    assert store.queued("k") == 0 and not store.client.exists(store.parked_key("k"))


def test_a_redelivery_copy_never_gets_a_second_slot_of_its_running_task(store: LeaseStore) -> None:
    """With max_concurrency=2: run-a holds slot 0 and its redelivery parked a copy; when run-b
    releases slot 1, the copy is not handed slot 1 (run-a still runs), an ordinary parked run is;
    once run-a's lease ends without a release, the sweeper hands the copy the key."""
    a = _token()
    store.acquire("k", a, 0.5, Holder("run-a"), slots=2)
    b = _token()
    assert isinstance(store.acquire("k", b, 10, Holder("run-b"), slots=2), Acquired)
    store.park("k", "run-a", "own-a", "copy-of-a", None, 0.5, slots=2)
    store.park("k", "run-c", "hc", "message-c", None, 0.5, slots=2)
    released = store.release("k", b, slot=1, task_id="run-b", slots=2)
    assert released.ours and released.handoff == "message-c"
    assert store.holder_record("k", 1)["task_id"] == "run-c"
    assert store.resume("k", 10, 0.5, slots=2) is None  # run-a still holds slot 0: the copy waits
    time.sleep(0.6)
    resumed = store.resume("k", 10, 0.5, slots=2)
    assert resumed is not None and resumed.handoff == "copy-of-a"
    assert store.holder_record("k", 0)["task_id"] == "run-a"
    assert store.holder_record("k", 0)["token"] == "own-a"


def test_a_task_id_running_on_one_slot_cannot_take_another(store: LeaseStore) -> None:
    """With max_concurrency=3, a redelivery of a running task id is told the key is held by
    itself instead of running concurrently with itself on a free slot."""
    assert isinstance(store.acquire("k", _token(), 10, Holder("run-a"), slots=3), Acquired)
    again = store.acquire("k", _token(), 10, Holder("run-a"), slots=3)
    assert isinstance(again, Held) and again.holder == "run-a"
    assert isinstance(store.acquire("k", _token(), 10, Holder("run-b"), slots=3), Acquired)


def test_fences_strictly_increase_across_acquires_and_expiry(store: LeaseStore) -> None:
    fences = []
    for _ in range(5):
        token = _token()
        got = store.acquire("f", token, 10, Holder("t"))
        assert isinstance(got, Acquired)
        fences.append(got.fence)
        store.release("f", token)
    got = store.acquire("f", _token(), 0.05, Holder("t"))
    assert isinstance(got, Acquired)
    fences.append(got.fence)
    time.sleep(0.1)  # the lease expires, nobody releases it
    got = store.acquire("f", _token(), 10, Holder("t"))
    assert isinstance(got, Acquired)
    fences.append(got.fence)
    assert fences == sorted(set(fences)), fences


def test_fences_keep_growing_after_redis_restarts_empty() -> None:
    """Given a private Redis with no persistence, when it is killed and restarted empty,
    then the next fence is still larger than every fence handed out before."""
    server = RedisServer().start()
    try:
        store = _store(server)
        before = [store.acquire(f"f{i}", _token(), 10, Holder("t")) for i in range(3)]
        highest = max(g.fence for g in before if isinstance(g, Acquired))
        server.kill()
        server.start()
        assert server.client(2).dbsize() == 0
        store = _store(server)
        after = store.acquire("f0", _token(), 10, Holder("t"))
        assert isinstance(after, Acquired)
        assert after.fence > highest
    finally:
        server.close()


def test_namespaces_do_not_see_each_other(redis_server: RedisServer) -> None:
    a, b = _store(redis_server, "app-a"), _store(redis_server, "app-b")
    assert isinstance(a.acquire("k", _token(), 10, Holder("t")), Acquired)
    assert isinstance(b.acquire("k", _token(), 10, Holder("t")), Acquired)


def _hold_repeatedly(url: str, key: str, rounds: int, errors: list[str] | None = None) -> None:
    """Acquire ``key`` ``rounds`` times, recording concurrent holders without the library."""
    client = redis.Redis.from_url(url + "/2")
    recorder = redis.Redis.from_url(url + "/3")
    store = LeaseStore(client, KeyLayout("contend"))
    done = 0
    while done < rounds:
        token = _token()
        if isinstance(store.acquire(key, token, 5, Holder(token)), Acquired):
            if recorder.incr("holders") != 1:
                recorder.incr("overlaps")
            recorder.incr("acquired")
            time.sleep(0.001)
            recorder.decr("holders")
            store.release(key, token)
            done += 1
        else:
            time.sleep(0.0005)


def test_contention_threads_and_processes_one_holder_at_a_time(redis_server: RedisServer) -> None:
    """Given 4 processes x 4 threads racing for one key, then at no instant are there two holders."""
    recorder = redis_server.client(3)
    recorder.flushdb()
    rounds = 15

    def process_main() -> None:
        threads = [
            threading.Thread(target=_hold_repeatedly, args=(redis_server.url, "hot", rounds))
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=process_main) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert int(recorder.get("acquired") or 0) == 4 * 4 * rounds
    assert int(recorder.get("overlaps") or 0) == 0


def _lease(store: LeaseStore, key: str, ttl: float, interval: float) -> Lease:
    token = _token()
    got = store.acquire(key, token, ttl, Holder("t"))
    assert isinstance(got, Acquired)
    return Lease(key=key, token=token, fence=got.fence, ttl=ttl, interval=interval, task_id="t",
                 task_name="test", store=store, since=got.since)


def test_heartbeat_keeps_a_lease_alive_for_three_ttls(store: LeaseStore) -> None:
    beat = Heartbeat(store)
    lease = _lease(store, "hb", 0.6, 0.2)
    beat.add(lease)
    try:
        deadline = time.monotonic() + 1.8
        while time.monotonic() < deadline:
            assert store.holder_record("hb"), "the lease expired while the heartbeat ran"
            time.sleep(0.05)
        assert not lease.lost
    finally:
        beat.stop()


def test_heartbeat_renews_many_leases_in_one_round_trip(store: LeaseStore) -> None:
    beat = Heartbeat(store)
    leases = [_lease(store, f"many:{i}", 30, 10) for i in range(1000)]
    before = beat.rounds
    beat.renew_once(leases)
    assert beat.rounds == before + 1
    assert not any(lease.lost for lease in leases)


def test_heartbeat_reports_a_lease_deleted_behind_its_back(store: LeaseStore) -> None:
    from celery_singleflight import LeaseLost, signals

    seen: list[str] = []

    def on_lost(sender: object, lease: Lease, reason: str, **_: object) -> None:
        seen.append(reason)

    signals.lease_lost.connect(on_lost)
    beat = Heartbeat(store)
    lease = _lease(store, "gone", 0.6, 0.2)
    beat.add(lease)
    try:
        store.client.delete(store.lease_key("gone"))
        wait_for(lambda: lease.lost, timeout=3)
        with pytest.raises(LeaseLost, match="gone"):
            lease.check()
        assert seen and "expired or was released" in seen[0]
    finally:
        signals.lease_lost.disconnect(on_lost)
        beat.stop()


def test_heartbeat_marks_lost_when_redis_stays_unreachable_past_the_ttl() -> None:
    server = RedisServer().start()
    try:
        store = LeaseStore(redis.Redis(host="127.0.0.1", port=server.port, db=2,
                                       socket_timeout=0.2, socket_connect_timeout=0.2),
                           KeyLayout("t"))
        beat = Heartbeat(store)
        lease = _lease(store, "cut", 1.0, 0.3)
        beat.add(lease)
        server.kill()
        wait_for(lambda: lease.lost, timeout=6)
        assert "unreachable" in lease.lost_reason
        beat.stop()
    finally:
        server.close()
