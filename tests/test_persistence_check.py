"""The start check of the lease Redis's persistence (``singleflight_require_persistence``).

Parked and delayed runs live only in the lease Redis once their broker message was acknowledged:
a worker whose tasks keep such runs warns (or refuses to start) when that Redis has no
append-only file. Private ``redis-server``s on free loopback ports, started here with and without
``--appendonly yes`` and stopped by PID; real worker subprocesses run a small app written below.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_singleflight import SingleFlightTask
from celery_singleflight.errors import ConfigurationError
from celery_singleflight.testing import RedisServer, WorkerProcess, binary_server_kind
from celery_singleflight.worker.findings import Finding
from celery_singleflight.worker.persistence import (
    Persistence,
    persistence_finding,
    read_persistence,
    waiting_runs,
)
from celery_singleflight.worker.preflight import preflight, run_at_worker_start

from .conftest import ROOT
from .test_isolation import PASSWORD, acl_rule, denied

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

SHOWN = "redis://127.0.0.1:6399/2"
REFUSED = Persistence(None, unknown="CONFIG GET is refused to this user (NOPERM)")


def app_with(lease_url: str, *, mode: str | None = None, waiting: bool = True, **conf: Any) -> Celery:
    """An app (no worker) with a plain task and, when ``waiting``, a ``queue`` task."""
    app = Celery("persistence", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=lease_url, **conf)
    if mode is not None:
        app.conf.singleflight_require_persistence = mode

    @app.task(base=SingleFlightTask, name="pc.plain", shared=False, lock_key="p:<x>")
    def plain(x: int) -> int:
        return x

    if waiting:
        @app.task(base=SingleFlightTask, name="pc.parked", shared=False, lock_key="q:<x>",
                  on_duplicate="queue")
        def parked(x: int) -> int:
            return x

    app.finalize()
    return app


def persistence_of(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.check == "persistence"]


@pytest.fixture(scope="module")
def no_aof() -> Iterator[RedisServer]:
    with RedisServer() as server:  # --appendonly no --save ""
        yield server


@pytest.fixture(scope="module")
def aof() -> Iterator[RedisServer]:
    with RedisServer(extra=["--appendonly", "yes"]) as server:
        yield server


# -- which tasks keep waiting runs ------------------------------------------------------------


def test_waiting_runs_are_read_from_each_tasks_options() -> None:
    """Given tasks of every policy, time policy and fair share, exactly those that park or delay
    runs in Redis are named, with the options that make them do so (a fair task's main process
    parks the runs that wait for a slot, whatever its duplicate policy)."""
    app = Celery("waiting", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.singleflight_redis_url = "redis://127.0.0.1:6399/0"
    declared = {
        "raise": {}, "skip": {"on_duplicate": "skip"}, "retry": {"on_duplicate": "retry"},
        "queue": {"on_duplicate": "queue", "max_concurrency": 2},
        "ordered": {"on_duplicate": "queue", "ordered": True},
        "join": {"on_duplicate": "join"}, "coalesce": {"on_duplicate": "coalesce"},
        "supersede": {"on_duplicate": "supersede"}, "beat": {"on_beat_duplicate": "queue"},
        "debounce": {"debounce": 2}, "rate": {"key_rate_limit": "10/m"},
        "fair": {"fair_concurrency": 2, "fair_key": "<x>"},
    }
    def body(x: int) -> int:
        return x

    for name, options in declared.items():
        app.task(base=SingleFlightTask, name=name, shared=False, lock_key="k:<x>", **options)(body)
    app.finalize()
    assert {name: waiting_runs(app.tasks[name]) for name in declared} == {
        "raise": [], "skip": [], "retry": ["on_duplicate=retry"], "queue": ["on_duplicate=queue"],
        "ordered": ["on_duplicate=queue"], "join": ["on_duplicate=join"],
        "coalesce": ["on_duplicate=coalesce"], "supersede": ["on_duplicate=supersede"],
        "beat": ["on_beat_duplicate=queue"], "debounce": ["debounce"], "rate": ["key_rate_limit"],
        "fair": ["fair_concurrency=2"],
    }


# -- classification -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("found", "kind", "age", "says"),
    [
        (Persistence(True, "everysec", ""), "aof", None, "about the last second"),
        (Persistence(True, "always", "3600 1"), "aof", 3600, "loses no write Redis acknowledged"),
        (Persistence(True, "no", ""), "aof", None, "what the OS had not flushed"),
        (Persistence(False, "everysec", "3600 1 300 100 60 10000"), "rdb", 3600, "at most the last 3600 s"),
        (Persistence(False, "everysec", "300 10"), "rdb", None, "fewer than 10 writes"),
        (Persistence(False, "everysec", ""), "none", None, "a restart loses everything"),
        (Persistence(True, save=None, unread="CONFIG GET is not asked of ACL user u"), "aof", None,
         "about the last second with everysec, the default"),
        (Persistence(False, save=None, unread="CONFIG GET is not asked of ACL user u"), "no_aof", None,
         "or everything when it takes none"),
        (REFUSED, "unknown", None, ""),
    ],
)
def test_persistence_is_classified_with_what_a_crash_loses(found: Persistence, kind: str, age: int | None,
                                                           says: str) -> None:
    assert found.kind == kind
    assert found.snapshot_age() == age
    if kind != "unknown":
        assert says in found.describe()


class _Task:
    def __init__(self, name: str, **options: Any) -> None:
        self.name = name
        self.options = type("Opts", (), {"on_duplicate": "raise", "on_beat_duplicate": "skip", **options})()


QUEUED = [_Task("t.queued", on_duplicate="queue"), _Task("t.plain")]


@pytest.mark.parametrize("found", [Persistence(False, "everysec", ""),
                                   Persistence(False, "everysec", "60 1"),
                                   Persistence(False, save=None, unread="CONFIG GET answered: unknown")])
def test_without_aof_warn_warns_and_refuse_refuses_naming_tasks_and_fix(found: Persistence) -> None:
    warning = persistence_finding(SHOWN, QUEUED, found, "warn")
    refusal = persistence_finding(SHOWN, QUEUED, found, "refuse")
    assert warning is not None and warning.level == logging.WARNING and not warning.refusal
    assert refusal is not None and refusal.refusal
    for finding in (warning, refusal):
        assert "t.queued (on_duplicate=queue)" in finding.message and "t.plain" not in finding.message
        assert "appendonly yes" in finding.message and "appendfsync everysec" in finding.message
        assert finding.url == SHOWN and finding.check == "persistence"
    if found.kind == "rdb":
        assert 'save "60 1"' in warning.message and "at most the last 60 s" in warning.message
    assert persistence_finding(SHOWN, QUEUED, found, "off") is None


@pytest.mark.parametrize("mode", ["warn", "refuse"])
def test_aof_no_waiting_tasks_or_unknown_are_info_only(mode: str) -> None:
    everysec = persistence_finding(SHOWN, QUEUED, Persistence(True, "everysec", ""), mode)
    assert everysec is not None and everysec.level == logging.INFO
    assert "appendfsync everysec" in everysec.message and "t.queued" in everysec.message
    quiet = persistence_finding(SHOWN, [_Task("t.plain")], Persistence(False, "everysec", ""), mode)
    assert quiet is not None and quiet.level == logging.INFO and "no task keeps waiting runs" in quiet.message
    unknown = persistence_finding(SHOWN, QUEUED, REFUSED, mode)
    assert unknown is not None and unknown.level == logging.INFO
    assert "unknown (CONFIG GET is refused" in unknown.message and "appendonly yes" in unknown.message


def test_a_bad_mode_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigurationError, match="singleflight_require_persistence"):
        app_with("redis://127.0.0.1:6399/0", mode="loud")


# -- against real servers -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ((), Persistence(False, "everysec", "")),
        (("--appendonly", "yes"), Persistence(True, "everysec", "")),
        (("--appendonly", "yes", "--appendfsync", "always"), Persistence(True, "always", "")),
        (("--save", "60", "1"), Persistence(False, "everysec", "60 1")),  # Redis 6.2 takes no "60 1"
    ],
)
def test_config_get_reads_the_servers_persistence(extra: tuple[str, ...], expected: Persistence) -> None:
    with RedisServer(extra=extra) as server:
        assert read_persistence(server.client()) == expected
        info = server.client().info()
        assert read_persistence(server.client(), info) == expected  # CONFIG's details over INFO's
        unread = "CONFIG GET is not asked of ACL user u"
        assert read_persistence(server.client(), info, ask_config=False, unread=unread) == Persistence(
            expected.appendonly, save=None, unread=unread)


def test_the_start_checks_warn_refuse_or_stay_silent_as_the_setting_says(no_aof: RedisServer,
                                                                         aof: RedisServer) -> None:
    """Given a queue task on a Redis without AOF: a WARNING by default, a refusal that stops the
    worker with "refuse", nothing with "off"; on a Redis with AOF, INFO only."""
    (warning,) = persistence_of(preflight(app_with(f"{no_aof.url}/0")))
    assert warning.level == logging.WARNING and "pc.parked (on_duplicate=queue)" in warning.message
    with pytest.raises(ConfigurationError, match="has no append-only file"):
        run_at_worker_start(app_with(f"{no_aof.url}/0", mode="refuse"))
    assert persistence_of(preflight(app_with(f"{no_aof.url}/0", mode="off"))) == []
    (quiet,) = persistence_of(preflight(app_with(f"{no_aof.url}/0", mode="refuse", waiting=False)))
    # shared tasks of other test modules join every app: only this app's own must not be named
    assert quiet.level == logging.INFO or "pc." not in quiet.message
    (info,) = persistence_of(run_at_worker_start(app_with(f"{aof.url}/0", mode="refuse")))
    assert info.level == logging.INFO and "appendonly yes, appendfsync everysec" in info.message


def test_an_acl_users_start_check_reads_info_and_leaves_the_acl_log_empty(aof: RedisServer) -> None:
    """Given the documented tenant ACL (INFO, never CONFIG), the start checks name the server,
    read the persistence from INFO and ask no CONFIG: ACL LOG stays empty. Without AOF and with
    "refuse", the worker is refused; with AOF it starts, at INFO."""
    for server, level in ((aof, logging.INFO), (None, logging.ERROR)):
        with contextlib.ExitStack() as stack:
            if server is None:
                server = stack.enter_context(RedisServer())
            admin = server.client()
            admin.execute_command("ACL", "SETUSER", "tenant-p", *acl_rule("tenant-p"))
            admin.acl_log_reset()
            url = f"redis://tenant-p:{PASSWORD}@127.0.0.1:{server.port}/0"
            findings = preflight(app_with(url, mode="refuse", singleflight_namespace="tenant-p"))
            (found,) = persistence_of(findings)
            assert found.level == level and "(CONFIG GET is not asked of ACL user tenant-p)" in found.message
            assert ("appendonly yes" if level == logging.INFO else "appendonly no") in found.message
            assert "pc.parked" in found.message and PASSWORD not in found.message
            (summary,) = [f for f in findings if f.check == "summary"]
            assert f": {binary_server_kind()}, role master, 0 replicas" in summary.message
            assert denied(admin) == []


def test_a_user_without_info_gets_unknown_at_info_and_one_acl_log_entry(no_aof: RedisServer) -> None:
    """Given a rule without +info (an older documented rule), "refuse" still starts: the persistence
    is unknown at INFO, the role and version come from HELLO, and INFO's refusal is the only ACL
    LOG entry (CONFIG GET is not tried after it)."""
    admin = no_aof.client()
    admin.execute_command("ACL", "SETUSER", "tenant-i", *[w for w in acl_rule("tenant-i") if w != "+info"])
    admin.acl_log_reset()
    url = f"redis://tenant-i:{PASSWORD}@127.0.0.1:{no_aof.port}/0"
    findings = run_at_worker_start(app_with(url, mode="refuse", singleflight_namespace="tenant-i"))
    (unknown,) = persistence_of(findings)
    assert unknown.level == logging.INFO
    assert "unknown (INFO did not say, and INFO was refused" in unknown.message
    (summary,) = [f for f in findings if f.check == "summary"]
    assert f": {binary_server_kind()}, role master," in summary.message
    assert denied(admin) == [("tenant-i", "command", "info")]


@pytest.mark.parametrize("appendonly", ["yes", "no"])
def test_a_redis_without_the_config_command_is_read_from_info(appendonly: str) -> None:
    """Given a managed-style Redis whose CONFIG command is renamed away (ElastiCache, Aiven), the
    check reads appendonly from INFO: with AOF, "refuse" starts at INFO; without, it refuses."""
    with RedisServer(extra=["--rename-command", "CONFIG", "", "--appendonly", appendonly]) as server:
        findings = preflight(app_with(f"{server.url}/0", mode="refuse"))
        (found,) = persistence_of(findings)
        assert f"appendonly {appendonly} (CONFIG GET answered: unknown command" in found.message
        assert found.level == (logging.INFO if appendonly == "yes" else logging.ERROR)


# -- real workers ---------------------------------------------------------------------------------

APP = '''
import os
from celery import Celery
from celery_singleflight import SingleFlightTask


app = Celery("persistapp", broker=os.environ["SF_TEST_BROKER"])
app.conf.update(
    singleflight_redis_url=os.environ["SF_TEST_LEASE_REDIS"],
    singleflight_require_persistence=os.environ["SF_TEST_REQUIRE_PERSISTENCE"],
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
)


@app.task(base=SingleFlightTask, name="persistapp.parked", lock_key="q:<x>", on_duplicate="queue")
def parked(x):
    return x
'''


def persist_worker(tmp_path: Path, broker: RedisServer, lease: RedisServer, mode: str) -> WorkerProcess:
    (tmp_path / "persistapp.py").write_text(APP)
    return WorkerProcess(
        "persistapp", concurrency=1, cwd=str(tmp_path), extra=("-Q", f"q-{uuid.uuid4().hex[:12]}"),
        env={"SF_TEST_BROKER": f"{broker.url}/0", "SF_TEST_LEASE_REDIS": f"{lease.url}/0",
             "SF_TEST_REQUIRE_PERSISTENCE": mode,
             "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )


def persistence_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if "persistapp.parked (on_duplicate=queue)" in line]


@pytest.mark.worker
def test_a_worker_warns_without_aof(tmp_path: Path, redis_server: RedisServer, no_aof: RedisServer) -> None:
    with persist_worker(tmp_path, redis_server, no_aof, "warn") as worker:
        (line,) = persistence_lines(worker.log())
        assert "WARNING/MainProcess" in line and "has no append-only file" in line, worker.log()
        assert "set appendonly yes with appendfsync everysec" in line


@pytest.mark.worker
def test_a_worker_refuses_to_start_without_aof(tmp_path: Path, redis_server: RedisServer,
                                               no_aof: RedisServer) -> None:
    worker = persist_worker(tmp_path, redis_server, no_aof, "refuse")
    try:
        with pytest.raises(RuntimeError, match="exited"):
            worker.start(timeout=60)
        assert worker.proc is not None and worker.proc.returncode != 0
        log = worker.log()
        assert any("has no append-only file" in line for line in persistence_lines(log)), log
        assert "singleflight_require_persistence='refuse'" in log and " ready." not in log
    finally:
        worker.kill()
        worker.cleanup()


@pytest.mark.worker
def test_a_worker_starts_quietly_with_aof(tmp_path: Path, redis_server: RedisServer,
                                          aof: RedisServer) -> None:
    with persist_worker(tmp_path, redis_server, aof, "refuse") as worker:
        log = worker.log()
        (line,) = persistence_lines(log)
        assert "INFO/MainProcess" in line and "appendonly yes, appendfsync everysec" in line, log
        assert "WARNING" not in log and "ERROR" not in log, log
