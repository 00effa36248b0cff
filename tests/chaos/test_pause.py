"""Scenario 2: the holder's pool process is frozen (SIGSTOP) for longer than its lease TTL.

A lease cannot stop a process that does not run: while the holder is stopped its heartbeat is
stopped too, the lease expires (TTL 2 s) and another run takes the key with a larger fence. When
the frozen holder continues (SIGCONT once the other run wrote) two bodies are alive on one key.
What must hold:

- the resumed holder learns that its lease is lost at its next ``self.lease.check()`` and at its
  next ``self.progress()``, and says so in the worker log;
- its write with its (stale) fence is refused by the resource, and the newer holder's writes stand.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight.testing import RedisServer

from .conftest import Workers, flush, holder_of, round3, wait_for, write_figures

pytestmark = pytest.mark.worker
TTL = 2.0


@pytest.fixture(scope="module")
def paused(
    chaos: ModuleType, broker_redis: RedisServer, lease_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """Runs the scenario once; the tests below check one promise each."""
    flush(broker_redis, lease_redis)
    workers = Workers(chaos, broker_redis, lease_redis, tmp_path_factory.mktemp("pause-logs"))
    try:
        queue = f"chaos-pause-{uuid.uuid4().hex[:8]}"
        worker = workers.one(queue, concurrency=2, env={"CHAOS_TTL": str(TTL)})
        key, go_b = "p", "go:p:B"
        first = chaos.fenced.apply_async((key, "A"), {"hold": 30.0, "spin": True}, queue=queue)
        # A wrote first and is in its loop, where it sees a pause
        wait_for(lambda: chaos.recorder.hget(f"fw:{key}:A", "looping"), timeout=20)
        pid = int(chaos.recorder.hget(f"fw:{key}:A", "pid"))
        stopped_at = time.time()
        os.kill(pid, signal.SIGSTOP)
        try:
            expired_at = wait_for(lambda: not holder_of(chaos.fenced, key, "A") and time.time(),
                                  timeout=TTL + 2, interval=0.005)
            # B holds the key until A has resumed and reported: two bodies alive on one key
            second = chaos.fenced.apply_async((key, "B"), {"hold": 60.0, "until": go_b}, queue=queue)
            wait_for(lambda: chaos.recorder.hget(f"fw:{key}:B", "pid"), timeout=10)
            second_started = time.time()
            holder_during_pause = holder_of(chaos.fenced, key, "B").get("task_id")
            # A stays stopped until B's first fenced write landed (A's own later write must meet it)
            wait_for(lambda: chaos.recorder.hget(f"resource:{key}", "value") == b"B:first", timeout=10)
        finally:
            os.kill(pid, signal.SIGCONT)
        resumed_at = time.time()
        try:
            seen_first = first.get(timeout=20)
        finally:
            chaos.recorder.set(go_b, 1)
        seen_second = second.get(timeout=20)
        stored = {k.decode(): v.decode() for k, v in chaos.recorder.hgetall(f"resource:{key}").items()}
        wait_for(lambda: "lease lost" in worker.log(), timeout=5)
        data = {
            "first": seen_first, "second": seen_second, "stored": stored, "log": worker.log(),
            "second_id": second.id, "holder_during_pause": holder_during_pause,
            "paused": resumed_at - stopped_at,
        }
        figures = {
            "ttl_s": TTL,
            "pause_s": round3(resumed_at - stopped_at),
            "lease_expired_after_stop_s": round3(expired_at - stopped_at),
            "other_run_started_after_stop_s": round3(second_started - stopped_at),
            "old_fence": seen_first["fence"],
            "new_fence": seen_second["fence"],
            "resumed_time_left": seen_first.get("time_left_after_pause"),
            "resumed_lost_flag_before_check": seen_first.get("lost_flag_after_pause"),
            "resumed_check": seen_first.get("check"),
            "resumed_progress": seen_first.get("progress"),
            "resumed_fenced_write_accepted": seen_first.get("write_after_pause"),
            "newer_writes_accepted": [seen_second["first_write"], seen_second.get("last_write")],
            "resource_final": stored.get("value"),
            "fenced_write_via": chaos.FENCED_WRITE_VIA,
        }
        write_figures(tmp_path_factory, "test_pause", figures)
    finally:  # stop this scenario's processes now, not when the module ends
        workers.finish()
    yield data


def test_another_run_takes_the_key_with_a_larger_fence(paused: dict[str, Any]) -> None:
    assert paused["holder_during_pause"] == paused["second_id"]
    assert paused["second"]["fence"] > paused["first"]["fence"]
    assert paused["first"]["paused_for"] >= paused["paused"] - 0.5  # the holder saw the whole pause


def test_the_stale_holders_fenced_write_is_refused(paused: dict[str, Any]) -> None:
    assert paused["first"]["first_write"] is True
    assert paused["first"]["write_after_pause"] is False
    assert paused["second"]["first_write"] is True and paused["second"]["last_write"] is True
    assert paused["stored"] == {"fence": str(paused["second"]["fence"]), "value": "B:last"}


def test_progress_after_the_pause_raises_lease_lost(paused: dict[str, Any]) -> None:
    assert paused["first"]["progress"] == "LeaseLost"
    assert "lease lost" in paused["log"]


def test_lease_time_left_is_zero_after_the_pause(paused: dict[str, Any]) -> None:
    assert paused["first"]["time_left_after_pause"] == 0.0


def test_check_right_after_the_pause_raises_lease_lost(paused: dict[str, Any]) -> None:
    assert paused["first"]["time_left_after_pause"] == 0.0
    assert paused["first"]["check"] == "LeaseLost"
