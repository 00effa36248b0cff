"""Scenario 4: the holder's worker loses its lease Redis for a while (a loopback TCP proxy is cut).

The holder's worker reaches the lease Redis only through :class:`TcpProxy`; a second worker (the
prober) reaches it directly and keeps trying the key (``skip`` policy) while the proxy is cut.

- a blip shorter than the TTL (TTL 4 s, cut 1.5 s, over the first renewal): renewals fail and are
  retried, the lease survives (``self.lease.lost`` stays False), and no other run takes the key;
- a cut longer than the TTL (TTL 3 s, cut 6 s): the loss is reported, not silent (the task sees
  ``lease.lost`` / ``LeaseLost``, the worker logs "lease lost"). How late it is reported, and
  whether the prober's run overlaps the old body meanwhile, is measured and checked too;
- the same with a partition that drops packets (8 s) instead of refusing connections: the client
  notices only through its socket timeout.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight import is_skipped
from celery_singleflight.testing import RedisServer

from .conftest import (
    Workers,
    flush,
    holder_of,
    lease_pttl,
    overlaps,
    renewed,
    round3,
    runs,
    since,
    wait_for,
    write_figures,
)
from .proxy import TcpProxy

pytestmark = pytest.mark.worker


class LeaseMonitor:
    """Samples the lease of one key every 5 ms from the test process (directly, not via the proxy)."""

    def __init__(self, task: Any, key: str, holder_id: str) -> None:
        self.task, self.key, self.holder_id = task, key, holder_id
        self.min_pttl: int | None = None
        self.lost_at: float | None = None  # first time the lease was not the holder's
        self.taken_by: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LeaseMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            record = holder_of(self.task, self.key)
            pttl = lease_pttl(self.task, self.key)
            if record.get("task_id") == self.holder_id and pttl > 0:
                self.min_pttl = pttl if self.min_pttl is None else min(self.min_pttl, pttl)
            elif self.lost_at is None:
                self.lost_at = time.time()
            elif self.taken_by is None and record.get("task_id"):
                self.taken_by = record["task_id"]
            time.sleep(0.005)


def probe_while(chaos: ModuleType, queue: str, key: str, until: float, every: float = 0.25,
                done: Callable[[], bool] = lambda: True) -> list[Any]:
    """Try the key every ``every`` seconds (the prober's pace) until ``until`` has passed and
    ``done()`` holds (or a minute has, so that a scenario that went wrong still ends)."""
    sent = []
    limit = until + 60.0
    while time.time() < limit and (time.time() < until or not done()):
        sent.append(chaos.probe.apply_async((key, 0.5), queue=queue))
        time.sleep(every)
    return sent


def start_pair(workers: Workers, proxy: TcpProxy, ttl: float) -> tuple[Any, str, str]:
    """A holder worker behind the proxy and a prober reaching Redis directly, each on a queue of its
    own (module-scoped scenarios keep their workers until the module ends)."""
    tag = uuid.uuid4().hex[:8]
    holder_q, probe_q = f"chaos-holder-{tag}", f"chaos-probe-{tag}"
    env = {"CHAOS_TTL": str(ttl)}
    holder_worker = workers.make(holder_q, env={**env, "CHAOS_LEASE_URL": proxy.url(2)})
    workers.start(holder_worker, workers.make(probe_q, env=env))
    return holder_worker, holder_q, probe_q


@pytest.mark.timeout(90)
def test_blip_shorter_than_the_ttl_keeps_the_lease(
    chaos: ModuleType, workers: Workers, figures: dict[str, Any], lease_redis: RedisServer
) -> None:
    ttl, cut_for = 4.0, 1.5
    proxy = TcpProxy(lease_redis.port).start()
    try:
        holder_worker, holder_q, probe_q = start_pair(workers, proxy, ttl)
        key = "blip"
        # the watcher holds 5.5 s past the cut: more than a TTL after its last renewal before it
        holder = chaos.watcher.apply_async((key, cut_for + 5.5), queue=holder_q)
        wait_for(lambda: chaos.recorder.hget(f"watcher:{key}", "pid"), timeout=20)
        with LeaseMonitor(chaos.watcher, key, holder.id) as monitor:
            cut_at = time.time()
            proxy.cut()
            # cut from the start of the run: its first renewal (a third of the TTL in) fails; the
            # cut lasts cut_for, and until that failure is in the log
            probes = probe_while(chaos, probe_q, key, cut_at + cut_for,
                                 done=lambda: "could not renew" in holder_worker.log())
            proxy.heal()
            healed_at = time.time()
            probes += probe_while(chaos, probe_q, key, healed_at + 1.5)
        told = holder.get(timeout=20)  # the watcher holds 7 s: still running when the monitor stops
        outcomes = [p.get(timeout=20) for p in probes]
    finally:
        proxy.close()
    log = holder_worker.log()
    figures.update({
        "ttl_s": ttl,
        "cut_s": round3(healed_at - cut_at),
        "renewal_failures_logged": log.count("could not renew"),
        "min_lease_ms_left_seen": monitor.min_pttl,
        "lease_lost_reported": told["lost"],
        "probes_sent": len(probes),
        "probes_ran": sum(not is_skipped(o) for o in outcomes),
        "connections_dropped": proxy.dropped,
    })
    assert log.count("could not renew") >= 1, "the cut did not hit a renewal: the scenario proved nothing"
    assert told["lost"] is False
    assert monitor.lost_at is None, "the lease left its holder during a blip shorter than the TTL"
    assert all(is_skipped(o) for o in outcomes), "another run took the key during the blip"
    assert "lease lost" not in log
    assert overlaps(chaos) == []


def long_partition(
    chaos: ModuleType, broker_redis: RedisServer, lease_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory, name: str, mode: str, ttl: float, lasting: float,
) -> Iterator[dict[str, Any]]:
    """The holder's worker is partitioned from the lease Redis for longer than the TTL, while the
    prober keeps trying the key every 50 ms; yields what happened, for the tests to check."""
    flush(broker_redis, lease_redis)
    workers = Workers(chaos, broker_redis, lease_redis, tmp_path_factory.mktemp(f"{name}-logs"))
    proxy = TcpProxy(lease_redis.port).start()
    try:
        holder_worker, holder_q, probe_q = start_pair(workers, proxy, ttl)
        key = name
        holder = chaos.watcher.apply_async((key, 30.0), queue=holder_q)
        wait_for(lambda: chaos.recorder.hget(f"watcher:{key}", "pid"), timeout=20)
        with LeaseMonitor(chaos.watcher, key, holder.id) as monitor:
            # the partition starts right after the lease's first renewal: its clock is known
            rendered = chaos.watcher.render_key(key)
            wait_for(lambda: renewed(chaos.watcher.store, rendered, ttl), timeout=10, interval=0.005)
            cut_at = time.time()
            if mode == "cut":
                proxy.cut()
            else:
                proxy.freeze()
            probes = probe_while(chaos, probe_q, key, cut_at + lasting, every=0.05)
            if mode == "cut":
                proxy.heal()
            else:
                proxy.thaw()
            healed_at = time.time()
            told = holder.get(timeout=40)
        outcomes = [p.get(timeout=20) for p in probes]
        probe_runs = [r for r in runs(chaos, key) if r["name"] == "probe"]
        first_probe_start = min(r["start"] for r in probe_runs) if probe_runs else None
        if told["lost"]:
            wait_for(lambda: "lease lost" in holder_worker.log(), timeout=5)
        data = {"told": told, "log": holder_worker.log(), "cut_at": cut_at, "ttl": ttl,
                "healed_at": healed_at, "expired_at": monitor.lost_at,
                "first_probe_start": first_probe_start, "overlaps": overlaps(chaos)}
        lost_at = told["lost_at"] if told["lost"] else None
        write_figures(tmp_path_factory, f"test_{name}", {
            "partition": "connections dropped, port refused" if mode == "cut" else "packets dropped",
            "ttl_s": ttl,
            "partition_s": round3(healed_at - cut_at),
            "lease_expired_in_redis_after_cut_s": since(monitor.lost_at, cut_at),
            "holder_told_after_cut_s": since(lost_at, cut_at),
            "holder_told_after_expiry_s": since(lost_at, monitor.lost_at),
            "time_left_zero_but_not_flagged_for_s": since(lost_at, told.get("zero_left_unflagged_at")),
            "other_run_took_key_after_cut_s": since(first_probe_start, cut_at),
            "probe_runs": sum(not is_skipped(o) for o in outcomes),
            "both_bodies_alive_s": max(0.0, since(lost_at, first_probe_start) or 0.0),
            "recorder_overlaps": len(data["overlaps"]),
            "told": told,
        })
    finally:  # stop this scenario's processes now, not when the module ends
        proxy.close()
        workers.finish()
    yield data


# inherent: the partition outlasts the TTL (3 s) by design, so that the lease runs out meanwhile
@pytest.fixture(scope="module")
def long_cut(
    chaos: ModuleType, broker_redis: RedisServer, lease_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """TTL 3 s, the proxy cut for 6 s (connections closed, new ones refused)."""
    yield from long_partition(chaos, broker_redis, lease_redis, tmp_path_factory, "long_cut", "cut",
                              ttl=3.0, lasting=6.0)


# inherent: 8 s of dropped packets, past the TTL and the client's 5 s socket timeout (the point)
@pytest.fixture(scope="module")
def blackhole(
    chaos: ModuleType, broker_redis: RedisServer, lease_redis: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """TTL 3 s, packets dropped for 8 s (connections stay open: no error until a socket timeout)."""
    yield from long_partition(chaos, broker_redis, lease_redis, tmp_path_factory, "blackhole", "freeze",
                              ttl=3.0, lasting=8.0)


def test_long_cut_reports_the_loss(long_cut: dict[str, Any]) -> None:
    told = long_cut["told"]
    # the lease's own deadline (check()) or the heartbeat's failed renewals, whichever comes first
    assert told["lost"] is True and ("Redis unreachable" in told["reason"]
                                     or "no renewal was confirmed" in told["reason"])
    # told at the latest one renewal interval + the TTL + one error retry (~1.3 s) after the cut
    assert told["lost_at"] - long_cut["cut_at"] <= long_cut["ttl"] / 3 + long_cut["ttl"] + 1.5
    assert "lease lost" in long_cut["log"]


def test_long_cut_another_run_takes_the_key_after_expiry(long_cut: dict[str, Any]) -> None:
    assert long_cut["expired_at"] is not None and long_cut["first_probe_start"] is not None
    # the monitor sees the expiry by polling, so it may note it a poll interval after the probe ran
    assert long_cut["first_probe_start"] >= long_cut["expired_at"] - 0.1


def test_long_cut_holder_is_told_before_another_run_takes_the_key(long_cut: dict[str, Any]) -> None:
    # told by the time its lease is gone from Redis (the moment another run may take the key) ...
    assert long_cut["told"]["lost_at"] <= long_cut["expired_at"] + 0.05
    # ... so the recorder never sees the prober's body while the old one still runs
    assert long_cut["told"]["lost_at"] <= long_cut["first_probe_start"]
    assert long_cut["overlaps"] == []


def test_blackhole_reports_the_loss_once_the_client_times_out(blackhole: dict[str, Any]) -> None:
    told = blackhole["told"]
    assert told["lost"] is True
    assert "lease lost" in blackhole["log"]
    assert blackhole["first_probe_start"] >= blackhole["expired_at"] - 0.1


def test_blackhole_holder_is_told_before_another_run_takes_the_key(blackhole: dict[str, Any]) -> None:
    assert blackhole["told"]["lost_at"] <= blackhole["expired_at"] + 0.05
    assert blackhole["overlaps"] == []
