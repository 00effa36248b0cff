"""A task with its own ``lock_namespace`` is seen and excluded by every key tool given that
namespace: ``hold()``, ``status()``, ``status_all()``, ``held()``, ``watch()``,
``force_release()`` and the CLI's ``--namespace``; the task's own helpers use it by themselves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight import LockHeld, hold

from .conftest import ROOT, TESTS, running_app, wait_for

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def nsapp() -> Iterator[ModuleType]:
    """tests/nsapp.py on a private Redis of its own, with its worker."""
    with running_app("nsapp", "SF_TEST_REDIS", concurrency=2) as module:
        yield module


def run_cli(nsapp: ModuleType, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "nsapp", "singleflight", *args], cwd=TESTS,
        env={**os.environ, "SF_TEST_REDIS": nsapp.BASE,
             "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])},
        capture_output=True, text=True, timeout=60,
    )


def test_every_key_tool_takes_the_tasks_namespace(nsapp: ModuleType) -> None:
    task = nsapp.billing_sleeper
    result = task.delay("ns", 600)  # held until the test revokes it, however slow the CLI's starts
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

    shown = run_cli(nsapp, "show", "--namespace", "billing", key)
    assert shown.returncode == 0 and result.id in shown.stdout, shown.stderr
    assert run_cli(nsapp, "show", key).returncode == 1
    listed = run_cli(nsapp, "ls", "--namespace", "billing", "--json")
    assert listed.returncode == 0 and result.id in listed.stdout
    by_task = run_cli(nsapp, "show", "--task", task.name, "ns")
    assert by_task.returncode == 0 and result.id in by_task.stdout
    clash = run_cli(nsapp, "show", "--namespace", "other", "--task", task.name, "ns")
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
