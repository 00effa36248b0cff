"""A failover right after a grant, with and without ``min_replicas`` (issue 24), on a real primary,
replica and three sentinels, with a real worker.

The replica replicates through a loopback proxy that the test stalls before each grant, so the
grant never reaches it (a stalled link holds its bytes: the link stays up for the sentinels).
The primary is then killed; the sentinels promote the replica, and a second run of the key is
sent. The killed server comes back as the new primary's replica, through a new proxy, for the
next round. Each round does it for two keys at once: one task without ``min_replicas``, one
with ``min_replicas=1``. Every body appends its start and end to a history on another Redis.

- Without it: the promoted replica never had the grant and gives the key to the second run
  while the first still runs. Expected in every round; asserted to happen at least once.
- With it: the first grant is never confirmed, so no body runs on it (it is released and the
  run re-sent, ``fail_closed``); no two runs of the key overlap, and every run ends SUCCESS.

``pytest tests/test_min_replicas_failover.py -s`` prints the figures the docs quote.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_singleflight.testing import RedisServer, WorkerProcess
from celery_singleflight.testing.engines import SentinelGroup

from .chaos.proxy import TcpProxy
from .conftest import IN_CI, ROOT, TESTS, wait_for

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

ROUNDS = 4
BODY = 3.0  # seconds: longer than a failover, so the first run still runs when the second starts
FAILOVER_MS = 2000  # the sentinels' failover-timeout while a failover may happen


@pytest.fixture
def side() -> Iterator[RedisServer]:
    """The broker, results and history: a private Redis the test never kills."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    # failover-timeout 2 s: a failover a sentinel started (or voted for) blocks the next one for
    # twice that; they also re-point a replica linked through the proxy after it, unless told to
    # leave it (see _sentinels_leave_replicas)
    sentinels = SentinelGroup(down_after_ms=500, failover_timeout_ms=FAILOVER_MS)
    try:
        sentinels.start()
    except (RuntimeError, OSError) as exc:
        if IN_CI:
            raise
        pytest.skip(f"Sentinel cannot start here: {exc}")
    yield sentinels
    sentinels.close()


@pytest.fixture
def replicaapp(side: RedisServer) -> Iterator[ModuleType]:
    os.environ["SF_REPLICA_SIDE"] = side.url
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    sys.modules.pop("replicaapp", None)
    import replicaapp as module

    yield module
    sys.modules.pop("replicaapp", None)


def _through_proxy(replica: RedisServer, master_port: int) -> TcpProxy:
    proxy = TcpProxy(master_port).start()
    replica.client().replicaof("127.0.0.1", str(proxy.port))
    return proxy


def _out_of_step(group: SentinelGroup, master: RedisServer, replica: RedisServer, proxy: TcpProxy) -> str:
    """What keeps the round from starting ("" once nothing does): the replica linked through the
    proxy, with all the master wrote, and seen healthy by every sentinel. A replica whose master
    address is not the master's (the proxy's) is re-pointed by the sentinels at the master itself
    unless they are told to leave it (:func:`_sentinels_leave_replicas`); it is linked through
    the proxy again here."""
    try:
        info = replica.client().info("replication")
        if int(info.get("master_port", 0)) != proxy.port:
            replica.client().replicaof("127.0.0.1", str(proxy.port))
            return f"the replica followed port {info.get('master_port')}, not the proxy"
        offset = master.client().info("replication")["master_repl_offset"]
        if info.get("master_link_status") != "up" or info.get("slave_repl_offset") != offset:
            return (f"the replica's link is {info.get('master_link_status')} at offset "
                    f"{info.get('slave_repl_offset')} of {offset}")
        for sentinel in group.sentinels:
            seen: Any = sentinel.client().sentinel_slaves(group.master_name)
            if not any(int(r["port"]) == replica.port and r["flags"] == "slave" for r in seen):
                return f"a sentinel sees the replicas as {[(r['port'], r['flags']) for r in seen]}"
    except redis.RedisError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _in_step(group: SentinelGroup, master: RedisServer, replica: RedisServer, proxy: TcpProxy,
             timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while why := _out_of_step(group, master, replica, proxy):
        if time.monotonic() > deadline:
            raise AssertionError(f"replica not in step within {timeout}s: {why}")
        time.sleep(0.05)


def _sentinels_leave_replicas(group: SentinelGroup, leave: bool) -> None:
    """A sentinel re-points a replica that follows another address than the master's once the
    failover-timeout passed since it saw it do so, at its next look (each 10 s, or 1 s): while
    leaving, that is an hour, so the replica stays on the proxy between rounds. The short one is
    back before the master is killed: it also spaces failovers (twice it since the last one)."""
    for sentinel in group.sentinels:
        sentinel.client().execute_command(
            "SENTINEL", "SET", group.master_name, "failover-timeout", 3_600_000 if leave else FAILOVER_MS)


def _overlaps(events: list[dict[str, Any]]) -> int:
    """Pairs of runs of one key whose [start, end] intervals overlap."""
    runs: dict[str, list[float]] = {}
    for event in events:
        runs.setdefault(event["task"] + str(event["fence"]), []).append(event["at"])
    spans = sorted((min(times), max(times)) for times in runs.values())
    return sum(1 for i, (_, end) in enumerate(spans) for start, _ in spans[i + 1:] if start < end)


# slow by nature (about 35 s): a Sentinel group, a real failover (Sentinel's down-after and election), and
# workers on both sides of it
@pytest.mark.worker
def test_min_replicas_keeps_a_failover_from_handing_a_key_out_twice(
    side: RedisServer, group: SentinelGroup, replicaapp: ModuleType
) -> None:
    history = side.client(3)
    master = group.server_on(group.master_port())
    replica = group.replica
    for server in group.servers:  # a new replica's first sync starts at once (not after 5 s)
        server.client().config_set("repl-diskless-sync-delay", 0)
    proxy = _through_proxy(replica, master.port)
    worker = WorkerProcess("replicaapp", concurrency=4, cwd=str(TESTS), env={
        "SF_REPLICA_SIDE": side.url, "SF_REPLICA_LEASES": group.url,
        "SF_REPLICA_OPTIONS": json.dumps(group.transport_options()),
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    })
    seen = {"unreplicated": 0, "replicated": 0}
    results: list[Any] = []
    try:
        worker.start(replicaapp.app)
        for round_ in range(ROUNDS):
            _sentinels_leave_replicas(group, True)
            _in_step(group, master, replica, proxy)
            proxy.freeze()  # from here the replica gets nothing the master writes
            plain, waiting = f"plain{round_}", f"waiting{round_}"
            firsts = [replicaapp.unreplicated.delay(plain, BODY), replicaapp.replicated.delay(waiting, BODY)]
            # the plain run's body started on its grant; the waiting run's grant is on the master
            wait_for(lambda p=plain: history.llen(f"history:{p}"), timeout=15)
            wait_for(lambda m=master, w=waiting: m.client().exists(f"sf:{{fo:{w}}}:run"), timeout=15)
            master.kill()
            _sentinels_leave_replicas(group, False)  # within down-after (0.5 s): the failover is not held up
            proxy.close()
            seconds = [replicaapp.unreplicated.delay(plain, BODY), replicaapp.replicated.delay(waiting, BODY)]
            new_port = group.wait_master_change(master.port)
            # the killed server comes back as the new master's replica, through a new proxy
            promoted = group.server_on(new_port)
            proxy = TcpProxy(new_port).start()
            master.extra = ["--replicaof", "127.0.0.1", str(proxy.port), "--repl-diskless-sync-delay", "0"]
            master.start()
            master, replica = promoted, master
            for result in [*firsts, *seconds]:
                results.append(result.get(timeout=40))
            for name, key in (("unreplicated", plain), ("replicated", waiting)):
                events = [json.loads(e) for e in history.lrange(f"history:{key}", 0, -1)]
                assert len(events) == 4, (key, events)  # both runs ran, each once
                seen[name] += _overlaps(events)
        print(f"\nfailover right after a grant, {ROUNDS} rounds: runs overlapping without min_replicas"
              f" {seen['unreplicated']}, with min_replicas=1 {seen['replicated']}")
    finally:
        proxy.close()
        worker.stop(timeout=15)
        worker.kill()
        worker.cleanup()
    assert seen["replicated"] == 0
    assert seen["unreplicated"] >= 1
    assert len(results) == 4 * ROUNDS
