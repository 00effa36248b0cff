"""Duplicate policies on real workers: truthful terminal outcomes and zero overlap per key."""

from __future__ import annotations

import random
import re
from types import ModuleType

import pytest
from celery.result import AsyncResult

from celery_singleflight import LockHeld, is_skipped
from celery_singleflight.testing import WorkerProcess

from .conftest import stays, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]


def start_holder(sfapp: ModuleType, key: str, seconds: float, queue: str | None = None) -> AsyncResult:
    holder = sfapp.hold_raise.apply_async((key, seconds), queue=queue)
    wait_for(lambda: sfapp.recorder.llen(f"runs:{key}") >= 1, timeout=15)
    return holder


@pytest.mark.core
def test_raise_fails_with_key_holder_and_time_left(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    holder = start_holder(sfapp, "r", 1.5)
    dup = sfapp.hold_raise.delay("r")
    with pytest.raises(LockHeld) as info:
        dup.get(timeout=15)
    assert dup.state == "FAILURE" and dup.ready()
    assert info.value.key == sfapp.hold_raise.render_key("r")
    assert info.value.holder == holder.id
    assert info.value.ttl_left is not None and 0 < info.value.ttl_left <= 30
    holder.get(timeout=15)


@pytest.mark.core
def test_skip_ends_successfully_and_says_why(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    holder = start_holder(sfapp, "s", 1.5)
    dup = sfapp.hold_skip.delay("s")
    outcome = dup.get(timeout=15)
    assert dup.state == "SUCCESS"
    assert is_skipped(outcome)
    assert outcome["holder"] == holder.id and outcome["key"] == "k:s"
    assert sfapp.recorder.llen("runs:s") == 1  # the duplicate did not run
    log = shared_worker.log()
    assert "held by" in log and "skipped" in log
    assert "ERROR" not in log.split(dup.id)[-1].split("\n")[0]
    holder.get(timeout=15)


@pytest.mark.core
def test_retry_runs_after_the_holder_without_spending_max_retries(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    holder = start_holder(sfapp, "t", 1.0)
    dup = sfapp.hold_retry.delay("t", 0.05)
    wait_for(lambda: dup.state == "RETRY", timeout=10)
    assert dup.get(timeout=30)["key"] == "t"
    assert holder.ready()
    runs = sfapp.recorder.lrange("runs:t", 0, -1)
    assert runs == [holder.id.encode(), dup.id.encode()]
    assert sfapp.recorder.llen("overlaps") == 0


def test_retry_waits_as_its_backoff_options_say(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given ``retry_backoff=0.6, retry_backoff_max=0.6, retry_jitter=False``, every wait of the
    duplicate is exactly 0.6 s (the default would start at 0.1 s with jitter and double)."""
    holder = start_holder(sfapp, "tuned", 2.0)
    dup = sfapp.hold_retry_tuned.delay("tuned", 0.05)
    assert dup.get(timeout=30)["key"] == "tuned"
    holder.get(timeout=15)
    waits = re.findall(rf"hold_retry_tuned\[{dup.id}\].*retry in ([0-9.]+)s", shared_worker.log())
    assert len(waits) >= 2 and set(waits) == {"0.60"}, waits
    assert sfapp.recorder.lrange("runs:tuned", 0, -1) == [holder.id.encode(), dup.id.encode()]


@pytest.mark.core
def test_retry_gives_up_after_max_wait_as_raise_would(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    holder = start_holder(sfapp, "u", 3.0)
    dup = sfapp.hold_retry_short.delay("u")
    with pytest.raises(LockHeld):
        dup.get(timeout=15)
    assert sfapp.recorder.llen("runs:u") == 1
    holder.get(timeout=15)


def test_redelivery_of_the_running_task_does_not_run_again(
    sfapp: ModuleType, shared_worker: WorkerProcess
) -> None:
    """Given a running task, when the broker delivers the same task id again (visibility timeout),
    then the second delivery does not run and the first one's result stands."""
    holder = start_holder(sfapp, "again", 1.5)
    sfapp.hold_skip.apply_async(("again",), task_id=holder.id)
    assert holder.get(timeout=15)["key"] == "again"
    # the copy the redelivery kept was dropped at the release, not run (nothing marks that it
    # never will: a copy sent on would run within this window on the idle shared worker)
    stays(lambda: sfapp.recorder.lrange("runs:again", 0, -1) == [holder.id.encode()], 0.3)
    assert "redelivery" in shared_worker.log()


def test_two_workers_200_tasks_each_policy_zero_overlap_all_accounted(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given 2 prefork workers (3 processes each) and 200 tasks over 5 keys with mixed policies,
    then no key ever has two runs at once and every task ends in an explained terminal state."""
    q = "two-workers"
    for _ in range(2):
        start_worker(concurrency=3, queue=q)  # type: ignore[operator]
    rng = random.Random(7)
    tasks = [sfapp.hold_raise, sfapp.hold_skip, sfapp.hold_retry]
    sent: list[tuple[str, AsyncResult]] = []
    for i in range(200):
        task = tasks[i % 3]
        args = (f"m{rng.randrange(5)}", rng.uniform(0.005, 0.05))
        sent.append((task.name, task.apply_async(args, queue=q)))
    ran = skipped = raised = 0
    for name, result in sent:
        try:
            value = result.get(timeout=120)
        except LockHeld:
            assert name.endswith("hold_raise") or name.endswith("hold_retry")
            raised += 1
            continue
        if is_skipped(value):
            assert name.endswith("hold_skip")
            skipped += 1
        else:
            ran += 1
    assert all(result.ready() for _, result in sent)
    assert ran + skipped + raised == 200
    recorded = sfapp.recorder.llen("runs")
    assert recorded == ran, (recorded, ran)
    retry_runs = sum(1 for name, r in sent if name.endswith("hold_retry") and r.successful())
    assert retry_runs == len([1 for name, _ in sent if name.endswith("hold_retry")])
    assert sfapp.recorder.llen("overlaps") == 0
    for k in range(5):
        assert sfapp.hold_raise.store.holder_record(f'k:"m{k}"') == {}


@pytest.mark.parametrize("pool", ["threads", "solo"])
def test_threads_and_solo_pools(sfapp: ModuleType, start_worker: object, pool: str) -> None:
    """Given a threads (4 threads in one process) or solo worker, duplicates get their policy,
    nothing overlaps and every key is free at the end."""
    q = start_worker(concurrency=4 if pool == "threads" else 1, pool=pool).queue  # type: ignore[operator]
    if pool == "solo":
        # one run at a time: duplicates are only seen through a second worker, so the solo
        # worker here checks that acquire and release work on the worker's own thread
        assert sfapp.hold_raise.apply_async(("solo", 0.01), queue=q).get(timeout=15)["key"] == "solo"
        assert sfapp.retry_once.apply_async(("solo-retry",), queue=q).get(timeout=15) == 1
        assert sfapp.hold_raise.store.holder_record("k:solo") == {}
        return
    holder = start_holder(sfapp, "th", 1.0, queue=q)
    raised = sfapp.hold_raise.apply_async(("th",), queue=q)
    skipped = sfapp.hold_skip.apply_async(("th",), queue=q)
    retried = sfapp.hold_retry.apply_async(("th", 0.01), queue=q)
    with pytest.raises(LockHeld):
        raised.get(timeout=15)
    assert is_skipped(skipped.get(timeout=15))
    assert retried.get(timeout=30)["key"] == "th"
    holder.get(timeout=15)
    assert sfapp.recorder.llen("overlaps") == 0
    assert sfapp.hold_raise.store.holder_record("k:th") == {}
