"""A Redis Cluster of 3 masters (private redis-servers, slots assigned by redis-cli): every
policy, progress, status, the CLI and the queue sweeper on real workers, and the heartbeat's
renewal grouped by slot (one round trip per node).

The broker, the results and the run recorder stay on the session's standalone server; only the
leases live on the Cluster (``SF_TEST_LEASE_REDIS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, RedisClusterException

from celery_singleflight import SingleFlightTask, force_release, hold
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.connection.targets import build_client, target_from_settings
from celery_singleflight.ops.acl import CLUSTER_COMMANDS, acl_rule, connection_commands
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore, store_for
from celery_singleflight.run.heartbeat import heartbeat_for
from celery_singleflight.testing import RedisServer, WorkerProcess, binary_server_kind
from celery_singleflight.testing.engines import RedisClusterServers
from celery_singleflight.worker.preflight import preflight

from .conftest import IN_CI, TESTS, wait_for, worker_env
from .topology_mix import check_outcomes, run_policy_mix

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)


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


@pytest.fixture
def lease_env(cluster: RedisClusterServers) -> Iterator[dict[str, str]]:
    yield {"SF_TEST_LEASE_REDIS": cluster.url}
    client = cluster.client()
    client.flushall(target_nodes=RedisCluster.PRIMARIES)


class _Lease:
    def __init__(self, store: Any, key: str, token: str, ttl: float = 10.0) -> None:
        self.store, self.key, self.token, self.slot, self.ttl = store, key, token, 0, ttl
        self.layout = store.layout


def test_the_cluster_url_builds_a_cluster_client(cluster: RedisClusterServers) -> None:
    client = redis_client(target_from_settings(cluster.url))
    assert isinstance(client, RedisCluster) and len(client.get_primaries()) == 3


def test_renewal_is_one_round_trip_per_node_and_tells_lost_from_held(
    cluster: RedisClusterServers, lease_env: dict[str, str]
) -> None:
    """Given 300 leases spread over the 3 masters, one renewal makes one round trip per node
    (every slot's call written before any reply is read), renews all of them, reports exactly
    the one whose record was deleted as lost, and recovers a node that forgot the scripts."""
    store = store_for(cluster.url, "sf")
    leases = []
    for i in range(300):
        token = uuid.uuid4().hex
        store.acquire(f"ren:{i}", token, 10.0, Holder(f"t{i}"))
        leases.append(_Lease(store, f"ren:{i}", token))
    nodes = {store.client.nodes_manager.get_node_from_slot(key_slot(store.layout.run(le.key).encode())).name
             for le in leases}
    assert len(nodes) == 3
    assert store.renew(leases) == [True] * 300  # loads the script on each node (NOSCRIPT)
    before = store.renew_round_trips
    assert store.renew(leases) == [True] * 300
    assert store.renew_round_trips - before == 3
    cluster.client().delete(store.layout.run("ren:7"))
    for node in cluster.nodes:
        node.client().script_flush()  # as after a restart: each node loads it and gets its batch again
    before = store.renew_round_trips
    assert store.renew(leases) == [i != 7 for i in range(300)]
    assert store.renew_round_trips - before == 9


# about 15 s: every policy on a six-node Cluster through a real worker (the Cluster is the module's)
@pytest.mark.worker
def test_every_policy_progress_and_status_on_the_cluster(
    cluster: RedisClusterServers, lease_env: dict[str, str], sfapp: ModuleType, start_worker: Any,
    redis_server: RedisServer,
) -> None:
    """A real worker whose leases live on the Cluster runs skip, raise, queue, join,
    max_concurrency, progress and heartbeat tasks correctly; the status reader, held() and the
    CLI (ls, show) read them across all nodes, without KEYS."""
    worker: WorkerProcess = start_worker(concurrency=6, env=lease_env)
    keys = run_policy_mix(sfapp, worker.queue, "cl", store_for(cluster.url, "sf"))
    # held until the test revokes it, however long the checks and CLI starts take on a busy machine
    sleeper = sfapp.sleeper.apply_async(("cl-held", 600.0), queue=worker.queue)
    reader = StatusReader(store_for(cluster.url, "sf"))
    check_outcomes(reader, keys)
    slots = {key_slot(reader.store.layout.run(k).encode()) for k in keys.values()}
    assert len(slots) == len(keys)  # spread over the cluster
    wait_for(lambda: [st.key for st in reader.held()] == ["k:cl-held"], timeout=15)

    env = {**os.environ, **worker_env(redis_server, **lease_env)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "celery", "-A", "sfapp", "singleflight", *args],
                              cwd=TESTS, env=env, capture_output=True, text=True, timeout=60)

    listed = cli("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [row["key"] for row in json.loads(listed.stdout)] == ["k:cl-held"]
    shown = cli("show", keys["p"], "--json")
    assert shown.returncode == 1, shown.stderr  # not held (exit 1), its last run shown
    assert json.loads(shown.stdout)["outcome"] == "succeeded"
    held = cli("show", "k:cl-held", "--json")
    assert held.returncode == 0 and json.loads(held.stdout)["task_id"] == sleeper.id, held.stderr
    acl = cli("acl")
    handshake = connection_commands(binary_server_kind())
    assert acl.stdout.strip().endswith(" ".join(f"+{c}" for c in (*CLUSTER_COMMANDS, *handshake)))
    released = cli("release", "k:cl-held", "--force")
    assert released.returncode == 0, released.stderr
    assert sleeper.id in released.stdout
    sleeper.revoke(terminate=True)  # the worker stops at once at teardown
    for node in cluster.nodes:
        stats: Any = node.client().info("commandstats")
        assert "cmdstat_keys" not in stats


@pytest.mark.worker
def test_the_sweeper_resumes_a_dead_holders_queue_on_the_cluster(
    cluster: RedisClusterServers, lease_env: dict[str, str], sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a 3 s TTL, a holder and 3 parked runs on the Cluster, when the whole worker is
    SIGKILLed (nobody releases), a new worker runs the parked runs in order once the lease runs
    out: the sweeper's index on the Cluster hands the key on."""
    q = f"cl-sweep-{uuid.uuid4().hex[:8]}"
    env = {**lease_env, "SF_TEST_TTL": "3"}
    first: WorkerProcess = start_worker(concurrency=2, queue=q, env=env)
    sfapp.queued_sleeper.apply_async(("cl-host",), queue=q)
    wait_for(lambda: sfapp.recorder.get("pid:cl-host"), timeout=15)
    parked = [sfapp.queued.apply_async(("cl-host", n, 0.01), queue=q) for n in range(1, 4)]
    reader = StatusReader(store_for(cluster.url, "sf"))
    wait_for(lambda: (st := reader.read("q:cl-host")) is not None and st.queued == 3, timeout=15)
    first.kill()
    start_worker(concurrency=2, queue=q, env=env)
    assert [r.get(timeout=30) for r in parked] == [1, 2, 3]
    assert sfapp.recorder.lrange("order:cl-host", 0, -1) == [b"1", b"2", b"3"]
    assert sfapp.recorder.llen("overlaps") == 0


def _move_slot(cluster: RedisClusterServers, slot: int) -> tuple[int, int]:
    """Reshard: move ``slot`` (with its keys) to another master, as redis-cli --cluster reshard
    does; returns (from port, to port). Clients keep their old slot map until a MOVED."""
    ids = {node.port: node.client().execute_command("CLUSTER MYID").decode() for node in cluster.nodes}
    owner = next(n for n in cluster.nodes
                 if any(a <= slot <= b for a, b, *_ in _slot_ranges(n.client())))
    target = next(n for n in cluster.nodes if n is not owner)
    source, dest = owner.client(), target.client()
    dest.execute_command("CLUSTER SETSLOT", slot, "IMPORTING", ids[owner.port])
    source.execute_command("CLUSTER SETSLOT", slot, "MIGRATING", ids[target.port])
    keys = source.execute_command("CLUSTER GETKEYSINSLOT", slot, 1000)
    if keys:
        source.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
    for node in cluster.nodes:
        node.client().execute_command("CLUSTER SETSLOT", slot, "NODE", ids[target.port])
    return owner.port, target.port


def _slot_ranges(client: Any) -> list[tuple[int, int]]:
    """The slot ranges the node of ``client`` serves as master."""
    port = client.connection_pool.connection_kwargs["port"]
    return [(int(start), int(end)) for start, end, master, *_ in client.execute_command("CLUSTER SLOTS")
            if int(master[1]) == port]


def test_a_resharded_slot_is_followed_not_reported_lost(
    cluster: RedisClusterServers, lease_env: dict[str, str]
) -> None:
    """Given a held lease whose slot then moves to another master (the client's slot map is
    now stale), its renewal follows the MOVED and keeps it, a release finds it, and a new
    acquire on that slot works: a redirection is never read as a lost lease."""
    store = store_for(cluster.url, "sf")
    token = uuid.uuid4().hex
    store.acquire("reshard:1", token, 10.0, Holder("t-reshard"))
    lease = _Lease(store, "reshard:1", token)
    assert store.renew([lease]) == [True]
    slot = key_slot(store.layout.run("reshard:1").encode())
    src, dst = _move_slot(cluster, slot)
    assert src != dst
    assert store.renew([lease]) == [True]
    assert store.time_left("reshard:1") is not None
    assert store.release("reshard:1", token).ours
    token2 = uuid.uuid4().hex
    assert store.acquire("reshard:1", token2, 10.0, Holder("t-after")).fence > 0  # type: ignore[union-attr]
    assert store.release("reshard:1", token2).ours


def _ops_as(url: str) -> None:
    """Acquire (several slots), renew, read, list, time and release, as the user of ``url``."""
    store = LeaseStore(build_client(target_from_settings(url), {}), KeyLayout("sf"))
    leases = []
    for i in range(20):
        token = uuid.uuid4().hex
        assert isinstance(store.acquire(f"acl:{i}", token, 10.0, Holder(f"t{i}")), Acquired)
        leases.append(_Lease(store, f"acl:{i}", token))
    assert all(store.renew(leases))
    reader = StatusReader(store)
    assert len(reader.held()) == 20 and reader.read("acl:3") is not None
    assert store.time_left("acl:3") is not None
    for lease in leases:
        assert store.release(lease.key, lease.token).ours


def test_the_cluster_acl_rule_is_enough_and_each_cluster_command_is_needed(
    cluster: RedisClusterServers, lease_env: dict[str, str]
) -> None:
    """The rule `celery singleflight acl` prints for a Cluster, set on every node, runs the
    library's calls with nothing refused; without either cluster command it cannot connect."""
    url = cluster.url.replace("redis+cluster://", "redis+cluster://sf-cluster:pw@")

    def set_rule(rule: list[str]) -> None:
        for node in cluster.nodes:
            admin = node.client()
            admin.execute_command("ACL", "SETUSER", "sf-cluster", *rule)
            admin.acl_log_reset()

    rule = acl_rule("sf", "pw", cluster=True, server=binary_server_kind())
    set_rule(rule)
    _ops_as(url)
    assert [e for node in cluster.nodes for e in node.client().acl_log()] == []
    for needed in CLUSTER_COMMANDS:
        set_rule([word for word in rule if word != f"+{needed}"])
        with pytest.raises((RedisClusterException, NoPermissionError)):
            _ops_as(url)


def test_the_start_checks_look_at_every_primary(cluster: RedisClusterServers) -> None:
    app = Celery("cluster-preflight", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=cluster.url)

    @app.task(name="cluster.guarded", base=SingleFlightTask, lock_key="g:<x>")
    def guarded(x: int) -> int:
        return x

    summaries = [f for f in preflight(app) if f.check == "summary"]
    assert len(summaries) == 3
    assert {f.message.split("primary ")[1].split(")")[0] for f in summaries} == {
        f"127.0.0.1:{node.port}" for node in cluster.nodes}
    assert all("role master" in f.message and "scripts loaded" in f.message for f in summaries)


def test_a_renewal_reply_lost_on_one_node_is_sent_again_and_keeps_the_leases(
    cluster: RedisClusterServers, lease_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given 60 leases over 3 masters, when one node runs its batch but its first reply is lost
    (the connection breaks after the server ran the calls), the calls of that node are sent again
    through the cluster client: they run twice, and every lease is still reported renewed."""
    store = store_for(cluster.url, "sf")
    leases = []
    for i in range(60):
        token = uuid.uuid4().hex
        store.acquire(f"lost-reply:{i}", token, 10.0, Holder(f"t{i}"))
        leases.append(_Lease(store, f"lost-reply:{i}", token))
    assert all(store.renew(leases))
    victim = cluster.nodes[1].port
    original = redis.connection.Connection.read_response
    lost: list[int] = []

    def read_response(conn: Any, *args: Any, **kwargs: Any) -> Any:
        reply = original(conn, *args, **kwargs)  # the server ran it; the reply is read, then lost
        if conn.port == victim and not lost:
            lost.append(conn.port)
            raise redis.ConnectionError("reply lost (test)")
        return reply

    before = [_evalsha_calls(node) for node in cluster.nodes]
    monkeypatch.setattr(redis.connection.Connection, "read_response", read_response)
    assert store.renew(leases) == [True] * 60
    monkeypatch.undo()
    assert lost == [victim]
    ran = [_evalsha_calls(node) - b for node, b in zip(cluster.nodes, before, strict=True)]
    on_victim = sum(1 for le in leases if store.client.nodes_manager.get_node_from_slot(
        key_slot(store.layout.run(le.key).encode())).port == victim)
    assert ran[1] == 2 * on_victim  # the batch ran, then its calls again through the cluster client


def _evalsha_calls(node: RedisServer) -> int:
    stats: Any = node.client().info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


@pytest.fixture(scope="module")
def replicated() -> Iterator[RedisClusterServers]:
    """3 masters, each with a replica (about 7 s to start)."""
    servers = RedisClusterServers(masters=3, replicas=1)
    try:
        servers.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        if IN_CI:
            raise
        pytest.skip(f"a replicated Redis Cluster cannot start here: {exc}")
    yield servers
    servers.close()


def test_a_held_lease_survives_a_cluster_failover_of_its_master(replicated: RedisClusterServers) -> None:
    """Given leases held on every master, when the replica of one lease's master takes over
    (CLUSTER FAILOVER: the old master becomes its replica and answers MOVED), the next renewal
    follows the redirection and keeps every lease; the lease is then released on the new master
    and the slot takes new leases."""
    store = store_for(replicated.url, "sf")
    leases = []
    for i in range(30):
        token = uuid.uuid4().hex
        store.acquire(f"failover:{i}", token, 10.0, Holder(f"t{i}"))
        leases.append(_Lease(store, f"failover:{i}", token))
    assert all(store.renew(leases))
    run = store.layout.run("failover:0")
    old_master = store.client.nodes_manager.get_node_from_slot(key_slot(run.encode()))
    master = replicated.node_on(old_master.port).client()
    info: Any = master.info("replication")
    replica = replicated.node_on(int(info["slave0"]["port"])).client()
    assert master.wait(1, 5000) == 1  # the replica has the leases
    replica.execute_command("CLUSTER FAILOVER")
    wait_for(lambda: replica.info("replication")["role"] == "master", timeout=15)
    assert store.renew(leases) == [True] * 30
    assert store.time_left("failover:0") is not None
    assert store.release("failover:0", leases[0].token).ours
    token = uuid.uuid4().hex
    assert isinstance(store.acquire("failover:0", token, 10.0, Holder("after")), Acquired)


def test_holders_on_every_master_are_told_at_once_by_the_push(cluster: RedisClusterServers) -> None:
    """Holds of this process on keys of all three masters' slots, with the default TTL: a
    force-release of each reaches the holder before any renewal could (one subscription of the process; a
    PUBLISH from a script on any master reaches it), so no renewal was needed."""
    app = Celery("cluster-told", broker="memory://", set_as_current=False)
    app.conf.singleflight_redis_url = cluster.url
    client = cluster.client()
    keys: dict[str, str] = {}
    n = 0
    while len(keys) < 3:  # one key per master
        key = f"told:{n}"
        node = client.nodes_manager.get_node_from_slot(key_slot(f"sf:{{{key}}}:run".encode())).name
        keys.setdefault(node, key)
        n += 1
    with hold(app, "told:warm") as warm:  # the process's inbox listens from its first lease on
        inbox = heartbeat_for(warm.lease.store).inbox
    assert inbox.subscribed.wait(5)
    for key in keys.values():
        with hold(app, key) as lease:
            sent = time.monotonic()
            assert force_release(app, key, by="ops") is not None
            # under half the first renewal (10 s): only the push tells this soon, even on a loaded machine
            assert lease.lease.wait_superseded(5.0), f"{key} not told"
            assert time.monotonic() - sent < 5.0 and "force-released by ops" in lease.lease.lost_reason


def test_a_master_other_than_the_epoch_keys_losing_its_data_is_seen_by_the_marks(
    cluster: RedisClusterServers, lease_env: dict[str, str], sfapp: ModuleType, tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Given a run parked on a key whose master is not the epoch key's, with its journal mark, when
    that master alone loses its data (flushed), the epoch still reads intact (its master kept its
    data), but the worker's next compaction finds the run gone with its mark and sends it again;
    a run parked on the epoch key's master, still waiting, stays journaled."""
    from celery.canvas import Signature

    from celery_singleflight.protocol.epoch import EPOCH_KEY
    from celery_singleflight.protocol.handoff import QUEUE
    from celery_singleflight.run.journal import Journal, new_mark
    from celery_singleflight.worker.recovery import Recovery

    sent: list[str] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self.options["task_id"]))
    client = cluster.client()
    store = LeaseStore(client, KeyLayout("sf"))
    epoch_node = client.get_node_from_key(store.layout.index(EPOCH_KEY))
    keys = [f"k{n}" for n in range(64)]
    other = next(k for k in keys if client.get_node_from_key(store.layout.key(QUEUE, k)) != epoch_node)
    same = next(k for k in keys if client.get_node_from_key(store.layout.key(QUEUE, k)) == epoch_node)
    job = Recovery(sfapp.app, Journal(str(tmp_path), "w@host"))
    job.stores["sf"] = store
    parked: dict[str, str] = {}
    for key in (other, same):
        task_id, mark = f"parked-{uuid.uuid4().hex[:6]}", new_mark()
        message = json.dumps(dict(sfapp.queued.s(key, 1).set(task_id=task_id)))
        assert isinstance(store.acquire(key, f"holder-{key}", 30, Holder(f"h-{key}")), Acquired)
        assert store.handoff.park(key, task_id, "h1", message, None, mark=mark) is not None
        sfapp.app.backend.store_result(task_id, {"key": key}, "QUEUED")
        job.journal.append({"kind": "park", "namespace": "sf", "key": key, "task_id": task_id,
                            "task": sfapp.queued.name, "message": message, "at": time.time(), "mark": mark})
        parked[key] = task_id
    assert job.sweep_once() == 0 and sent == []  # the first look: both wait
    node = client.get_node_from_key(store.layout.key(QUEUE, other))
    cluster.node_on(int(node.port)).client().flushall()  # that master alone loses its data
    job.compact_at = 0.0
    assert job.sweep_once() == 1
    assert sent == [parked[other]]
    assert [e.task_id for e in job.journal.entries()] == [parked[same]]
