"""``min_replicas`` on private redis-servers: the ACQUIRE and its ``WAIT`` are one write on one
connection; a grant no replica confirmed is released and counts as "Redis unavailable"
(``fail_closed``: the body does not run; ``fail_open``: it runs unguarded); a renewal no replica
confirmed leaves the lease's clock where it was. The failover itself: test_min_replicas_failover.py."""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_singleflight import RedisUnavailable, ReplicasUnavailable, SingleFlightTask, hold
from celery_singleflight.config.options import resolve_options
from celery_singleflight.connection.clients import is_unavailable, kept_connection, redis_client
from celery_singleflight.connection.scripts import ClientScript
from celery_singleflight.errors import ConfigurationError
from celery_singleflight.protocol.replicas import AcquireWaiting
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.outage import counters
from celery_singleflight.testing import RedisServer

from .conftest import wait_for

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)


@pytest.fixture
def primary() -> Iterator[RedisServer]:
    with RedisServer(extra=("--repl-diskless-sync-delay", "0")) as server:  # a replica syncs at once
        yield server


@pytest.fixture
def replica(primary: RedisServer) -> Iterator[RedisServer]:
    with RedisServer(extra=("--replicaof", "127.0.0.1", str(primary.port))) as server:
        wait_for(lambda: _counted(primary))
        yield server


def _counted(primary: RedisServer) -> bool:
    """The primary's replica is online and has acknowledged all it was sent."""
    info = primary.client().info("replication")
    replica = info.get("slave0") or {}
    return bool(replica.get("state") == "online" and replica.get("offset") == info["master_repl_offset"])


def test_off_the_store_calls_the_plain_script() -> None:
    """min_replicas=0 (the default) adds nothing to the uncontended path: the plain script."""
    client = redis.Redis(host="127.0.0.1", port=1)
    assert type(LeaseStore(client, KeyLayout("sf")).lease._acquire) is ClientScript
    assert type(LeaseStore(client, KeyLayout("sf"), min_replicas=1).lease._acquire) is AcquireWaiting


def test_acquire_and_wait_are_one_write_on_one_connection(primary: RedisServer, replica: RedisServer,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a primary with a replica, the grant is on the replica when acquire returns; the
    EVALSHA and its WAIT left in one write, on the connection the thread keeps for scripts."""
    client = redis_client(primary.url)
    store = LeaseStore(client, KeyLayout("sf"), min_replicas=1, replica_timeout=1.0)
    store.acquire("warm", "t0", 5, Holder("t0"))  # loads the script
    conn = kept_connection(client)
    writes: list[bytes] = []
    send = conn.send_packed_command

    def recorded(packed: list[bytes], *args: Any, **kwargs: Any) -> None:
        writes.append(b"".join(packed))
        send(packed, *args, **kwargs)

    monkeypatch.setattr(conn, "send_packed_command", recorded)
    before = primary.client().info("commandstats")["cmdstat_wait"]["calls"]
    got = store.acquire("k", "t1", 5, Holder("t1"))
    assert isinstance(got, Acquired)
    assert len(writes) == 1 and writes[0].index(b"WAIT") > writes[0].index(b"EVALSHA") >= 0
    assert primary.client().info("commandstats")["cmdstat_wait"]["calls"] == before + 1
    assert replica.client().get("sf:{k}:run") is not None


def test_a_grant_no_replica_confirmed_is_released_and_unavailable(primary: RedisServer) -> None:
    """No replica: the grant raises ReplicasUnavailable (an outage, naming the key; it pickles),
    and a plain store can take the key at once after the guard released it. The same through a
    client whose calls go through a pipeline (a single-connection client)."""
    for client in (redis_client(primary.url), redis.Redis(host="127.0.0.1", port=primary.port,
                                                          single_connection_client=True)):
        store = LeaseStore(client, KeyLayout("sf"), min_replicas=1, replica_timeout=0.05)
        with pytest.raises(ReplicasUnavailable) as info:
            store.acquire("lonely", "t1", 5, Holder("t1"))
        error = info.value
        assert (error.key, error.needed, error.acknowledged) == ("lonely", 1, 0)
        assert is_unavailable(error) and isinstance(error, redis.RedisError)
        assert pickle.loads(pickle.dumps(error)).key == "lonely"
        assert store.release("lonely", "t1", "retried")  # the guard's forget_attempt
        plain = LeaseStore(client, KeyLayout("sf"))
        assert isinstance(plain.acquire("lonely", "t2", 5, Holder("t2")), Acquired)
        client.delete("sf:{lonely}:run")


def _app(primary: RedisServer, mode: str) -> tuple[Celery, Any, list[str]]:
    app = Celery(f"replicas-{mode}", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=f"{primary.url}/0", singleflight_min_replicas=1,
                    singleflight_min_replicas_timeout=0.05, singleflight_on_redis_error=mode)
    ran: list[str] = []

    @app.task(name=f"replicas.{mode}", bind=True, base=SingleFlightTask, lock_key="r:<x>", shared=False)
    def guarded(self: Any, x: str) -> str:
        ran.append(x)
        return x

    return app, guarded, ran


def test_fail_closed_does_not_run_the_body_and_frees_the_key(primary: RedisServer) -> None:
    _, guarded, ran = _app(primary, "fail_closed")
    result = guarded.apply(("a",))
    assert isinstance(result.result, RedisUnavailable) and "0 of the 1 replica" in str(result.result)
    assert ran == []
    store = LeaseStore(primary.client(), KeyLayout("sf"))
    assert store.time_left("r:a") is None  # released, not held for a TTL
    assert isinstance(store.acquire("r:a", "t", 5, Holder("t")), Acquired)


def test_fail_open_runs_the_body_unguarded(primary: RedisServer) -> None:
    _, guarded, ran = _app(primary, "fail_open")
    before = counters.unguarded_runs
    assert guarded.apply(("b",)).get() == "b"
    assert ran == ["b"] and counters.unguarded_runs == before + 1
    assert LeaseStore(primary.client(), KeyLayout("sf")).time_left("r:b") is None


def test_hold_raises_redis_unavailable_and_frees_the_key(primary: RedisServer) -> None:
    app, _, _ = _app(primary, "fail_closed")
    with pytest.raises(RedisUnavailable) as info, hold(app, "h:1"):
        pass
    assert isinstance(info.value.__cause__, ReplicasUnavailable)
    assert LeaseStore(primary.client(), KeyLayout("sf")).time_left("h:1") is None


def test_renewals_no_replica_confirms_run_the_lease_clock_out(primary: RedisServer) -> None:
    """Given a hold taken while a replica confirmed it, when the replica dies its renewals still
    succeed on the primary, but none is confirmed: the holder counts its lease lost by its own
    clock, within its TTL, while the primary still shows it held."""
    with RedisServer(extra=("--replicaof", "127.0.0.1", str(primary.port))) as replica:
        wait_for(lambda: _counted(primary))
        app, _, _ = _app(primary, "fail_closed")
        app.conf.update(singleflight_ttl=1.5, singleflight_min_replicas_timeout=1.0)  # a slow machine
        with hold(app, "h:renew") as lease:
            replica.kill()
            started = time.monotonic()
            wait_for(lambda: lease.lease.lost, timeout=3)
            assert time.monotonic() - started < 1.5
            assert LeaseStore(primary.client(), KeyLayout("sf")).time_left("h:renew")


@pytest.mark.parametrize(("settings", "says"), [
    ({"singleflight_min_replicas": -1}, r"singleflight_min_replicas\) must be a whole number of at least 0"),
    ({"singleflight_min_replicas": 1.5}, r"singleflight_min_replicas\) must be a whole number"),
    ({"singleflight_min_replicas_timeout": 0}, "min_replicas_timeout"),
    ({"singleflight_min_replicas_timeout": 30}, "shorter than the lease TTL"),
    ({"singleflight_min_replicas_timeout": 6}, "socket timeout"),
])
def test_bad_values_fail_when_options_resolve(settings: dict[str, Any], says: str) -> None:
    class Task:
        name = "t"

    with pytest.raises(ConfigurationError, match=says):
        resolve_options(Task, {"broker_url": "redis://127.0.0.1:1/0", **settings})


def test_defaults_and_precedence() -> None:
    class Task:
        name = "t"
        min_replicas = 2

    conf = {"broker_url": "redis://127.0.0.1:1/0", "singleflight_min_replicas": 1}
    options = resolve_options(Task, conf)
    assert (options.min_replicas, options.min_replicas_timeout) == (2, 0.5)
    Task.min_replicas = None  # type: ignore[assignment]
    assert resolve_options(Task, conf).min_replicas == 1
