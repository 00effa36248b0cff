"""A script whose reply was lost is sent again by redis-py, and something may have happened on the
key in between: the second run must answer as the first did and change nothing more.

Each test runs one script call, lets the key change the way it can between a lost reply and its
re-send (another slot taken, the holder released, a new holder), then runs the very same call
again, on a private Redis. (The fault proxy of ``tests/chaos/test_redis_faults.py`` drops real
replies; it cannot put an event between the two runs.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from celery_singleflight.protocol.handoff import (
    FORCE_RELEASE,
    JOIN,
    JOINED,
    PARKED,
    QUEUE,
    SETTLED,
    JoinReply,
)
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.messages import rejoined
from celery_singleflight.testing import RedisServer

from .conftest import wait_for


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[LeaseStore]:
    yield LeaseStore(redis_server.client(2), KeyLayout(f"replay-{uuid.uuid4().hex[:6]}"))


def _token() -> str:
    return uuid.uuid4().hex


def test_acquire_answers_its_slot_though_another_slot_got_a_foreign_record(store: LeaseStore) -> None:
    """ACQUIRE took slot 0 of a two-slot key; before its re-send, a worker of another protocol
    version took slot 1. The re-send answers "acquired, slot 0" (the run goes on under the lease
    it holds), not "foreign" (which re-sends the run while its lease sits unrenewed)."""
    token = _token()
    first = store.acquire("k", token, 10, Holder("a"), slots=2)
    assert isinstance(first, Acquired) and first.slot == 0
    foreign = '{"v":"3","token":"t","fence":"1","deadline":"99999999999999"}'
    store.client.set(store.layout.run("k", 1), foreign)
    again = store.acquire("k", token, 10, Holder("a"), slots=2)
    assert isinstance(again, Acquired) and (again.fence, again.slot) == (first.fence, 0)


def _force_release(store: LeaseStore, key: str, holder: str, call: str) -> list[object]:
    """FORCE_RELEASE of slot 0 by 'operator', handing on; ``call`` is the call's id."""
    layout = store.layout
    reply = store.ctx.script(FORCE_RELEASE)(
        keys=[layout.run(key), layout.history(key, 0), layout.key(QUEUE, key), layout.key(PARKED, key),
              layout.key(JOINED, key), layout.key(SETTLED, key)],
        args=["operator", 60_000, 10, holder, 1, 1, 30_000, "1", call],
    )
    return list(reply)


@pytest.mark.parametrize("named", [False, True])
def test_force_release_answers_the_same_after_handing_the_key_on(store: LeaseStore, named: bool) -> None:
    """A force-release that handed the key to a parked run, sent again, answers the run it
    released and the parked run's message, as the first time; the reservation it made stays
    (it does not force-release it too), whether or not the operator named the holder."""
    store.acquire("k", _token(), 10, Holder("holder"))
    parked = store.handoff.park("k", "waiter", "h1", '{"m": "waiter"}', None)
    assert parked is not None and not isinstance(parked, int)
    call = _token()
    first = _force_release(store, "k", "holder" if named else "", call)
    after_first = store.record("k")
    assert first[1:4] == [b"holder", first[2], b'{"m": "waiter"}'] and after_first.reserved
    again = _force_release(store, "k", "holder" if named else "", call)
    assert again == first
    after = store.record("k")
    assert (after.token, after.task_id, after.prev_task_id) == (after_first.token, "waiter", "holder")
    assert store.client.xlen(store.layout.history("k", 0)) <= 1


def _join(store: LeaseStore, key: str, message: str) -> list[object]:
    layout = store.layout
    keys = [layout.run(key), layout.key(JOINED, key), layout.key(SETTLED, key)]
    return list(store.ctx.script(JOIN)(keys=keys, args=[message]))


@pytest.mark.parametrize("next_holder", [False, True])
def test_join_answers_joined_though_the_holder_released_in_between(
    store: LeaseStore, next_holder: bool
) -> None:
    """JOIN joined the holder's run; the holder released (taking the joined message to answer it)
    before the JOIN was sent again. The re-send answers "joined", so the duplicate does not run
    itself (it would run twice: once as itself, once answered); nor is it joined again to the
    next holder (it would be answered twice)."""
    token = _token()
    got = store.acquire("k", token, 10, Holder("holder"))
    assert isinstance(got, Acquired)
    message = '{"id": "dup"}'
    assert int(_join(store, "k", message)[0]) == JoinReply.JOINED
    settlement = store.release("k", token, fence=got.fence)
    assert settlement.joined == (message,)
    if next_holder:
        assert isinstance(store.acquire("k", _token(), 10, Holder("next")), Acquired)
    again = _join(store, "k", message)
    assert int(again[0]) == JoinReply.JOINED
    assert store.client.llen(store.layout.key(JOINED, "k")) == 0


def test_a_joined_run_sent_to_run_itself_joins_again(store: LeaseStore) -> None:
    """A hold has no result: its release sends the runs that joined it to run themselves
    (``rejoined``). Such a run that finds the key held again joins the new holder: its message
    is not taken for a re-send of the JOIN the hold's release took."""
    token = _token()
    got = store.acquire("k", token, 10, Holder("hold"))
    assert isinstance(got, Acquired)
    message = '{"task": "t", "options": {"task_id": "dup", "headers": {}}}'
    assert int(_join(store, "k", message)[0]) == JoinReply.JOINED
    assert store.release("k", token, fence=got.fence).joined == (message,)
    assert isinstance(store.acquire("k", _token(), 10, Holder("next")), Acquired)
    again = rejoined(message)
    assert int(_join(store, "k", again)[0]) == JoinReply.JOINED
    assert store.client.lrange(store.layout.key(JOINED, "k"), 0, -1) == [again.encode()]


def test_another_copy_of_a_parked_runs_message_does_not_run_it_again(store: LeaseStore) -> None:
    """A parked run handed the key takes its slot and ends; another copy of its message (sent again
    by ``fail_closed`` while Redis was away, or by a sweeper whose reservation ran out meanwhile)
    finds the key free but is told it is a copy: it must not run a second time. A run of that
    task id never parked (no handoff token) is not affected."""
    holder = _token()
    store.acquire("k", holder, 10, Holder("holder"))
    assert store.handoff.park("k", "waiter", "h1", '{"m": "waiter"}', None) is not None
    assert store.release("k", holder).handoff == '{"m": "waiter"}'
    mine = _token()
    assert isinstance(store.acquire("k", mine, 10, Holder("waiter"), handoff="h1"), Acquired)
    store.release("k", mine)
    again = store.acquire("k", _token(), 10, Holder("waiter"), handoff="h1")
    assert isinstance(again, Held) and again.copy
    assert isinstance(store.acquire("k", _token(), 10, Holder("waiter")), Acquired)


def test_a_copy_of_a_parked_run_whose_lease_ran_out_runs_again(store: LeaseStore) -> None:
    """As a redelivery (``acks_late``) of a run killed with its worker: a parked run took its slot,
    then its lease ran out unreleased; another copy of its message takes the key and runs."""
    holder = _token()
    store.acquire("k2", holder, 10, Holder("holder"))
    assert store.handoff.park("k2", "waiter", "h2", '{"m": "waiter"}', None) is not None
    assert store.release("k2", holder).handoff == '{"m": "waiter"}'
    assert isinstance(store.acquire("k2", _token(), 0.05, Holder("waiter"), handoff="h2"), Acquired)
    wait_for(lambda: store.time_left("k2") is None)  # its worker died: the lease runs out unreleased
    again = store.acquire("k2", _token(), 10, Holder("waiter"), handoff="h2")
    assert isinstance(again, Acquired)


def test_a_duplicate_that_hands_a_dead_holders_key_on_learns_who_died(store: LeaseStore) -> None:
    """A holder's worker died with a run parked behind it; before the sweeper looks, a duplicate
    finds the key free and hands it to the parked run: it is told whose run died there (task id,
    worker, task name), so that it sets that run's result (FAILURE, RunLost)."""
    assert isinstance(store.acquire("k3", _token(), 0.05, Holder("dead", "w1@h", "t.dead")), Acquired)
    assert store.handoff.park("k3", "waiter", "h3", '{"m": "waiter"}', None) is not None
    wait_for(lambda: store.time_left("k3") is None)  # the dead holder's lease ran out
    got = store.acquire("k3", _token(), 10, Holder("newcomer"))
    assert isinstance(got, Held) and got.handoff == '{"m": "waiter"}'
    assert got.dead is not None and (got.dead.task_id, got.dead.worker, got.dead.task_name) == (
        "dead", "w1@h", "t.dead")
