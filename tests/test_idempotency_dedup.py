"""Idempotency window and enqueue-time dedup, against real Redis and a real worker."""

from __future__ import annotations

import multiprocessing
import threading
import time
from types import ModuleType

import pytest
from kombu.exceptions import EncodeError

from celery_singleflight.testing import RedisServer

from .conftest import wait_for

pytestmark = pytest.mark.worker


def test_same_message_five_times_runs_once_with_five_identical_results(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a message delivered 5 times (the first still running when the second arrives, the
    rest spread over ~2 s), it runs once and all 5 deliveries return the same result."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    results = []
    for _ in range(5):
        results.append(sfapp.handle_message.apply_async(("acme", "m-1", 0.5), queue=q))
        time.sleep(0.5)
    values = [r.get(timeout=30) for r in results]
    assert values == [values[0]] * 5
    assert values[0]["reply"] == "handled m-1" and values[0]["ran"] == results[0].id
    assert sfapp.recorder.llen("runs:acme:m-1") == 1
    other = sfapp.handle_message.apply_async(("acme", "m-2", 0.01), queue=q).get(timeout=15)
    assert other["reply"] == "handled m-2"  # another message id is another run


def test_after_the_window_the_message_runs_again(sfapp: ModuleType, start_worker: object) -> None:
    q = start_worker(concurrency=1).queue  # type: ignore[operator]
    first = sfapp.handle_short_window.apply_async(("t", "w"), queue=q).get(timeout=15)
    again = sfapp.handle_short_window.apply_async(("t", "w"), queue=q).get(timeout=15)
    assert again == first
    time.sleep(1.2)
    later = sfapp.handle_short_window.apply_async(("t", "w"), queue=q).get(timeout=15)
    assert later != first and sfapp.recorder.llen("runs:t:w") == 2


def _send_many(url: str, queue: str, account: str, threads: int, per_thread: int) -> None:
    """In a fresh process: `threads` threads each call delay() `per_thread` times."""
    import os
    import sys

    os.environ["SF_TEST_REDIS"] = url
    sys.path.insert(0, os.path.dirname(__file__))
    import sfapp as fresh

    def run() -> None:
        for _ in range(per_thread):
            fresh.recorder.rpush("dedup-ids", fresh.deduped.apply_async((account,), queue=queue).id)

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


def test_100_concurrent_sends_queue_one_message_and_share_its_id(
    sfapp: ModuleType, redis_server: RedisServer, start_worker: object
) -> None:
    """Given 100 delay() calls for one key from 4 processes x 5 threads while nothing consumes
    the queue, exactly one message is queued and every caller holds its task id; once that run
    ends, the next delay() sends a new message."""
    queue = "dedup-nobody-listens"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_send_many, args=(redis_server.url, queue, "a1", 5, 5)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    ids = {x.decode() for x in sfapp.recorder.lrange("dedup-ids", 0, -1)}
    assert sfapp.recorder.llen("dedup-ids") == 100
    assert len(ids) == 1
    assert redis_server.client(0).llen(queue) == 1  # the broker queue holds one message
    start_worker(concurrency=1, queue=queue)  # type: ignore[operator]
    (only,) = ids
    assert sfapp.deduped.AsyncResult(only).get(timeout=15) == only
    wait_for(lambda: not redis_server.client(2).exists(
        sfapp.deduped.store.layout.enqueued(sfapp.deduped.render_key("a1"))), timeout=5)
    nxt = sfapp.deduped.apply_async(("a1", 0.01), queue=queue)
    assert nxt.id != only and nxt.get(timeout=15) == nxt.id


def test_a_failed_publish_leaves_no_marker(sfapp: ModuleType, redis_server: RedisServer) -> None:
    marker = sfapp.deduped.store.layout.enqueued(sfapp.deduped.render_key("fails"))
    with pytest.raises(EncodeError):
        sfapp.deduped.apply_async(("fails", object()), queue="dedup-never")  # not JSON-serializable
    assert not redis_server.client(2).exists(marker)


@pytest.mark.core
def test_a_duplicate_send_while_running_returns_the_running_task(
    sfapp: ModuleType, start_worker: object
) -> None:
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    first = sfapp.deduped.apply_async(("run", 1.0), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:run") == 1, timeout=15)
    second = sfapp.deduped.apply_async(("run", 1.0), queue=q)
    assert second.id == first.id
    assert first.get(timeout=15) == first.id
    assert sfapp.recorder.llen("runs:run") == 1
