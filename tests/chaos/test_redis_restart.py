"""Scenario 3: the lease Redis is SIGKILLed mid-run and comes back empty on the same port.

The broker lives on another private Redis, so only the leases go away. With ``fail_closed`` (the
default) nothing may run unguarded meanwhile:

- tasks dispatched during the outage end up ``RETRY`` and run only after Redis is back;
- the holder that was running when Redis died learns that its lease is lost (it cannot renew it)
  once its TTL is up, before Redis comes back empty and another run could take the key;
- fencing tokens handed out after the restart are larger than every token handed out before.
"""

from __future__ import annotations

import contextlib
import time
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.fencing import FencedValue, fenced_get, fenced_set
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import store_for
from celery_singleflight.testing import RedisServer

from .conftest import Workers, interval_overlaps, overlaps, round3, runs, wait_for

pytestmark = pytest.mark.worker
TTL = 3.0


@pytest.mark.timeout(90)
def test_lease_redis_killed_and_restarted_empty(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], lease_redis: RedisServer
) -> None:
    worker = workers.one(queue, concurrency=2, env={"CHAOS_TTL": str(TTL), "CHAOS_RETRY_DELAY": "0.5"})
    key = "r"
    before = [chaos.quick.apply_async((key,), queue=queue).get(timeout=20)["fence"] for _ in range(3)]
    holder = chaos.watcher.apply_async((key, 30.0), queue=queue)
    wait_for(lambda: any(r["task_id"] == holder.id for r in runs(chaos, key)), timeout=20)  # in its body

    down_at = time.time()
    lease_redis.kill()
    retry_seen: set[str] = set()
    try:
        keys = [f"o{i}" for i in range(4)] + [key, key]
        during = [chaos.quick.apply_async((k,), queue=queue) for k in keys]
        told = holder.get(timeout=TTL + 5)  # the watcher returns as soon as it is told
        ids = {r.id for r in during}

        def all_retried() -> bool:
            retry_seen.update(r.id for r in during if r.state == "RETRY")
            return retry_seen == ids

        # Redis stays away until the holder was told (its lease ran out meanwhile: longer than the
        # TTL) and every task sent meanwhile was seen re-sent (RETRY); the assertions say what not
        with contextlib.suppress(AssertionError):
            wait_for(all_retried, timeout=20, interval=0.05)
    finally:
        restarting_at = time.time()  # from here on Redis may answer: runs may start
        lease_redis.start()
    up_at = time.time()

    after = [r.get(timeout=30) for r in during]
    key_fences_after = [a["fence"] for a, r in zip(after, keys, strict=True) if r == key]
    all_runs = runs(chaos)
    started_in_outage = [r for r in all_runs if down_at <= r["start"] <= restarting_at]
    holder_run = next(r for r in all_runs if r["task_id"] == holder.id)
    first_after = min(r["start"] for r in all_runs if r["task_id"] in {d.id for d in during})
    figures.update({
        "ttl_s": TTL,
        "outage_s": round3(up_at - down_at),
        "holder_told_lost_after_down_s": round3(told["lost_at"] - down_at),
        "holder_reason": told.get("reason"),
        "holder_body_ended_before_redis_back_s": round3(up_at - holder_run["end"]),
        "dispatched_during_outage": len(during),
        "seen_in_retry_state": len(retry_seen),
        "resend_log_lines": worker.log().count("will be retried"),
        "runs_started_during_outage": len(started_in_outage),
        "first_run_after_restart_s": round3(first_after - up_at),
        "fence_max_before": max([*before, told["fence"]]),
        "fence_min_after": min(key_fences_after),
        "overlaps": len(overlaps(chaos)),
    })

    # the lease's own deadline (check()) or the heartbeat's failed renewals, whichever comes first
    assert told["lost"] is True and ("Redis unreachable" in told["reason"]
                                     or "no renewal was confirmed" in told["reason"])
    assert told["lost_at"] - down_at <= TTL + 2.0
    assert holder_run["end"] < restarting_at, "the holder was still running unguarded when Redis came back"
    assert started_in_outage == [], "a run started while the lease Redis was away"
    assert retry_seen == {r.id for r in during}, "every task sent during the outage ends up RETRY first"
    assert min(key_fences_after) > max([*before, told["fence"]]), "fences went backwards after the restart"
    assert all(a["fence"] > max(before) for a in after)  # fresh keys are seeded from the clock too
    assert overlaps(chaos) == [] and interval_overlaps(all_runs) == []
    assert "lease lost" in worker.log()
    wait_for(lambda: sf.held(chaos.app) == [], timeout=TTL + 1)


@pytest.mark.timeout(90)
def test_fences_keep_growing_after_a_restore_from_an_older_snapshot(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], broker_redis: RedisServer
) -> None:
    """Given runs A, then a snapshot (``SAVE``), then runs B and C, when the lease Redis is killed
    and comes back from that snapshot (it knows only A: an RDB restore, an AOF ``everysec`` that
    lost its last second, a failover to a lagging replica), then the next runs D and E still get
    fences larger than C's, so a fenced write of D is accepted and C's late write is refused."""
    with RedisServer() as lease:
        worker = workers.one(queue, concurrency=2, env={"CHAOS_LEASE_URL": f"{lease.url}/2"})

        def fence() -> int:
            return int(chaos.quick.apply_async(("snap",), queue=queue).get(timeout=30)["fence"])

        a = fence()
        lease.client().save()
        b, c = fence(), fence()
        lease.kill()
        lease.start()  # loads dump.rdb: the records of B and C are gone, A's is back
        back = StatusReader(store_for(f"{lease.url}/2", "sf")).read("r:snap")
        restored = None if back is None else back.fence
        d, e = fence(), fence()
        worker.stop(timeout=15)
    figures.update(fences=[a, b, c, d, e], restored_record_fence=restored)
    assert restored == a, "the snapshot should bring back the status of A's run"
    assert a < b < c < d < e
    data = broker_redis.client(3)
    assert fenced_set(data, "snap:balance", "C", c)
    assert fenced_set(data, "snap:balance", "D", d)
    assert fenced_set(data, "snap:balance", "C, late", c) is False
    assert fenced_get(data, "snap:balance") == FencedValue(b"D", d)
