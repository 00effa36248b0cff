"""Every slot of a ``max_concurrency`` > 1 key is visible and operable, not only slot 0.

``held()`` lists one status per held slot, ``read(key)`` stays slot 0 while ``read(key, slot)`` and
``read_all(key)`` see the others, ``watch(key, slot=N)`` follows one slot's run, and
``force_release(key, ..., slot=N)`` frees exactly that slot. The CLI (``ls``, ``show``, ``watch``,
``release --slot/--holder``, exit 6 when ambiguous) is checked as a subprocess against runs of a
real worker.
"""

from __future__ import annotations

import json
import re
import subprocess
import threading
import uuid
from types import ModuleType
from typing import Any

import pytest
import redis

import celery_singleflight as sf
from celery_singleflight import Lease, signals
from celery_singleflight.ops.cli import status_lines, status_table
from celery_singleflight.ops.status import KeyStatus, StatusReader, WatchEvent, status_all
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.progress import ProgressUpdate
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import wait_for
from .test_cli import finish, json_lines, run_cli, start_cli

pytestmark = pytest.mark.share_workers  # start_worker may lend a worker an earlier test left idle

KEY = "lim:multi"


def token() -> str:
    return uuid.uuid4().hex


@pytest.fixture
def store(sfapp: ModuleType) -> LeaseStore:
    """The store of sfapp's ``limited`` task (namespace ``sf``, lease db 2, emptied per test)."""
    return sfapp.limited.store  # type: ignore[no-any-return]


def take(store: LeaseStore, key: str, task_id: str, slots: int = 3) -> tuple[str, Acquired]:
    tok = token()
    got = store.acquire(key, tok, 30, Holder(task_id, "w@h", "sfapp.limited"), slots=slots)
    assert isinstance(got, Acquired), (key, task_id, got)
    return tok, got


def take_slots(store: LeaseStore, key: str, n: int = 3) -> dict[int, tuple[str, Acquired]]:
    """Hold all ``n`` slots of ``key`` with tasks ``run-0`` ... ``run-<n-1>``; by slot."""
    taken = {}
    for i in range(n):
        tok, got = take(store, key, f"run-{i}", slots=n)
        taken[got.slot] = (tok, got)
    assert sorted(taken) == list(range(n))
    return taken


def lease_of(store: LeaseStore, key: str, task_id: str, tok: str, got: Acquired) -> Lease:
    return Lease(key=key, token=tok, fence=got.fence, ttl=30, interval=10, task_id=task_id,
                 task_name="sfapp.limited", store=store, since=got.since, slot=got.slot)


def runs(statuses: list[KeyStatus]) -> list[tuple[str, int, str | None]]:
    return [(st.key, st.slot, st.task_id) for st in statuses]


# -- library: listing and reading ------------------------------------------------------------------


#: user keys whose text looks like a slot's lease part, or tries to end the hash tag early
SLOTLIKE_KEYS = ["run1", "x}:run1", "x}:run", "a:run2}", "}:run1\n", "run", "k*", "{%7D}:run3"]


def test_held_lists_one_status_per_held_slot_and_nothing_else(store: LeaseStore, sfapp: ModuleType) -> None:
    """Given 3 runs on the 3 slots of one key, a key whose slot 0 is free but slot 1 held, keys whose
    text contains ``run1`` or ``}:run``, and decoy Redis keys that look like slot records, then
    held() lists exactly one entry per held slot, with its slot and task id."""
    taken = take_slots(store, KEY)
    expected = [(KEY, slot, f"run-{slot}") for slot in range(3)]
    for key in SLOTLIKE_KEYS:
        take(store, key, f"one:{key}", slots=1)
        expected.append((key, 0, f"one:{key}"))
    gap_tok, _ = take(store, "lim:gap", "gap-0", slots=2)
    take(store, "lim:gap", "gap-1", slots=2)
    assert store.release("lim:gap", gap_tok)  # slot 0 free, slot 1 still held
    expected.append(("lim:gap", 1, "gap-1"))

    client = store.client
    decoy = json.dumps({"task_id": "decoy", "token": "t", "fence": "1", "since": "1", "deadline": "9" * 15})
    for name in ("sf:{decoy}:run01", "sf:{decoy}:runx", "sf:{decoy}:run-1", "sf:{decoy}:history1",
                 "sf:{de%7bcoy}:run1", "sf-other:{multi}:run1", "sf:x:{multi}:run2",
                 "sf:{decoy}:run1:x"):
        client.set(name, decoy)
    client.set("sf:{decoy}:run1", "not a record")
    client.hset("sf:{decoy}:run2", mapping={"task_id": "a hash"})

    reader = StatusReader(store)
    listed = reader.held()
    assert runs(listed) == sorted(expected)
    assert all(st.held and st.ttl_left and st.ttl_left > 0 for st in listed)
    assert [st.fence for st in listed if st.key == KEY] == [taken[s][1].fence for s in range(3)]
    assert runs(sf.held(sfapp.app, prefix="lim:")) == [
        ("lim:gap", 1, "gap-1"), *((KEY, s, f"run-{s}") for s in range(3))
    ]
    assert runs(reader.held(prefix="x}")) == [
        ("x}:run", 0, "one:x}:run"), ("x}:run1", 0, "one:x}:run1")
    ]
    assert [st.as_dict()["slot"] for st in reader.held(prefix=KEY)] == [0, 1, 2]


def test_read_stays_slot_0_and_read_all_returns_every_held_slot(store: LeaseStore, sfapp: ModuleType) -> None:
    taken = take_slots(store, KEY)
    # keys whose Redis names start like KEY's: not slots of KEY
    take(store, KEY + "2", "other-2", slots=1)
    take(store, KEY + "}:run1", "other-tag", slots=1)
    tok1, got1 = taken[1]
    lease_of(store, KEY, "run-1", tok1, got1).write_progress(ProgressUpdate("loading", 2, 4, "half"))
    reader = StatusReader(store)

    zero = reader.read(KEY)
    assert zero is not None and zero.held and zero.slot == 0 and zero.task_id == "run-0"
    assert zero.state == "running" and zero.current is None  # slot 1's progress is not slot 0's
    one = reader.read(KEY, slot=1)
    assert one is not None and one.held and one.slot == 1 and one.task_id == "run-1"
    assert (one.state, one.current, one.total, one.percent, one.message) == ("loading", 2, 4, 50.0, "half")
    assert reader.read(KEY, slot=3) is None  # no such slot held, nothing known

    every = [(KEY, s, f"run-{s}") for s in range(3)]
    assert runs(reader.read_all(KEY)) == every
    assert runs(reader.read_all(KEY, slots=3)) == every  # no SCAN: the caller knows N
    assert runs(reader.read_all(KEY, slots=2)) == every[:2]
    assert runs(status_all(sfapp.app, KEY)) == every
    assert reader.read_all(KEY)[1].state == "loading"

    assert store.release(KEY, taken[0][0], fence=taken[0][1].fence)
    ended = reader.read(KEY)
    assert ended is not None and not ended.held and ended.outcome == "succeeded"
    assert runs(reader.read_all(KEY)) == every[1:]
    for slot in (1, 2):
        assert store.release(KEY, taken[slot][0], fence=taken[slot][1].fence, slot=slot)
    assert reader.read_all(KEY) == [] and reader.read_all(KEY, slots=3) == []
    assert reader.read_all("lim:nobody") == []
    with pytest.raises(ValueError, match="slot"):
        reader.read(KEY, slot=-1)


def test_force_release_frees_exactly_the_chosen_slot(store: LeaseStore) -> None:
    taken = take_slots(store, KEY)
    reader = StatusReader(store)
    seen: list[dict[str, Any]] = []

    def receiver(sender: Any = None, **kwargs: Any) -> None:
        seen.append(kwargs)

    signals.lease_force_released.connect(receiver)
    try:
        assert reader.force_release(KEY, "ops@test", expected_holder="run-2", slot=1) is None  # not its slot
        assert runs(reader.read_all(KEY)) == [(KEY, s, f"run-{s}") for s in range(3)]
        assert reader.force_release(KEY, "ops@test", expected_holder="run-1", slot=1) == "run-1"
    finally:
        signals.lease_force_released.disconnect(receiver)
    assert [(s["key"], s["task_id"], s["by"]) for s in seen] == [(KEY, "run-1", "ops@test")]

    assert store.holder_record(KEY, 1) == {}
    for slot in (0, 2):
        assert store.holder_record(KEY, slot)["token"] == taken[slot][0]
    assert runs(reader.read_all(KEY)) == [(KEY, 0, "run-0"), (KEY, 2, "run-2")]
    one = reader.read(KEY, slot=1)
    assert one is not None and not one.held and one.outcome == "force-released"
    assert one.released_by == "ops@test" and one.task_id == "run-1"
    tok1, got1 = taken[1]
    assert store.renew([lease_of(store, KEY, "run-1", tok1, got1)]) == [False]  # its heartbeat learns
    assert not store.release(KEY, tok1, slot=1)  # its late release records nothing
    events = list(reader.watch(KEY, timeout=2, slot=1))
    assert events[-1].kind == "end" and events[-1].state == "force-released"
    assert events[-1].fields["by"] == "ops@test"

    assert reader.force_release(KEY, "ops@test") == "run-0"  # the default is slot 0, as before
    assert runs(reader.read_all(KEY)) == [(KEY, 2, "run-2")]


def test_watch_follows_the_run_of_one_slot(store: LeaseStore) -> None:
    """Each slot's run is watched on its own stream: replay, then live XREAD, until that run ends."""
    taken = take_slots(store, KEY)
    leases = {s: lease_of(store, KEY, f"run-{s}", *taken[s]) for s in range(3)}

    def progress(slot: int, state: str, current: int) -> None:
        leases[slot].write_progress(ProgressUpdate(state, current, 3))

    progress(0, "zero", 1)
    progress(1, "one", 1)
    progress(1, "one", 2)
    assert store.release(KEY, taken[1][0], "succeeded", fence=taken[1][1].fence, slot=1)
    reader = StatusReader(store)
    one = list(reader.watch(KEY, slot=1, timeout=5))
    assert [(e.kind, e.state, e.current) for e in one] == [
        ("progress", "one", 1), ("progress", "one", 2), ("end", "succeeded", None)
    ]
    zero = list(reader.watch(KEY, timeout=0.5))  # slot 0 is still running
    assert [(e.kind, e.state) for e in zero] == [("progress", "zero")]

    live: list[WatchEvent] = []
    follower = threading.Thread(target=lambda: live.extend(reader.watch(KEY, slot=2, timeout=20, poll=0.1)))
    follower.start()
    wait_for(lambda: reader.read(KEY, slot=2) is not None, timeout=5)
    progress(2, "two", 1)
    progress(0, "zero", 2)  # another slot's progress is not slot 2's
    progress(2, "two", 3)
    assert store.release(KEY, taken[2][0], "failed", fence=taken[2][1].fence, slot=2)
    follower.join(timeout=25)
    assert not follower.is_alive()
    assert [(e.kind, e.state, e.current) for e in live] == [
        ("progress", "two", 1), ("progress", "two", 3), ("end", "failed", None)
    ]


@pytest.mark.parametrize(
    ("ns_a", "ns_b"), [("tenant", "tenant-b"), ("tenant-a", "tenant-a:x"), ("ns*", "nsx")]
)
def test_slots_stay_in_their_namespace(
    redis_server: RedisServer, sfapp: ModuleType, ns_a: str, ns_b: str
) -> None:
    """Given both slots of adversarial keys held in namespace A and of plain keys in B, each
    namespace lists exactly its own (key, slot) pairs, and A force-releasing every slot 1 leaves
    B's leases intact."""
    client = redis_server.client(2)
    a, b = LeaseStore(client, KeyLayout(ns_a)), LeaseStore(client, KeyLayout(ns_b))
    mine = [*SLOTLIKE_KEYS, "x", f"{ns_b}:{{x}}:run1", "}{"]
    theirs = ["x", "run1", "}"]
    tokens_b = {}
    for key in mine:
        for i in range(2):
            take(a, key, f"a{i}:{key}", slots=2)
    for key in theirs:
        for i in range(2):
            tok, got = take(b, key, f"b{i}:{key}", slots=2)
            tokens_b[key, got.slot] = tok
    assert runs(StatusReader(a).held()) == sorted((k, s, f"a{s}:{k}") for k in mine for s in range(2))
    assert runs(StatusReader(b).held()) == sorted((k, s, f"b{s}:{k}") for k in theirs for s in range(2))
    for key in mine:
        assert StatusReader(a).force_release(key, "ops@a", slot=1) == f"a1:{key}"
        assert runs(StatusReader(a).read_all(key)) == [(key, 0, f"a0:{key}")]
    for (key, slot), tok in tokens_b.items():
        assert b.holder_record(key, slot)["token"] == tok
    client.close()


def test_without_scan_read_all_needs_the_slot_count_and_the_cli_needs_no_scan(
    redis_server: RedisServer, sfapp: ModuleType, store: LeaseStore
) -> None:
    """A Redis user refused SCAN (the ACL rule of docs/isolation.md without +scan): read_all(key)
    fails with NOPERM, read_all(key, slots=N) works, and ``show`` works, since it reads the slots
    the app's tasks can have (sfapp.limited: 3), while ``ls`` still needs SCAN (exit 3)."""
    take_slots(store, KEY)
    admin = redis_server.client()
    user, password = "slots-noscan", "pw-noscan"
    admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", "~*", "+@all", "-scan")
    url = f"redis://{user}:{password}@127.0.0.1:{redis_server.port}/2"
    client = redis.Redis.from_url(url)
    try:
        reader = StatusReader(LeaseStore(client, KeyLayout("sf")))
        with pytest.raises(redis.exceptions.NoPermissionError, match="scan"):
            reader.read_all(KEY)
        assert runs(reader.read_all(KEY, slots=3)) == [(KEY, s, f"run-{s}") for s in range(3)]

        shown = run_cli(redis_server, "show", KEY, "--json", env={"SF_TEST_LEASE_REDIS": url})
        assert shown.returncode == 0, shown.stderr
        assert [(r["slot"], r["task_id"]) for r in json.loads(shown.stdout)["slots"]] == [
            (s, f"run-{s}") for s in range(3)
        ]
        listed = run_cli(redis_server, "ls", env={"SF_TEST_LEASE_REDIS": url})
        assert listed.returncode == 3 and "scan" in listed.stderr.lower()
    finally:
        client.close()
        admin.execute_command("ACL", "DELUSER", user)
        admin.close()


def test_text_output_shows_the_slot_only_where_it_matters() -> None:
    plain = KeyStatus(key="k", held=True, state="running", task_id="t0" * 8, task_name="t", ttl_left=3)
    other = KeyStatus(key="k", held=True, state="running", task_id="t1" * 8, task_name="t", ttl_left=3,
                      slot=1)
    assert status_table([plain])[0].split() == [
        "KEY", "TASK", "ID", "TASK", "STATE", "PROGRESS", "AGE", "TTL"
    ]
    header, first, second = status_table([plain, other])
    assert header.split()[:3] == ["KEY", "SLOT", "TASK"]
    assert first.split()[:3] == ["k", "0", "t0t0t0t0"] and second.split()[:3] == ["k", "1", "t1t1t1t1"]
    assert not any(line.startswith("slot:") for line in status_lines(plain))
    assert "slot:        1" in status_lines(other)
    assert "slot:        0" in status_lines(plain, slot=True)
    assert plain.as_dict()["slot"] == 0 and other.as_dict()["slot"] == 1


# -- end to end: three runs of a max_concurrency=3 task on a real worker, through the CLI -----------


def blocks(text: str) -> list[dict[str, str]]:
    """``show`` output: one ``name: value`` dict per block (blocks are separated by a blank line)."""
    return [dict(re.findall(r"^([a-z /]+):\s+(.*)$", block, re.MULTILINE)) for block in text.split("\n\n")]


# about 30 s: thirteen runs of the CLI as a user runs it, each a process that imports Celery and the app
# (several times that on a loaded machine, hence the timeout)
@pytest.mark.worker
@pytest.mark.timeout(300)
def test_cli_sees_and_releases_each_slot_of_a_key_held_by_three_runs(
    sfapp: ModuleType, start_worker: Any, redis_server: RedisServer
) -> None:
    worker: WorkerProcess = start_worker(concurrency=3)
    # the three runs hold their slots until the test revokes them, however slow the CLI's starts
    results = [sfapp.limited.apply_async(("cli-slots", 600), queue=worker.queue) for _ in range(3)]  # type: ignore[attr-defined]
    key = sfapp.limited.render_key("cli-slots")
    assert key == "lim:cli-slots"
    watcher: subprocess.Popen[str] | None = None
    try:
        listed = wait_for(lambda: len(found := sf.held(sfapp.app, prefix=key)) == 3 and found, timeout=60,
                          interval=0.1)
        by_slot = {st.slot: st.task_id for st in listed}
        assert sorted(by_slot) == [0, 1, 2]
        assert sorted(by_slot.values()) == sorted(r.id for r in results)  # type: ignore[type-var]

        as_json = run_cli(redis_server, "ls", "--json")
        assert as_json.returncode == 0, as_json.stderr
        rows = [item for item in json.loads(as_json.stdout) if item["key"] == key]
        assert {row["slot"]: row["task_id"] for row in rows} == by_slot and len(rows) == 3
        assert all(row["held"] and 0 < row["ttl_left"] <= 30 for row in rows)
        table = run_cli(redis_server, "ls")
        assert table.returncode == 0, table.stderr
        header, *lines = table.stdout.splitlines()
        assert header.split()[:3] == ["KEY", "SLOT", "TASK"]
        assert sorted(line.split()[1] for line in lines if line.startswith(key + " ")) == ["0", "1", "2"]

        shown = run_cli(redis_server, "show", key)
        assert shown.returncode == 0, shown.stderr
        assert {int(b["slot"]): b["task id"] for b in blocks(shown.stdout)} == by_slot
        assert all(b["held"] == "yes" and b["task name"] == "sfapp.limited" for b in blocks(shown.stdout))
        shown_json = run_cli(redis_server, "show", key, "--json")
        assert shown_json.returncode == 0, shown_json.stderr
        data = json.loads(shown_json.stdout)
        assert data["slot"] == 0 and data["task_id"] == by_slot[0]
        assert {s["slot"]: s["task_id"] for s in data["slots"]} == by_slot

        # several runs hold the key: release and watch refuse to pick one
        refused = run_cli(redis_server, "release", key, "--force")
        assert refused.returncode == 6, refused.stderr
        assert "--slot" in refused.stderr and "--holder" in refused.stderr
        assert all(task_id in refused.stderr for task_id in by_slot.values())
        refused_json = run_cli(redis_server, "release", key, "--force", "--json")
        assert refused_json.returncode == 6
        answer = json.loads(refused_json.stdout)
        assert answer["released"] is False and answer["task_id"] is None
        assert {h["slot"]: h["task_id"] for h in answer["held"]} == by_slot
        unwatched = run_cli(redis_server, "watch", key, "--timeout", "1")
        assert unwatched.returncode == 6 and "--slot" in unwatched.stderr
        assert len(sf.held(sfapp.app, prefix=key)) == 3  # nothing was released

        # release by holder: exactly that slot, and its watcher sees the end
        victim = by_slot[1]
        watcher = start_cli(redis_server, "watch", key, "--holder", victim, "--json")
        admin = redis_server.client()
        try:  # the watcher is following (blocked in XREAD on slot 1's history) before the release
            wait_for(lambda: watcher.poll() is not None or any(
                c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in admin.client_list()
            ), timeout=30, interval=0.05)
        finally:
            admin.close()
        assert watcher.poll() is None, finish(watcher)
        released = run_cli(redis_server, "release", key, "--holder", victim, "--force")
        assert released.returncode == 0, released.stderr
        assert f"released key {key} (slot 1), held by task {victim}" in released.stdout
        left = {st.slot: st.task_id for st in sf.held(sfapp.app, prefix=key)}
        assert left == {0: by_slot[0], 2: by_slot[2]}
        freed = sf.status(sfapp.app, key, slot=1)
        assert freed is not None and not freed.held and freed.outcome == "force-released"
        code, out, err = finish(watcher, timeout=30)
        assert code == 4, err
        events = json_lines(out)
        assert events[-1]["kind"] == "end" and events[-1]["state"] == "force-released"
        assert all(e["slot"] == 1 and e["key"] == key for e in events)

        # --slot: a holder that does not match refuses; the right one releases (JSON)
        mismatch = run_cli(redis_server, "release", key, "--slot", "2", "--holder", by_slot[0], "--force")
        assert mismatch.returncode == 1 and by_slot[2] in mismatch.stderr
        gone = run_cli(redis_server, "release", key, "--slot", "1", "--force")
        assert gone.returncode == 1 and "slot 1" in gone.stderr and "force-released" in gone.stderr
        by_number = run_cli(redis_server, "release", key, "--slot", "2", "--force", "--json")
        assert by_number.returncode == 0, by_number.stderr
        assert json.loads(by_number.stdout) | {"by": None} == {
            "key": key, "released": True, "task_id": by_slot[2], "slot": 2, "by": None
        }
        assert {st.slot for st in sf.held(sfapp.app, prefix=key)} == {0}

        # one run left: no choice needed
        last = run_cli(redis_server, "release", key, "--force")
        assert last.returncode == 0, last.stderr
        assert f"released key {key}, held by task {by_slot[0]}" in last.stdout
        assert sf.held(sfapp.app, prefix=key) == []
        after = run_cli(redis_server, "show", key)
        assert after.returncode == 1 and "not held" in after.stderr
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
            finish(watcher)
        for result in results:
            result.revoke(terminate=True)
    wait_for(lambda: all(r.ready() for r in results), timeout=30, interval=0.2)
