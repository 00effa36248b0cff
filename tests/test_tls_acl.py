"""TLS and a least-privilege ACL user, on a real TLS-only redis-server.

The server listens only on a TLS port (``--port 0``) with a CA and certificate made here
(``openssl``) and asks clients for a certificate. The ACL rule is the one
``celery singleflight acl`` prints for the test app; a real worker runs tasks of every policy as
that user over TLS, and Redis refuses it nothing but the optional CONFIG GET of the start checks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_singleflight.connection.clients import redis_client
from celery_singleflight.connection.targets import build_client, target_from_settings
from celery_singleflight.ops.acl import LIBRARY_COMMANDS, acl_rule, connection_commands
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer, binary_server_kind
from celery_singleflight.testing.engines import TlsFiles, TlsRedisServer, make_tls_files

from .conftest import IN_CI, TESTS, worker_env
from .topology_mix import check_outcomes, run_policy_mix

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

PASSWORD = "tls-s3cret"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    try:
        return make_tls_files(tmp_path_factory.mktemp("tls"))
    except (RuntimeError, subprocess.CalledProcessError) as exc:
        if IN_CI:
            raise
        pytest.skip(f"cannot make certificates here: {exc}")


@pytest.fixture(scope="module")
def tls_redis(tls: TlsFiles) -> Iterator[TlsRedisServer]:
    server = TlsRedisServer(tls)
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        if IN_CI:
            raise
        pytest.skip(f"redis-server cannot serve TLS here: {exc}")
    yield server
    server.close()


def cli_acl(redis_server: RedisServer, lease_url: str, options: dict[str, Any], *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "sfapp", "singleflight", "acl", *args],
        cwd=TESTS, capture_output=True, text=True, timeout=60,
        env={**os.environ, **worker_env(redis_server, SF_TEST_LEASE_REDIS=lease_url,
                                        SF_TEST_LEASE_OPTIONS=json.dumps(options))},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_acl_command_prints_the_documented_rule(redis_server: RedisServer, tls_redis: TlsRedisServer) -> None:
    """The CLI asks the server its version and prints the rule for it; the docs show the rule for
    Redis 7.2+ and Valkey (and say what differs on 6.2 and 7.0)."""
    line = cli_acl(redis_server, f"{tls_redis.url}/0", tls_redis.tls.transport_options(), "--user", "u1")
    assert line.startswith("ACL SETUSER u1 reset on >PASSWORD ~sf:{* ~sf:waiting ~sf:superseding "
                           "~sf:ordering ~sf:delays ~sf:workers ~sf:started ~sf:epoch ~sf:protocol"
                           " resetchannels &sf:inbox:* -@all ")
    handshake = connection_commands(binary_server_kind())
    assert line.endswith(" ".join(f"+{c}" for c in (*LIBRARY_COMMANDS, *handshake)))
    assert line == "ACL SETUSER u1 " + " ".join(acl_rule("sf", server=binary_server_kind()))
    documented = (Path(__file__).parents[1] / "docs" / "isolation.md").read_text()
    assert "ACL SETUSER tenant-a " + " ".join(acl_rule("tenant-a")) in documented
    # another database needs SELECT (redis-py selects it on connecting)
    assert "+select" in cli_acl(redis_server, f"{redis_server.url}/2", {}).split()
    assert "+select" not in line.split()


def test_plain_and_certificate_less_clients_are_refused(tls_redis: TlsRedisServer) -> None:
    once = {"retry": Retry(NoBackoff(), 0), "socket_connect_timeout": 1.0, "socket_timeout": 1.0}
    with pytest.raises(redis.ConnectionError):
        redis.Redis(port=tls_redis.port, **once).ping()
    without_cert = target_from_settings(f"{tls_redis.url}/0", {"ssl_ca_certs": tls_redis.tls.ca})
    with pytest.raises(redis.ConnectionError):
        build_client(without_cert, once).ping()
    assert redis_client(target_from_settings(f"{tls_redis.url}/0", tls_redis.tls.transport_options())).ping()


@pytest.mark.worker
def test_a_real_worker_runs_every_policy_over_tls_as_the_acl_user(
    redis_server: RedisServer, tls_redis: TlsRedisServer, sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a TLS-only lease Redis and a user with exactly the rule `celery singleflight acl`
    prints, a real worker runs skip, raise, queue, join, max_concurrency, progress and heartbeat
    tasks; the lease keys are written over TLS, and Redis refuses nothing (ACL LOG stays empty)."""
    options = tls_redis.tls.transport_options()
    line = cli_acl(redis_server, f"{tls_redis.url}/0", options, "--user", "sf-tls", "--password", PASSWORD)
    admin = tls_redis.client()
    admin.execute_command(*line.split())
    admin.acl_log_reset()
    url = f"rediss://sf-tls:{PASSWORD}@127.0.0.1:{tls_redis.port}/0"
    worker = start_worker(concurrency=6, env={"SF_TEST_LEASE_REDIS": url,
                                              "SF_TEST_LEASE_OPTIONS": json.dumps(options)})
    store = LeaseStore(admin, KeyLayout("sf"))
    keys = run_policy_mix(sfapp, worker.queue, "tls", store)
    check_outcomes(StatusReader(store), keys)
    assert admin.acl_log(count=100) == []
    clients = admin.client_list()
    assert any(c.get("user") == "sf-tls" for c in clients)
    assert "no permissions" not in worker.log()
