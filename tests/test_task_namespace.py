"""A task with its own ``lock_namespace`` is seen and excluded by every key tool given that
namespace: ``hold()``, ``status()``, ``status_all()``, ``held()``, ``watch()``,
``force_release()`` and the CLI's ``--namespace``; the task's own helpers use it by themselves."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight import LockHeld, hold
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import TESTS, wait_for, worker_env

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def nsapp(redis_server: RedisServer) -> Iterator[ModuleType]:
    """tests/nsapp.py with a worker of its own on its own queue."""
    old = os.environ.get("SF_TEST_REDIS")
    os.environ["SF_TEST_REDIS"] = redis_server.url
    sys.modules.pop("nsapp", None)
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    module = importlib.import_module("nsapp")
    worker = WorkerProcess("nsapp", concurrency=2, cwd=str(TESTS), env=worker_env(redis_server),
                           extra=("-Q", "nsapp"))
    try:
        worker.start(module.app)
        yield module
    finally:
        worker.stop(timeout=15)
        worker.kill()
        worker.cleanup()
        sys.modules.pop("nsapp", None)
        if old is None:
            os.environ.pop("SF_TEST_REDIS", None)
        else:
            os.environ["SF_TEST_REDIS"] = old


def run_cli(redis_server: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "nsapp", "singleflight", *args], cwd=TESTS,
        env={**os.environ, **worker_env(redis_server)}, capture_output=True, text=True, timeout=60,
    )


def test_every_key_tool_takes_the_tasks_namespace(nsapp: ModuleType, redis_server: RedisServer) -> None:
    task = nsapp.billing_sleeper
    result = task.delay("ns", 30)
    key = task.render_key("ns")
    assert key == "k:ns"
    wait_for(lambda: nsapp.recorder.get("pid:billing:ns"), timeout=15)

    # the app's namespace knows nothing of it: another lock altogether
    assert sf.status(nsapp.app, key) is None
    with hold(nsapp.app, key):
        pass
    # given the task's namespace, each tool sees the running task
    st = sf.status(nsapp.app, key, namespace="billing")
    assert st is not None and st.held and st.task_id == result.id
    assert task.status("ns") is not None and task.status("ns").task_id == result.id  # type: ignore[union-attr]
    assert [s.task_id for s in sf.status_all(nsapp.app, key, namespace="billing")] == [result.id]
    assert [s.key for s in sf.held(nsapp.app, "k:", namespace="billing")] == [key]
    with pytest.raises(LockHeld) as refused, hold(nsapp.app, key, namespace="billing"):
        pytest.fail("a hold in the task's namespace must be refused while the task runs")
    assert refused.value.holder == result.id

    shown = run_cli(redis_server, "show", "--namespace", "billing", key)
    assert shown.returncode == 0 and result.id in shown.stdout, shown.stderr
    assert run_cli(redis_server, "show", key).returncode == 1
    listed = run_cli(redis_server, "ls", "--namespace", "billing", "--json")
    assert listed.returncode == 0 and result.id in listed.stdout
    by_task = run_cli(redis_server, "show", "--task", task.name, "ns")
    assert by_task.returncode == 0 and result.id in by_task.stdout
    clash = run_cli(redis_server, "show", "--namespace", "other", "--task", task.name, "ns")
    assert clash.returncode == 2 and "namespace" in clash.stderr

    events = sf.watch(nsapp.app, key, timeout=20, namespace="billing")
    assert sf.force_release(nsapp.app, key, by="test", namespace="billing") == result.id
    states = [event.kind for event in events]
    assert states[-1] == "end"
    started = time.monotonic()
    with hold(nsapp.app, key, namespace="billing", wait=5) as lease:
        assert lease.fence > st.fence
    assert time.monotonic() - started < 5
    result.revoke(terminate=True)
