"""Scripts evicted from the lease Redis's script cache at any moment lose nothing and re-run nothing.

Managed services flush the script cache (a failover, an upgrade, a ``SCRIPT FLUSH`` of their
own), and Redis 7.4+ evicts the scripts ``EVAL`` loaded (the library loads its own with ``SCRIPT
LOAD``, but a cache can be emptied under it all the same). The library calls every protocol
script with ``EVALSHA``; a ``NOSCRIPT`` reply means nothing ran, so it loads the script and calls
it again (until it runs: a flush can come between the load and the call), and that call is the
first run. Here a thread flushes the lease Redis's script cache every
20 ms while a real worker runs every policy (the topology mix): each run must end as it would
without the flushes, no body may run twice, and the server's own counters must show that the
library really met ``NOSCRIPT`` replies (the flushes hit it, not the gaps between its calls).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from ..topology_mix import check_outcomes, run_policy_mix

pytestmark = [pytest.mark.worker, pytest.mark.server]

TAG = "flush"

#: the body runs the mix sends per recorder key (``runs:<key>``): the skipped and refused
#: duplicates and the joiner do not run; the queued key runs its holder and both parked runs,
#: the max_concurrency key all five
EXPECTED_RUNS = {f"{TAG}-s": 1, f"{TAG}-r": 1, f"{TAG}-q": 3, f"{TAG}-j": 1, f"{TAG}-l": 5}
#: the same runs in the recorder's list of every run (``name:key:task id``; limited runs are not in it)
EXPECTED_NAMED = {("skip", f"{TAG}-s"): 1, ("raise", f"{TAG}-r"): 1, ("queue", f"{TAG}-q"): 3,
                  ("join", f"{TAG}-j"): 1}


@pytest.fixture
def lease() -> Iterator[RedisServer]:
    """A private lease Redis of this test, stopped by it."""
    with RedisServer() as server:
        yield server


class Flusher(threading.Thread):
    """Sends ``SCRIPT FLUSH`` to ``client`` every ``every`` seconds until stopped; counts the flushes."""

    def __init__(self, client: redis.Redis, every: float = 0.02) -> None:
        super().__init__(name="script-flusher", daemon=True)
        self.client = client
        self.every = every
        self.flushes = 0
        self.errors: list[BaseException] = []
        self._stop_flag = threading.Event()

    def run(self) -> None:
        while not self._stop_flag.wait(self.every):
            try:
                self.client.script_flush()
            except redis.RedisError as exc:  # reported by the test, not swallowed
                self.errors.append(exc)
                return
            self.flushes += 1

    def stop(self) -> None:
        self._stop_flag.set()
        self.join(timeout=10)


def script_counters(client: redis.Redis, flushes: int) -> dict[str, int]:
    """The server's counts since the last ``CONFIG RESETSTAT``: ``NOSCRIPT`` replies (errorstats,
    Redis 6.2+ and Valkey), ``SCRIPT LOAD`` and ``SCRIPT FLUSH`` calls. Redis 6.2 counts every
    subcommand under ``cmdstat_script``: there the loads are its calls less our ``flushes``."""
    errors: Any = client.info("errorstats")
    stats: Any = client.info("commandstats")
    entry = errors.get("errorstat_NOSCRIPT", {})
    if isinstance(entry, str):  # redis-py 5.0 leaves "count=3" unparsed
        entry = dict(part.split("=", 1) for part in entry.split(","))
    noscript = int(entry.get("count", 0))
    if "cmdstat_script|load" in stats or "cmdstat_script|flush" in stats:
        loads = int(stats.get("cmdstat_script|load", {}).get("calls", 0))
        flushed = int(stats.get("cmdstat_script|flush", {}).get("calls", 0))
    else:
        loads = int(stats.get("cmdstat_script", {}).get("calls", 0)) - flushes
        flushed = flushes
    evalsha = int(stats.get("cmdstat_evalsha", {}).get("calls", 0))
    return {"noscript": noscript, "script_load": loads, "script_flush": flushed, "evalsha": evalsha}


@pytest.mark.timeout(60)
def test_scripts_flushed_every_20ms_lose_nothing_and_rerun_nothing(
    lease: RedisServer, sfapp: ModuleType, start_worker: Any, figures: dict[str, Any]
) -> None:
    """Given a real worker (6 processes) whose lease Redis has its script cache flushed every 20 ms,
    when it runs skip, raise, queue, join, max_concurrency, progress and heartbeat tasks,
    then every run ends as without the flushes (outcomes, order, no overlap, nothing held), each
    body ran exactly as often as the mix sends runs that should execute, no task ran twice, the
    worker logged no NOSCRIPT, and the lease Redis counted NOSCRIPT replies and reloads."""
    admin = lease.client()
    worker = start_worker(concurrency=6, env={"SF_TEST_LEASE_REDIS": f"{lease.url}/0"})
    admin.config_resetstat()  # the start checks' probe (a NOSCRIPT) and loads are not the flusher's
    flusher = Flusher(lease.client())
    began = time.monotonic()
    flusher.start()
    try:
        keys = run_policy_mix(sfapp, worker.queue, TAG, LeaseStore(admin, KeyLayout("sf")))
    finally:
        flusher.stop()
    took = time.monotonic() - began
    counters = script_counters(admin, flusher.flushes)
    info: Any = admin.info("server")
    server = (f"Valkey {info['valkey_version']}" if "valkey_version" in info
              else f"Redis {info['redis_version']}")
    figures.update(server=server, flushes=flusher.flushes, mix_seconds=round(took, 3), **counters)

    assert not flusher.errors, flusher.errors
    assert not flusher.is_alive()
    # the flusher really hit the library: flushes all along, NOSCRIPT replies, scripts loaded again
    assert flusher.flushes >= took / 0.02 / 4, (flusher.flushes, took)
    assert counters["script_flush"] == flusher.flushes, counters
    assert counters["noscript"] > 0, counters
    assert counters["script_load"] > 0, counters
    assert counters["script_load"] <= counters["noscript"], counters  # a load only after a NOSCRIPT

    # lose nothing: every run ended as it should, and no lease is left held
    check_outcomes(StatusReader(LeaseStore(admin, KeyLayout("sf"))), keys)
    # re-run nothing: each key's body ran as often as the mix sends runs that execute, each task once
    recorder = sfapp.recorder
    for key, expected in EXPECTED_RUNS.items():
        ran = [raw.decode() for raw in recorder.lrange(f"runs:{key}", 0, -1)]
        assert len(ran) == expected, (key, ran)
        assert len(set(ran)) == len(ran), (key, ran)
    named = Counter(tuple(raw.decode().split(":")[:2]) for raw in recorder.lrange("runs", 0, -1))
    assert named == EXPECTED_NAMED, named
    assert recorder.llen("overlaps") == 0
    # nothing was lost on the way either: no call failed (a lease left to expire, a progress write
    # or a renewal dropped), and no key waited out a lease's TTL (the mix takes about 3 s)
    log = worker.log()
    failed = [line for line in log.splitlines()
              if any(word in line for word in ("NOSCRIPT", "NoScriptError", "No matching script",
                                               "could not", "Redis refused"))]
    assert not failed, failed
    assert took < 15, took
