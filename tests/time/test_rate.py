"""key_rate_limit on real workers: one limit per key across every worker process, delaying runs
over it (never dropping them), and a GCRA script that is safe to run twice."""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight import ConfigurationError, SingleFlightTask, constants
from celery_singleflight.policies.ratelimit import parse_rate, reserve
from celery_singleflight.protocol.store import store_for
from celery_singleflight.testing import RedisServer, WorkerProcess

from ..conftest import wait_for, wait_server_time
from .conftest import starts

FULL = os.environ.get("SF_RATE_FULL") == "1"


def most_in_window(times: list[float], window: float) -> int:
    """The most of ``times`` in any closed window of ``window`` seconds."""
    times = sorted(times)
    best, j = 0, 0
    for i, t in enumerate(times):
        while times[j] < t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def wait_late(redis_server: RedisServer, planned: float) -> None:
    """Until a run planned at ``planned`` (epoch seconds) comes late by more than RATE_LATE: by the
    server's clock, which the rate script reads (a millisecond more: ``planned`` is rounded)."""
    wait_server_time(redis_server.client(2), (planned + constants.RATE_LATE + 0.001) * 1000 + 1)


def check_paced(timeapp: ModuleType, workers: Callable[..., WorkerProcess], *, n_workers: int, rate: str,
                per_second: float, burst: int, n: int, window: float) -> dict[str, Any]:
    env = {"SF_RATE": rate, "SF_BURST": str(burst)}
    queue = ""
    for _ in range(n_workers):
        queue = workers(concurrency=2, env=env).queue  # type: ignore[attr-defined]
    sent_at = time.time()
    hot = [timeapp.paced.apply_async(("hot", i), queue=queue) for i in range(n)]
    cold = [timeapp.paced.apply_async((f"cold{i}", i), queue=queue) for i in range(3)]
    timeout = n / per_second + 60
    assert sorted(r.get(timeout=timeout) for r in hot) == list(range(n))  # 0 lost, 0 stuck
    assert [r.get(timeout=10) for r in cold] == [0, 1, 2]
    runs = starts(timeapp, "hot")
    assert len(runs) == n and len({r["task_id"] for r in runs}) == n  # each ran exactly once
    planned = [r["planned"] for r in runs]
    actual = [r["at"] for r in runs]
    # the planned starts obey the limit exactly: rate * W + burst in any window of W seconds
    assert most_in_window(planned, window) <= per_second * window + burst
    lag = sorted(a - p for a, p in zip(actual, planned, strict=True))
    worst = lag[-1]
    # the actual starts obey it up to the scheduling error (a late run can land near the next)
    assert most_in_window(actual, window) <= per_second * (window + worst) + burst
    assert all(r.state == "SUCCESS" for r in hot)
    # other keys are not held back by the hot one: each got its cell the moment it came (a
    # throttled run would have been planned later than it was first seen, and re-sent)
    for i in range(3):
        cold_run = starts(timeapp, f"cold{i}")[0]
        assert cold_run["planned"] >= sent_at and cold_run["at"] - cold_run["planned"] < 0.1, cold_run
    return {"p50_lag": lag[len(lag) // 2], "p99_lag": lag[int(len(lag) * 0.99)], "max_lag": worst}


@pytest.mark.worker
def test_a_key_rate_limit_holds_across_workers_and_delays_instead_of_dropping(
    timeapp: ModuleType, time_workers: Callable[..., WorkerProcess]
) -> None:
    """Given 2 workers x 2 processes and 120 tasks on one key at 20/s with burst 5 (the issue's
    60/m test, sped up; SF_RATE_FULL=1 runs that one), then every run starts once, the planned
    starts never put more than rate * W + burst in a window of W seconds, the actual ones only
    by the scheduling error, other keys start at once, and every result is ready."""
    figures = check_paced(timeapp, time_workers, n_workers=2, rate="20/s", per_second=20, burst=5, n=120,
                          window=1.0)
    # the scheduling error depends on the machine's load: benchmarks/bench_time_policies.py reports it
    print("scheduling error (actual - planned start), s:", figures)


@pytest.mark.worker
@pytest.mark.skipif(not FULL, reason="the issue's full-length test (two minutes): SF_RATE_FULL=1")
@pytest.mark.timeout(400)
def test_the_issues_full_rate_test(timeapp: ModuleType, time_workers: Callable[..., WorkerProcess]) -> None:
    """4 workers x 2 processes, 120 tasks on one key at 60/m, burst 5: no 1-minute window with
    more than 60 + 5 starts."""
    check_paced(timeapp, time_workers, n_workers=4, rate="60/m", per_second=1.0, burst=5, n=120, window=60.0)


def test_a_throttled_run_is_retry_with_throttled_meta(
    timeapp: ModuleType, time_workers: Callable[..., WorkerProcess]
) -> None:
    """Given a rate of 1/s with burst 1, when two runs come at once, the one that comes second
    shows RETRY with a Throttled meta (.throttled: key, limit, planned, wait) while it waits, then
    ends SUCCESS about 1 s after the other started."""
    queue = time_workers(concurrency=2, env={"SF_RATE": "1/s", "SF_BURST": "1"}).queue  # type: ignore[attr-defined]
    first = timeapp.paced.apply_async(("slow", 1), queue=queue)
    second = timeapp.paced.apply_async(("slow", 2), queue=queue)
    seen: dict[str, Any] = {}

    def both_ended() -> bool:
        """Looks at both runs until they are ready, keeping the Throttled meta of a RETRY."""
        for result in (first, second):
            # state and meta from one read: a run that ends between result.state and
            # result.info would pair RETRY with its return value
            meta = result.backend.get_task_meta(result.id)
            if meta["status"] == "RETRY":
                seen.update(meta["result"].throttled)
        return bool(first.ready() and second.ready())

    wait_for(both_ended, timeout=10, interval=0.01)
    assert first.get(timeout=10) == 1 and second.get(timeout=10) == 2
    info = seen
    assert info["key"] == "pace:slow" and info["limit"] == "1/s" and 0 < info["wait"] <= 1.0
    runs = starts(timeapp, "slow")
    assert runs[1]["at"] - runs[0]["at"] >= 0.95


@pytest.mark.parametrize("bad", ["10/x", "10", "ten/m", "/m", "-1/s", "0/m", 0, -5, "", True, [10]])
def test_bad_rates_are_refused_at_definition_naming_the_option(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="key_rate_limit"):
        type("Bad", (SingleFlightTask,), {"lock_key": "k", "key_rate_limit": bad, "run": lambda self: None})


@pytest.mark.parametrize("bad", [0, -1, 1.5, "5", True])
def test_bad_bursts_are_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match="key_rate_burst"):
        parse_rate("task t", "10/m", bad)


def test_rates_parse() -> None:
    assert parse_rate("t", "10/m") == parse_rate("t", " 10 / m ")
    rate = parse_rate("t", "10/m", 3)
    assert rate is not None and rate.burst == 3 and abs(rate.interval - 6.0) < 1e-9
    assert parse_rate("t", "2/h").per_second == 2 / 3600  # type: ignore[union-attr]
    assert parse_rate("t", 5).per_second == 5.0  # type: ignore[union-attr]
    assert parse_rate("t", "0.5/s").interval == 2.0  # type: ignore[union-attr]
    assert parse_rate("t", None) is None


def test_cells_are_spaced_burst_first_and_a_call_id_gets_its_own_cell_again(
    redis_server: RedisServer,
) -> None:
    """Given 1/s with burst 3 on an idle key, the first 3 calls start now, the next ones are
    planned 1 s apart; asking again with a granted call id answers the same cell, no new one."""
    store = store_for(f"{redis_server.url}/2", f"rt{uuid.uuid4().hex[:8]}")
    rate = parse_rate("t", "1/s", 3)
    assert rate is not None
    slots = [reserve(store, "k", rate, f"c{i}") for i in range(6)]
    assert [s.wait for s in slots[:3]] == [0, 0, 0]
    gaps = [b.planned - a.planned for a, b in itertools.pairwise([slots[0], *slots[3:]])]
    assert all(abs(g - 1.0) < 0.002 for g in gaps), gaps
    again = reserve(store, "k", rate, "c4")
    assert again.planned == slots[4].planned and not again.fresh
    assert reserve(store, "k", rate, "c6").planned - slots[5].planned == pytest.approx(1.0, abs=0.002)


def test_a_lost_reply_of_the_rate_script_does_not_take_two_cells(redis_server: RedisServer) -> None:
    """Given the rate script's first reply dropped (it ran; redis-py sends it again), then the
    call gets one cell: the server ran the script twice, one cell is planned for the call id, and
    the next call is planned one interval later, not two."""
    from celery_singleflight.protocol.timing import RATE

    from ..chaos.faultproxy import DROP_REPLY, FaultProxy

    with FaultProxy(redis_server.port) as proxy:
        store = store_for(proxy.url(2), f"rf{uuid.uuid4().hex[:8]}")
        rate = parse_rate("t", "2/s", 1)
        assert rate is not None
        reserve(store, "warm", rate, "call-0")  # the server knows the script: no NOSCRIPT round
        rule = proxy.add_rule(DROP_REPLY, script=RATE.source, first_time_only=True)
        first = reserve(store, "k", rate, "call-1")
        assert rule.faulted == 1 and rule.matched == 2  # ran, reply lost, sent again
        assert first.wait == 0
        assert redis_server.client(2).zcard(store.layout.planned("k")) == 1
        second = reserve(store, "k", rate, "call-2")
        assert second.planned - first.planned == pytest.approx(0.5, abs=0.01)


def test_a_run_late_by_more_than_a_second_takes_a_new_cell_once(redis_server: RedisServer) -> None:
    """Given 4/s and two runs planned now and 0.25 s later, when both come back over a second late (their
    worker died, Redis was away), they do not start together: the first takes the next free cell
    (now), the second the one after it. A run that comes late a second time keeps its new cell:
    a worker that cannot keep up is not pushed back again and again."""
    store = store_for(f"{redis_server.url}/2", f"rt{uuid.uuid4().hex[:8]}")
    rate = parse_rate("t", "4/s")
    assert rate is not None
    first, second = reserve(store, "k", rate, "a:0"), reserve(store, "k", rate, "b:0")
    assert second.planned - first.planned == pytest.approx(0.25, abs=0.002)
    wait_late(redis_server, second.planned)
    again_a, again_b = reserve(store, "k", rate, "a:0"), reserve(store, "k", rate, "b:0")
    assert again_a.fresh and again_b.fresh and again_a.wait == 0
    assert again_b.planned - again_a.planned == pytest.approx(0.25, abs=0.002)
    assert reserve(store, "k", rate, "a:0").planned == again_a.planned  # a replay: the same cell
    wait_late(redis_server, again_b.planned)
    late_again = reserve(store, "k", rate, "b:0")
    assert late_again.planned == pytest.approx(again_b.planned, abs=1e-6) and not late_again.fresh
