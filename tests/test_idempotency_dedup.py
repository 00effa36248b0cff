"""Idempotency window and enqueue-time dedup, against real Redis and a real worker."""

from __future__ import annotations

import multiprocessing
import threading
from types import ModuleType
from typing import Any

import pytest
from kombu.exceptions import EncodeError

from celery_singleflight.testing import RedisServer

from .conftest import HOLD, gates_opened_after, let_go, met, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

_gates_opened = gates_opened_after("acme:m-1", "run")


def test_same_message_five_times_runs_once_with_five_identical_results(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a message delivered 5 times (the first still running when the second arrives, the
    rest one after another once it ended), it runs once and all 5 deliveries return the same
    result."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]

    def deliver() -> Any:
        return sfapp.handle_message.apply_async(("acme", "m-1", HOLD), queue=q)

    def parked_behind_it() -> bool:
        return results[1].state == "QUEUED" and met(sfapp.handle_message, 1, "acme", "m-1")

    results = [deliver()]
    wait_for(lambda: sfapp.recorder.llen("runs:acme:m-1") == 1, timeout=15)  # the first runs (held)
    results.append(deliver())  # taken by the other pool process while the first still runs
    wait_for(parked_behind_it, timeout=15)
    let_go(sfapp, "acme:m-1")
    results[0].get(timeout=30)
    for _ in range(3):  # within the window, after the first ended
        results.append(deliver())
        results[-1].get(timeout=30)
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
    marks = sfapp.handle_short_window.store.marks
    wait_for(lambda: marks.remembered("short:t:w") is None, timeout=10)  # its 1 s window closed
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
    first = sfapp.deduped.apply_async(("run", HOLD), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:run") == 1, timeout=15)
    second = sfapp.deduped.apply_async(("run", HOLD), queue=q)
    assert second.id == first.id
    let_go(sfapp, "run")  # the send met the running task
    assert first.get(timeout=15) == first.id
    assert sfapp.recorder.llen("runs:run") == 1


def _marked(task: object, *args: object) -> str | None:
    """The task id the enqueue marker of this call's key holds, if any."""
    holder, _ = task.store.marks.enqueued(task.render_key(*args))  # type: ignore[attr-defined]
    return holder


@pytest.mark.core
def test_a_run_that_expires_or_is_revoked_while_queued_frees_its_marker(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a deduplicated task that expires in the queue, and one revoked there, neither runs,
    and the next send of each key goes out (their markers do not wait for ``dedup_ttl``)."""
    q = start_worker(concurrency=1).queue  # type: ignore[operator]
    expiring = sfapp.deduped.apply_async(("expires", 0.01), countdown=3, expires=1, queue=q)
    revoked = sfapp.deduped.apply_async(("revoked", 0.01), countdown=2, queue=q)
    revoked.revoke()

    wait_for(lambda: _marked(sfapp.deduped, "expires") is None and _marked(sfapp.deduped, "revoked") is None,
             timeout=15)
    later = sfapp.deduped.apply_async(("expires", 0.01), queue=q)
    later_revoked = sfapp.deduped.apply_async(("revoked", 0.01), queue=q)

    assert later.id != expiring.id and later.get(timeout=15) == later.id
    assert later_revoked.id != revoked.id and later_revoked.get(timeout=15) == later_revoked.id
    assert expiring.state == revoked.state == "REVOKED"


@pytest.mark.core
def test_a_run_waiting_to_retry_keeps_its_marker(sfapp: ModuleType, start_worker: object) -> None:
    """Given a deduplicated run that called ``self.retry(countdown=2)``, a send during the
    countdown returns it instead of sending a second run; once its retry ran, the key is free."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    first = sfapp.mx_holder.apply_async(("dedup-retry", "retry", 0.1), queue=q)
    wait_for(lambda: first.state == "RETRY", timeout=15)

    during = sfapp.mx_holder.apply_async(("dedup-retry", "retry", 0.1), queue=q)

    assert during.id == first.id
    assert first.get(timeout=15) == {"ran": first.id, "mode": "retry"}
    assert sfapp.recorder.lrange("runs:dedup-retry", 0, -1) == [f"holder:{first.id}".encode()] * 2
    wait_for(lambda: _marked(sfapp.mx_holder, "dedup-retry") is None, timeout=5)
    after = sfapp.mx_holder.apply_async(("dedup-retry", "succeed", 0.01), queue=q)
    assert after.id != first.id and after.get(timeout=15)["ran"] == after.id
