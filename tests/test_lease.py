"""The lease against a real Redis: ownership, contention, fencing, heartbeat."""

from __future__ import annotations

import gc
import multiprocessing
import signal
import threading
import time
import uuid
from typing import Any

import pytest
import redis

from celery_singleflight import Lease
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.heartbeat import Heartbeat
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import FaultProxy, stall_reply
from .conftest import stays, wait_for
from .lua_sources import SOURCE


def _store(server: RedisServer, namespace: str = "t") -> LeaseStore:
    return LeaseStore(server.client(2), KeyLayout(namespace))


def _token() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def store(redis_server: RedisServer) -> LeaseStore:
    redis_server.client(2).flushdb()
    return _store(redis_server)


@pytest.mark.core
def test_acquire_then_duplicate_learns_holder_and_time_left(store: LeaseStore) -> None:
    """Given a held key, a second acquire is told who holds it and for how long."""
    first = store.acquire("sync:1", _token(), 10, Holder("task-a"))
    second = store.acquire("sync:1", _token(), 10, Holder("task-b"))
    assert isinstance(first, Acquired)
    assert isinstance(second, Held)
    assert second.holder == "task-a"
    assert 9 < second.ttl_left <= 10


@pytest.mark.parametrize("decode", [False, True], ids=["bytes", "decode_responses"])
@pytest.mark.core
def test_short_replies_and_their_replays_read_alike(redis_server: RedisServer, decode: bool) -> None:
    """An uncontended acquire answers one string and a release that hands nothing on a bare 1 (the
    cheapest replies to read); a second run of the same call (a lost reply re-sent) answers the
    same things, also through a client that decodes replies (``singleflight_redis_client``)."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=2, decode_responses=decode)
    store = LeaseStore(client, KeyLayout(f"short-{decode}"))
    token = _token()
    first = store.acquire("k", token, 10, Holder("task-a"))
    again = store.acquire("k", token, 10, Holder("task-a"))
    assert isinstance(first, Acquired) and isinstance(again, Acquired)
    assert (again.fence, again.since, again.slot) == (first.fence, first.since, 0)
    assert store.newest.notice("k", 0) is None  # nobody superseded it
    released = store.release("k", token, fence=first.fence)
    assert released.ours and released.handoff is None and released.joined == () and not released.duties
    assert store.release("k", token, fence=first.fence) == released
    other = store.acquire("k", _token(), 10, Holder("task-b"))
    assert isinstance(other, Acquired) and other.fence > first.fence


@pytest.mark.core
def test_only_the_owner_token_can_release_or_renew(store: LeaseStore) -> None:
    """Nobody but the holder can release the lease: not even the same task id with another token."""
    token = _token()
    store.acquire("k", token, 10, Holder("task-a"))
    assert store.release("k", _token()).ours is False
    assert store.holder_record("k")["task_id"] == "task-a"
    assert store.release("k", token).ours is True
    assert store.holder_record("k") == {}
    # a second run of the same release (a lost reply re-sent) answers as the first did and frees
    # nothing more, also once a new holder has the key
    assert store.release("k", token).ours is True
    newer = _token()
    assert isinstance(store.acquire("k", newer, 10, Holder("task-b")), Acquired)
    assert store.release("k", token).ours is True
    assert store.holder_record("k")["task_id"] == "task-b"


def test_expired_holder_cannot_release_the_next_owner(store: LeaseStore) -> None:
    """The celery-once bug: an expired holder's release must not delete the next owner's lease."""
    old = _token()
    store.acquire("k", old, 0.05, Holder("old"))
    wait_for(lambda: store.time_left("k") is None)  # run out by the server's clock
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
    assert store.handoff.park("k", "run-b", "hb", "message-b", None) is not None
    parked = store.handoff.park("k", "run-a", "own-a", "copy-of-a", None)
    assert parked is not None and not isinstance(parked, int) and parked.position == 1
    # a third delivery keeps the first copy (its handoff token and message stay as they were)
    store.handoff.park("k", "run-a", "own-a2", "another-copy", None)
    assert store.client.lrange(store.layout.queue("k"), 0, -1) == [b"run-a|own-a", b"run-b|hb"]
    released = store.release("k", token)
    assert released.ours and released.handoff == "message-b"
    assert store.client.lrange(store.layout.queue("k"), 0, -1) == [b"run-b|hb"]
    assert set(store.client.hkeys(store.layout.parked("k"))) == {b"run-b"}
    assert store.holder_record("k")["task_id"] == "run-b"  # the slot is reserved for run-b


def test_a_redelivery_copy_runs_when_its_own_run_dies_without_releasing(store: LeaseStore) -> None:
    """Given a run whose redelivery parked a copy of itself, when the run's lease expires (its
    worker died), then the sweeper's resume hands the key to the copy, ahead of other parked runs,
    even with a bounded queue that is full."""
    store.acquire("k", _token(), 0.2, Holder("run-a"))
    assert store.handoff.park("k", "run-b", "hb", "message-b", 1) is not None
    assert store.handoff.park("k", "run-a", "own-a", "copy-of-a", 1) is not None
    wait_for(lambda: store.time_left("k") is None)  # run-a's lease ran out by the server's clock
    resumed = store.handoff.resume("k", 10)
    assert resumed is not None and resumed.handoff == "copy-of-a"
    assert store.holder_record("k")["task_id"] == "run-a" and store.holder_record("k")["token"] == "own-a"
    adopted = store.acquire("k", _token(), 10, Holder("run-a"), handoff="own-a")
    assert isinstance(adopted, Acquired)
    assert store.client.lrange(store.layout.queue("k"), 0, -1) == [b"run-b|hb"]


@pytest.mark.parametrize("taken_meanwhile", [False, True])
def test_a_redelivery_copy_is_dropped_by_its_runs_late_release(
    store: LeaseStore, taken_meanwhile: bool
) -> None:
    """Given a run whose lease ran out (frozen past its TTL) and whose redelivery parked a copy,
    when the run ends and releases late, then the copy is dropped: the run ended, so it is not
    repeated. The late release is the run's own if nobody took the key meanwhile. If another run
    came meanwhile, the free key went to the copy (its run looked gone): the late release then
    reports the loss and the copy, already handed the key, stays."""
    token = _token()
    first = store.acquire("k", token, 0.2, Holder("run-a"))
    assert isinstance(first, Acquired)
    store.handoff.park("k", "run-a", "own-a", "copy-of-a", None)
    wait_for(lambda: store.time_left("k") is None)  # run-a's lease ran out by the server's clock
    if taken_meanwhile:
        other = store.acquire("k", _token(), 10, Holder("run-z"))
        assert isinstance(other, Held) and other.handoff == "copy-of-a"
    released = store.release("k", token, fence=first.fence, task_id="run-a")
    assert released.ours is (not taken_meanwhile)
    assert store.handoff.queued("k") == (1 if taken_meanwhile else 0)
    assert store.client.exists(store.layout.parked("k")) == (1 if taken_meanwhile else 0)


def test_a_redelivery_copy_never_gets_a_second_slot_of_its_running_task(store: LeaseStore) -> None:
    """With max_concurrency=2: run-a holds slot 0 and its redelivery parked a copy; when run-b
    releases slot 1, the copy is not handed slot 1 (run-a still runs), an ordinary parked run is;
    once run-a's lease ends without a release, the sweeper hands the copy the key."""
    a = _token()
    store.acquire("k", a, 0.5, Holder("run-a"), slots=2)
    b = _token()
    assert isinstance(store.acquire("k", b, 10, Holder("run-b"), slots=2), Acquired)
    store.handoff.park("k", "run-a", "own-a", "copy-of-a", None, slots=2)
    store.handoff.park("k", "run-c", "hc", "message-c", None, slots=2)
    released = store.release("k", b, slot=1, task_id="run-b", slots=2)
    assert released.ours and released.handoff == "message-c"
    assert store.holder_record("k", 1)["task_id"] == "run-c"
    assert store.handoff.resume("k", 10, slots=2) is None  # run-a still holds slot 0: the copy waits
    wait_for(lambda: store.time_left("k", 0) is None)  # run-a's lease on slot 0 ran out
    resumed = store.handoff.resume("k", 10, slots=2)
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
    wait_for(lambda: store.time_left("f") is None)  # the lease expires, nobody releases it
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


@pytest.mark.core
def test_heartbeat_keeps_a_lease_alive_for_three_ttls(store: LeaseStore) -> None:
    beat = Heartbeat(store)
    lease = _lease(store, "hb", 0.6, 0.2)
    beat.add(lease)
    try:
        stays(lambda: store.holder_record("hb"), 1.8)  # three TTLs: held all along
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
        store.client.delete(store.layout.run("gone"))
        wait_for(lambda: lease.lost_known, timeout=3)  # the heartbeat's verdict
        with pytest.raises(LeaseLost, match="gone"):
            lease.check()
        # the heartbeat's thread marks the lease lost, then sends the signal: wait for that too
        wait_for(lambda: seen, timeout=3)
        assert "expired or was released" in seen[0]
    finally:
        signals.lease_lost.disconnect(on_lost)
        beat.stop()


@pytest.mark.core
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
        wait_for(lambda: lease.lost_known, timeout=6)  # the heartbeat's verdict, not the clock's
        assert "unreachable" in lease.lost_reason
        beat.stop()
    finally:
        server.close()


def test_the_heartbeat_survives_any_exception_and_keeps_renewing(
    store: LeaseStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Given a progress flush that raises a non-Redis error on the heartbeat thread and a renewal
    round that breaks (a bug, not an outage), then the thread logs each with its traceback and goes
    on: the other lease stays renewed well past its TTL and is never reported lost."""
    from celery_singleflight.run.progress import ProgressReporter, ProgressUpdate

    beat = Heartbeat(store)
    healthy = _lease(store, "healthy", 0.6, 0.2)
    broken = _lease(store, "broken-flush", 0.6, 0.2)

    def write(update: ProgressUpdate) -> None:
        if update.state != "a":  # the first is written by the caller; the pending one breaks
            raise RuntimeError("a progress hook broke")

    broken.reporter = ProgressReporter(1.0, write, beat.schedule_flush)
    real_renew = store.renew
    calls = {"n": 0}

    def flaky_renew(leases: Any) -> list[bool]:
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyError("a renewal round broke")
        return real_renew(leases)

    store.renew = flaky_renew  # type: ignore[method-assign]
    try:
        beat.add(healthy)
        beat.add(broken)
        broken.reporter.submit(ProgressUpdate("a"))
        broken.reporter.submit(ProgressUpdate("b"))  # pending: the heartbeat thread flushes it
        # more than three TTLs, all along renewed and never lost (`lost` also judges by the clock)
        stays(lambda: not healthy.lost and healthy.time_left > 0, 2.0)
        assert calls["n"] >= 5
        assert "a renewal round broke" in caplog.text and "a progress hook broke" in caplog.text
    finally:
        store.renew = real_renew  # type: ignore[method-assign]
        beat.stop()


def _settled(beat: Heartbeat) -> bool:
    """Whether the renewer thread waits for its planned look with no wake-up pending: from then on
    it sleeps a whole tick (no lease is added any more), so its count of wake-ups is final."""
    return beat._planned != float("inf") and not beat._wake.is_set()


def test_a_stream_of_short_leases_does_not_wake_the_heartbeat_each_time(store: LeaseStore) -> None:
    """Given 300 leases each added and discarded before the renewer thread could look at it (the
    short runs of a busy worker), then the thread is woken about once, not once per lease: it
    plans its tick from the first lease even if that lease is already gone when it looks."""
    beat = Heartbeat(store)
    try:
        for i in range(300):
            lease = _lease(store, f"short-{i}", 30, 10)
            beat.add(lease)
            beat.discard(lease)
            store.release(lease.key, lease.token, fence=lease.fence)
        wait_for(lambda: _settled(beat))  # every wake-up the adds caused is counted by now
        assert beat.wakeups <= 2, beat.wakeups
    finally:
        beat.stop()


@pytest.mark.core
def test_a_call_stopped_before_its_reply_leaves_the_next_call_in_step(redis_server: RedisServer) -> None:
    """Each thread keeps one connection for its lease scripts. A call stopped between sending and
    reading (a soft time limit, a signal) must not leave its reply to be read as the next call's:
    the next acquire on another key gets its own answer, not the stalled one's."""
    class Stopped(Exception):
        pass

    def stop(_signum: int, _frame: Any) -> None:
        raise Stopped

    with FaultProxy(redis_server.port) as proxy:
        store = LeaseStore(redis.Redis.from_url(proxy.url(2)), KeyLayout(f"kept-{uuid.uuid4().hex[:6]}"))
        rule = proxy.add_rule(stall_reply(1.0), script=SOURCE["ACQUIRE"], nth=1)
        previous = signal.signal(signal.SIGALRM, stop)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Stopped):
                store.acquire("stalled", _token(), 10, Holder("task-a"))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        # the proxy holds the stalled reply 1.0 s from the server's answer (its fault's time); past
        # that it has reached whatever connection it was on. An answer that came only after the
        # client hung up went with its link: no fault is recorded and no reply will come.
        if rule.event.wait(timeout=5):
            released_at = proxy.faults[0].at + 1.0
            wait_for(lambda: time.monotonic() >= released_at)
        mine = _token()
        got = store.acquire("next", mine, 10, Holder("task-b"))
        assert isinstance(got, Acquired)
        assert store.holder_record("next")["task_id"] == "task-b"
        assert store.release("next", mine).ours is True
        assert store.record("next")["state"] == "succeeded"


@pytest.mark.core
def test_a_thread_gives_its_kept_connection_back_when_it_ends(redis_server: RedisServer) -> None:
    """Threads that run lease scripts keep a connection each and give it back when they end: a
    hundred short-lived threads do not leave a hundred connections open."""
    client = redis_server.client(2)
    store = LeaseStore(client, KeyLayout(f"threads-{uuid.uuid4().hex[:6]}"))
    pool = client.connection_pool

    def one(index: int) -> None:
        token = _token()
        assert isinstance(store.acquire(f"k{index}", token, 10, Holder(f"t{index}")), Acquired)
        assert store.release(f"k{index}", token).ours

    for index in range(100):
        thread = threading.Thread(target=one, args=(index,))
        thread.start()
        thread.join()
    gc.collect()
    assert len(pool._in_use_connections) <= 1  # type: ignore[attr-defined]
    assert len(pool._available_connections) <= 2  # type: ignore[attr-defined]


