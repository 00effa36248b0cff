"""Sentinel: a master, a replica and three sentinels (private redis-servers), with a failover by
``SENTINEL FAILOVER`` and one by killing the master.

- Leases taken after a failover work (a real worker, every policy), and a lease held across a
  clean failover is kept: the renewals that meet the switch are retried, not read as a loss.
- A lease that the failover lost (the promoted replica never had it: replication is
  asynchronous) is reported lost to its holder at its next renewal, never silently kept; the
  next holder's fence is higher.
- The worker's start checks warn that min-replicas-to-write is 0 on the master.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_singleflight import SingleFlightTask, force_release, hold
from celery_singleflight.connection.targets import target_from_settings
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import store_for
from celery_singleflight.run.heartbeat import heartbeat_for
from celery_singleflight.testing.engines import SentinelGroup
from celery_singleflight.worker.preflight import preflight

from .conftest import IN_CI, wait_for
from .topology_mix import check_outcomes, run_policy_mix

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)


def _started() -> Iterator[SentinelGroup]:
    sentinels = SentinelGroup()
    try:
        sentinels.start()
    except (RuntimeError, OSError) as exc:
        if IN_CI:
            raise
        pytest.skip(f"Sentinel cannot start here: {exc}")
    yield sentinels
    sentinels.close()


@pytest.fixture(scope="module")
def group() -> Iterator[SentinelGroup]:
    """One group for the tests that leave it whole (a SENTINEL FAILOVER keeps a master and a
    replica); each test asks the sentinels for the current master."""
    yield from _started()


@pytest.fixture
def fresh_group() -> Iterator[SentinelGroup]:
    """A group of its own, for the test that kills its master."""
    yield from _started()


def sentinel_app(group: SentinelGroup, name: str) -> Celery:
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=group.url,
                    singleflight_redis_transport_options=group.transport_options())
    return app


def test_preflight_warns_when_min_replicas_to_write_is_zero(group: SentinelGroup) -> None:
    app = sentinel_app(group, "sentinel-preflight")

    @app.task(name="sentinel.guarded", lock_key="g:<x>", base=SingleFlightTask)
    def guarded(x: int) -> int:
        return x

    found = preflight(app)
    warned = [f for f in found if f.check == "replication"]
    assert len(warned) == 1 and warned[0].level == logging.WARNING
    assert "min-replicas-to-write" in warned[0].message and "sentinel://" in warned[0].message
    summary = next(f for f in found if f.check == "summary")
    assert "role master" in summary.message and "1 replica" in summary.message
    master = group.server_on(group.master_port()).client()
    master.config_set("min-replicas-to-write", 1)
    try:
        assert not [f for f in preflight(app) if f.check == "replication"]
    finally:
        master.config_set("min-replicas-to-write", 0)


def test_a_lease_the_failover_lost_is_reported_lost_at_the_next_renewal(fresh_group: SentinelGroup) -> None:
    """Given a lease held with a 9 s TTL (renewed every 3 s) that the replica does not have (as
    when the master dies before replicating it), when the master is killed and the replica
    promoted, the holder's next renewal finds the lease gone and reports it lost, well before
    its TTL would have run out; a new holder gets the key with a higher fence."""
    group = fresh_group
    app = sentinel_app(group, "sentinel-lost")
    old_port = group.master_port()
    with hold(app, "failover:lost", ttl=9.0, holder="first") as lease:
        master = group.server_on(old_port).client()
        assert master.wait(1, 5000) == 1  # replicated ...
        replica = group.replica.client()
        replica.config_set("replica-read-only", "no")
        names = [n for n in replica.scan_iter(match="sf:{failover:lost}:*")]
        assert names
        replica.delete(*names)  # ... and then lost on the replica: it never saw the lease
        group.master.kill()
        new_port = group.wait_master_change(old_port)
        promoted_at = time.monotonic()
        wait_for(lambda: lease.lease.lost_known, timeout=15)  # the heartbeat's verdict
        assert time.monotonic() - promoted_at < 9.0
        assert "expired or was released" in lease.lease.lost_reason
        with hold(app, "failover:lost", ttl=9.0, holder="second") as second:
            assert second.fence > lease.fence
            assert group.server_on(new_port).client().exists("sf:{failover:lost}:run")


@pytest.mark.worker
def test_leases_after_a_sentinel_failover_work_and_a_held_one_is_kept(
    group: SentinelGroup, sfapp: ModuleType, start_worker: Any
) -> None:
    """A lease held here (6 s TTL, renewed every 2 s) while SENTINEL FAILOVER promotes the
    replica is kept: the renewals that meet the switch (READONLY, a closed connection) are sent
    again to the new master, not read as a loss. A real worker whose leases live behind the
    sentinels then runs every policy, progress and the heartbeat on the new master."""
    env = {"SF_TEST_LEASE_REDIS": group.url, "SF_TEST_LEASE_OPTIONS": json.dumps(group.transport_options())}
    worker = start_worker(concurrency=6, env=env)
    app = sentinel_app(group, "sentinel-kept")
    old_port = group.master_port()
    with hold(app, "failover:kept", ttl=6.0, holder="kept") as lease:
        renewed = lease.lease.confirmed_at
        group.failover()
        new_port = group.wait_master_change(old_port)
        wait_for(lambda: lease.lease.confirmed_at > renewed + 2.5, timeout=15)  # a renewal after the switch
        assert not lease.lost
        record = group.server_on(new_port).client().get("sf:{failover:kept}:run")
        assert record is not None and b'"kept"' in record
    store = store_for(target_from_settings(group.url, group.transport_options()), "sf")
    keys = run_policy_mix(sfapp, worker.queue, "fo", store)
    reader = StatusReader(store)
    check_outcomes(reader, keys)


def test_a_holder_behind_the_sentinels_is_told_at_once_also_after_a_failover(
    fresh_group: SentinelGroup,
) -> None:
    """A hold with the default TTL behind the sentinels learns a force-release within a second
    (the push); after SENTINEL FAILOVER the process's inbox listens on the new master, and a hold
    taken there is told at once too. A group of its own: a failover blocks the next one for a while."""
    group = fresh_group
    app = sentinel_app(group, "sentinel-told")

    def told(key: str) -> None:
        with hold(app, key) as lease:
            beat = heartbeat_for(lease.lease.store)
            wait_for(lambda: beat.inbox.subscribed.is_set(), timeout=10)
            sent = time.monotonic()
            assert force_release(app, key, by="ops") is not None
            # under half the first renewal (10 s): only the push tells this soon, even on a loaded machine
            assert lease.lease.wait_superseded(5.0), f"{key} not told"
            assert time.monotonic() - sent < 5.0 and "force-released by ops" in lease.lease.lost_reason

    with hold(app, "told:warm"):
        pass
    told("told:before")
    old_port = group.master_port()
    group.failover()
    group.wait_master_change(old_port)
    deadline = time.monotonic() + 20
    while True:  # the inbox reconnects to the new master (a push meanwhile is lost: renewals cover it)
        try:
            told("told:after")
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
