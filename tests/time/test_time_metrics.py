"""Metrics of the time policies, from real runs on a real worker of the time app: the calls a
debounce folded into one run, and the runs a key's rate limit delayed, with their delays."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from celery_singleflight.metrics.record import FLUSH_AFTER
from celery_singleflight.testing import WorkerProcess, free_port

from ..conftest import wait_for
from ..test_metrics import sample, scrape

pytestmark = pytest.mark.worker


def test_calls_folded_and_runs_rate_limited_are_counted(
    timeapp: ModuleType, time_workers: Callable[..., WorkerProcess], tmp_path: Path,
) -> None:
    """A burst of three debounced calls is one run and two calls folded; three runs at once on a
    key allowed 1/s with a burst of 1 are two delayed, by about 1 s and 2 s. The spacing leaves
    room for a loaded machine: the calls fold by their send times, the cells are a second apart."""
    port = free_port()
    worker = time_workers(concurrency=4, env={
        "SF_TEST_METRICS_PORT": str(port), "SF_TEST_METRICS_DIR": str(tmp_path / "metrics"),
        "SF_RATE": "1/s", "SF_BURST": "1"})
    key = uuid.uuid4().hex[:8]
    burst = [timeapp.settled.apply_async((key, n), queue=worker.queue) for n in range(3)]
    paced = [timeapp.paced.apply_async((key, n), queue=worker.queue) for n in range(3)]

    outcomes = [r.get(timeout=30) for r in burst]
    assert [o for o in outcomes if not isinstance(o, dict)] == [2], outcomes  # the last call's payload
    assert [o["singleflight"] for o in outcomes if isinstance(o, dict)] == ["debounced"] * 2, outcomes
    assert sorted(r.get(timeout=30) for r in paced) == [0, 1, 2]

    def counted() -> dict[str, float] | None:
        values = scrape(port)
        found = {name: sample(values, f"celery_singleflight_{name}", task=f"timeapp.{task}")
                 for name, task in (("calls_folded_total", "settled"), ("rate_limited_total", "paced"),
                                    ("rate_limit_delay_seconds_sum", "paced"))}
        return found if found["calls_folded_total"] == 2 and found["rate_limited_total"] == 2 else None

    found = wait_for(counted, timeout=FLUSH_AFTER + 5)
    assert 2.4 <= found["rate_limit_delay_seconds_sum"] <= 3.5, found  # 1 s + 2 s, give or take
