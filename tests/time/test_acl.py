"""The time policies work for a tenant's Redis user with the documented ACL rule and its extra
time-policy commands, and nothing more (docs/isolation.md)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from celery_singleflight.ops.acl import (
    LIBRARY_COMMANDS,
    MAINT_NOTIFICATIONS,
    SETINFO,
    TIME_POLICY_COMMANDS,
    connection_commands,
)
from celery_singleflight.ops.timestatus import read_time_status
from celery_singleflight.policies import debounce, ratelimit
from celery_singleflight.protocol.store import store_for
from celery_singleflight.protocol.timing import DueReply
from celery_singleflight.testing import RedisServer, binary_server_kind

from ..conftest import wait_server_time

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

DOC = Path(__file__).resolve().parents[2] / "docs" / "isolation.md"


def test_the_documented_acl_and_its_time_policy_commands_are_enough(redis_server: RedisServer) -> None:
    text = DOC.read_text()
    rule = re.search(r"^ACL SETUSER tenant-a (.*)$", text, re.MULTILINE)
    extra = re.search(r"`(\+hmget[^`]*)` when a task uses a", text)
    assert rule and extra
    ns, user = f"tp{uuid.uuid4().hex[:6]}", f"u{uuid.uuid4().hex[:6]}"
    assert extra[1].split() == [f"+{c}" for c in TIME_POLICY_COMMANDS]  # what `celery singleflight acl` adds
    # the documented rule is for Redis 7.2+ and Valkey; the page says what differs on 6.2 and 7.0
    documented = rule[1].replace("tenant-a", ns).replace(">PASSWORD", ">pw").split()
    handshake = [w[1:] for w in documented if w[1:] in (SETINFO, MAINT_NOTIFICATIONS)]
    assert handshake == list(connection_commands(None))
    rules = [w for w in documented if w[1:] not in (SETINFO, MAINT_NOTIFICATIONS)] + extra[1].split()
    rules += [f"+{c}" for c in connection_commands(binary_server_kind())]
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", user, *rules)
    try:
        admin.execute_command("ACL", "LOG", "RESET")
        store = store_for(f"redis://{user}:pw@127.0.0.1:{redis_server.port}/0", ns)
        rate = ratelimit.parse_rate("t", "1/s", 1)
        assert rate is not None
        ratelimit.reserve(store, "k", rate, "a:0")
        assert ratelimit.reserve(store, "k", rate, "b:0").wait > 0
        deb = debounce.Debounce(0.05, None, "last", None)
        debounce.record(store, "k", "a", deb, (1,), {})
        debounce.record(store, "k", "b", deb, (2,), {})
        # the burst is due once the server's clock passes its due time (read as the admin: the
        # tenant's user may not HGET or TIME, and a refusal would be in the ACL log)
        burst = store.layout.debounce("k")
        wait_server_time(admin, int(admin.hget(burst, "due")))
        assert store.timing.due("k", "a", "a", "t1").kind == DueReply.RUN
        assert store.timing.due("k", "b", "a", "t2").kind == DueReply.FOLDED
        seen = read_time_status(store, "k")
        assert seen.rate is not None and seen.rate.planned == 1
        assert admin.execute_command("ACL", "LOG") == []
    finally:
        admin.execute_command("ACL", "DELUSER", user)


def test_the_acl_command_adds_the_time_commands_when_a_task_uses_them(redis_server: RedisServer) -> None:
    """``celery singleflight acl`` for an app with debounced and rate-limited tasks prints the rule
    with the time-policy commands (the tests' other app, with neither, gets the rule without them)."""
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "timeapp", "singleflight", "acl", "--user", "t1"],
        cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=60,
        env={**os.environ, "SF_TEST_REDIS": redis_server.url},
    )
    assert out.returncode == 0, out.stderr
    # (+select: the app's leases are not in database 0)
    assert " ".join(f"+{c}" for c in (*LIBRARY_COMMANDS, *TIME_POLICY_COMMANDS, "select")) in out.stdout
