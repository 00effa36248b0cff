"""Scenario 5: the broker delivers a running task a second time.

Redis broker, ``task_acks_late=True``, visibility timeout 2 s (kombu sweeps unacknowledged
messages every second), a task that runs until the scenario saw it delivered again: kombu puts the
message back on the queue while the first delivery still runs, and a free pool process of the
same worker receives it. tests/test_policies.py fakes this by sending the same task id by hand;
here the broker does it.

- the second delivery does not run its body while the first one runs (recorder), nor afterwards;
- the worker log says it was a redelivery; the first delivery's result stands.
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.testing import RedisServer

from .conftest import Workers, broker_empty, deliveries, overlaps, round3, runs, wait_for

pytestmark = pytest.mark.worker

def nothing_left(chaos: ModuleType, broker: RedisServer, queue: str, key: str) -> bool:
    """Nothing is left that could run again later: no message of ``queue`` in the broker, and no
    copy of a run of ``key`` kept by the library."""
    store = chaos.long_run.store
    return (broker_empty(broker, queue) and store.handoff.queued(key) == 0
            and not store.client.exists(store.layout.parked(key)))


@pytest.mark.timeout(90)
def test_broker_redelivers_a_running_task(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], broker_redis: RedisServer
) -> None:
    env = {"CHAOS_ACKS_LATE": "1", "CHAOS_VISIBILITY": "2", "CHAOS_TTL": "3"}
    worker = workers.one(queue, concurrency=2, env=env)
    key, go = "again", "go:again"
    # it runs until the broker delivered it again and the worker turned that delivery away
    result = chaos.long_run.apply_async((key, 60.0), {"until": go}, queue=queue)
    rendered = chaos.long_run.render_key(key)
    # turned away, with a copy parked in case the first delivery's worker dies
    wait_for(lambda: len(deliveries(chaos, result.id)) >= 2 and "redelivery" in worker.log()
             and chaos.long_run.store.handoff.queued(rendered) == 1, timeout=30)
    chaos.recorder.set(go, 1)
    out = result.get(timeout=40)
    # no copy is left anywhere to run late: none in the broker (queued or unacknowledged) and none
    # kept by the library (the redelivery's parked copy, dropped by the first delivery's release)
    wait_for(lambda: nothing_left(chaos, broker_redis, queue, rendered), timeout=10)
    seen = deliveries(chaos, result.id)
    body = runs(chaos, key)
    log = worker.log()
    figures.update({
        "visibility_timeout_s": 2.0,
        "task_seconds": round3(body[0]["end"] - body[0]["start"]) if body and body[0]["end"] else None,
        "deliveries": len(seen),
        "redelivered_after_s": [round3(t - seen[0]) for t in seen[1:]],
        "body_runs": len(body),
        "redelivery_log_lines": log.count("redelivery"),
        "overlaps": len(overlaps(chaos)),
        "state": result.state,
    })
    assert len(seen) >= 2, "the broker did not redeliver the running task: the scenario proved nothing"
    assert len(body) == 1 and body[0]["task_id"] == result.id
    assert seen[1] < body[0]["end"], "the redelivery came after the first run ended"
    assert out == {"task_id": result.id, "pid": out["pid"]} and result.state == "SUCCESS"
    assert "redelivery" in log
    assert overlaps(chaos) == []
    # the copy the redelivery kept in case the first delivery's worker died was dropped by its release
    assert chaos.long_run.store.handoff.queued(rendered) == 0
    assert not chaos.long_run.store.client.exists(chaos.long_run.store.layout.parked(rendered))
    wait_for(lambda: sf.held(chaos.app) == [], timeout=5)


@pytest.mark.timeout(90)
def test_task_whose_redelivery_was_turned_away_still_survives_its_worker_dying(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], broker_redis: RedisServer
) -> None:
    """Given a running task whose redelivery was turned away, when the worker running it is
    SIGKILLed, then (acks_late) the task is delivered again and runs, as in test_worker_kill's
    acks-late case, where no redelivery came first.

    With the Redis broker both deliveries share one delivery tag: acknowledging the turned-away
    one removes the message from kombu's unacked set while the first still runs. What is left is
    the copy the redelivery parked behind its own run, sent by the survivor's queue sweeper once
    the dead run's lease ends."""
    env = {"CHAOS_ACKS_LATE": "1", "CHAOS_VISIBILITY": "2", "CHAOS_TTL": "3"}
    first, second = workers.start(workers.make(queue, env=env), workers.make(queue, env=env))
    key, go = "orphan", "go:orphan"
    rendered = chaos.long_run.render_key(key)
    # it runs until its worker is killed; its run again ends as soon as it started
    result = chaos.long_run.apply_async((key, 60.0), {"until": go}, queue=queue)
    wait_for(lambda: len(deliveries(chaos, result.id)) >= 2, timeout=20)  # turned away
    wait_for(lambda: "redelivery" in first.log() + second.log(), timeout=5)
    pid = int(runs(chaos, key)[0]["pid"])
    victim = first if pid in first.children() else second
    # the redelivery parked a copy of the run behind it (what is left to send once its worker dies)
    wait_for(lambda: chaos.long_run.store.handoff.queued(rendered) == 1, timeout=10)
    killed_at = time.time()
    victim.kill()
    chaos.recorder.set(go, 1)
    # the survivor sweeps every second for messages unacknowledged for longer than 2 s
    try:
        ran_again = wait_for(lambda: len(runs(chaos, key)) >= 2, timeout=12, interval=0.1)
    except AssertionError:
        ran_again = False
    figures.update({
        "deliveries_before_kill": len(deliveries(chaos, result.id)),
        "body_runs": len(runs(chaos, key)),
        "ran_again_within_12s_of_kill": bool(ran_again),
        "state_12s_after_kill": result.state,
        "unacked_left_in_broker": broker_redis.client(0).hlen("unacked"),
        "checked_for_s_after_kill": round3(time.time() - killed_at),
    })
    assert ran_again, "the task was lost with its worker: no copy of the message was left to deliver"
    assert result.get(timeout=45)["task_id"] == result.id
    body = runs(chaos, key)
    figures.update({
        "rerun_started_after_kill_s": round3(body[1]["start"] - killed_at),
        "state_at_end": result.state,
        "body_runs_at_end": len(body),
    })
    assert [r["task_id"] for r in body] == [result.id, result.id]
    assert overlaps(chaos) == []
    assert chaos.long_run.store.handoff.queued(rendered) == 0
    wait_for(lambda: sf.held(chaos.app) == [], timeout=5)
