"""Told at once: a superseded or force-released holder learns it through a push to its process,
within milliseconds, not at its next renewal (the lease TTL here is the default, 30 s: a renewal
every 10 s, so anything under a second is the push). A lost push is still caught by the renewal.
And newest means last sent: sends reordered by a countdown or by two queues end with the last
one sent completing."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from celery import states as celery_states

import celery_singleflight as sf
from celery_singleflight import LeaseLost, Superseded, hold
from celery_singleflight.ops.acl import acl_rule
from celery_singleflight.protocol.inbox import Told, inbox_channel
from celery_singleflight.protocol.replies import Holder, this_process
from celery_singleflight.protocol.store import KeyLayout
from celery_singleflight.run.heartbeat import heartbeat_for
from celery_singleflight.testing import RedisServer, binary_server_kind

from .conftest import wait_for

pytestmark = [pytest.mark.server, pytest.mark.share_workers]  # server: also on Redis 6.2 and Valkey 8

#: half the first renewal (lock_ttl / 3 = 10 s with the default TTL), so only the push can tell
#: a holder this soon; a push takes milliseconds, but a loaded machine runs the inbox thread late
TOLD_WITHIN = 5.0


def _started(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"started:{key}", 0, -1)]


def _done(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"done:{key}", 0, -1)]


def _raised(sfapp: ModuleType, key: str, n: int) -> float | None:
    raw = sfapp.recorder.get(f"raised:{key}:{n}")
    return None if raw is None else float(raw)


@pytest.mark.worker
def test_a_superseded_holder_is_told_at_once_with_the_default_ttl(
    sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a holder with the default 30 s lease that checks every 10 ms, when a newcomer is
    sent, then the holder's check() raises Superseded (naming the newcomer) well within a second,
    ten rounds in a row (its first renewal would come after 10 s), and the newcomer completes."""
    q = start_worker(concurrency=2).queue
    for round_ in range(10):
        key = f"push-{round_}-{uuid.uuid4().hex[:6]}"
        holder = sfapp.told_at_once.apply_async((key, 0, 30.0), queue=q)
        wait_for(lambda key=key: _started(sfapp, key) == [0], timeout=15)
        sent = time.time()
        newcomer = sfapp.told_at_once.apply_async((key, 1), queue=q)
        with pytest.raises(Superseded) as info:
            holder.get(timeout=15)
        assert info.value.by == newcomer.id
        told = _raised(sfapp, key, 0)
        assert told is not None and told - sent < TOLD_WITHIN, f"round {round_}: {told and told - sent} s"
        assert newcomer.get(timeout=15) == 1
        assert _done(sfapp, key) == [1]


@pytest.mark.worker
def test_a_force_released_holder_is_told_at_once(sfapp: ModuleType, start_worker: Any) -> None:
    """Given a holder with the default lease, when an operator force-releases its key, then its
    next check() raises LeaseLost within a second, and the key's status says who released it."""
    q = start_worker(concurrency=2).queue
    key = f"fr-{uuid.uuid4().hex[:6]}"
    holder = sfapp.told_at_once.apply_async((key, 0, 30.0), queue=q)
    wait_for(lambda: _started(sfapp, key) == [0], timeout=15)
    sent = time.time()
    assert sf.force_release(sfapp.app, f"told:{key}", by="ops@test") is not None
    with pytest.raises(LeaseLost) as info:
        holder.get(timeout=15)
    assert "force-released by ops@test" in str(info.value)
    told = _raised(sfapp, key, 0)
    assert told is not None and told - sent < TOLD_WITHIN
    assert sfapp.recorder.get(f"why:{key}:0") == b"LeaseLost"


@pytest.mark.worker
def test_wait_superseded_wakes_a_blocked_body_at_once(sfapp: ModuleType, start_worker: Any) -> None:
    """Given a body blocked in self.lease.wait_superseded(30), when a newcomer is sent, it wakes
    within a second and its check() raises Superseded; a body never superseded waits its timeout
    and completes."""
    q = start_worker(concurrency=2).queue
    key = f"ws-{uuid.uuid4().hex[:6]}"
    holder = sfapp.waits_superseded.apply_async((key, 0, 30.0), queue=q)
    wait_for(lambda: _started(sfapp, key) == [0], timeout=15)
    sent = time.time()
    newcomer = sfapp.waits_superseded.apply_async((key, 1, 0.3), queue=q)
    with pytest.raises(Superseded):
        holder.get(timeout=15)
    told = _raised(sfapp, key, 0)
    assert told is not None and told - sent < TOLD_WITHIN
    assert newcomer.get(timeout=15) == 1
    assert _done(sfapp, key) == [1]


@pytest.mark.worker
def test_no_grace_revokes_a_holder_that_never_checks_at_once(sfapp: ModuleType, start_worker: Any) -> None:
    """Given supersede_grace=0 and a holder that never checks, when a newcomer is sent, the
    newcomer's process revokes the holder at once (not at the next sweep) and then runs."""
    q = start_worker(concurrency=2).queue
    key = f"rv-{uuid.uuid4().hex[:6]}"
    holder = sfapp.revoked_at_once.apply_async((key, 0, 60.0), queue=q)
    wait_for(lambda: _started(sfapp, key) == [0], timeout=15)
    sent = time.time()
    newcomer = sfapp.revoked_at_once.apply_async((key, 1, 0.05), queue=q)
    assert wait_for(lambda: holder.state == celery_states.REVOKED, timeout=10)
    assert newcomer.get(timeout=15) == 1
    assert time.time() - sent < 5.0  # the sweeper alone looks every few seconds, then revokes
    assert _done(sfapp, key) == [1]


@pytest.mark.worker
def test_sends_reordered_by_a_countdown_end_with_the_last_sent_completing(
    sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a holder, when versions 1-9 are sent with countdown=1.5 and then version 10 with
    none, version 10 supersedes the holder and completes; 1-9, arriving after it started, end
    Superseded by version 10 without running."""
    q = start_worker(concurrency=4).queue
    key = f"cd-{uuid.uuid4().hex[:6]}"
    holder = sfapp.told_at_once.apply_async((key, 0, 30.0), queue=q)
    wait_for(lambda: _started(sfapp, key) == [0], timeout=15)
    late = [sfapp.told_at_once.apply_async((key, n, 0.05), queue=q, countdown=1.5) for n in range(1, 10)]
    last = sfapp.told_at_once.apply_async((key, 10, 3.0), queue=q)
    assert last.get(timeout=20) == 10
    for result in (holder, *late):
        with pytest.raises(Superseded) as info:
            result.get(timeout=15)
        if result is not holder:
            assert info.value.by == last.id
    assert _done(sfapp, key) == [10]
    assert _started(sfapp, key) == [0, 10]


@pytest.mark.worker
def test_sends_reordered_by_two_queues_end_with_the_last_sent_completing(
    sfapp: ModuleType, start_worker: Any
) -> None:
    """Given version 1 sent to a queue nobody consumes yet and version 2 sent after it to a
    consumed queue, when version 1 arrives (its queue's worker starts) while version 2 runs and
    again after it completed, it ends Superseded by version 2 and never runs."""
    fast = start_worker(concurrency=2).queue
    slow = f"q-slow-{uuid.uuid4().hex[:8]}"
    key = f"qq-{uuid.uuid4().hex[:6]}"
    older = sfapp.told_at_once.apply_async((key, 1, 0.05), queue=slow)
    newer = sfapp.told_at_once.apply_async((key, 2, 2.0), queue=fast)
    wait_for(lambda: _started(sfapp, key) == [2], timeout=15)
    start_worker(concurrency=2, queue=slow)
    with pytest.raises(Superseded) as info:
        older.get(timeout=15)
    assert info.value.by == newer.id
    assert newer.get(timeout=15) == 2
    after = sfapp.told_at_once.apply_async((key, 1, 0.05), queue=slow)
    assert after.get(timeout=15) == 1  # a new send is newer: it runs
    assert _done(sfapp, key) == [2, 1]


# -- in this process: a real Redis, the real heartbeat and inbox ------------------------------


@pytest.fixture
def app(redis_server: RedisServer) -> Iterator[Celery]:
    app = Celery("told", set_as_current=False)
    app.conf.singleflight_redis_url = f"{redis_server.url}/7"
    app.conf.singleflight_namespace = f"told-{uuid.uuid4().hex[:6]}"
    yield app


def _inbox_ready(app: Celery, key: str) -> Any:
    """Hold ``key`` once so this process's inbox listens, and return the heartbeat."""
    with hold(app, key) as lease:
        beat = heartbeat_for(lease.lease.store)
    assert beat.inbox.subscribed.wait(5)
    return beat


def _cut_inbox(beat: Any) -> None:
    """Kill this process's inbox connection, and no other: the suite's server is shared, and
    killing every pub/sub client cut the other test processes' result consumers (Celery 5.3's
    gives up reconnecting after 20 s) and the shared workers' inboxes."""
    client = beat.store.client
    mine = [conn._sock.getsockname() for conn in list(client.connection_pool._in_use_connections)
            if conn._sock is not None]
    assert sum(client.client_kill_filter(_type="pubsub", addr=f"{host}:{port}")
               for host, port, *_ in mine) == 1


def _subscribers(beat: Any, app: Celery) -> int:
    """How many connections the server has subscribed to this process's inbox of ``app``'s
    namespace (the event that proves the listener is back: its ``subscribed`` flag may be set by
    the old one before it saw the cut)."""
    channel = inbox_channel(KeyLayout(app.conf.singleflight_namespace), *this_process())
    return int(dict(beat.store.client.pubsub_numsub(channel))[channel.encode()])


def test_a_hold_learns_a_force_release_through_the_push(app: Celery) -> None:
    """Given a hold with the default TTL, when its key is force-released, the hold's lease is lost
    within a second (the push), and wait_superseded() returns True."""
    key = f"h-{uuid.uuid4().hex[:6]}"
    beat = _inbox_ready(app, key + "-warm")
    heard = beat.inbox.heard
    with hold(app, key) as lease:
        woke = threading.Event()
        threading.Thread(target=lambda: lease.lease.wait_superseded(30) and woke.set(), daemon=True).start()
        sent = time.monotonic()
        assert sf.force_release(app, key, by="ops") is not None
        assert woke.wait(TOLD_WITHIN), "wait_superseded did not wake"
        assert time.monotonic() - sent < TOLD_WITHIN
        # the inbox counts a push after it woke the waiter: the count may come a moment later
        assert lease.lost and wait_for(lambda: beat.inbox.heard == heard + 1, timeout=1)
        with pytest.raises(LeaseLost, match="force-released by ops"):
            lease.check()


def test_a_lost_push_is_caught_by_the_renewal(app: Celery) -> None:
    """Given the inbox's connection cut (its listener stopped, the pub/sub client killed), when the
    hold's key is force-released, the push is lost, and the renewal still finds the loss within
    one interval (ttl 1.5 s: a renewal every 0.5 s)."""
    key = f"cut-{uuid.uuid4().hex[:6]}"
    beat = _inbox_ready(app, key + "-warm")
    beat.inbox.stop()
    _cut_inbox(beat)
    wait_for(lambda: not (beat.inbox._thread and beat.inbox._thread.is_alive()), timeout=5)
    heard = beat.inbox.heard
    try:
        with hold(app, key, ttl=1.5) as lease:
            assert sf.force_release(app, key, by="ops") is not None
            assert lease.lease.wait_superseded(1.2), "the renewal did not find the loss"
            assert lease.lost and beat.inbox.heard == heard
    finally:
        beat.inbox._stop.clear()
        beat.inbox.listen(beat.store.layout)


def test_a_message_for_a_lease_this_process_does_not_hold_is_dropped(app: Celery) -> None:
    """A push naming a token this process does not hold (a pid reused by a new process, a lease
    released meanwhile) marks nothing."""
    key = f"drop-{uuid.uuid4().hex[:6]}"
    with hold(app, key) as lease:
        beat = heartbeat_for(lease.lease.store)
        run_key = lease.lease.layout.run(key)
        assert not beat.inbox.deliver(Told(run_key, "not-its-token", "released", ("ops",)))
        assert not beat.inbox.deliver(Told(run_key, lease.lease.token, "unknown-kind", ()))
        assert not lease.lost
        assert Told.decode(b"no separators") is None
    assert Holder("x").host and Holder("x").pid


def test_the_inbox_listens_again_after_its_connection_is_cut(app: Celery) -> None:
    """Given the inbox's pub/sub connection killed by the server, the listener connects and
    subscribes again (within about a second), and the next force-release is told by the push."""
    key = f"again-{uuid.uuid4().hex[:6]}"
    beat = _inbox_ready(app, key + "-warm")
    _cut_inbox(beat)
    assert _subscribers(beat, app) == 0  # the server dropped it with the connection
    wait_for(lambda: _subscribers(beat, app) == 1, timeout=5)  # "the inbox did not subscribe again"
    heard = beat.inbox.heard
    with hold(app, key) as lease:
        sent = time.monotonic()
        assert sf.force_release(app, key, by="ops") is not None
        assert lease.lease.wait_superseded(TOLD_WITHIN) and time.monotonic() - sent < TOLD_WITHIN
        # counted just after the wake-up, by the inbox thread (which a loaded machine may run late)
        assert wait_for(lambda: beat.inbox.heard == heard + 1, timeout=5)


def test_a_user_whose_acl_allows_no_channel_still_supersedes_and_learns_at_the_renewal(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Given an ACL user with the rule from before the push (no channel), its inbox is refused
    (one WARNING), a force-release still works (the script's PUBLISH is allowed to fail), and the
    holder learns it at its next renewal (ttl 1.5 s: a renewal every 0.5 s)."""
    namespace = f"noch-{uuid.uuid4().hex[:6]}"
    user = f"noch-{uuid.uuid4().hex[:6]}"
    rule = [word for word in acl_rule(namespace, "pw", server=binary_server_kind())
            if not word.startswith("&")]
    admin = redis.Redis.from_url(redis_server.url)
    admin.execute_command("ACL", "SETUSER", user, *rule)
    beat = None
    try:
        app = Celery("noch", set_as_current=False)
        app.conf.singleflight_redis_url = f"redis://{user}:pw@127.0.0.1:{redis_server.port}/0"
        app.conf.singleflight_namespace = namespace
        key = f"k-{uuid.uuid4().hex[:6]}"
        with caplog.at_level(logging.WARNING, logger="celery_singleflight.renew"), \
                hold(app, key, ttl=1.5) as lease:
            beat = heartbeat_for(lease.lease.store)
            wait_for(lambda: beat.inbox._refused, timeout=5)
            assert sf.force_release(app, key, by="ops") is not None
            assert lease.lease.wait_superseded(1.2), "the renewal did not find the loss"
            assert beat.inbox.heard == 0
        assert sum("cannot subscribe" in r.getMessage() for r in caplog.records) == 1
    finally:
        if beat is not None:  # its listener would try again as a deleted user (other tests read the ACL log)
            beat.stop()
        admin.execute_command("ACL", "DELUSER", user)


@pytest.mark.worker
def test_each_pool_process_listens_before_its_first_task(sfapp: ModuleType, start_worker: Any) -> None:
    """Given a fresh prefork worker with two pool processes and no task sent yet, each pool
    process already subscribes to its inbox: the first lease it will hold is told at once too."""
    worker = start_worker(concurrency=2, fresh=True)  # a worker that never ran a task
    pid = worker.proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children")

    def listening() -> bool:
        pids = children.read_text().split()
        channels = {c.decode() for c in sfapp.told_at_once.store.client.pubsub_channels("sf:inbox:*")}
        return len(pids) == 2 and all(any(c.endswith(f":{child}") for c in channels) for child in pids)

    assert wait_for(listening, timeout=15)
