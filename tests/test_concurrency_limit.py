"""max_concurrency=N on real workers: at most N runs per key, and a dead holder's slot returns."""

from __future__ import annotations

import time
from types import ModuleType

import pytest

from celery_singleflight import ConfigurationError
from celery_singleflight.config.options import resolve_options
from celery_singleflight.testing import WorkerProcess

from .conftest import HOLD, gates_opened_after, let_go, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

_gates_opened = gates_opened_after("slot", "self")


def test_limit_three_with_thirty_tasks(sfapp: ModuleType, start_worker: object) -> None:
    """Given max_concurrency=3 and 30 tasks for one key on 5 worker processes, never more than 3
    run at once (independent recorder), 3 do run together, and all 30 run."""
    q = start_worker(concurrency=5).queue  # type: ignore[operator]
    results = [sfapp.limited.apply_async(("thirty", 0.3), queue=q) for _ in range(30)]
    slots = [r.get(timeout=60) for r in results]
    assert sfapp.recorder.llen("runs:thirty") == 30
    assert sfapp.recorder.llen("overlaps") == 0
    concurrent = [int(x) for x in sfapp.recorder.lrange("concurrent:thirty", 0, -1)]
    assert max(concurrent) == 3
    assert set(slots) == {0, 1, 2}


def test_a_dead_holders_slot_returns_within_one_ttl_while_the_other_stays_busy(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given max_concurrency=2 with a 3 s TTL, one holder on a worker that is SIGKILLed (nobody
    releases) and one long holder elsewhere that keeps renewing, a waiting run gets the dead
    holder's slot once its lease expires, without waiting for the busy one."""
    env = {"SF_TEST_TTL": "3"}
    doomed: WorkerProcess = start_worker(concurrency=1, env=env)  # type: ignore[operator]
    busy_q = start_worker(concurrency=2, env=env).queue  # type: ignore[operator]
    sfapp.limited_two.apply_async(("slot", HOLD), queue=doomed.queue)  # type: ignore[attr-defined]
    busy = sfapp.limited_two.apply_async(("slot", HOLD), queue=busy_q)  # until the test let it go
    wait_for(lambda: sfapp.recorder.llen("runs:slot") == 2, timeout=20)
    doomed.kill()
    killed_at = time.monotonic()
    waiting = sfapp.limited_two.apply_async(("slot", 0.1), queue=busy_q)
    waiting.get(timeout=30)
    took = time.monotonic() - killed_at
    assert took < 3 + 3, took  # the lease TTL plus the retry policy's backoff
    assert not busy.ready()  # the other slot was still busy all along
    let_go(sfapp, "slot")
    assert busy.get(timeout=30) in (0, 1)


def test_a_redelivered_task_does_not_take_a_second_slot_of_its_own_key(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given max_concurrency=2 and a running task, when the broker delivers the same task id again
    (sent here by hand, as in test_policies), then the second delivery does not run on the free
    slot: one body run, and the first delivery's result stands."""
    worker = start_worker(concurrency=3)  # type: ignore[operator]
    first = sfapp.limited_two.apply_async(("self", HOLD), queue=worker.queue)  # until the test let it go
    wait_for(lambda: sfapp.recorder.llen("runs:self") == 1, timeout=20)
    sfapp.limited_two.apply_async(("self", HOLD), queue=worker.queue, task_id=first.id)
    turned_away = f"[{first.id}] key='lim:self'"
    # the second delivery came while the first ran, and was turned away (its copy parked)
    wait_for(lambda: any(turned_away in line and "redelivery of a running task, not run again" in line
                         for line in worker.log().splitlines()), timeout=20)
    let_go(sfapp, "self")
    assert first.get(timeout=30) == 0
    key = sfapp.limited_two.render_key("self")

    def settled() -> bool:
        """The first delivery released: no slot held, nothing parked. Had its release handed the
        parked copy on instead of dropping it, the copy would hold a slot until it had run (and
        recorded its run)."""
        st = sfapp.limited_two.status("self")
        return (st is None or not st.held) and sfapp.limited_two.store.handoff.queued(key) == 0

    wait_for(settled, timeout=10)
    assert sfapp.recorder.lrange("runs:self", 0, -1) == [first.id.encode()]
    assert sfapp.recorder.llen("overlaps") == 0
    assert sfapp.limited_two.store.handoff.queued(key) == 0


def test_bad_limits_are_refused() -> None:
    class Task:
        name = "t"
        max_concurrency = 0

    with pytest.raises(ConfigurationError, match="max_concurrency"):
        resolve_options(Task, {"broker_url": "redis://h/0"})

    class Joins:
        name = "t"
        max_concurrency = 2
        on_duplicate = "join"

    with pytest.raises(ConfigurationError, match="needs max_concurrency=1"):
        resolve_options(Joins, {"broker_url": "redis://h/0"})

    class Queued:
        name = "t"
        max_queued = -1

    with pytest.raises(ConfigurationError, match="max_queued"):
        resolve_options(Queued, {"broker_url": "redis://h/0"})


def test_an_idempotency_template_naming_a_missing_parameter_fails_at_definition() -> None:
    from celery import Celery

    from celery_singleflight import KeyTemplateError, SingleFlightTask

    app = Celery("idem", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(bind=True, base=SingleFlightTask, lock_key="c:<tenant>",
              idempotency_key="msg:<tenant>:<message_idd>", shared=False)
    def handle(self: object, tenant: str, message_id: str) -> None:
        return None

    with pytest.raises(KeyTemplateError, match="message_idd"):
        app.finalize()
        handle.name  # noqa: B018 - evaluating the task creates its class
