"""``celery_singleflight.compat.QueueOnce``: celery-once's tasks (tests/onceapp.py, its README's
examples with only the import changed) on a real worker, and what its ``once`` options map to."""

from __future__ import annotations

import importlib
import os
import pickle
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from celery import Celery

from celery_singleflight import ConfigurationError, KeyTemplateError, LockHeld, is_skipped
from celery_singleflight.compat import AlreadyQueued, QueueOnce
from celery_singleflight.testing import RedisServer, WorkerProcess

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def onceapp() -> Iterator[ModuleType]:
    old = os.environ.get("SF_ONCE_REDIS")
    with RedisServer() as redis_server:
        os.environ["SF_ONCE_REDIS"] = redis_server.url
        sys.modules.pop("onceapp", None)
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        module = importlib.import_module("onceapp")
        worker = WorkerProcess(
            "onceapp", concurrency=4, cwd=str(TESTS), loglevel="WARNING",
            env={"SF_ONCE_REDIS": redis_server.url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])},
        )
        try:
            worker.start(module.app)
            yield module
        finally:
            worker.stop(timeout=15)
            worker.kill()
            worker.cleanup()
            sys.modules.pop("onceapp", None)
            if old is None:
                os.environ.pop("SF_ONCE_REDIS", None)
            else:
                os.environ["SF_ONCE_REDIS"] = old


def _wait_running(task: object, *args: object) -> None:
    from celery_singleflight import status

    key = task.render_key(*args)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = status(task.app, key)  # type: ignore[attr-defined]
        if st is not None and st.held:
            return
        time.sleep(0.02)
    raise AssertionError(f"{key} was not taken")


# -- the once options, mapped when the task is defined ----------------------------------------------


@pytest.fixture
def app() -> Celery:
    return Celery("compat", broker="redis://127.0.0.1:1/0", set_as_current=False)


def test_keys_become_a_template_over_those_parameters(app: Celery) -> None:
    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def slow_add(a, b):
        return a + b

    @app.task(base=QueueOnce, once={"keys": []})
    def any_args(a, b):
        return a + b

    @app.task(base=QueueOnce)
    def every_arg(a, b=2):
        return a + b

    assert slow_add.lock_key == "<@task>:<a>"
    assert slow_add.render_key(1, 2) == slow_add.render_key(a=1, b=5) == f"{slow_add.name}:1"
    assert any_args.render_key(1, 2) == any_args.render_key(3, 4) == any_args.name
    assert every_arg.render_key(1) == every_arg.render_key(a=1, b=2) == f"{every_arg.name}:1:2"
    assert every_arg.render_key(1, 3) != every_arg.render_key(1)


def test_graceful_and_timeout_map_to_skip_and_the_marker_ttl(app: Celery) -> None:
    @app.task(base=QueueOnce, once={"graceful": True, "timeout": 600})
    def gentle(x):
        return x

    @app.task(base=QueueOnce)
    def strict(x):
        return x

    assert (gentle.options.on_duplicate, gentle.options.dedup_ttl, gentle.options.dedup_enqueue) == (
        "skip", 600.0, True)
    assert (strict.options.on_duplicate, strict.options.dedup_ttl) == ("raise", 3600.0)
    assert strict.options.ttl == 30.0  # the lease is renewed while it runs; the timeout is not its TTL


def test_unknown_or_unsupported_once_options_fail_at_definition() -> None:
    with pytest.raises(ConfigurationError, match="'unlock_before_run': True"):
        class Early(QueueOnce):
            once = {"unlock_before_run": True}

            def run(self, x):
                return x

    with pytest.raises(ConfigurationError, match=r"'grace'.*QueueOnce knows keys, graceful"):
        class Typo(QueueOnce):
            once = {"grace": True}

            def run(self, x):
                return x

    with pytest.raises(KeyTemplateError, match="names <c>"):
        class Missing(QueueOnce):
            once = {"keys": ["c"]}

            def run(self, a, b):
                return a + b


def test_already_queued_is_a_lock_held_that_pickles() -> None:
    exc = AlreadyQueued("k:1", "abc", 12.5)

    again = pickle.loads(pickle.dumps(exc))

    assert isinstance(again, LockHeld)
    assert (again.key, again.holder, again.countdown) == ("k:1", "abc", 12.5)


# -- on a real worker ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_a_queued_duplicate_raises_already_queued_and_the_key_frees_after(onceapp: ModuleType) -> None:
    first = onceapp.slow_add.delay(1, 1)
    with pytest.raises(AlreadyQueued) as queued:
        onceapp.slow_add.delay(1, 2)  # same a: refused in the caller, nothing is sent
    other = onceapp.slow_add.delay(2, 2)  # another a: sent

    assert queued.value.holder == first.id
    assert queued.value.countdown is None or 0 < queued.value.countdown <= 30
    assert first.get(timeout=20) == 2 and other.get(timeout=20) == 4
    assert onceapp.slow_add.delay(1, 5).get(timeout=20) == 6  # the key is free once the run ended


@pytest.mark.worker
def test_a_running_duplicate_reports_the_lease_time_left(onceapp: ModuleType) -> None:
    first = onceapp.slow_any.delay(1, 1)
    _wait_running(onceapp.slow_any, 1, 1)

    with pytest.raises(AlreadyQueued) as running:
        onceapp.slow_any.delay(5, 5)  # keys=[]: one run of the task at a time, whatever the arguments

    assert running.value.holder == first.id
    assert running.value.countdown is not None and 0 < running.value.countdown <= 30
    assert first.get(timeout=20) == 2


@pytest.mark.worker
def test_graceful_returns_the_queued_task_instead_of_raising(onceapp: ModuleType) -> None:
    first = onceapp.graceful_task.delay(1)
    again = onceapp.graceful_task.delay(1)
    per_call = onceapp.slow_task.apply_async()
    per_call_again = onceapp.slow_task.apply_async(once={"graceful": True})  # as celery-once allows

    assert again.id == first.id
    assert per_call_again.id == per_call.id
    assert first.get(timeout=20) == "graceful done" and per_call.get(timeout=20) == "Done!"


@pytest.mark.worker
def test_a_send_by_name_is_guarded_when_it_runs(onceapp: ModuleType) -> None:
    first = onceapp.slow_task.delay()
    _wait_running(onceapp.slow_task)
    by_name = onceapp.app.send_task(onceapp.slow_task.name)  # bypasses apply_async, like beat
    gentle = onceapp.graceful_task.delay(1)
    _wait_running(onceapp.graceful_task, 1)
    gentle_by_name = onceapp.app.send_task(onceapp.graceful_task.name, args=(1,))

    with pytest.raises(LockHeld):
        by_name.get(timeout=20)  # graceful=False: raise
    assert is_skipped(gentle_by_name.get(timeout=20))  # graceful=True: skip
    assert first.get(timeout=20) == "Done!" and gentle.get(timeout=20) == "graceful done"


@pytest.mark.worker
def test_self_retry_is_not_its_own_duplicate(onceapp: ModuleType) -> None:
    assert onceapp.flaky.delay(3).get(timeout=20) == 2


@pytest.mark.worker
def test_long_timeout_task_runs(onceapp: ModuleType) -> None:
    assert onceapp.long_running_task.delay().get(timeout=20) == "long done"
    assert onceapp.long_running_task.options.dedup_ttl == 36000.0
