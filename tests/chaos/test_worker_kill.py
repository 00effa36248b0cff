"""Scenario 1: the holder's whole worker is SIGKILLed mid-run (nothing survives to release).

tests/test_release_paths.py and tests/test_queue.py already check that such a key frees by expiry
and that parked runs resume on a new worker. Here, with a standby worker already consuming the same
queue, we measure the takeover (kill -> the next run starts) and check what happens to the killed
run itself, with and without ``task_acks_late``:

- the key is not taken while the dead holder's lease still had time (no early takeover);
- the key frees within the TTL (3 s) and the parked ``queue`` runs all run, in order;
- with ``acks_late`` (Redis broker, visibility timeout 5 s) the killed task is delivered again and
  runs exactly once more, after the key freed, never at the same time as another run;
- without it, Celery acknowledged the message when the run started: the killed run is not run
  again (at-most-once); the sweeper that hands its key on sets its result to FAILURE (RunLost).
"""

from __future__ import annotations

import time
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.testing import RedisServer

from .conftest import (
    Workers,
    broker_empty,
    holder_of,
    interval_overlaps,
    lease_pttl,
    overlaps,
    renewed,
    round3,
    runs,
    wait_for,
)

pytestmark = pytest.mark.worker
TTL = 3.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("acks_late", [False, True], ids=["acks-early", "acks-late"])
def test_whole_worker_killed_mid_run(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], acks_late: bool,
    broker_redis: RedisServer,
) -> None:
    env = {"CHAOS_TTL": str(TTL)}
    if acks_late:
        env.update(CHAOS_ACKS_LATE="1", CHAOS_VISIBILITY="5")
    first, second = workers.start(workers.make(queue, env=env), workers.make(queue, env=env))
    key = "host"
    rendered = chaos.queued.render_key(key, 0)
    holder = chaos.queued.apply_async((key, 0), {"seconds": 0.05, "first_seconds": 60.0}, queue=queue)
    wait_for(lambda: runs(chaos, key), timeout=20)
    where = chaos.recorder.hget(f"holder:{key}", "hostname").decode()
    victim = first if first.hostname == where else second
    parked = [chaos.queued.apply_async((key, n), {"seconds": 0.2}, queue=queue) for n in (1, 2, 3)]
    wait_for(lambda: (sf.status(chaos.app, rendered) or None) and sf.status(chaos.app, rendered).queued == 3,
             timeout=20)
    # a renewal happened, so the lease time left at the kill is not trivially full (its deadline is
    # later than its take's: start + TTL)
    wait_for(lambda: renewed(chaos.queued.store, rendered, TTL), timeout=10)
    # two workers park concurrently, so the FIFO is the order they parked in, not the send order
    store = chaos.queued.store
    fifo = [e.decode().split("|")[0] for e in store.client.lrange(store.layout.queue(rendered), 0, -1)]
    assert sorted(fifo) == sorted(r.id for r in parked)

    killed_at = time.time()
    victim.kill()
    left_ms = lease_pttl(chaos.queued, key, 0)
    expires_at = killed_at + left_ms / 1000.0
    freed_at = wait_for(
        lambda: holder_of(chaos.queued, key, 0).get("task_id") != holder.id and time.time(),
        timeout=TTL + 2, interval=0.005,
    )

    assert [r.get(timeout=40) for r in parked] == [1, 2, 3]
    after = [r for r in runs(chaos, key) if r["start"] > killed_at]
    parked_order = [r["task_id"] for r in after if r["task_id"] != holder.id]
    assert parked_order == fifo, "parked runs ran out of their FIFO order (or twice)"
    takeover_at = after[0]["start"]

    if acks_late:
        assert holder.get(timeout=40) == 0  # the redelivered holder ran to the end
        wait_for(lambda: len(runs(chaos, key)) == 5, timeout=10)
    else:
        # nothing is left that could deliver the holder again: the broker holds no message of the
        # queue (queued, or delivered and unacknowledged), and the sweeper that handed the key on
        # ended the holder's run
        wait_for(lambda: holder.state == "FAILURE" and broker_empty(broker_redis, queue), timeout=10)
    holder_runs = [r for r in runs(chaos, key) if r["task_id"] == holder.id]
    figures.update({
        "acks_late": acks_late,
        "ttl_s": TTL,
        "lease_left_at_kill_s": round3(left_ms / 1000.0),
        "key_freed_after_kill_s": round3(freed_at - killed_at),
        "takeover_after_kill_s": round3(takeover_at - killed_at),
        "takeover_after_lease_expiry_s": round3(takeover_at - expires_at),
        "parked_runs_ran": len(parked_order),
        "holder_body_runs": len(holder_runs),
        "holder_state": holder.state,
        "overlaps": len(overlaps(chaos)),
    })
    if acks_late:
        figures["holder_rerun_after_kill_s"] = round3(holder_runs[-1]["start"] - killed_at)

    assert 0 < left_ms <= TTL * 1000
    assert freed_at - killed_at <= left_ms / 1000.0 + 0.3, "the key outlived the dead holder's lease"
    assert takeover_at >= expires_at - 0.05, "the key was taken while the dead holder's lease had time left"
    assert takeover_at - killed_at <= TTL + 3.0
    assert overlaps(chaos) == []
    assert interval_overlaps(runs(chaos), {int(holder_runs[0]["pid"]): killed_at}) == []
    if acks_late:
        assert len(holder_runs) == 2, "the redelivered holder must run exactly once more"
        assert holder_runs[1]["start"] >= expires_at - 0.05
    else:
        assert len(holder_runs) == 1  # acknowledged at start, lost with its worker: at-most-once
        # runs were parked on its key: the sweeper that handed the key on ended it
        wait_for(lambda: holder.state == "FAILURE", timeout=10)
        assert isinstance(holder.result, sf.RunLost) and holder.result.key == rendered
    assert sf.held(chaos.app) == []
