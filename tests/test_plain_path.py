"""The lease scripts' plain path against a real Redis.

An uncontended run of a one-slot key that was never parked is the commonest call, and ACQUIRE
and RELEASE answer it before they make any helper, reading and writing the run record as text
(no JSON decode or encode). These tests hold that path to what the general path does with the
same calls: the same answers and records that decode to the same fields, whichever path wrote
them, in any order of the two.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.lease import ProgressReply
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import wait_for
from .lua_sources import SOURCE

#: fields that differ from run to run (times, tokens, ids): compared by what they stand for
_VARYING = ("token", "rt", "fence", "since", "deadline", "ended", "updated", "task_id", "prev_task_id",
            "lost")


@pytest.fixture
def store(redis_server: RedisServer) -> LeaseStore:
    client = redis_server.client(2)
    client.flushdb()
    return LeaseStore(client, KeyLayout(f"plain-{uuid.uuid4().hex[:6]}"))


def _record(store: LeaseStore, key: str) -> tuple[bytes, dict[str, Any]]:
    raw = store.client.get(store.layout.run(key))
    assert raw is not None
    return raw, json.loads(raw)


def _runs(store: LeaseStore, key: str, general: bool, count: int, *, expire_first: bool = False,
          ) -> list[tuple[dict[str, Any], dict[str, Any], list[str], list[int]]]:
    """``count`` runs of ``key`` one after another: per run the record while it runs and after its
    release, with its token and fence. ``general`` sends every call down the general path (an
    acquire that names an earlier attempt which never was; a release that clears a marker which
    is not there). ``expire_first``: the first run's lease runs out unreleased."""
    found = []
    for i in range(count):
        token, task_id = uuid.uuid4().hex, f"task-{i}"
        ttl = 0.2 if expire_first and i == 0 else 10
        got = store.acquire(key, token, ttl, Holder(task_id, worker="w@h", task_name="t.plain"),
                            earlier="never-an-attempt" if general else "")
        assert isinstance(got, Acquired)
        raw, running = _record(store, key)
        assert raw.startswith(b"{ "), "a plain run's record is one the plain path may read"
        if expire_first and i == 0:
            wait_for(lambda: store.time_left(key) is None, timeout=10, interval=0.01)  # its 0.2 s ran out
            found.append((running, {}, [token, task_id], [got.fence]))
            continue
        settled = store.release(key, token, "failed" if i == 2 else "succeeded", fence=got.fence,
                                clear_marker=general, task_id=task_id)
        assert settled.ours and settled.handoff is None and settled.joined == ()
        raw, released = _record(store, key)
        again = store.release(key, token, "succeeded", fence=got.fence, task_id=task_id)
        assert again.ours, "a second run of the release answers as the first"
        assert _record(store, key)[0] == raw, "and changes nothing"
        found.append((running, released, [token, task_id], [got.fence]))
    return found


def _shape(record: dict[str, Any], runs: list[list[str]]) -> dict[str, Any]:
    """The record with its varying fields replaced by what they stand for (which run's token or
    task id; a number or a time)."""
    def which(value: str) -> str:
        for i, (token, task_id) in enumerate(runs):
            if value == token:
                return f"token of run {i}"
            if value == task_id:
                return f"task id of run {i}"
        return "a fence list" if "," in value else ("a number" if value.isdigit() else repr(value))
    return {name: which(value) if name in _VARYING else value for name, value in record.items()
            if not (name in ("rt", "lost") and value == "")}  # written empty by a plain run


@pytest.mark.parametrize("expire_first", [False, True], ids=["released", "first-lease-ran-out"])
def test_the_plain_path_writes_the_records_and_answers_of_the_general_path(
    store: LeaseStore, expire_first: bool
) -> None:
    """Four runs of one key, through the plain path and through the general path: each running
    and each released record decodes to the same fields (the previous run, its outcome, the
    releasing token, the fences of lost runs), fences grow, and a replayed release answers as
    the first."""
    plain = _runs(store, "acct:1", general=False, count=4, expire_first=expire_first)
    general = _runs(store, "acct:2", general=True, count=4, expire_first=expire_first)
    runs_plain = [ids for _, _, ids, _ in plain]
    runs_general = [ids for _, _, ids, _ in general]
    for (p_running, p_released, _, _), (g_running, g_released, _, _) in zip(plain, general, strict=True):
        assert _shape(p_running, runs_plain) == _shape(g_running, runs_general)
        assert _shape(p_released, runs_plain) == _shape(g_released, runs_general)
    fences = [fence for _, _, _, (fence,) in plain]
    assert fences == sorted(fences) and len(set(fences)) == len(fences)
    if expire_first:  # the lost run's fence is remembered by every later record
        assert all(released["lost"] == str(fences[0]) for _, released, _, _ in plain[1:])
        assert all(released["lost"] == str(general[0][3][0]) for _, released, _, _ in general[1:])
    assert plain[-1][1]["prev_task_id"] == "task-2" and plain[-1][1]["prev_outcome"] == "failed"


def test_a_record_changed_by_another_script_takes_the_general_path(store: LeaseStore) -> None:
    """A run that reported progress has a history; its record was re-encoded without the plain
    mark, and its release still ends the history and records the outcome."""
    token = uuid.uuid4().hex
    got = store.acquire("acct:3", token, 10, Holder("task-p"))
    assert isinstance(got, Acquired)
    assert store.lease.progress("acct:3", 0, token, '{"done": 1}', "PROGRESS", 1)[0] == ProgressReply.WRITTEN
    raw, running = _record(store, "acct:3")
    assert not raw.startswith(b"{ ") and running["history"] == "1"
    assert store.release("acct:3", token, fence=got.fence).ours
    raw, released = _record(store, "acct:3")
    assert released["outcome"] == "succeeded" and released["rt"] == token and "token" not in released
    kinds = [fields[b"kind"] for _, fields in store.client.xrange(store.layout.history("acct:3"))]
    assert kinds == [b"progress", b"end"]
    nxt = store.acquire("acct:3", uuid.uuid4().hex, 10, Holder("task-q"))
    assert isinstance(nxt, Acquired) and nxt.fence > got.fence
    assert _record(store, "acct:3")[1]["prev_task_id"] == "task-p"


def test_a_late_release_of_a_lost_lease_does_not_touch_the_next_plain_run(store: LeaseStore) -> None:
    """A run whose lease ran out and whose key a plain run took since cannot release that run."""
    old, new = uuid.uuid4().hex, uuid.uuid4().hex
    first = store.acquire("acct:4", old, 0.2, Holder("task-old"))
    wait_for(lambda: store.time_left("acct:4") is None, timeout=10, interval=0.01)  # its 0.2 s ran out
    second = store.acquire("acct:4", new, 10, Holder("task-new"))
    assert isinstance(first, Acquired) and isinstance(second, Acquired)
    assert not store.release("acct:4", old, fence=first.fence).ours
    raw, running = _record(store, "acct:4")
    assert running["token"] == new and running["lost"] == str(first.fence) and raw.startswith(b"{ ")
    assert store.release("acct:4", new, fence=second.fence).ours


@pytest.mark.parametrize("general", [False, True], ids=["plain", "general"])
def test_a_fence_stays_above_the_last_one_when_the_clock_is_behind_it(
    store: LeaseStore, general: bool
) -> None:
    """A fence is the larger of the clock and the last fence plus one: a record whose fence is
    ahead of the server's clock (a clock set back, a snapshot from a faster host) still gets a
    larger one, through either path."""
    token = uuid.uuid4().hex
    got = store.acquire("acct:5", token, 10, Holder("task-a"))
    assert isinstance(got, Acquired) and store.release("acct:5", token, fence=got.fence).ours
    ahead = got.fence + 10**12  # about eleven days ahead of the clock, in microseconds
    raw = store.client.get(store.layout.run("acct:5"))
    assert raw is not None and raw.startswith(b"{ ")
    moved = raw.replace(b'"fence":"%d"' % got.fence, b'"fence":"%d"' % ahead)
    store.client.set(store.layout.run("acct:5"), moved, px=60_000)
    nxt = store.acquire("acct:5", uuid.uuid4().hex, 10, Holder("task-b"),
                        earlier="never-an-attempt" if general else "")
    assert isinstance(nxt, Acquired) and nxt.fence == ahead + 1


def test_an_outcome_json_must_escape_is_recorded_as_it_was_given(store: LeaseStore) -> None:
    """The plain path writes the outcome into the record's text as it is; one with a quote, a
    backslash or a control character takes the general path, which escapes it."""
    for i, outcome in enumerate(['said "no"', "back\\slash", "new\nline"]):
        token = uuid.uuid4().hex
        got = store.acquire("acct:6", token, 10, Holder(f"task-{i}"))
        assert isinstance(got, Acquired) and store.release("acct:6", token, outcome, fence=got.fence).ours
        assert _record(store, "acct:6")[1]["outcome"] == outcome


@pytest.mark.parametrize("script", ["ACQUIRE", "RELEASE"])
def test_a_lost_reply_of_the_plain_path_is_answered_as_the_first_run(
    redis_server: RedisServer, script: str
) -> None:
    """The server runs a plain ACQUIRE or RELEASE of a key a plain run used before, and its reply
    is lost; redis-py sends the call again (the library's client retries). The second run, which
    meets the record the first one wrote, answers as the first did: the same fence, "released"."""
    with FaultProxy(redis_server.port) as proxy:
        store = LeaseStore(redis_client(proxy.url(2)), KeyLayout(f"lost-{uuid.uuid4().hex[:6]}"))
        before, token = uuid.uuid4().hex, uuid.uuid4().hex
        got = store.acquire("acct:7", before, 10, Holder("task-before"))
        assert isinstance(got, Acquired) and store.release("acct:7", before, fence=got.fence).ours
        assert _record(store, "acct:7")[0].startswith(b'{ "v":"2","rt":'), "a released plain record"
        rule = proxy.add_rule(DROP_REPLY, script=SOURCE[script], nth=1)
        mine = store.acquire("acct:7", token, 10, Holder("task-mine"))
        assert isinstance(mine, Acquired) and mine.fence > got.fence
        raw, running = _record(store, "acct:7")
        assert running["token"] == token and running["fence"] == str(mine.fence)
        assert running["prev_task_id"] == "task-before" and running["rt"] == before
        settled = store.release("acct:7", token, fence=mine.fence)
        assert settled.ours and settled.handoff is None and settled.joined == ()
        raw, released = _record(store, "acct:7")
        assert released["rt"] == token and released["outcome"] == "succeeded"
        # a second ACQUIRE re-encodes the record (it counts the lease from its own run): that run's
        # release then takes the general path, to the same record
        assert raw.startswith(b'{ "v":"2","rt":') == (script == "RELEASE")
        assert "token" not in released and released["fence"] == str(mine.fence)
        assert rule.faulted == 1
