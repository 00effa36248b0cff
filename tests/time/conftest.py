"""Fixtures of the time-policy tests: the time app and its real workers."""

from __future__ import annotations

import importlib
import json
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight.testing import RedisServer, WorkerProcess

from ..conftest import worker_env

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def timeapp(redis_server: RedisServer) -> ModuleType:
    os.environ["SF_TEST_REDIS"] = redis_server.url
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    return importlib.import_module("timeapp")


@pytest.fixture
def time_workers(redis_server: RedisServer, timeapp: ModuleType) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real workers of the time app on one fresh queue; all stopped (then killed) after."""
    redis_server.client(2).flushdb()
    redis_server.client(3).flushdb()
    started: list[WorkerProcess] = []
    queue = f"t-{uuid.uuid4().hex[:12]}"

    def start(
        concurrency: int = 2, env: dict[str, str] | None = None, extra: tuple[str, ...] = ()
    ) -> WorkerProcess:
        worker = WorkerProcess("timeapp", concurrency=concurrency, cwd=str(HERE),
                               env=worker_env(redis_server, **(env or {})), extra=("-Q", queue, *extra))
        worker.queue = queue  # type: ignore[attr-defined]
        started.append(worker)
        return worker.start(timeapp.app)

    yield start
    for worker in started:
        worker.discard()


@pytest.fixture(scope="module")
def debounce_queue(redis_server: RedisServer, timeapp: ModuleType) -> Iterator[str]:
    """One worker (2 processes) of the time app for a module whose tests use keys of their own:
    the queue it consumes."""
    redis_server.client(2).flushdb()
    redis_server.client(3).flushdb()
    queue = f"t-{uuid.uuid4().hex[:12]}"
    worker = WorkerProcess("timeapp", concurrency=2, cwd=str(HERE), env=worker_env(redis_server),
                           extra=("-Q", queue))
    worker.start(timeapp.app)
    yield queue
    worker.discard()


def starts(timeapp: ModuleType, key: str, task: str = "paced") -> list[dict[str, Any]]:
    """The runs the recorder saw for ``task`` on ``key``, in start order."""
    return [json.loads(x) for x in timeapp.recorder.lrange(f"starts:{task}:{key}", 0, -1)]
