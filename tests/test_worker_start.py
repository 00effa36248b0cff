"""What a worker checks once at start against each lease Redis and its broker settings.

Real ``celery worker`` processes and private ``redis-server``s on free loopback ports (a primary,
a replica of it, one with ACL users), all started here and stopped by PID. The app-level checks
call ``preflight(app)`` on small apps defined below, against the same private servers.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_singleflight import SingleFlightTask
from celery_singleflight.connection.clients import redacted_url
from celery_singleflight.constants import MAX_CLOCK_SKEW
from celery_singleflight.errors import ConfigurationError
from celery_singleflight.protocol.servers import OLDEST
from celery_singleflight.protocol.store import SCRIPTS
from celery_singleflight.testing import RedisServer, WorkerProcess, binary_server_kind, free_port
from celery_singleflight.worker.preflight import (
    Finding,
    clock_finding,
    clock_skew,
    preflight,
    run_at_worker_start,
)

from .conftest import TESTS, wait_for, worker_env
from .test_isolation import PASSWORD, acl_rule, denied

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

SUMMARY = re.compile(
    r"INFO/MainProcess\] lease Redis (?P<url>\S+): (?P<server>\w+ [\d.]+), role master, 0 replicas,"
    r" (?P<scripts>\d+) scripts loaded, clock skew (?P<skew>[+-]\d+\.\d{3}) s$",
    re.MULTILINE,
)


def lease_scripts() -> list[str]:
    return [script.source for script in SCRIPTS]


@pytest.fixture(scope="module")
def primary() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def replica(primary: RedisServer) -> Iterator[RedisServer]:
    """A second private server, made a replica of ``primary`` with REPLICAOF."""
    with RedisServer() as server:
        server.client().replicaof("127.0.0.1", primary.port)
        wait_for(lambda: primary.client().info("replication")["connected_slaves"] >= 1, timeout=20)
        yield server


def small_app(lease_url: str, *, broker: str = "memory://", **conf: Any) -> Celery:
    """An app (no worker) with three guarded tasks: ``ws.timed`` (TTL 3 s, time_limit 10 s),
    ``ws.plain`` (defaults) and ``ws.early`` (acks_late=False)."""
    app = Celery("worker-start", broker=broker, set_as_current=False)
    app.conf.update(singleflight_redis_url=lease_url, **conf)

    @app.task(bind=True, base=SingleFlightTask, name="ws.timed", shared=False, lock_key="t:<x>",
              lock_ttl=3, time_limit=10)
    def timed(self: Any, x: int) -> int:
        return x

    @app.task(bind=True, base=SingleFlightTask, name="ws.plain", shared=False, lock_key="p:<x>")
    def plain(self: Any, x: int) -> int:
        return x

    @app.task(bind=True, base=SingleFlightTask, name="ws.early", shared=False, lock_key="e:<x>",
              acks_late=False)
    def early(self: Any, x: int) -> int:
        return x

    app.finalize()
    return app


def by_check(findings: list[Finding], check: str) -> list[Finding]:
    return [f for f in findings if f.check == check]


def refused_worker(redis_server: RedisServer, lease_url: str) -> WorkerProcess:
    """Start a worker on ``lease_url`` that must refuse to start; return it once it exited."""
    worker = WorkerProcess("sfapp", concurrency=1, cwd=str(TESTS),
                           env=worker_env(redis_server, SF_TEST_LEASE_REDIS=lease_url))
    with pytest.raises(RuntimeError, match="exited"):
        worker.start(timeout=60)
    assert worker.proc is not None and worker.proc.returncode != 0
    return worker


# -- real workers ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_a_worker_logs_one_summary_per_lease_redis_and_loads_the_scripts(
    sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a healthy private lease Redis, the worker logs one INFO summary for it, naming the
    server's family and version (Valkey's own, not its redis_version), has loaded every lease
    script into it before any task ran, and starts."""
    with RedisServer() as lease:
        url = f"{lease.url}/2"
        worker = start_worker(concurrency=1, env={"SF_TEST_LEASE_REDIS": url})
        log = worker.log()
        found = [m for m in SUMMARY.finditer(log) if m["url"] == url]
        assert len(found) == 1, log
        assert found[0]["server"] == str(binary_server_kind())
        assert int(found[0]["scripts"]) == len(lease_scripts())
        assert abs(float(found[0]["skew"])) < MAX_CLOCK_SKEW
        shas = [hashlib.sha1(text.encode()).hexdigest() for text in lease_scripts()]
        assert all(lease.client().script_exists(*shas))
        assert sfapp.hold_raise.apply_async(("ws-healthy", 0.01), queue=worker.queue).get(timeout=30)


@pytest.mark.worker
def test_a_worker_whose_lease_redis_is_down_starts_and_warns(sfapp: ModuleType, start_worker: Any) -> None:
    """Given a lease Redis URL (with a password) on a closed port, the worker starts, warns once
    naming the redacted URL and on_redis_error, and a fail_closed task waits (RETRY), unrun."""
    port = free_port()
    worker = start_worker(concurrency=1, env={
        "SF_TEST_LEASE_REDIS": f"redis://:hunter2@127.0.0.1:{port}/2", "SF_TEST_REDIS_RETRY": "0.5",
    })
    log = worker.log()
    warning = [line for line in log.splitlines() if "is unreachable" in line]
    assert len(warning) == 1, log
    assert "WARNING" in warning[0] and f"redis://:***@127.0.0.1:{port}/2" in warning[0]
    assert "on_redis_error" in warning[0] and "fail_closed tasks are re-sent" in warning[0]
    assert "hunter2" not in log
    result = sfapp.hold_raise.apply_async(("ws-down", 0.01), queue=worker.queue)
    wait_for(lambda: result.state == "RETRY", timeout=30)
    assert sfapp.recorder.llen("runs:ws-down") == 0


@pytest.mark.worker
def test_a_worker_refuses_to_start_on_a_replica(
    redis_server: RedisServer, primary: RedisServer, replica: RedisServer
) -> None:
    worker = refused_worker(redis_server, f"{replica.url}/2")
    try:
        log = worker.log()
        assert f"the lease Redis {replica.url}/2 is a replica of 127.0.0.1:{primary.port}" in log, log
        assert "point singleflight_redis_url at the primary" in log
    finally:
        worker.cleanup()


@pytest.mark.worker
def test_a_worker_refuses_to_start_when_the_acl_refuses_evalsha(redis_server: RedisServer) -> None:
    """Given the recommended tenant rule minus +evalsha, the worker stops with one sentence naming
    the user, the command and the ACL doc, without the password."""
    with RedisServer() as acl:
        rule = [part for part in acl_rule("sf") if part != "+evalsha"]
        acl.client().execute_command("ACL", "SETUSER", "sf-noeval", *rule)
        url = f"redis://sf-noeval:{PASSWORD}@127.0.0.1:{acl.port}/0"
        worker = refused_worker(redis_server, url)
        try:
            log = worker.log()
            assert (f"the lease Redis redis://sf-noeval:***@127.0.0.1:{acl.port}/0 refuses the 'evalsha'"
                    " command to user sf-noeval (NOPERM)") in log, log
            assert "ACL rule of docs/isolation.md" in log and PASSWORD not in log
        finally:
            worker.cleanup()


# -- the checks, called on small apps ----------------------------------------------------------


def test_the_minimal_tenant_acl_passes_and_leaves_the_acl_log_empty() -> None:
    """Given a user with exactly the rule of docs/isolation.md, the checks refuse nothing, name the
    server (family and version), load the scripts, read the role and leave ACL LOG empty."""
    with RedisServer() as acl:
        admin = acl.client()
        admin.execute_command("ACL", "SETUSER", "tenant-a", *acl_rule("tenant-a"))
        admin.acl_log_reset()
        url = f"redis://tenant-a:{PASSWORD}@127.0.0.1:{acl.port}/0"
        findings = preflight(small_app(url, singleflight_namespace="tenant-a"))
        assert not [f for f in findings if f.refusal], findings
        (summary,) = by_check(findings, "summary")
        assert f"{len(lease_scripts())} scripts loaded" in summary.message
        assert f"lease Redis {redacted_url(url)}: {binary_server_kind()}, role master" in summary.message
        assert PASSWORD not in summary.message and summary.url == redacted_url(url)
        assert denied(admin) == []


def test_a_primary_with_a_replica_and_no_min_replicas_to_write_gets_the_failover_warning(
    primary: RedisServer, replica: RedisServer
) -> None:
    app = small_app(f"{primary.url}/0")
    (warning,) = by_check(preflight(app), "replication")
    assert warning.level == logging.WARNING and "1 connected replica(s)" in warning.message
    assert "min-replicas-to-write" in warning.message and "second holder" in warning.message
    admin = primary.client()
    admin.config_set("min-replicas-to-write", 1)
    try:
        assert by_check(preflight(app), "replication") == []
    finally:
        admin.config_set("min-replicas-to-write", 0)


def test_the_replica_refusal_is_a_finding_at_error(replica: RedisServer) -> None:
    (refusal,) = by_check(preflight(small_app(f"{replica.url}/0")), "replication")
    assert refusal.refusal and "is a replica" in refusal.message


def test_visibility_timeout_shorter_than_a_time_limit_is_one_warning_naming_the_tasks(
    primary: RedisServer,
) -> None:
    """Given a Redis broker with a 2 s visibility timeout and task_acks_late, one warning names the
    task with time_limit=10 and the one without a limit, not the task with acks_late=False."""
    lease = f"{primary.url}/0"
    app = small_app(lease, broker=f"redis://:hunter2@127.0.0.1:{primary.port}/5", task_acks_late=True,
                    broker_transport_options={"visibility_timeout": 2})
    (warning,) = by_check(preflight(app), "visibility_timeout")
    assert warning.level == logging.WARNING and "(2 s)" in warning.message
    assert "ws.timed (time_limit 10 s)" in warning.message
    assert "ws.plain have no time limit" in warning.message
    assert "ws.early" not in warning.message and "hunter2" not in warning.message
    long_enough = small_app(lease, broker=f"redis://127.0.0.1:{primary.port}/5", task_acks_late=True,
                            task_time_limit=60, broker_transport_options={"visibility_timeout": 3600})
    assert by_check(preflight(long_enough), "visibility_timeout") == []
    amqp = small_app(lease, broker="amqp://127.0.0.1:1//", task_acks_late=True)
    assert by_check(preflight(amqp), "visibility_timeout") == []


def test_a_ttl_shorter_than_a_blocked_renewal_is_warned_about(primary: RedisServer) -> None:
    (warning,) = by_check(preflight(small_app(f"{primary.url}/0")), "ttl")
    assert "ws.timed (3 s)" in warning.message and "ws.plain" not in warning.message  # 30 s default
    assert "up to 15 s" in warning.message and "self.lease.check()" in warning.message


def test_clock_skew_takes_the_midpoint_of_the_round_trip(primary: RedisServer) -> None:
    """The comparison with given times (Redis's clock cannot be moved without faking it), then the
    real call on a Redis on this machine: a skew near 0."""
    assert clock_skew(100.0, 102.5, 101.0) == pytest.approx(2.0)
    assert clock_skew(100.0, 99.0, 100.2) == pytest.approx(-1.1)
    ahead = clock_finding(100.0, 102.5, 101.0, "redis://x")
    assert ahead is not None and ahead.level == logging.WARNING
    assert "2.000 s ahead of" in ahead.message
    assert "Redis TIME" in ahead.message and "ttl_left" in ahead.message
    behind = clock_finding(100.0, 98.5, 100.0, "redis://x")
    assert behind is not None and "1.500 s behind" in behind.message
    assert clock_finding(100.0, 100.9, 100.0, "redis://x") is None  # within MAX_CLOCK_SKEW
    assert clock_finding(100.0, 102.2, 102.0, "redis://x") is None  # 1.2 s, but a 2 s round trip hides 1 s
    findings = preflight(small_app(f"{primary.url}/0"))
    (summary,) = by_check(findings, "summary")
    skew = re.search(r"clock skew ([+-]\d+\.\d{3}) s", summary.message)
    assert skew is not None and abs(float(skew[1])) < 0.5
    assert by_check(findings, "clock") == []


def test_a_check_that_breaks_never_stops_the_start(primary: RedisServer) -> None:
    """Given broker_transport_options that is not a mapping, the visibility check fails inside;
    the others still report, and nothing is refused."""
    app = small_app(f"{primary.url}/0", broker="redis://127.0.0.1:1/0", task_acks_late=True,
                    broker_transport_options="not a mapping")
    findings = preflight(app)
    assert by_check(findings, "summary") and not [f for f in findings if f.refusal]
    assert by_check(findings, "visibility_timeout") == []


def test_an_unreachable_lease_redis_is_one_quick_warning() -> None:
    findings = preflight(small_app(f"redis://user:pw@127.0.0.1:{free_port()}/0"))
    (warning,) = by_check(findings, "reachability")
    assert warning.level == logging.WARNING and "redis://user:***@127.0.0.1:" in warning.message
    assert by_check(findings, "summary") == []


@pytest.mark.parametrize("command", ["ping", "script|load"])
def test_noperm_for_a_command_every_run_needs_is_a_refusal(command: str) -> None:
    with RedisServer() as acl:
        rule = [part for part in acl_rule("sf") if part != f"+{command}"]
        acl.client().execute_command("ACL", "SETUSER", "sf-short", *rule)
        findings = preflight(small_app(f"redis://sf-short:{PASSWORD}@127.0.0.1:{acl.port}/0"))
    (refusal,) = [f for f in findings if f.refusal]
    assert f"refuses the '{command}' command to user sf-short (NOPERM)" in refusal.message


@pytest.mark.parametrize(("mark", "reads"), [("3", False), ("1", True)])
def test_a_worker_of_another_protocol_version_in_the_namespace_is_one_warning(
    mark: str, reads: bool
) -> None:
    """A worker marks its protocol version in ``<namespace>:protocol`` at its start; a worker
    that finds another version there warns, naming both versions and whether it reads the
    other's records. The mark keeps the highest version."""
    with RedisServer() as lease:
        app = small_app(f"{lease.url}/0")
        assert by_check(preflight(app), "protocol") == []
        assert lease.client().get("sf:protocol") == b"2"
        lease.client().set("sf:protocol", mark)
        (warning,) = by_check(preflight(app), "protocol")
        assert warning.level == logging.WARNING
        assert f"protocol version {mark} started in namespace 'sf'" in warning.message
        assert "this worker speaks version 2" in warning.message
        assert ("this worker reads its records" in warning.message) is reads
        assert lease.client().get("sf:protocol") == (b"3" if mark == "3" else b"2")


@pytest.mark.worker
def test_a_run_whose_key_holds_a_record_of_another_version_is_resent_not_run(
    sfapp: ModuleType, redis_server: RedisServer, start_worker: Any
) -> None:
    """Given a record written by a future protocol (version 3) on a task's key, the worker does
    not run the task unguarded: it logs one error naming both versions, re-sends the run, and
    the run happens once the foreign record is gone."""
    worker = start_worker(concurrency=1, env={"SF_TEST_REDIS_RETRY": "0.3"})
    leases = redis_server.client(2)
    run_key = sfapp.hold_raise.store.layout.run("k:pv-1")
    foreign = '{"v":"3","token":"t","fence":"5","since":"1","deadline":"99999999999999","state":"running"}'
    leases.set(run_key, foreign)
    result = sfapp.hold_raise.apply_async(("pv-1", 0.01), queue=worker.queue)
    wait_for(lambda: worker.log().count("protocol version 3") >= 2, timeout=30)
    (line, *_) = [line for line in worker.log().splitlines() if "(not run unguarded)" in line]
    assert "key 'k:pv-1'" in line and "protocol version 3" in line and "speaks version 2" in line, line
    assert sfapp.recorder.lrange("runs:pv-1", 0, -1) == []
    assert leases.get(run_key) == foreign.encode()
    leases.delete(run_key)
    assert result.get(timeout=30)["key"] == "pv-1"
    assert len(sfapp.recorder.lrange("runs:pv-1", 0, -1)) == 1


def test_a_server_older_than_the_oldest_supported_stops_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """Given a server below the supported floor (the floor raised above the real server here, as
    no older server is installed), the start checks refuse it in one sentence naming the server,
    the floor and what to do; at the floor itself nothing is refused."""
    kind = binary_server_kind()
    with RedisServer() as server:
        app = small_app(f"{server.url}/0")
        assert by_check(preflight(app), "version") == []
        monkeypatch.setitem(OLDEST, kind.family, (*kind.version[:1], kind.version[1] + 1))
        (refusal,) = by_check(preflight(app), "version")
        assert refusal.refusal
        assert f"is {kind}, older than {kind.family} {kind.version[0]}." in refusal.message
        assert "upgrade that server" in refusal.message and "docs/versioning.md" in refusal.message
        with pytest.raises(ConfigurationError, match=f"is {kind}, older than"):
            run_at_worker_start(app)
