"""Many workers on a Redis Cluster: every policy on one key space, pool processes SIGKILLed.

The leases live on a private 3-master Redis Cluster (``CHAOS_LEASE_URL`` of the workers); the
broker, results and the independent recorder stay on the chaos suite's broker Redis. Workers with
distinct node names run skip, queue, retry, raise, join and ``max_concurrency=3`` tasks over a
shared key space while pool processes are killed, then the recorder and the Cluster are checked:

- zero overlapping runs per key (per slot for ``max_concurrency``), live and offline;
- zero lost tasks: every task id reaches SUCCESS or FAILURE with an explained error;
- zero keys held and no parked run left on any node, one TTL after the end.

By default a small version runs (2 workers x 2 processes, 300 tasks over 30 keys, about 40 s).
``SF_MANY_WORKERS_FULL=1`` runs the full one: 4 workers, 5,000 tasks over 200 keys, pool
processes killed every 1.5-3.5 s and one whole worker killed and replaced.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from redis.cluster import RedisCluster

from celery_singleflight import is_skipped
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import store_for
from celery_singleflight.testing import RedisServer, WorkerProcess
from celery_singleflight.testing.engines import RedisClusterServers

from ..conftest import IN_CI
from .conftest import Workers, interval_overlaps, overlaps, runs, wait_for
from .test_soak import in_flight_at_kill, states, terminal

pytestmark = pytest.mark.worker

FULL = os.environ.get("SF_MANY_WORKERS_FULL") == "1"
WORKERS = 4 if FULL else 2
TASKS = 5_000 if FULL else 300
KEYS = 200 if FULL else 30
RATE = 40.0  # tasks per second
TTL = 3.0
SEED = int(os.environ.get("CHAOS_SOAK_SEED", "0")) or random.randrange(1, 10**6)
#: failures that are a policy's or a kill's truthful answer: a duplicate refused (raise), a full
#: queue, a run whose pool process was killed, and (join only) a run that joined a holder whose
#: process was killed: "the run it joined ended without a result"
EXPLAINED = {"LockHeld", "QueueFull", "WorkerLostError", "LeaseLost"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters=3)
    try:
        servers.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if IN_CI:
            raise
        pytest.skip(f"a Redis Cluster cannot start here: {exc}")
    yield servers
    servers.close()


# its time is inherent: TASKS sent at RATE (7.5 s), a Redis Cluster's start; the rest waits on states
@pytest.mark.timeout(900 if FULL else 240)
def test_many_workers_on_a_cluster_with_kills(
    chaos: ModuleType, workers: Workers, queue: str, broker_redis: RedisServer, cluster: RedisClusterServers,
) -> None:
    rng = random.Random(SEED)
    cluster.client().flushall(target_nodes=RedisCluster.PRIMARIES)
    env = {"CHAOS_TTL": str(TTL), "CHAOS_ACKS_LATE": "1", "CHAOS_VISIBILITY": "10",
           "CHAOS_LEASE_URL": cluster.url}
    live: list[WorkerProcess] = workers.start(*(workers.make(queue, env=env) for _ in range(WORKERS)))
    assert len({w.hostname for w in live}) == WORKERS
    tasks = {"skip": chaos.soak_skip, "queue": chaos.soak_queue, "retry": chaos.soak_retry,
             "raise": chaos.soak_raise, "join": chaos.soak_join, "limited": chaos.soak_limited}
    sent: list[tuple[str, str, Any]] = []
    sent_at: list[float] = []
    deaths: dict[int, float] = {}
    whole_killed_at: list[float] = []
    kills = Counter[str]()
    replacement: list[WorkerProcess] = []
    restarter: threading.Thread | None = None

    def replace_worker() -> None:
        worker = workers.make(queue, env=env)
        worker.start(None, timeout=60)
        replacement.append(worker)

    began = time.monotonic()
    next_kill = began + rng.uniform(1.5, 3.5)
    whole_kill_at = began + TASKS / RATE * 0.4 if FULL else float("inf")
    try:
        while len(sent) < TASKS:
            key = f"k{rng.randrange(KEYS // 10) if rng.random() < 0.5 else rng.randrange(KEYS)}"
            for _ in range(rng.choice((1, 1, 2, 3))):
                policy = rng.choice(tuple(tasks))
                seconds = round(rng.uniform(0.005, 0.05), 4)
                sent.append((policy, key, tasks[policy].apply_async((key, seconds), queue=queue)))
                sent_at.append(time.time())
            now = time.monotonic()
            if now >= next_kill:
                children = [pid for worker in live for pid in worker.children() if pid not in deaths]
                busy = {int(pid) for pid in chaos.recorder.hkeys("busy")} & set(children)
                if children:
                    pid = rng.choice(sorted(busy) if busy else children)
                    os.kill(pid, signal.SIGKILL)
                    deaths[pid] = time.time()
                    kills["pool_process"] += 1
                next_kill = now + rng.uniform(1.5, 3.5)
            if restarter is None and now >= whole_kill_at:
                victim = rng.choice(live)
                children = victim.children()
                victim.kill()
                whole_killed_at.append(time.time())
                for pid in children:
                    deaths.setdefault(pid, whole_killed_at[-1])
                kills["whole_worker"] += 1
                live.remove(victim)
                restarter = threading.Thread(target=replace_worker)
                restarter.start()
            pause = len(sent) / RATE - (time.monotonic() - began)
            if pause > 0:
                time.sleep(pause)
    finally:
        if restarter is not None:
            restarter.join(timeout=60)

    ids = [r.id for _, _, r in sent]
    deadline = time.monotonic() + max(30.0, max(whole_killed_at, default=0) + 30 - time.time())
    while True:
        metas = states(broker_redis, ids)
        pending = [i for i in ids if not terminal(metas[i])]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    reader = StatusReader(store_for(cluster.url, "sf"))
    nodes = cluster.client()
    left: list[Any] = []

    def nothing_left() -> bool:
        """No key held and no run parked on any node (what is left is kept in ``left``)."""
        parked = sum(int(nodes.llen(k)) for k in nodes.scan_iter(match="sf:{*}:queue", count=1000))
        left[:] = [reader.held(), parked]
        return left == [[], 0]

    # grace: one TTL for leases of processes killed at the very end (each runs out within it)
    with contextlib.suppress(AssertionError):
        wait_for(nothing_left, timeout=TTL, interval=0.1)
    still_held, parked_left = left

    failed = Counter[str]()
    outcome = Counter[str]()
    lease_lost_by = Counter[str]()
    policy_of = {r.id: p for p, _, r in sent}
    for task_id in ids:
        meta = metas[task_id]
        if meta["status"] == "SUCCESS":
            outcome["skipped" if is_skipped(meta["result"]) else "ran"] += 1
        elif meta["status"] == "FAILURE":
            failed[meta["result"].get("exc_type", "?")] += 1
            if meta["result"].get("exc_type") == "LeaseLost":
                lease_lost_by[policy_of[task_id]] += 1
    in_flight = in_flight_at_kill(pending, dict(zip(ids, sent_at, strict=True)), whole_killed_at,
                                  [w.log() for w in workers.started])
    lost = [i for i in pending if i not in in_flight]
    all_runs = runs(chaos)
    live_overlaps = overlaps(chaos)
    offline = interval_overlaps(all_runs, deaths)
    summary = {"seed": SEED, "dispatched": len(ids), "by_policy": dict(Counter(p for p, _, _ in sent)),
               "ran": outcome["ran"], "skipped": outcome["skipped"], "failed": dict(failed),
               "lost": len(lost),
               "in_flight_at_kill": len(in_flight), "kills": dict(kills), "held": len(still_held),
               "parked_left": parked_left, "overlaps": len(live_overlaps) + len(offline)}
    print(summary)
    assert live_overlaps == [] and offline == [], (live_overlaps[:3], offline[:3], summary)
    key_of = {r.id: (p, k) for p, k, r in sent}
    diagnosis = [{"id": i, "policy_key": key_of[i], "meta": metas[i],
                  "log": [line for w in workers.started for line in w.log().splitlines() if i in line],
                  "runs_of_key": [r for r in all_runs if r["key"] == key_of[i][1]][-3:]}
                 for i in lost[:3]]
    assert lost == [], (diagnosis, summary)
    assert set(failed) <= EXPLAINED, summary
    assert set(lease_lost_by) <= {"join"}, lease_lost_by
    assert still_held == [] and parked_left == 0, summary
    assert kills["pool_process"] >= 1
