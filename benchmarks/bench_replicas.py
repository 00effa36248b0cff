"""What ``min_replicas=1`` costs an uncontended acquire + release pair, against ``min_replicas=0``.

A private primary and one replica (redis-servers on loopback ports, stopped afterwards). One
client takes and releases one key again and again through two stores on the same client: one
with ``min_replicas=0`` (the plain ACQUIRE) and one with ``min_replicas=1`` (ACQUIRE and ``WAIT 1``
in one round trip, the reply once the replica acknowledged the grant). The two run in
alternating slices (as in ``bench_lease.py``), and the cost is the median of the per-slice
ratios and the difference in microseconds per pair. The replica is on the same host, so the
figure is the floor: a replica across a network adds its round trip to every grant.

The result is a report, not a test.

    .venv/bin/python benchmarks/bench_replicas.py [--seconds N] [--write-docs]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

from bench_lease import paired_ratio, pairs_per_second
from benchutil import machine, write_section

from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.replies import Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer


def pair(store: LeaseStore, key: str) -> Callable[[], None]:
    """One run's acquire and release, with a fresh token (as a task does)."""
    holder = Holder("bench")

    def run() -> None:
        token = os.urandom(16).hex()
        store.acquire(key, token, 30.0, holder)
        store.release(key, token)

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=6.0, help="duration of each timed measurement")
    parser.add_argument("--write-docs", action="store_true", help="write the section of docs/benchmarks.md")
    args = parser.parse_args()
    seconds = args.seconds
    with RedisServer(extra=("--repl-diskless-sync-delay", "0")) as primary, \
            RedisServer(extra=("--replicaof", "127.0.0.1", str(primary.port))) as replica:
        deadline = time.monotonic() + 30
        while primary.client().wait(1, 200) < 1:  # the primary counts the replica
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not come up")
        client = redis_client(primary.url)
        off = LeaseStore(client, KeyLayout("bench"))
        on = LeaseStore(client, KeyLayout("bench"), min_replicas=1, replica_timeout=1.0)
        for store in (off, on):  # load the scripts, warm the connection
            pair(store, "warm")()
        rates, per_slice = pairs_per_second([pair(off, "off"), pair(on, "on")], seconds)
        median, low, high = paired_ratio(per_slice[1], per_slice[0])
        extra_us = statistics.median(1e6 / b - 1e6 / a for a, b in zip(*per_slice, strict=True))
        assert replica.client().exists("bench:{on}:run")
    report = "\n".join([
        "## `min_replicas` (`benchmarks/bench_replicas.py`)",
        "",
        f"A private primary and replica on this host. Measured {machine()}.",
        "",
        "| acquire+release pairs/s | `min_replicas=0` | `min_replicas=1` | per-slice ratio | per pair |",
        "|---|---:|---:|---:|---:|",
        f"| one client | {rates[0]:,.0f} | {rates[1]:,.0f} | {median:.2f} ({low:.2f} to {high:.2f}) |"
        f" {extra_us:+.0f} µs |",
    ])
    print(report)
    if args.write_docs:
        write_section("replicas", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
