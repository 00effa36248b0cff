"""Heartbeat, lost leases and Redis outages, seen from a real worker."""

from __future__ import annotations

import logging
from types import ModuleType

import pytest

from celery_singleflight.testing import RedisServer, WorkerProcess, free_port

from .conftest import stays, wait_for

pytestmark = pytest.mark.worker


@pytest.mark.core
def test_task_running_three_ttls_keeps_its_lease(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    """Given a 1.5 s TTL, when the task runs 4.5 s, then its lease is held the whole time."""
    result = sfapp.heartbeat_check.delay("hb", 4.5)
    key = sfapp.heartbeat_check.render_key("hb")
    store = sfapp.heartbeat_check.store
    st = wait_for(lambda: (found := sfapp.heartbeat_check.status("hb")) is not None and found.held and found,
                  timeout=15)
    # watched until half a second before the run's end: past its first TTL only renewals keep it
    stays(lambda: store.time_left(key), 4.0 - (st.age or 0.0))
    assert result.get(timeout=5)["lost"] is False


@pytest.mark.core
def test_lease_deleted_behind_its_back_is_reported_lost(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    result = sfapp.loses_lease.delay("lost")
    wait_for(lambda: sfapp.recorder.get("started:lost"), timeout=15)
    redis_server.client(2).delete(
        sfapp.loses_lease.store.layout.run(sfapp.loses_lease.render_key("lost"))
    )
    outcome = result.get(timeout=15)
    assert outcome["lost"] is True and outcome["error"] == "LeaseLost"
    assert "lost" in outcome["message"]
    wait_for(lambda: "lease lost" in shared_worker.log(), timeout=5)


@pytest.mark.core
def test_fail_closed_does_not_run_unguarded_and_resumes_when_redis_returns(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given the lease Redis is down, the task is retried later (RETRY), never run unguarded;
    when Redis comes back on that port, it runs."""
    port = free_port()
    worker: WorkerProcess = start_worker(  # type: ignore[operator]
        concurrency=1,
        env={"SF_TEST_LEASE_REDIS": f"redis://127.0.0.1:{port}/2", "SF_TEST_REDIS_RETRY": "0.5"},
    )
    result = sfapp.hold_raise.apply_async(("closed", 0.01), queue=worker.queue)
    wait_for(lambda: result.state == "RETRY", timeout=20)
    assert sfapp.recorder.llen("runs:closed") == 0
    lease_redis = RedisServer(port=port).start()
    try:
        assert result.get(timeout=30)["key"] == "closed"
        assert sfapp.recorder.llen("runs:closed") == 1
    finally:
        lease_redis.close()


def test_fail_open_runs_with_a_warning(sfapp: ModuleType, start_worker: object) -> None:
    worker: WorkerProcess = start_worker(  # type: ignore[operator]
        concurrency=1, env={"SF_TEST_LEASE_REDIS": f"redis://127.0.0.1:{free_port()}/2"}
    )
    assert sfapp.open_on_error.apply_async(("open",), queue=worker.queue).get(timeout=30) == "ran"
    assert "UNGUARDED" in worker.log()


def test_bad_setting_stops_the_worker_at_start(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """Given a negative TTL in the app's settings, the worker refuses to start and says why."""
    from celery_singleflight.testing import WorkerProcess

    from .conftest import TESTS, worker_env

    worker = WorkerProcess("sfapp", concurrency=1, cwd=str(TESTS),
                           env=worker_env(redis_server, SF_TEST_TTL="-1"))
    with pytest.raises(RuntimeError, match="exited"):
        worker.start(timeout=60)
    assert "singleflight_ttl" in worker.log() and "more than zero" in worker.log()


def test_unbound_task_uses_its_function_signature(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    assert sfapp.plain.render_key(3) == sfapp.plain.render_key(x=3, y=1) == "plain:3"
    assert sfapp.plain.delay(3).get(timeout=15) == [3, 1]


def test_worker_start_warns_when_the_lease_redis_may_evict_leases(sfapp: ModuleType) -> None:
    """Given a private lease Redis with maxmemory and an allkeys-lru policy, the worker-start check
    warns; with noeviction it does not."""
    from celery_singleflight.worker.preflight import preflight

    def eviction_warnings() -> list[str]:
        found = preflight(sfapp.app)
        return [f.message for f in found if f.check == "eviction" and f.level == logging.WARNING]

    server = RedisServer(extra=["--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"]).start()
    original = sfapp.app.conf.singleflight_redis_url
    try:
        for task in sfapp.app.tasks.values():
            if hasattr(type(task), "_sf_options"):
                type(task)._sf_options = None
        sfapp.app.conf.singleflight_redis_url = f"{server.url}/2"
        warnings = eviction_warnings()
        assert len(warnings) == 1 and "allkeys-lru" in warnings[0] and "noeviction" in warnings[0]
        server.client().config_set("maxmemory-policy", "noeviction")
        assert eviction_warnings() == []
    finally:
        sfapp.app.conf.singleflight_redis_url = original
        for task in sfapp.app.tasks.values():
            if hasattr(type(task), "_sf_options"):
                type(task)._sf_options = None
        server.close()
