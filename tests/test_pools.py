"""Which worker pools a guarded task runs on (docs/pools.md), each on a real ``celery worker``.

prefork, threads and solo: the lease is taken by the pool's own process, duplicates get their
policy, the heartbeat renews a lease over three TTLs, and the key is free the moment the run
ends. gevent and eventlet: the worker refuses to start, says why and what to use instead, and
consumes nothing. (The rest of the suite runs on prefork: release paths, policies, heartbeat.)
"""

from __future__ import annotations

import importlib.util
import re
import time
import uuid
from types import ModuleType
from typing import Any

import pytest
from celery.concurrency import get_implementation

import celery_singleflight as sf
from celery_singleflight import LockHeld, is_skipped
from celery_singleflight.errors import ConfigurationError
from celery_singleflight.testing import RedisServer, WorkerProcess
from celery_singleflight.worker.pools import check_pool, pool_name

from .conftest import TESTS, stays, wait_for, worker_env

pytestmark = [pytest.mark.worker, pytest.mark.core]

RUN_SECONDS = 4.5  # three TTLs of heartbeat_check (lock_ttl=1.5): only renewals keep it held


@pytest.mark.parametrize("pool", ["prefork", "threads", "solo"])
def test_a_guarded_run_on_each_supported_pool(
    sfapp: ModuleType, start_worker: Any, pool: str
) -> None:
    """Given a worker with ``-P pool``, when a run holds its key for three TTLs while duplicates
    arrive, then its lease is taken in the pool's process, renewed throughout, the duplicates
    get their policy (raise, skip), and the key is free as soon as the run ends."""
    # solo runs one task at a time, so its duplicates reach a second solo worker on the queue
    workers = [start_worker(concurrency=3, pool=pool)]
    if pool == "solo":
        workers.append(start_worker(concurrency=1, pool=pool, queue=workers[0].queue))
    queue = workers[0].queue
    name = f"pool-{pool}-{uuid.uuid4().hex[:6]}"
    task = sfapp.heartbeat_check
    key = task.render_key(name)

    result = task.apply_async((name, RUN_SECONDS), queue=queue)
    holder = wait_for(lambda: task.store.holder_record(key) or None, timeout=20)
    taken = time.monotonic()
    mains = {worker.proc.pid for worker in workers}
    if pool == "prefork":  # a pool child holds it; threads and solo run in the worker itself
        assert int(holder.pid) not in mains
    else:
        assert int(holder.pid) in mains

    raised = sfapp.hold_raise.apply_async((name,), queue=queue)
    skipped = sfapp.hold_skip.apply_async((name,), queue=queue)
    with pytest.raises(LockHeld, match=re.escape(key)):
        raised.get(timeout=15)
    assert is_skipped(skipped.get(timeout=15))

    # the run's first TTL ends 1.5 s after it took the key: only renewals keep it held after that;
    # watched until shortly before the run ends, its lease never expires nor changes hands
    stays(lambda: task.store.holder_record(key).fence == holder.fence,
          RUN_SECONDS - 0.5 - (time.monotonic() - taken), interval=0.05)
    assert result.get(timeout=15) == {"lost": False, "fence": int(holder.fence)}

    assert task.store.holder_record(key) == {}  # released by the run, not expired (30 s TTL)
    st = sf.status(sfapp.app, key)
    assert st is not None and st.outcome == "succeeded" and not st.held


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_a_green_pool_is_refused_at_worker_start(
    sfapp: ModuleType, redis_server: RedisServer, pool: str
) -> None:
    """Given ``celery worker -P gevent`` (or eventlet), the worker stops at start with one
    sentence naming the pool and the pools to use instead, and takes no message off its queue."""
    if importlib.util.find_spec(pool) is None:  # not imported here: eventlet warns on import
        pytest.skip(f"{pool} is not installed")
    queue = f"q-{uuid.uuid4().hex[:12]}"
    sfapp.hold_raise.apply_async(("green",), queue=queue)
    worker = WorkerProcess("sfapp", pool=pool, concurrency=2, cwd=str(TESTS),
                           env=worker_env(redis_server), extra=("-Q", queue))
    try:
        with pytest.raises(RuntimeError, match="exited"):
            worker.start(timeout=60)
        log = worker.log()
    finally:
        worker.stop(timeout=15)
        worker.kill()
        worker.cleanup()
    assert f"the {pool} worker pool is not supported" in log
    assert "-P prefork (the default), -P threads or -P solo" in log
    assert " ready." not in log
    assert redis_server.client(0).llen(queue) == 1  # still waiting for a worker that can guard it


def test_the_pool_check_names_the_pool_and_passes_the_supported_ones() -> None:
    for name in ("prefork", "threads", "solo"):
        check_pool(get_implementation(name))
        assert pool_name(get_implementation(name)) == name
    for name in ("gevent", "eventlet"):
        green = type("TaskPool", (), {"is_green": True, "__module__": f"celery.concurrency.{name}"})
        with pytest.raises(ConfigurationError, match=f"the {name} worker pool is not supported"):
            check_pool(green)
    custom = type("GreenPool", (), {"is_green": True, "__module__": "myproject.pools"})
    with pytest.raises(ConfigurationError, match=re.escape("myproject.pools:GreenPool worker pool")):
        check_pool(custom)
