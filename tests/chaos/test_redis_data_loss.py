"""The lease Redis loses its data while runs are parked in it: they are sent again, and each
ends (celery_singleflight.worker.recovery).

A run parked by ``queue`` had its broker message acknowledged; it lives only in the lease Redis.
Two workers of two processes each park ``PARKED`` runs behind a holder; the lease Redis is
SIGKILLed and comes back empty on its port once the holder's body is over. Each worker sees the
loss at its next sweep and sends again the runs its processes parked (from its journal), which
then take the key or park again as new arrivals. Every AsyncResult must end SUCCESS, each body
run once, no two at once, the key free at the end. Without the recovery, most of them stayed
``QUEUED`` forever (13 of 15 with ``ordered=True``).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import store_for
from celery_singleflight.run.journal import HEADER_RECOVERED, HEADER_RECOVERED_HANDOFF, Journal
from celery_singleflight.run.messages import HEADER_HANDOFF, HEADER_SEQ
from celery_singleflight.testing import RedisServer

from .conftest import Workers, interval_overlaps, overlaps, round3, runs, wait_for

pytestmark = pytest.mark.worker

TTL = 3.0
PARKED = 8
HOLD = 60.0  # the most the holder's body takes: it ends when the scenario opens its gate (after the kill)
SWEEP = 1.0
# the runs are sent again within a sweep of Redis coming back; then they run one after the other
BOUND = SWEEP + PARKED * 0.05 + 10.0  # the rest is room for a loaded machine


def _journaled(directory: Path, key: str) -> set[str]:
    """Task ids journaled as parked on ``key`` by any worker."""
    found: set[str] = set()
    for path in directory.glob("*.jsonl"):
        journal = Journal(str(directory), path.name.removesuffix(".jsonl"))
        found |= {e.task_id for e in journal.entries() if e.kind == "park" and e.key.endswith(key)}
    return found


def _epoch(server: RedisServer) -> int:
    """How many looks the workers' sweepers have counted on the namespace's epoch."""
    raw = server.client(2).get("sf:epoch")
    return int(raw.split()[1]) if raw else 0


def _scenario(chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], lease: RedisServer,
              journals: Path, task_name: str, *, snapshot_after: int | None = None) -> None:
    """Two workers, a holder and PARKED runs parked behind it; the lease Redis killed and back once
    the holder's body is over: empty, or (``snapshot_after``) from a snapshot taken after that many
    runs had parked. Every run must end SUCCESS, each body once, never two at once."""
    env = {"CHAOS_TTL": str(TTL), "CHAOS_JOURNAL_DIR": str(journals), "CHAOS_LEASE_URL": f"{lease.url}/2"}
    a, b = workers.start(workers.make(queue, env=env), workers.make(queue, env=env))
    task = getattr(chaos, task_name)
    key = f"dl-{uuid.uuid4().hex[:8]}"
    wait_for(lambda: _epoch(lease) >= 6, timeout=20)  # each worker has looked (once per sweep)

    # Given a holder and PARKED runs parked behind it, each journaled by the worker that parked it
    go = f"go:{key}"
    holder = task.apply_async((key, 0), {"first_seconds": HOLD, "until": go}, queue=queue)
    wait_for(lambda: runs(chaos, key), timeout=20)
    parked = []
    for n in range(1, PARKED + 1):
        parked.append(task.apply_async((key, n), queue=queue))
        if n == snapshot_after:
            wait_for(lambda: all(r.state == "QUEUED" for r in parked), timeout=20)
            lease.client().save()
            saved = _epoch(lease)
    wait_for(lambda: all(r.state == "QUEUED" for r in parked), timeout=20)
    wait_for(lambda: _journaled(journals, key) == {r.id for r in parked}, timeout=10)
    if snapshot_after is not None:
        wait_for(lambda: _epoch(lease) >= saved + 6, timeout=20)  # each worker looked after the snapshot

    # When the lease Redis is killed, and comes back once the holder's body is over
    down_at = time.time()
    lease.kill()
    try:
        chaos.recorder.set(go, 1)  # the holder's body ends while Redis is away
        wait_for(lambda: runs(chaos, key)[0]["end"] is not None, timeout=20)
        # its release met the dead Redis (and gave up): Redis comes back after the holder's end
        wait_for(lambda: any("could not release key=" in line and holder.id in line
                             for line in (a.log() + b.log()).splitlines()), timeout=20)
    finally:
        lease.start()
    up_at = time.time()

    # Then every run ends SUCCESS within the bound, each body once, never two at once
    wait_for(lambda: all(r.ready() for r in parked), timeout=BOUND + 5)
    ended_at = time.time()
    all_runs = runs(chaos, key)
    recovered = [r for r in all_runs if r["task_id"] != holder.id]
    logs = a.log() + b.log()
    figures.update({
        "task": task_name,
        "parked": PARKED,
        "parked_before_the_snapshot": snapshot_after,
        "outage_s": round3(up_at - down_at),
        "first_run_after_redis_back_s": round3(min((r["start"] for r in recovered), default=up_at) - up_at),
        "all_ended_after_redis_back_s": round3(ended_at - up_at),
        "sent_again": logs.count("sent again ("),
        "states": sorted(r.state for r in parked),
    })
    assert ended_at <= up_at + BOUND
    assert [r.state for r in parked] == ["SUCCESS"] * PARKED
    assert sorted(r.get(timeout=1) for r in parked) == list(range(1, PARKED + 1))
    assert sorted(r["task_id"] for r in recovered) == sorted(r.id for r in parked), "a body ran twice, or not"
    assert min(r["start"] for r in recovered) - up_at <= SWEEP + 3.0
    assert overlaps(chaos) == [] and interval_overlaps(all_runs) == []
    why = "it came back empty" if snapshot_after is None else "it came back with older data"
    assert f"lost its data ({why}" in a.log() and f"lost its data ({why}" in b.log()
    # sent again: every run when Redis came back empty; those parked after the snapshot otherwise
    assert figures["sent_again"] == PARKED - (snapshot_after or 0)
    store = store_for(f"{lease.url}/2", "sf")
    wait_for(lambda: StatusReader(store).held() == [], timeout=TTL + 2)
    wait_for(lambda: _journaled(journals, key) == set(), timeout=10)  # compacted once they ran


# its time is the product's: the sweepers' looks (each once a second) before the fault, the data loss
# seen at the next sweep, and the journals compacted (every JOURNAL_COMPACT, 5 s) at the end
@pytest.mark.timeout(120)
@pytest.mark.parametrize("task_name", ["queued", "queued_in_order"])
def test_runs_parked_in_a_lease_redis_that_comes_back_empty_are_sent_again_and_all_end(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], lease_redis: RedisServer,
    tmp_path: Path, task_name: str,
) -> None:
    _scenario(chaos, workers, queue, figures, lease_redis, tmp_path / "journals", task_name)


@pytest.mark.timeout(120)
def test_runs_parked_after_the_snapshot_a_lease_redis_comes_back_from_are_sent_again(
    chaos: ModuleType, workers: Workers, queue: str, figures: dict[str, Any], tmp_path: Path,
) -> None:
    """The runs parked before the snapshot are still parked in the restored Redis and are handed
    the key as usual; those parked after it are sent again. (A private server: its snapshot must
    not reach the other scenarios.)"""
    with RedisServer() as lease:
        _scenario(chaos, workers, queue, figures, lease, tmp_path / "journals", "queued", snapshot_after=4)


@pytest.mark.timeout(60)
def test_a_hand_off_message_still_on_its_way_does_not_run_a_recovered_run_again(
    chaos: ModuleType, workers: Workers, queue: str, tmp_path: Path,
) -> None:
    """Given a parked run sent again by the recovery (QUEUED; its hand-off token in a header)
    whose hand-off message was still on its way, when the recovered run starts, then it shows
    STARTED; when that hand-off message arrives after it ended, it is dropped as a copy: the
    body ran once."""
    worker = workers.one(queue, env={"CHAOS_TTL": str(TTL), "CHAOS_JOURNAL_DIR": str(tmp_path / "journals")})
    key, task_id, handoff = f"ho-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, uuid.uuid4().hex
    chaos.app.backend.store_result(task_id, {"key": key}, "QUEUED")
    recovered = chaos.queued.apply_async((key, 1), {"seconds": 1.0}, task_id=task_id, queue=queue, headers={
        HEADER_RECOVERED: "park", HEADER_RECOVERED_HANDOFF: handoff, HEADER_SEQ: 0})
    wait_for(lambda: runs(chaos, key), timeout=20)
    assert recovered.state == "STARTED"
    assert recovered.get(timeout=10) == 1
    chaos.queued.apply_async((key, 1), {"seconds": 1.0}, task_id=task_id, queue=queue,
                             headers={HEADER_HANDOFF: handoff})
    wait_for(lambda: "this copy of its message is dropped" in worker.log(), timeout=10)
    assert [r["task_id"] for r in runs(chaos, key)] == [task_id] and recovered.state == "SUCCESS"
