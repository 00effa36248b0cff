"""Every end of a run frees the key at once (not after the TTL), on a real prefork worker.

The worker runs with the default 30 s TTL, so "free within a few seconds" can only come from
a release, never from expiry.
"""

from __future__ import annotations

import os
import signal
from types import ModuleType

import pytest
from billiard.exceptions import WorkerLostError
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded

import celery_singleflight as sf
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import HOLD, gates_opened_after, let_go, wait_for

pytestmark = pytest.mark.worker
FREE_WITHIN = 5.0  # seconds; far below the 30 s TTL
_gates_opened = gates_opened_after("revoked", "killed", "warm", "host")


def held(sfapp: ModuleType, task: object, key: str) -> dict[str, str]:
    return task.store.holder_record(task.render_key(key))  # type: ignore[attr-defined, no-any-return]


def assert_freed(sfapp: ModuleType, task: object, key: str) -> None:
    wait_for(lambda: not held(sfapp, task, key), timeout=FREE_WITHIN)


def wait_running(sfapp: ModuleType, key: str) -> int:
    return int(wait_for(lambda: sfapp.recorder.get(f"pid:{key}"), timeout=15))


@pytest.mark.core
def test_success_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    result = sfapp.hold_raise.delay("ok", 0.05)
    assert result.get(timeout=15)["key"] == "ok"
    assert held(sfapp, sfapp.hold_raise, "ok") == {}


@pytest.mark.core
def test_failure_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    with pytest.raises(ValueError, match="boom"):
        sfapp.fails.delay("bad").get(timeout=15)
    assert held(sfapp, sfapp.fails, "bad") == {}


@pytest.mark.core
def test_self_retry_is_not_its_own_duplicate(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a task that calls self.retry() while holding its key (policy raise),
    then the retry runs (it is not refused as a duplicate) and the key is free at the end."""
    assert sfapp.retry_once.delay("again").get(timeout=15) == 1
    assert sfapp.recorder.lrange("attempts:again", 0, -1) == [b"0", b"1"]
    assert held(sfapp, sfapp.retry_once, "again") == {}


@pytest.mark.core
def test_ignore_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a run that raises Ignore (its state stays as it was: nothing to wait on), then its
    release records the outcome ``ignored`` and the key is free: waiting for that outcome proves
    the run took the key and gave it back."""
    sfapp.ignores.delay("ign")
    key = sfapp.ignores.render_key("ign")
    st = wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.outcome and s, timeout=15)
    assert st.outcome == "ignored" and not st.held
    assert held(sfapp, sfapp.ignores, "ign") == {}


@pytest.mark.core
def test_reject_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a run that raises Reject(requeue=False), its release records ``rejected`` and the
    key is free. The outcome is awaited, not the task's state: Celery 5.7 marks it FAILURE, 5.3
    to 5.6 leave the state as it was."""
    sfapp.rejects.delay("rej")
    key = sfapp.rejects.render_key("rej")
    st = wait_for(lambda: (s := sf.status(sfapp.app, key)) and s.outcome and s, timeout=15)
    assert st.outcome == "rejected" and not st.held
    assert_freed(sfapp, sfapp.rejects, "rej")


@pytest.mark.core
def test_soft_time_limit_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    with pytest.raises(SoftTimeLimitExceeded):
        sfapp.soft_limited.delay("soft").get(timeout=15)
    assert held(sfapp, sfapp.soft_limited, "soft") == {}


@pytest.mark.core
def test_hard_time_limit_releases_from_the_main_process(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    with pytest.raises(TimeLimitExceeded):
        sfapp.hard_limited.delay("hard").get(timeout=20)
    assert_freed(sfapp, sfapp.hard_limited, "hard")


@pytest.mark.core
def test_revoke_terminate_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    result = sfapp.sleeper.delay("revoked", HOLD)
    wait_running(sfapp, "revoked")
    assert held(sfapp, sfapp.sleeper, "revoked")
    result.revoke(terminate=True)
    assert_freed(sfapp, sfapp.sleeper, "revoked")
    wait_for(lambda: result.state == "REVOKED", timeout=FREE_WITHIN)


@pytest.mark.core
def test_killed_pool_process_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a running holder, when its pool process is killed with SIGKILL (it runs no code),
    then the worker's main process frees the key, well before the TTL."""
    result = sfapp.sleeper.delay("killed", HOLD)
    pid = wait_running(sfapp, "killed")
    os.kill(pid, signal.SIGKILL)
    assert_freed(sfapp, sfapp.sleeper, "killed")
    with pytest.raises(WorkerLostError):
        result.get(timeout=15)


@pytest.mark.core
def test_warm_shutdown_lets_the_run_finish_and_release(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a run holding its key, when its worker gets SIGTERM, then the run finishes (let go
    once the warm shutdown began), stores its result and releases the key before the worker exits."""
    worker: WorkerProcess = start_worker(concurrency=1)  # type: ignore[operator]
    result = sfapp.sleeper.apply_async(("warm", HOLD), queue=worker.queue)
    wait_running(sfapp, "warm")
    assert worker.proc is not None
    worker.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "Warm shutdown" in worker.log(), timeout=15)
    assert not result.ready()
    let_go(sfapp, "warm")
    worker.proc.wait(timeout=20)  # the run ends, then the worker
    assert result.get(timeout=5) == "slept"
    assert held(sfapp, sfapp.sleeper, "warm") == {}


def test_lost_host_frees_the_key_within_the_ttl(
    sfapp: ModuleType, start_worker: object, redis_server: RedisServer
) -> None:
    """Given a worker with a 3 s TTL, when the whole worker is SIGKILLed (no process survives to
    release), then the key frees by expiry within the TTL."""
    worker: WorkerProcess = start_worker(concurrency=1, env={"SF_TEST_TTL": "3"})  # type: ignore[operator]
    sfapp.sleeper.apply_async(("host", HOLD), queue=worker.queue)
    wait_running(sfapp, "host")
    assert held(sfapp, sfapp.sleeper, "host")
    worker.kill()
    left = sfapp.sleeper.store.time_left(sfapp.sleeper.render_key("host"))
    assert left is not None and 0 < left <= 3
    assert_freed(sfapp, sfapp.sleeper, "host")
