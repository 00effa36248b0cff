"""Leases on a Redis Cluster against a standalone Redis, in one run.

Starts a private 3-master Redis Cluster and a private standalone redis-server (loopback, stopped
by PID), then measures:

- uncontended acquire + release pairs/s through the library's lease path, from one client, keys
  spread over the cluster's slots (1,000 keys in turn), against the same on the standalone
  server: short slices, interleaved, and the median of the paired ratios (budget: >= 0.8);
- a renewal pass of 1,000 leases spread over the cluster: round trips per master (budget: 1),
  counted by the client (batches sent) and by the servers (connections that received a renewal
  call during the pass), and its time against the standalone server's single-script pass.

``--write-docs`` writes the "Cluster" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid
from typing import Any

from benchutil import machine, write_section
from redis.crc import key_slot

from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import LeaseStore, store_for
from celery_singleflight.testing import RedisServer
from celery_singleflight.testing.engines import RedisClusterServers

TTL = 30.0
KEYS = 1_000
RENEWED = 1_000


class _Lease:
    def __init__(self, store: LeaseStore, key: str, token: str) -> None:
        self.store, self.key, self.token, self.slot, self.ttl = store, key, token, 0, TTL


class Pairs:
    """Acquire + release of keys ``pair:0`` ... ``pair:999`` in turn (spread over the slots)."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.i = 0
        self.keys = [f"pair:{n}" for n in range(KEYS)]

    def pair(self) -> None:
        key = self.keys[self.i % KEYS]
        self.i += 1
        token = uuid.uuid4().hex
        got = self.store.acquire(key, token, TTL, Holder(task_id=token))
        if not isinstance(got, Acquired) or not self.store.release(key, token, fence=got.fence).ours:
            raise RuntimeError(f"an uncontended acquire + release of {key} failed: {got}")

    def rate(self, seconds: float) -> tuple[float, float]:
        """(pairs/s, client CPU seconds per pair) over about ``seconds``."""
        done = 0
        start, cpu = time.perf_counter(), time.process_time()
        deadline = start + seconds
        while True:
            for _ in range(50):
                self.pair()
            done += 50
            now = time.perf_counter()
            if now >= deadline:
                return done / (now - start), (time.process_time() - cpu) / done


def interleaved(
    cluster: Pairs, standalone: Pairs, rounds: int, slice_s: float
) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Per slice: (pairs/s, client CPU per pair) on the Cluster and on the standalone server."""
    ours: list[tuple[float, float]] = []
    base: list[tuple[float, float]] = []
    for n in range(rounds):  # alternate which goes first, so drift hits both alike
        first, second = (cluster, standalone) if n % 2 == 0 else (standalone, cluster)
        a = first.rate(slice_s)
        b = second.rate(slice_s)
        ours.append(a if first is cluster else b)
        base.append(b if first is cluster else a)
    return ours, base


def hold(store: LeaseStore, count: int, prefix: str) -> list[_Lease]:
    leases = []
    for n in range(count):
        token = uuid.uuid4().hex
        got = store.acquire(f"{prefix}:{n}", token, TTL, Holder(task_id=token))
        assert isinstance(got, Acquired)
        leases.append(_Lease(store, f"{prefix}:{n}", token))
    return leases


def _renew_calls(client: Any) -> int:
    stats: Any = client.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))




def renewal(
    cluster: RedisClusterServers, store: LeaseStore, standalone: LeaseStore, passes: int
) -> dict[str, Any]:
    leases = hold(store, RENEWED, "renew")
    local = hold(standalone, RENEWED, "renew")
    assert all(store.renew(leases))  # warm: connections, scripts
    assert all(standalone.renew(local))
    nodes = [node.client() for node in cluster.nodes]
    cluster_client: Any = store.client
    owners = [cluster_client.nodes_manager.get_node_from_slot(_slot(store, lease)).port for lease in leases]
    per_node_keys = [owners.count(node.connection_pool.connection_kwargs["port"]) for node in nodes]
    trips_before = store.renew_round_trips
    times: list[float] = []
    local_times: list[float] = []
    calls: list[list[int]] = []
    for _ in range(passes):
        before = [_renew_calls(node) for node in nodes]
        start = time.perf_counter()
        assert all(store.renew(leases))
        times.append(time.perf_counter() - start)
        calls.append([_renew_calls(node) - b for node, b in zip(nodes, before, strict=True)])
        start = time.perf_counter()
        assert all(standalone.renew(local))
        local_times.append(time.perf_counter() - start)
    trips = (store.renew_round_trips - trips_before) / passes
    return {
        "trips_per_pass": trips, "masters": len(nodes), "per_node_keys": per_node_keys,
        "calls": [max(c[i] for c in calls) for i in range(len(nodes))],
        "cluster_ms": statistics.median(times) * 1000, "standalone_ms": statistics.median(local_times) * 1000,
    }


def _slot(store: LeaseStore, lease: _Lease) -> int:
    return int(key_slot(store.layout.run(lease.key).encode()))


def run(seconds: float, rounds: int, write_docs: bool) -> None:
    namespace = f"sfbench-{uuid.uuid4().hex[:8]}"
    with RedisClusterServers() as cluster, RedisServer() as server:
        cluster_store = store_for(cluster.url, namespace)
        standalone_store = store_for(f"{server.url}/0", namespace)
        on_cluster, on_server = Pairs(cluster_store), Pairs(standalone_store)
        for _ in range(KEYS):  # warm: every node's connection, scripts, the key names
            on_cluster.pair()
            on_server.pair()
        ours_slices, base_slices = interleaved(on_cluster, on_server, rounds, seconds / rounds)
        ours = [rate for rate, _ in ours_slices]
        base = [rate for rate, _ in base_slices]
        ratios = [a / b for a, b in zip(ours, base, strict=True)]
        ratio = statistics.median(ratios)
        cpu_ours = statistics.median(cpu for _, cpu in ours_slices) * 1e6
        cpu_base = statistics.median(cpu for _, cpu in base_slices) * 1e6
        cpu_ratio = statistics.median(b[1] / a[1] for a, b in zip(ours_slices, base_slices, strict=True))
        load = os.getloadavg()[0]
        renew = renewal(cluster, cluster_store, standalone_store, passes=5)
        per_master = renew["trips_per_pass"] / renew["masters"]
        keys_per_master = " / ".join(str(n) for n in renew["per_node_keys"])
        calls_per_master = " / ".join(str(n) for n in renew["calls"])
        rows = [
            "| measure | Cluster (3 masters) | standalone | budget | verdict |",
            "|---|---:|---:|---|---|",
            f"| acquire+release pairs/s, 1 client, {KEYS:,} keys in turn (median of {rounds} interleaved "
            f"slices) | {statistics.median(ours):,.0f} | {statistics.median(base):,.0f} | "
            f"≥ 0.8 x standalone | {ratio:.2f} x {'PASS' if ratio >= 0.8 else 'MISS'} |",
            f"| client CPU per pair (median; paired ratio standalone / cluster: {cpu_ratio:.2f}) | "
            f"{cpu_ours:.0f} µs | {cpu_base:.0f} µs | — | info |",
            f"| round trips per {RENEWED:,}-lease renewal pass, client (batches sent) | "
            f"{renew['trips_per_pass']:.0f} ({per_master:.2f} per master) | 1 | 1 per master | "
            f"{'PASS' if per_master <= 1.0 else 'MISS'} |",
            f"| leases per master | {keys_per_master} | {RENEWED:,} | — | info |",
            f"| script calls per master in one pass, counted by the servers (one per hash slot, sent as "
            f"one batch) | {calls_per_master} | 1 | — | info |",
            f"| time per renewal pass (median of 5) | {renew['cluster_ms']:.2f} ms | "
            f"{renew['standalone_ms']:.2f} ms | — | info |",
        ]
        report = "\n".join(rows)
        notes = (
            "A renewal pass writes every node's calls before reading any reply: one round trip per "
            "master. The servers and the client share "
            f"{os.cpu_count()} cores (load {load:.2f} at the end of the pairs), which spreads the "
            "per-slice ratios."
        )
        print(report)
        print()
        print(notes)
        if write_docs:
            write_section("cluster", "\n\n".join([
                "## Redis Cluster (`benchmarks/bench_cluster.py`)",
                "Alone: `.venv/bin/python benchmarks/bench_cluster.py` (it "
                "starts a private 3-master Redis Cluster and a private standalone redis-server).",
                f"Measured {machine()}.", report, notes,
            ]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=15.0,
                        help="total time of the interleaved pair slices")
    parser.add_argument("--rounds", type=int, default=50, help="interleaved slices")
    parser.add_argument("--write-docs", action="store_true", help="write the figures into docs/benchmarks.md")
    args = parser.parse_args()
    run(args.seconds, args.rounds, args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
