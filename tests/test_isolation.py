"""Tenant isolation: namespaces on one Redis, a per-tenant Redis ACL, and who force-released a key.

- Two namespaces on one Redis hold the same key independently; nothing one namespace does (status,
  listing, renew, release, force-release, progress) reaches the other's keys, whatever the key text.
- A Redis ACL user limited to one namespace's keys (``acl_rule()``, the rule in docs/isolation.md)
  runs everything the library does, through the library's own objects and a real worker, and
  nothing else.
- ``celery singleflight release --force`` records and logs who released a key, and when.

The ACL tests run on a private redis-server started here and stopped by PID.
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import re
import socket
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

import celery_singleflight as sf
from celery_singleflight import Lease, LockHeld, SingleFlightTask, constants, hold
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.ops.acl import (
    MAINT_NOTIFICATIONS,
    channel_patterns,
    connection_commands,
    key_patterns,
)
from celery_singleflight.ops.acl import acl_rule as rule_for
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.delayed import Claim, ClaimDoneReply, ClaimReply
from celery_singleflight.protocol.fair import Admitted, Waiting
from celery_singleflight.protocol.lease import ProgressReply
from celery_singleflight.protocol.replies import Acquired, Held, Holder, Parked
from celery_singleflight.protocol.servers import ServerKind
from celery_singleflight.protocol.store import KeyLayout, LeaseStore, store_for
from celery_singleflight.run.heartbeat import Heartbeat
from celery_singleflight.run.progress import ProgressUpdate
from celery_singleflight.testing import RedisServer, binary_server_kind
from celery_singleflight.worker.preflight import preflight
from celery_singleflight.worker.sweeper import HandOn, Sweeper

from .conftest import HOLD, TESTS, stays, wait_for, wait_server_time, worker_env

pytestmark = pytest.mark.server  # also run on Redis 6.2 and Valkey 8 (make test)

NS_A, NS_B = "tenant-a", "tenant-b"
PASSWORD = "s3cret-tenant"

@functools.cache
def server() -> ServerKind:
    """The server the tests run on (``$SINGLEFLIGHT_TEST_SERVER``)."""
    return binary_server_kind()


def acl_rule(namespace: str, password: str = PASSWORD, **options: Any) -> list[str]:
    """The recommended per-tenant ACL (``ACL SETUSER <user> <rule...>``), as ``celery singleflight acl``
    prints it for the server under test and docs/isolation.md shows it."""
    return rule_for(namespace, password, server=server(), **options)


def commands_of(rule: list[str]) -> set[str]:
    """The commands a rule grants (its ``+name`` words)."""
    return {word[1:] for word in rule if word.startswith("+")}


def stat_names(commands: set[str]) -> set[str]:
    """``commands`` as the server counts them in ``INFO commandstats``: Redis 6.2 counts a
    subcommand under its command (``script``, not ``script|load``)."""
    if server().family == "Redis" and server().version < (7,):
        return {command.split("|")[0] for command in commands}
    return commands


def set_user(admin: redis.Redis, user: str, rule: list[str]) -> str:
    """Create (or redefine) ``user``; return a URL that connects as it."""
    admin.execute_command("ACL", "SETUSER", user, *rule)
    port = admin.connection_pool.connection_kwargs["port"]
    return f"redis://{user}:{PASSWORD}@127.0.0.1:{port}/0"


def token() -> str:
    return uuid.uuid4().hex


def names(client: redis.Redis, match: str | None = None) -> set[str]:
    return {raw.decode() for raw in client.scan_iter(match=match, count=1000)}


def denied(admin: redis.Redis) -> list[tuple[str, str, str]]:
    """What the ACL refused since the last ``ACL LOG RESET``: (user, reason, command or key)."""
    return [(e["username"], e["reason"], e["object"]) for e in admin.acl_log(count=1000)]


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisServer]:
    """A private redis-server for this module (its default user is the admin)."""
    with RedisServer() as server:
        yield server


@pytest.fixture
def admin(acl_redis: RedisServer) -> redis.Redis:
    """The admin connection, on an empty server with a clean ACL log and command stats."""
    client = acl_redis.client()
    client.flushall()
    client.acl_log_reset()
    client.config_resetstat()
    return client


def tenant_app(url: str, namespace: str) -> tuple[Celery, Any]:
    """A Celery app of one tenant (in-memory broker, no worker) and one guarded task of it."""
    app = Celery(f"iso-{namespace}", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.update(
        singleflight_redis_url=url, singleflight_namespace=namespace, singleflight_status_retention=60,
    )

    @app.task(bind=True, base=SingleFlightTask, name=f"iso.{namespace}.sync", shared=False,
              lock_key="acct:<account>", dedup_enqueue=True, idempotency_key="msg:<account>:<message_id>",
              ignore_result=True)
    def sync(self: Any, account: str, message_id: str) -> dict[str, Any]:
        self.progress("syncing", current=1, total=1, message=message_id)
        return {"synced": message_id, "fence": self.lease.fence}

    return app, sync


# -- two namespaces on one Redis -------------------------------------------------------------


def test_one_key_is_held_independently_in_two_namespaces(admin: redis.Redis) -> None:
    """Given the same key held in tenant-a and tenant-b, tenant-a's status, listing, renew,
    progress, duplicates, release and force-release see and touch only tenant-a's lease."""
    a = LeaseStore(admin, KeyLayout(NS_A), status_retention=60)
    b = LeaseStore(admin, KeyLayout(NS_B), status_retention=60)
    read_a, read_b = StatusReader(a), StatusReader(b)
    key = "sync:42"
    tok_a, tok_b = token(), token()
    got_a = a.acquire(key, tok_a, 30, Holder("run-a"))
    got_b = b.acquire(key, tok_b, 5, Holder("run-b"))
    assert isinstance(got_a, Acquired) and isinstance(got_b, Acquired)
    b_fence = got_b.fence
    b_deadline = int(b.holder_record(key)["deadline"])

    def b_intact() -> None:
        record = b.holder_record(key)
        assert record["token"] == tok_b and record["task_id"] == "run-b" and int(record["fence"]) == b_fence
        assert int(record["deadline"]) == b_deadline  # never renewed by tenant-a
        st = read_b.read(key)
        assert st is not None and st.held and st.task_id == "run-b" and st.state == "running"
        assert st.duplicates == 0 and st.released_by is None and st.current is None

    duplicate = a.acquire(key, token(), 30, Holder("run-a2"))
    assert isinstance(duplicate, Held) and duplicate.holder == "run-a"
    st_a = read_a.read(key)
    assert st_a is not None and st_a.task_id == "run-a"
    assert [s.task_id for s in read_a.held()] == ["run-a"]
    assert [s.task_id for s in read_b.held()] == ["run-b"]
    b_intact()

    lease_a = Lease(key=key, token=tok_a, fence=got_a.fence, ttl=30, interval=10, task_id="run-a",
                    task_name="t", store=a, since=got_a.since)
    # tenant-a's store asked to renew with tenant-b's token: not its lease
    posing = Lease(key=key, token=tok_b, fence=b_fence, ttl=30, interval=10, task_id="run-b",
                   task_name="t", store=a, since=got_b.since)
    assert a.renew([lease_a, posing]) == [True, False]
    lease_a.write_progress(ProgressUpdate("loading", 1, 3))
    forged = a.lease.progress(key, 0, tok_b, json.dumps({"state": "forged"}), "forged", 1)
    assert forged[0] == ProgressReply.NOT_OURS
    assert a.marks.note_duplicate(key, "run-a2", "skipped")
    st_a = read_a.read(key)
    assert st_a is not None and st_a.state == "loading" and st_a.current == 1 and st_a.duplicates == 1
    b_intact()

    assert not a.release(key, tok_b)  # tenant-b's token means nothing in tenant-a
    assert read_a.force_release(key, "ops@test", expected_holder="run-b") is None
    b_intact()
    assert read_a.force_release(key, "ops@test") == "run-a"
    assert a.holder_record(key) == {}
    assert not a.release(key, tok_a, fence=got_a.fence)  # the late release of tenant-a's holder
    b_intact()
    ended = read_a.read(key)
    assert ended is not None and ended.outcome == "force-released" and ended.released_by == "ops@test"

    assert b.release(key, tok_b)
    st_b = read_b.read(key)
    assert st_b is not None and st_b.outcome == "succeeded" and st_b.released_by is None
    written = names(admin)
    assert written and all(n.startswith((f"{NS_A}:{{", f"{NS_B}:{{")) for n in written), written


def test_two_apps_with_their_own_namespace_never_see_each_other(acl_redis: RedisServer) -> None:
    """Given two apps (singleflight_namespace tenant-a / tenant-b) holding the same key with hold(),
    each app's status(), held() and watch() show its own holder only, and force_release() in one
    leaves the other's lease held and renewed."""
    url = f"{acl_redis.url}/0"
    acl_redis.client().flushall()
    app_a, _ = tenant_app(url, NS_A)
    app_b, _ = tenant_app(url, NS_B)
    key = "maintenance:db"
    with hold(app_a, key, ttl=1.5, holder="hold-a") as ha, hold(app_b, key, ttl=1.5, holder="hold-b") as hb:
        taken = time.monotonic()
        ha.progress("vacuum", current=1, total=2)
        st_a, st_b = sf.status(app_a, key), sf.status(app_b, key)
        assert st_a is not None and st_a.task_id == "hold-a" and st_a.state == "vacuum"
        assert st_b is not None and st_b.task_id == "hold-b" and st_b.state == "running"
        assert [s.task_id for s in sf.held(app_a)] == ["hold-a"]
        assert [s.task_id for s in sf.held(app_b)] == ["hold-b"]

        assert sf.force_release(app_a, key, by="ops@tenant-a") == "hold-a"
        wait_for(lambda: ha.lost, timeout=5)  # tenant-a's holder learns it from its heartbeat
        # held all along, until past hold-b's 1.5 s TTL: renewed, untouched by tenant-a's release
        window = max(0.0, taken + 2.0 - time.monotonic())
        stays(lambda: not hb.lost and _held_by(app_b, key, "hold-b"), window)
        st_b = sf.status(app_b, key)
        assert not hb.lost and st_b is not None and st_b.held and st_b.task_id == "hold-b"
        assert st_b.released_by is None and st_b.ttl_left is not None and st_b.ttl_left > 0
        assert sf.held(app_a) == []
    end_a, end_b = sf.status(app_a, key), sf.status(app_b, key)
    assert end_a is not None and end_a.outcome == "force-released" and end_a.released_by == "ops@tenant-a"
    assert end_b is not None and end_b.outcome == "succeeded" and end_b.released_by is None
    watched_a = list(sf.watch(app_a, key, timeout=1))
    watched_b = list(sf.watch(app_b, key, timeout=1))
    assert watched_a[-1].kind == "end" and watched_a[-1].state == "force-released"
    assert watched_a[-1].fields.get("by") == "ops@tenant-a"
    assert [e.kind for e in watched_b] == ["end"] and watched_b[-1].state == "succeeded"


def _held_by(app: Celery, key: str, task_id: str) -> bool:
    st = sf.status(app, key)
    return st is not None and st.held and st.task_id == task_id


#: user keys that try to break out of their namespace: braces, separators, glob and control chars
ADVERSARIAL_KEYS = [
    "x}:lease", "}:x", "}", "{", "{}", "}{", "x}:lease}", "{tenant-b}", "}:lease\ntenant-b:{x",
    f"{NS_B}:{{x}}:lease", "*", "?", "[a-z]", "\\", "%7D", "%7B", "%", "\n", "a\r\nb", ":", "::",
    "x*", "x?", "sync:42",
]
#: namespace pairs where one is a string prefix of the other, or holds glob characters
NAMESPACE_PAIRS = [(NS_A, NS_B), ("tenant", NS_B), (NS_A, f"{NS_A}:x"), ("ns*", "nsx"), ("n?", "nx"),
                   ("a[b]", "ab")]
PARTS = ["lease", "lease1", "fence", "status", "status1", "history", "queue", "parked", "joined",
         "enqueued", "done"]


@pytest.mark.parametrize(("ns_a", "ns_b"), NAMESPACE_PAIRS)
def test_no_key_text_reaches_into_another_namespace(ns_a: str, ns_b: str) -> None:
    """Given adversarial keys in either namespace, every Redis key name stays under its own
    ``<ns>:{`` prefix with the escaped key as hash tag, and the other namespace's layout does not
    recognize it as one of its own."""
    for mine, other in ((KeyLayout(ns_a), KeyLayout(ns_b)), (KeyLayout(ns_b), KeyLayout(ns_a))):
        for key in ADVERSARIAL_KEYS:
            tags = set()
            for part in PARTS:
                name = mine.redis_key(key, part)
                assert name.startswith(f"{mine.namespace}:{{") and name.endswith(f"}}:{part}")
                assert not name.startswith(f"{other.namespace}:{{"), (key, name)
                assert other.user_key(name) is None, (key, name)
                assert mine.user_key(name) == key
                inner = name[len(mine.namespace) + 2 : -len(part) - 2]
                assert "{" not in inner and "}" not in inner  # the hash tag cannot be cut short
                tags.add(inner)
            assert len(tags) == 1  # one hash tag (slot) for every key of the lock


@pytest.mark.parametrize(("ns_a", "ns_b"), NAMESPACE_PAIRS)
def test_adversarial_keys_on_redis_stay_in_their_namespace(admin: redis.Redis, ns_a: str, ns_b: str) -> None:
    """Given tenant A holding adversarial keys and tenant B holding its own keys on one Redis, then
    A's SCAN patterns never match B's keys, held() of each lists exactly its own keys, and A
    force-releasing all its keys leaves every lease of B intact."""
    a, b = LeaseStore(admin, KeyLayout(ns_a)), LeaseStore(admin, KeyLayout(ns_b))
    victims = {"x": token(), "sync:42": token(), "}": token(), "lease": token(), "*": token()}
    for key, tok in victims.items():
        assert isinstance(b.acquire(key, tok, 30, Holder(f"b:{key}")), Acquired)
    for key in ADVERSARIAL_KEYS:
        assert isinstance(a.acquire(key, token(), 30, Holder(f"a:{key}")), Acquired), key
    # a parked run puts the key in the namespace's waiting index too
    assert isinstance(a.handoff.park("x}:lease", "p-1", "h-1", "{}", None), Parked)

    keys_b = {name for key in victims for name in (b.layout.run(key),)}
    keys_a = {name for key in ADVERSARIAL_KEYS for name in (a.layout.run(key),)}
    keys_a |= {a.layout.queue("x}:lease"), a.layout.parked("x}:lease"), a.layout.waiting()}
    assert names(admin) == keys_a | keys_b
    assert {n for p in key_patterns(ns_a) for n in names(admin, p)} == keys_a
    assert {n for p in key_patterns(ns_b) for n in names(admin, p)} == keys_b
    assert sorted(s.key for s in StatusReader(a).held()) == sorted(ADVERSARIAL_KEYS)
    assert sorted(s.key for s in StatusReader(b).held()) == sorted(victims)
    # a prefix with glob characters is taken literally
    assert [s.key for s in StatusReader(a).held(prefix="x*")] == ["x*"]
    assert [s.key for s in StatusReader(a).held(prefix="}:")] == ["}:lease\ntenant-b:{x", "}:x"]

    for key in ADVERSARIAL_KEYS:
        assert StatusReader(a).force_release(key, "ops@a") == f"a:{key}"
    # a reader without an app leaves the hand-on of a parked run to a worker's sweeper
    assert StatusReader(a).held() == []
    for key, tok in victims.items():
        record = b.holder_record(key)
        assert record["token"] == tok and record["task_id"] == f"b:{key}"
        st = StatusReader(b).read(key)
        assert st is not None and st.held and st.released_by is None


# -- a Redis ACL per tenant --------------------------------------------------------------------


def full_run(url: str, namespace: str, listing: bool = True) -> None:
    """Every operation the library performs on its lease Redis, for ``namespace``, connecting with
    ``url``, through the library's own objects; each step asserts it worked. ``listing=False``
    leaves out ``held()`` (the only user of SCAN)."""
    app, sync = tenant_app(url, namespace)
    store = store_for(url, namespace, status_retention=60, history_length=20)
    assert store.client is redis_client(url)
    # the worker's start checks: the server's version, role, memory and persistence (INFO), the
    # scripts loaded, the clock, the protocol mark; nothing refused
    findings = preflight(app)
    assert not [f for f in findings if f.refusal], findings
    reader = StatusReader(store)
    key = "sync:42"

    # acquire (two slots of a max_concurrency=2 key), duplicate, heartbeat, progress
    tok = token()
    got = store.acquire(key, tok, 5, Holder("run-1", "w1@h", "iso.sync"), slots=2)
    second = store.acquire(key, (tok2 := token()), 5, Holder("run-2"), slots=2)
    assert isinstance(got, Acquired) and isinstance(second, Acquired) and second.slot == 1
    assert isinstance(store.acquire(key, token(), 5, Holder("run-3"), slots=2), Held)
    assert store.release(key, tok2, slot=1)
    lease = Lease(key=key, token=tok, fence=got.fence, ttl=5, interval=0.05, task_id="run-1",
                  task_name="iso.sync", store=store, since=got.since)
    beat = Heartbeat(store)
    beat.add(lease)
    wait_for(lambda: beat.rounds >= 2, timeout=5)
    # the push: a force-release publishes on the holder's process inbox, which hears it at once
    ptok = token()
    pgot = store.acquire("push:1", ptok, 5, Holder("run-p", "w1@h", "iso.sync"))
    assert isinstance(pgot, Acquired)
    pushed = Lease(key="push:1", token=ptok, fence=pgot.fence, ttl=5, interval=1, task_id="run-p",
                   task_name="iso.sync", store=store, since=pgot.since)
    beat.add(pushed)
    assert beat.inbox.subscribed.wait(5)
    assert store.handoff.force_release("push:1", "ops", hand_on=False) is not None
    assert pushed.wait_superseded(2) and "force-released by ops" in pushed.lost_reason
    beat.stop()
    assert not lease.lost
    lease.write_progress(ProgressUpdate("loading", 1, 2))
    assert isinstance(held := store.acquire(key, token(), 5, Holder("run-3")), Held)
    assert held.holder == "run-1"
    assert store.marks.note_duplicate(key, "run-3", "skipped")

    # status, listing, watching
    st = reader.read(key)
    assert st is not None and st.held and st.state == "loading" and st.duplicates == 1
    if listing:
        assert [s.key for s in reader.held(prefix="sync:")] == [key]
    events = list(reader.watch(key, timeout=0.2))
    assert [e.kind for e in events] == ["progress", "duplicate"]

    # queue and join: park, join, release hands the key on, the parked run adopts it
    parked = store.handoff.park(key, "run-4", "handoff-4", '{"parked": 4}', None)
    assert isinstance(parked, Parked) and parked.position == 1
    assert store.handoff.join(key, '{"joined": 5}') == (1, "run-1")
    assert store.handoff.queued(key) == 1
    assert store.handoff.resume(key, 5) is None  # the sweeper's check: the holder is alive
    released = store.release(key, tok, "succeeded", 5, fence=lease.fence)
    assert released and released.handoff == '{"parked": 4}' and released.joined == ('{"joined": 5}',)
    adopted = store.acquire(key, (tok4 := token()), 5, Holder("run-4"), handoff="handoff-4")
    assert isinstance(adopted, Acquired) and store.handoff.queued(key) == 0
    assert store.lease.revise_outcome(key, "run-4", "running", "revoked") is False
    assert store.release(key, tok4, "terminated", 5, fence=adopted.fence)
    assert store.lease.revise_outcome(key, "run-4", "terminated", "revoked") is True
    # a parked run whose reservation ran out still takes the free key when it is first in line
    tok6 = token()
    assert isinstance(store.acquire(key, tok6, 5, Holder("run-6")), Acquired)
    assert isinstance(store.handoff.park(key, "run-7", "handoff-7", '{"parked": 7}', None), Parked)
    assert store.release(key, tok6, ttl=0.1).handoff == '{"parked": 7}'
    wait_for(lambda: store.time_left(key) is None)  # run-7's reservation ran out (the server's clock)
    late = store.acquire(key, (tok7 := token()), 5, Holder("run-7"), handoff="handoff-7")
    assert isinstance(late, Acquired) and store.handoff.queued(key) == 0
    assert store.release(key, tok7)
    # another copy of its message (a re-send) does not run it again
    copy = store.acquire(key, token(), 5, Holder("run-7"), handoff="handoff-7")
    assert isinstance(copy, Held) and copy.copy

    # fair share: a run enters its gate, the others wait in fair order, a release hands the slot
    # on, a run past its queue_timeout is taken out of the queue
    gate, fair = "fair:acl", store.fair
    assert fair.enter(gate, 1, "f-1", "ft-1", "{}", "A", 1.0, 5) == Admitted(0)
    assert isinstance(store.acquire(gate, (tokf := token()), 5, Holder("f-1"), handoff="ft-1"), Acquired)
    assert isinstance(fair.enter(gate, 1, "f-2", "ft-2", '{"fair": 2}', "A", 1.0, 5, dry=True), Waiting)
    assert isinstance(fair.enter(gate, 1, "f-2", "ft-2", '{"fair": 2}', "A", 1.0, 5), Waiting)
    assert isinstance(fair.enter(gate, 1, "f-4", "ft-4", '{"fair": 4}', "A", 1.0, 5), Waiting)
    assert isinstance(fair.enter(gate, 1, "f-3", "ft-3", '{"fair": 3}', "B", 1.0, 5), Waiting)
    fair.set_weight(gate, "B", 2.0)
    assert fair.weights(gate) == {"B": 2.0}
    fair.set_weight(gate, "B", None)
    assert [w.task_id for w in fair.waiters(gate, 1)] == ["f-2", "f-3", "f-4"]
    assert store.release(gate, tokf).handoff == '{"fair": 2}'
    assert isinstance(store.acquire(gate, (tokf2 := token()), 5, Holder("f-2"), handoff="ft-2"), Acquired)
    fair.note_run(gate, 0.1)
    # each waiter is taken out once it waited 10 ms and kept (answered again) until ended
    wait_for(lambda: sorted(t for t, _, _ in fair.timed_out(gate, 1, 0.01)) == ["f-3", "f-4"])
    fair.ended_timeout(gate, "f-3")
    fair.ended_timeout(gate, "f-4")
    assert store.release(gate, tokf2) and store.handoff.queued(gate) == 0

    # a delayed run keeps a copy: noted as held by a worker, sent again once that worker is gone,
    # claimed by the copy that starts first
    due = store.delayed.delay(key, "run-8", "tok-8", '{"delayed": 8}', 0.01)
    store.delayed.touch([(key, "run-8", "tok-8")], "gone@h")
    assert due is not None
    grace_over = round(due * 1000) + constants.LUA_CONSTANTS["DELAYED_GRACE_MS"]
    wait_server_time(store.client, grace_over)  # by the clock RESEND judges by
    alive = store.delayed.alive("w1@h")
    assert store.delayed.due() == [(key, "run-8")]
    resent = store.delayed.resend(key, "run-8", "sweep-8", alive)
    assert resent is not None and (resent.message, resent.headers) == ('{"delayed": 8}', {})
    store.delayed.sent(key, "run-8")
    assert store.delayed.claim(key, "run-8", "sweep-8", "w1@h#x", "lease-8") != ClaimReply.STALE
    assert store.delayed.done(Claim(key, "run-8", "sweep-8")) == ClaimDoneReply.DONE

    # the sweeper hands the key of a dead holder to its parked run and answers its joined runs
    conv = "conv:7"
    assert isinstance(store.acquire(conv, token(), 0.2, Holder("dying")), Acquired)
    message = json.dumps(dict(sync.s("acme", "m-9").set(task_id="run-9", headers={"x": "1"})))
    assert isinstance(store.handoff.park(conv, "run-9", "handoff-9", message, None), Parked)
    assert store.handoff.join(conv, message) is not None
    sweeper = Sweeper(app, [HandOn(app, store, 5.0, 1)])
    wait_for(lambda: sweeper.sweep_once() == 1, timeout=5, interval=0.05)
    reserved = store.holder_record(conv)
    assert reserved["task_id"] == "run-9" and reserved["reserved"] == "1"
    assert app.AsyncResult("run-9").state == "FAILURE"  # the joined run got the LeaseLost error
    got9 = store.acquire(conv, (tok9 := token()), 5, Holder("run-9"), handoff="handoff-9")
    assert isinstance(got9, Acquired) and store.handoff.queued(conv) == 0
    assert store.release(conv, tok9, fence=got9.fence)
    assert store.handoff.resume(conv, 5) is None  # nothing waits any more: dropped from the index
    assert conv not in store.handoff.due_waiting()

    # a turned-away redelivery keeps a copy of itself in the queue; its run's release drops it
    tok8 = token()
    assert isinstance(store.acquire(key, tok8, 5, Holder("run-8")), Acquired)
    assert isinstance(store.handoff.park(key, "run-8", "own-8", '{"copy": 8}', None), Parked)
    assert store.handoff.queued(key) == 1
    assert store.release(key, tok8).handoff is None and store.handoff.queued(key) == 0

    # force-release by an operator
    tok5 = token()
    assert isinstance(store.acquire(key, tok5, 5, Holder("run-5")), Acquired)
    assert reader.force_release(key, "ops@tenant", expected_holder="run-5") == "run-5"
    st = reader.read(key)
    assert st is not None and not st.held and st.released_by == "ops@tenant"
    assert not store.release(key, tok5)  # its late release records nothing

    # enqueue-time dedup and the idempotency window, through a task
    first = sync.apply_async(("acme", "m-1"))
    assert sync.apply_async(("acme", "m-1")).id == first.id
    assert sync.apply(("acme", "m-1"), task_id=first.id).get()["synced"] == "m-1"
    again = sync.apply(("acme", "m-1"))  # a repeat of the message: remembered, not run
    assert again.get()["synced"] == "m-1"
    assert sync.apply_async(("acme", "m-1")).id != first.id  # the run ended: a new message
    assert store.marks.clear_enqueued("acct:acme", "nobody") is False

    # hold(): progress, a refused second hold, status through the app
    with hold(app, "maintenance:db", ttl=3, holder="ops-hold") as h:
        h.progress("vacuum", current=1, total=3)
        with pytest.raises(LockHeld), hold(app, "maintenance:db", wait=0.1):
            pass
        st = sf.status(app, "maintenance:db")
        assert st is not None and st.state == "vacuum" and st.duplicates == 1
        if listing:
            assert {s.key for s in sf.held(app)} == {"maintenance:db"}
    st = sf.status(app, "maintenance:db")
    assert st is not None and st.outcome == "succeeded"


def test_the_acl_grants_exactly_what_a_full_run_uses(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """Given a probe user allowed every command on tenant-a's keys, a full run (the worker's start
    checks included) uses exactly the commands of the recommended rule for the server under test."""
    probe = set_user(admin, "probe", ["reset", "on", f">{PASSWORD}",
                                      *(f"~{p}" for p in key_patterns(NS_A)),
                                      "resetchannels", *(f"&{p}" for p in channel_patterns(NS_A)), "+@all"])
    admin.config_resetstat()
    full_run(probe, NS_A)
    stats = admin.info("commandstats")
    used = {name.removeprefix("cmdstat_") for name, stat in stats.items() if stat["calls"]}
    handshake_and_admin = stat_names({"hello", "auth", "config|resetstat"})
    assert used - handshake_and_admin == stat_names(commands_of(acl_rule(NS_A)))
    assert all(not stat["rejected_calls"] for stat in stats.values())


def test_info_and_each_handshake_command_are_needed(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """Without +info the start checks leave an ACL LOG entry (and read nothing but HELLO); without
    a command of redis-py's handshake that the server's rule grants, every new connection leaves one."""
    url = set_user(admin, "no-info", [word for word in acl_rule(NS_A) if word != "+info"])
    preflight(tenant_app(url, NS_A)[0])
    assert denied(admin) == [("no-info", "command", "info")]
    resp3 = int(redis.__version__.split(".")[0]) >= 8  # redis-py 8 speaks RESP3 unless told otherwise
    for command in connection_commands(server()):
        if command == MAINT_NOTIFICATIONS and not resp3:
            continue  # only sent over RESP3
        admin.acl_log_reset()
        # the rule without it (Redis 6.2 cannot take a subcommand away with -)
        url = set_user(admin, "no-handshake", [word for word in acl_rule(NS_A) if word != f"+{command}"])
        redis.Redis.from_url(url).ping()
        (logged,) = stat_names({command})  # Redis 6.2 logs the command, not the subcommand
        assert denied(admin) == [("no-handshake", "command", logged)]


def test_ping_is_needed_for_the_health_check(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """The library's client checks a connection idle for 30 s with PING before using it; a user
    without +ping then gets NOPERM on the next command (shown with a 0.2 s interval)."""
    url = set_user(admin, "no-ping", [*acl_rule(NS_A), "-ping"])
    assert redis_client(url).connection_pool.connection_kwargs["health_check_interval"] == 30
    client = redis.Redis.from_url(url, health_check_interval=0.2)
    store = LeaseStore(client, KeyLayout(NS_A))
    assert store.holder_record("k") == {}
    idle = client.connection_pool._available_connections
    assert idle
    # idle past the interval: redis-py checks each with a PING before its next command (on its own
    # clock: the wall clock before redis-py 5.1, the monotonic one since)
    clock = redis.connection.time if callable(redis.connection.time) else redis.connection.time.monotonic
    wait_for(lambda: all(clock() > conn.next_health_check for conn in idle))
    with pytest.raises(redis.exceptions.NoPermissionError, match="ping"):
        store.holder_record("k")
    client.close()


def test_a_tenant_user_with_the_minimal_acl_runs_everything(
    acl_redis: RedisServer, admin: redis.Redis
) -> None:
    """Given a user with only the recommended rule for tenant-a, a full run of tenant-a works and
    Redis refuses nothing."""
    rule = acl_rule(NS_A)
    print("\nrecommended per-tenant ACL:\nACL SETUSER tenant-a " + " ".join(rule))
    url = set_user(admin, "tenant-a", rule)
    full_run(url, NS_A)
    assert denied(admin) == []
    written = names(admin)
    indexes = {f"{NS_A}:waiting", f"{NS_A}:workers", f"{NS_A}:delays", f"{NS_A}:protocol"}
    assert written and all(n.startswith(f"{NS_A}:{{") or n in indexes for n in written), written


def test_without_scan_everything_but_listing_works(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """The stricter rule for tenants that must not see other tenants' key names (see
    test_scan_is_not_limited_by_acl_key_patterns): without +scan, everything but held() and
    `celery singleflight ls` works."""
    url = set_user(admin, "tenant-a-noscan", [*acl_rule(NS_A), "-scan"])
    full_run(url, NS_A, listing=False)
    assert denied(admin) == []
    with pytest.raises(redis.exceptions.NoPermissionError, match="scan"):
        sf.held(tenant_app(url, NS_A)[0])


REFUSED = [
    ("GET", f"{NS_B}:{{x}}:lease"), ("SET", f"{NS_B}:{{x}}:lease", "1"), ("DEL", f"{NS_B}:{{x}}:lease"),
    ("HGETALL", f"{NS_B}:{{x}}:lease"), ("ZADD", f"{NS_B}:waiting", "1", "x"),
    ("GET", f"{NS_A}:x:{{y}}:lease"),  # the keys of a namespace "tenant-a:x"
    ("GET", "plain"), ("KEYS", "*"), ("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "GET", "maxmemory"),
    ("CONFIG", "SET", "maxmemory", "1"), ("EVAL", "return 1", "0"), ("SCRIPT", "FLUSH"), ("SELECT", "1"),
    ("PUBLISH", "ch", "x"), ("CLIENT", "LIST"), ("ACL", "LIST"), ("SWAPDB", "0", "1"), ("SHUTDOWN",),
    ("RENAME", f"{NS_A}:{{x}}:lease", f"{NS_B}:{{x}}:lease"),
    ("COPY", f"{NS_A}:{{x}}:lease", f"{NS_B}:{{x}}"),
]


def test_the_tenant_user_can_do_nothing_else(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """Given the tenant-a user, another tenant's keys, KEYS, FLUSHALL, CONFIG, EVAL and the rest are
    refused with NOPERM, and Lua scripts cannot reach other keys either."""
    url = set_user(admin, "tenant-a", acl_rule(NS_A))
    admin.set(f"{NS_B}:{{x}}:lease", "b")
    admin.set(f"{NS_A}:{{x}}:lease", "a")
    client = redis.Redis.from_url(url)
    try:
        for command in REFUSED:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        sneaky = client.register_script("return redis.call('GET', 'tenant-b:{x}:lease')")
        with pytest.raises(redis.ResponseError, match=r"(?i)can't access|no permissions to access"):
            sneaky(keys=[f"{NS_A}:{{x}}:lease"])
        assert client.get(f"{NS_A}:{{x}}:lease") == b"a"
    finally:
        client.close()
    assert admin.get(f"{NS_B}:{{x}}:lease") == b"b" and admin.dbsize() == 2
    assert admin.ping()


def test_scan_is_not_limited_by_acl_key_patterns(acl_redis: RedisServer, admin: redis.Redis) -> None:
    """A limit of Redis, not of the library (see docs/isolation.md): SCAN, which held() needs,
    returns the *names* of every key of the database, so a tenant user can list another tenant's
    key names (never read them). held() itself filters on its own namespace."""
    url = set_user(admin, "tenant-a", acl_rule(NS_A))
    b = LeaseStore(admin, KeyLayout(NS_B))
    b.acquire("secret-customer:42", token(), 30, Holder("run-b"))
    client = redis.Redis.from_url(url)
    try:
        assert names(client) == {b.layout.run("secret-customer:42")}
        assert StatusReader(LeaseStore(client, KeyLayout(NS_A))).held() == []
    finally:
        client.close()


def test_a_library_call_for_another_namespace_fails_with_noperm(
    acl_redis: RedisServer, admin: redis.Redis
) -> None:
    """Given the tenant-a user configured with namespace tenant-b (by mistake or on purpose), every
    library call fails with Redis's NOPERM error and nothing is written."""
    url = set_user(admin, "tenant-a", acl_rule(NS_A))
    b_admin = LeaseStore(admin, KeyLayout(NS_B))
    b_tok = token()
    b_admin.acquire("held-by-b", b_tok, 30, Holder("run-b"))
    store = store_for(url, NS_B)
    reader = StatusReader(store)
    app, _ = tenant_app(url, NS_B)
    lease = Lease(key="held-by-b", token=b_tok, fence=1, ttl=30, interval=10, task_id="run-b",
                  task_name="t", store=store, since=0.0)
    calls = {
        "acquire": lambda: store.acquire("k", token(), 5, Holder("x")),
        "renew": lambda: store.renew([lease]),
        "release": lambda: store.release("held-by-b", b_tok),
        "progress": lambda: store.lease.progress("held-by-b", 0, b_tok, "{}", "x", 1),
        "force_release": lambda: reader.force_release("held-by-b", "intruder"),
        "read": lambda: reader.read("held-by-b"),
        "held": lambda: reader.held(),
        "park": lambda: store.handoff.park("held-by-b", "t", "h", "{}", None),
        "join": lambda: store.handoff.join("held-by-b", "{}"),
        "due_waiting": lambda: store.handoff.due_waiting(),
        "mark_enqueued": lambda: store.marks.mark_enqueued("k", "t", 5),
        "remembered": lambda: store.marks.remembered("k"),
        "remember": lambda: store.marks.remember("k", "{}", 5),
        "status": lambda: sf.status(app, "held-by-b"),
        "sf.held": lambda: sf.held(app),
        "sf.force_release": lambda: sf.force_release(app, "held-by-b", by="intruder"),
    }
    for name, call in calls.items():
        with pytest.raises(redis.exceptions.NoPermissionError, match=r"(?i)no permissions"):
            call()
            pytest.fail(f"{name} did not fail")
    with pytest.raises(Exception) as info, hold(app, "k"):
        pytest.fail("hold() must not get a key of another tenant")
    assert isinstance(info.value.__cause__ or info.value, redis.exceptions.NoPermissionError)
    assert names(admin) == {b_admin.layout.run("held-by-b")}
    assert b_admin.holder_record("held-by-b")["token"] == b_tok


def test_a_permission_error_is_not_reported_as_redis_unreachable(
    acl_redis: RedisServer, admin: redis.Redis
) -> None:
    url = set_user(admin, "tenant-a", acl_rule(NS_A))
    app, sync = tenant_app(url, NS_B)
    errors: list[BaseException] = []
    for attempt in (lambda: hold(app, "k").__enter__(), lambda: sync("acme", "m-1")):
        with pytest.raises(Exception) as info:  # asserted below
            attempt()
        errors.append(info.value)
    for error in errors:
        assert isinstance(error.__cause__ or error.__context__ or error, redis.exceptions.NoPermissionError)
        assert "unreachable" not in str(error), str(error)


def test_fail_open_does_not_run_unguarded_when_redis_refuses_the_keys(
    acl_redis: RedisServer, admin: redis.Redis
) -> None:
    url = set_user(admin, "tenant-a", acl_rule(NS_A))
    app = Celery("iso-fail-open", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=url, singleflight_namespace=NS_B)
    ran: list[str] = []

    @app.task(base=SingleFlightTask, name="iso.fail_open", shared=False, lock_key="acct:<account>",
              on_redis_error="fail_open")
    def guarded(account: str) -> str:
        ran.append(account)
        return "ran"

    with pytest.raises(redis.exceptions.NoPermissionError):
        guarded.apply(("acme",)).get()
    assert ran == []


@pytest.mark.worker
def test_a_real_worker_runs_with_the_tenant_acl(
    admin: redis.Redis, sfapp: ModuleType, start_worker: Any
) -> None:
    """Given a worker whose lease Redis connects as a user with the recommended rule for the test
    app's namespace ("sf"; the broker and results use another server), its tasks acquire, renew,
    report progress, queue, join, remember and release; Redis refuses nothing, the worker's start
    checks included: ACL LOG stays empty."""
    url = set_user(admin, "sf-worker", acl_rule("sf"))
    worker = start_worker(concurrency=4, env={"SF_TEST_LEASE_REDIS": url})
    q = worker.queue
    renewing = sfapp.heartbeat_check.apply_async(("acl-hb", 2.0), queue=q)  # TTL 1.5 s
    # the queue and join holders hold until their duplicates met them (HOLD s at most)
    holder = sfapp.queued.apply_async(("acl-q", 0, HOLD), queue=q)
    join_holder = sfapp.joined.apply_async(("acl-j", "v", HOLD), queue=q)
    try:
        wait_for(lambda: sfapp.recorder.llen("runs:acl-q") and sfapp.recorder.llen("runs:acl-j"), timeout=15)
        parked = [sfapp.queued.apply_async(("acl-q", n, 0.01), queue=q) for n in (1, 2)]
        joiner = sfapp.joined.apply_async(("acl-j", "w", 0.01), queue=q)
        wait_for(lambda: all(r.state == "QUEUED" for r in parked) and joiner.state == "JOINED", timeout=15)
    finally:
        for key in ("acl-q", "acl-j"):
            sfapp.recorder.set(f"gate:{key}", 1)  # the holders go on (sfapp.record_run)
    report = sfapp.reporting.apply_async(("acl-r", 3, 0.05), queue=q)
    messages = [sfapp.handle_message.apply_async(("acl-t", "m-1", 0.3), queue=q) for _ in range(2)]

    assert [r.get(timeout=30) for r in (holder, *parked)] == [0, 1, 2]
    assert joiner.get(timeout=30) == join_holder.get(timeout=30) == {"value": "v", "ran": join_holder.id}
    assert report.get(timeout=30) == 3
    first, second = (m.get(timeout=30) for m in messages)
    assert first == second and sfapp.recorder.llen("runs:acl-t:m-1") == 1
    assert renewing.get(timeout=30)["lost"] is False
    assert sfapp.recorder.llen("overlaps") == 0

    leases = StatusReader(LeaseStore(admin, KeyLayout("sf")))
    for key in ("q:acl-q", "job:acl-r", "j:acl-j", "k:acl-hb", "conv:acl-t"):
        st = leases.read(key)
        assert st is not None and st.outcome == "succeeded", (key, st)
    written = names(admin)
    outside = {"sf:waiting", "sf:started", "sf:epoch", "sf:protocol", "sf:delays", "sf:workers"}
    assert written and all(n.startswith("sf:{") or n in outside for n in written), written
    assert denied(admin) == []
    assert "no permissions" not in worker.log().lower()


# -- who force-released a key -----------------------------------------------------------------


def released_by_here() -> str:
    """Who the CLI says released a key when run by this user on this host."""
    return f"{getpass.getuser()}@{socket.gethostname()} (celery singleflight release)"


def release_from_cli(
    redis_server: RedisServer, key: str
) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """``celery -A sfapp singleflight release KEY --force`` as an operator runs it."""
    before = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "sfapp", "singleflight", "release", key, "--force"],
        cwd=TESTS, env={**os.environ, **worker_env(redis_server)}, capture_output=True, text=True, timeout=60,
    )
    return out, before, time.time()


def test_cli_force_release_is_logged_with_who_and_when(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """Given a key held by hold() in this process, `celery singleflight release KEY --force` logs a
    warning naming who released it (user@host) and records who and when in the key's status and
    history; the holder's heartbeat then finds its lease gone."""
    key, by = "iso:cli", released_by_here()
    with hold(sfapp.app, key, ttl=1.5, holder="hold:iso-cli") as lease:
        out, before, after = release_from_cli(redis_server, key)
        assert out.returncode == 0, out.stderr
        shown, done = out.stdout.splitlines()
        assert shown.startswith("key iso:cli is held by task hold:iso-cli (hold)")
        assert done == "released key iso:cli, held by task hold:iso-cli"
        # the CLI configures no logging: Python's last-resort handler prints WARNING and above
        logged = [line for line in out.stderr.splitlines() if "force-released key='iso:cli'" in line]
        assert len(logged) == 1, out.stderr
        assert logged[0].endswith(f"held by task hold:iso-cli (fence {lease.fence}), by {by}"), logged[0]
        st = sf.status(sfapp.app, key)
        assert st is not None and not st.held and st.state == st.outcome == "force-released"
        assert st.released_by == by and st.task_id == "hold:iso-cli" and st.fence == lease.fence
        assert st.ended is not None and before - 1 <= st.ended <= after + 1
        wait_for(lambda: lease.lost, timeout=5)
    end = list(sf.watch(sfapp.app, key, timeout=1))[-1]
    assert end.kind == "end" and end.state == "force-released" and end.fields.get("by") == by
    assert end.ts is not None and before - 1 <= end.ts <= after + 1
    st = sf.status(sfapp.app, key)
    assert st is not None and st.released_by == by  # the holder's late release did not overwrite it


def test_cli_force_release_log_line_says_when_and_at_which_level(
    sfapp: ModuleType, redis_server: RedisServer
) -> None:
    with hold(sfapp.app, "iso:cli-when", ttl=1.5):
        out, _, _ = release_from_cli(redis_server, "iso:cli-when")
    assert out.returncode == 0, out.stderr
    (line,) = [line for line in out.stderr.splitlines() if "force-released key=" in line]
    assert "WARNING" in line
    assert re.search(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d", line), line
