"""Debounce on a real worker: a burst of calls becomes one run with the chosen payload, a
steady stream still runs every debounce_max_wait, every AsyncResult ends, a lost leader is
replaced, and the scripts are safe to run twice."""

from __future__ import annotations

import json
import time
import uuid
from types import ModuleType

import pytest

from celery_singleflight import ConfigurationError, SingleFlightTask
from celery_singleflight.policies.debounce import HEADER_LEADER, Debounce, is_debounced, record
from celery_singleflight.protocol.store import LeaseStore, store_for
from celery_singleflight.protocol.timing import DueReply
from celery_singleflight.run.messages import HEADER_SENT
from celery_singleflight.testing import RedisServer

from ..conftest import wait_server_time
from .conftest import starts

pytestmark = pytest.mark.worker


def pace(start: float, at: float) -> None:
    """Until ``at`` seconds after ``start`` (``time.monotonic()``): the calls of a stream come on
    a schedule, so a slow send does not push the later ones back."""
    time.sleep(max(0.0, start + at - time.monotonic()))


def wait_burst_due(store: LeaseStore, key: str) -> None:
    """Until the server's clock, which the debounce scripts read, reaches the due time of the
    open burst of ``key`` (its debounce window has passed)."""
    wait_server_time(store.client, int(store.client.hget(store.layout.debounce(key), "due")))


def test_a_burst_of_50_calls_is_one_run_a_second_after_the_last_with_its_payload(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given debounce=1, when 50 calls come over 3 s, then one run starts about 1 s after the
    last call, with the last call's argument, under the first call's task id; the 49 others end
    SUCCESS as debounced into it."""
    queue = debounce_queue
    results = []
    start, last_call = time.monotonic(), 0.0
    for n in range(50):
        pace(start, n * 3 / 49)
        last_call = time.time()  # the call is recorded (its burst's due time set) during the send
        results.append(timeapp.settled.apply_async(("burst", n), queue=queue))
    assert results[0].get(timeout=15) == 49
    folded = [r.get(timeout=15) for r in results[1:]]
    assert all(is_debounced(f) and f["into"] == results[0].id and f["key"] == "deb:burst" for f in folded)
    runs = starts(timeapp, "burst", "settled")
    assert len(runs) == 1 and runs[0]["payload"] == 49 and runs[0]["task_id"] == results[0].id
    assert 0.95 <= runs[0]["at"] - last_call <= 1.5, runs[0]["at"] - last_call


def test_a_steady_stream_still_runs_every_max_wait(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given debounce=1 and debounce_max_wait=3, when a call comes every 0.5 s for 10 s (the key
    is never quiet for 1 s), then no call waits more than 3 s for a run that starts after it,
    each run has the latest payload of its burst, and every result is ready."""
    queue = debounce_queue
    calls: list[tuple[float, object]] = []
    start = time.monotonic()
    for n in range(20):
        pace(start, n * 0.5)
        calls.append((time.time(), timeapp.streamed.apply_async(("s", n), queue=queue)))
    values = [r.get(timeout=15) for _, r in calls]
    runs = starts(timeapp, "s", "streamed")
    run_ids = {r["task_id"] for r in runs}
    assert all(v in range(20) or (is_debounced(v) and v["into"] in run_ids) for v in values)
    assert 3 <= len(runs) <= 6, runs
    for at, _ in calls:
        first_run_after = min(r["at"] for r in runs if r["at"] >= at)
        assert first_run_after - at <= 3.0 + 0.4, (at, runs)
    payloads = [r["payload"] for r in runs]
    assert payloads == sorted(payloads) and payloads[-1] == 19


def test_debounce_keep_first_runs_with_the_first_payload(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    queue = debounce_queue
    results = [timeapp.first_kept.apply_async(("f", n), queue=queue) for n in range(5)]
    assert results[0].get(timeout=10) == 0
    assert all(is_debounced(r.get(timeout=10)) for r in results[1:])
    assert [r["payload"] for r in starts(timeapp, "f", "first_kept")] == [0]


def test_calls_by_name_are_debounced_when_they_come(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given send_task (no record at send), when 5 calls come at once, then one run, with the
    last recorded call's payload; the others end debounced into it."""
    queue = debounce_queue
    results = [timeapp.app.send_task("timeapp.settled", ("byname", n), queue=queue) for n in range(5)]
    values = [r.get(timeout=15) for r in results]
    runs = starts(timeapp, "byname", "settled")
    assert len(runs) == 1
    assert sum(1 for v in values if is_debounced(v)) == 4
    assert all(v["into"] == runs[0]["task_id"] for v in values if is_debounced(v))


def test_a_lost_leader_is_replaced_by_a_call_of_its_burst(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given a burst whose first call's message is lost (sent to a queue no worker reads, as a
    worker killed with it unacknowledged), then one of the other calls runs it, GRACE after it
    was due, with the last payload, and the rest end debounced into that run."""
    queue = debounce_queue
    lost = timeapp.settled.apply_async(("orphan", 0), queue=f"nobody-{uuid.uuid4().hex[:8]}")
    rest = [timeapp.settled.apply_async(("orphan", n), queue=queue) for n in range(1, 6)]
    values = [r.get(timeout=15) for r in rest]
    runs = starts(timeapp, "orphan", "settled")
    assert len(runs) == 1 and runs[0]["payload"] == 5
    ran = [v for v in values if not is_debounced(v)]
    assert ran == [5]
    assert all(v["into"] == runs[0]["task_id"] for v in values if is_debounced(v))
    assert lost.state == "PENDING"


def test_a_replayed_record_is_one_call(redis_server: RedisServer) -> None:
    """Recording the same call twice (a lost reply sent again) folds one call, not two."""
    store = store_for(f"{redis_server.url}/2", f"db{uuid.uuid4().hex[:8]}")
    deb = Debounce(1.0, None, "last", None)
    assert record(store, "k", "a", deb, (1,), {})[0] == "a"
    assert record(store, "k", "b", deb, (2,), {})[0] == "a"
    assert record(store, "k", "b", deb, (2,), {})[0] == "a"
    assert int(store.client.hget(store.layout.debounce("k"), "count")) == 2


@pytest.mark.parametrize(("options", "named"), [
    ({"debounce": 0}, "debounce"), ({"debounce": -1}, "debounce"), ({"debounce": "2"}, "debounce"),
    ({"debounce": 1, "debounce_max_wait": 0.5}, "debounce_max_wait"),
    ({"debounce": 1, "debounce_keep": "middle"}, "debounce_keep"),
    ({"debounce_max_wait": 3}, "debounce_max_wait"),
    ({"debounce": 1, "dedup_enqueue": True}, "dedup_enqueue"),
    ({"debounce": 1, "debounce_key": "chat:<chat_id>"}, "chat_id"),
    ({"debounce": 1, "debounce_maxwait": 3}, "did you mean debounce_max_wait"),
    ({"key_rate_limt": "10/m"}, "did you mean key_rate_limit"),
])
def test_bad_debounce_options_fail_at_definition(options: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigurationError, match=named):
        type("Bad", (SingleFlightTask,), {"lock_key": "k", "run": lambda self: None, **options})


def test_lost_replies_of_the_debounce_scripts_change_nothing(redis_server: RedisServer) -> None:
    """Given the first reply of the record script and of the due script dropped (each ran; redis-py
    sends it again), then the call is folded once and the run is decided once: the replay of the
    close answers 'run' with the same payload to the same task id (and a second delivery of that
    message, another execution, is told it is one)."""
    from celery_singleflight.protocol.timing import DEBOUNCE_CALL, DEBOUNCE_DUE, DueReply

    from ..chaos.faultproxy import DROP_REPLY, FaultProxy

    with FaultProxy(redis_server.port) as proxy:
        store = store_for(proxy.url(2), f"dbf{uuid.uuid4().hex[:8]}")
        deb = Debounce(0.2, None, "last", None)
        record(store, "k", "a", deb, (1,), {})  # the server knows the script now
        call_rule = proxy.add_rule(DROP_REPLY, script=DEBOUNCE_CALL.source, first_time_only=True)
        assert record(store, "k", "b", deb, (2,), {})[0] == "a"
        assert call_rule.faulted == 1 and call_rule.matched == 2
        assert int(store.client.hget(store.layout.debounce("k"), "count")) == 2
        wait_burst_due(store, "k")
        store.timing.due("k", "zzz", "nobody", "t0")  # loads the script
        due_rule = proxy.add_rule(DROP_REPLY, script=DEBOUNCE_DUE.source, first_time_only=True)
        due = store.timing.due("k", "a", "a", "t1")
        assert due_rule.faulted == 1 and due_rule.matched == 2
        assert due.kind == DueReply.RUN and "[2]" in due.payload and due.calls == 2 and due.closed_here
        assert store.client.hget(store.layout.debounced("k"), "ran") == b"a"
        folded = store.timing.due("k", "b", "a", "t2")
        assert (folded.kind, folded.into) == (DueReply.FOLDED, "a")
        # the same message delivered a second time (another execution) is told so; the lease decides
        assert not store.timing.due("k", "a", "a", "t3").closed_here


def test_a_debounce_key_of_its_own_groups_calls_apart_from_the_lock_key(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given debounce_key="chat:<chat>" and lock_key="acct:<acct>", when three calls of one chat
    name three accounts, then one run, holding the lock of the last call's account."""
    queue = debounce_queue
    results = [timeapp.keyed.apply_async(("c1", f"a{n}", n), queue=queue) for n in range(3)]
    assert timeapp.keyed.time_status("c1", "a0").debounce.calls == 3
    assert results[0].get(timeout=15) == 2
    assert all(is_debounced(r.get(timeout=15)) for r in results[1:])
    runs = starts(timeapp, "c1", "keyed")
    assert [r["payload"] for r in runs] == [{"n": 2, "lock": "acct:a2"}]


def test_a_call_re_sent_after_later_bursts_ran_is_folded_not_run_again(
    timeapp: ModuleType, debounce_queue: str
) -> None:
    """Given a call sent first (the leader of its burst) whose message comes back only after two
    later bursts ran (a ``fail_closed`` re-send keeps its headers: the stamp and the leader it
    names), then it ends debounced into the last burst's run instead of starting a burst of its
    own with its older arguments."""
    queue = debounce_queue
    key = f"resent-{uuid.uuid4().hex[:6]}"
    sent_first, old_id = time.time_ns(), str(uuid.uuid4())
    for burst in (1, 2):
        ran = timeapp.settled.apply_async((key, burst), queue=queue)
        assert ran.get(timeout=15) == burst
    late = timeapp.settled.apply_async(
        (key, 0), queue=queue, task_id=old_id,
        headers={HEADER_SENT: sent_first, HEADER_LEADER: old_id},
    )
    folded = late.get(timeout=15)
    assert is_debounced(folded) and folded["into"] == ran.id
    assert [r["payload"] for r in starts(timeapp, key, "settled")] == [1, 2]


def test_a_burst_lost_with_the_redis_data_is_recorded_again_with_its_last_call(
    redis_server: RedisServer,
) -> None:
    """Given a burst of calls a (its leader), b, c recorded at send, then the lease Redis loses its
    data: the leader's message comes first, finds nothing and records the burst again, waiting a
    grace longer; b and c, which come a grace after the old due time, join it (c, sent last, gives
    the arguments, whatever order they come in); the burst then runs once, with c's."""
    store = store_for(f"{redis_server.url}/2", f"db{uuid.uuid4().hex[:8]}")
    deb = Debounce(0.2, None, "last", None)
    sent = {name: 1000.0 + i for i, name in enumerate("abc")}
    for name in "abc":
        assert record(store, "k", name, deb, (name,), {}, sent=sent[name])[0] == "a"
    store.client.delete(store.layout.debounce("k"))  # Redis lost it
    first = store.timing.due("k", "a", "a", "t1", sent["a"], '{"args": ["a"], "kwargs": {}}')
    assert first.kind == DueReply.UNKNOWN
    assert record(store, "k", "a", deb, ("a",), {}, sent=sent["a"], wait=0.4)[0] == "a"
    for name in "cb":  # in the other order than sent
        payload = json.dumps({"args": [name], "kwargs": {}})
        due = store.timing.due("k", name, "a", f"t-{name}", sent[name], payload)
        assert due.kind == DueReply.WAIT
    wait_burst_due(store, "k")  # the grace of the burst recorded again
    ran = store.timing.due("k", "a", "a", "t2", sent["a"], '{"args": ["a"], "kwargs": {}}')
    assert ran.kind == DueReply.RUN and json.loads(ran.payload)["args"] == ["c"] and ran.calls == 3
    folded = store.timing.due("k", "b", "a", "t3", sent["b"], '{"args": ["b"], "kwargs": {}}')
    assert folded.kind == DueReply.FOLDED and folded.into == "a"


def test_a_lost_burst_is_opened_again_by_whichever_call_comes_first(
    redis_server: RedisServer,
) -> None:
    """As above, but the other calls come before the leader (they were re-sent while Redis was
    away): the first opens the burst again for the leader, the next joins it, and the leader's
    message runs it with the arguments of the call sent last."""
    store = store_for(f"{redis_server.url}/2", f"db{uuid.uuid4().hex[:8]}")
    deb = Debounce(0.2, None, "last", None)
    sent = {name: time.time() + i / 1000 for i, name in enumerate("abc")}
    for name in "abc":
        record(store, "k", name, deb, (name,), {}, sent=sent[name])
    store.client.delete(store.layout.debounce("k"))  # Redis lost it
    for name in "cb":
        payload = json.dumps({"args": [name], "kwargs": {}})
        due = store.timing.due("k", name, "a", f"t-{name}", sent[name], payload, "last", 0.2)
        assert due.kind == DueReply.WAIT
    wait_burst_due(store, "k")  # the burst opened again is due
    ran = store.timing.due("k", "a", "a", "t-a", sent["a"], '{"args": ["a"], "kwargs": {}}', "last", 0.2)
    assert ran.kind == DueReply.RUN and json.loads(ran.payload)["args"] == ["c"]


def test_a_call_whose_burst_ran_long_ago_is_folded_not_run_again(redis_server: RedisServer) -> None:
    """A call of a burst that ran and was forgotten long ago (its message held up for more than
    the closed burst is kept) is folded into its leader's run, not run again as a new burst."""
    store = store_for(f"{redis_server.url}/2", f"db{uuid.uuid4().hex[:8]}")
    old = time.time() - 700
    due = store.timing.due("k", "x", "leader", "t-x", old, '{"args": ["x"], "kwargs": {}}', "last", 0.2)
    assert due.kind == DueReply.FOLDED and due.into == "leader"
    assert store.client.exists(store.layout.debounce("k")) == 0
