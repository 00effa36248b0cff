"""Protocol defects the model of the lease protocol found (model/lease.pml, docs/guarantees.md),
each replayed on a real Redis. A script call whose reply was lost is sent again after the run it
parked was handed the key, or after the key fell free: the second run must answer as the first
did (the run waits), never "free" or a second park, or the run would run twice. A hand-off that
an older snapshot brought back must not run a run that already succeeded. (Joined runs whose
releaser's whole worker was lost: tests/test_orphaned_joined.py.)
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from types import ModuleType

import pytest

from celery_singleflight.protocol.handoff import QUEUE
from celery_singleflight.protocol.replies import Acquired, Holder, Parked
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.messages import HEADER_HANDOFF
from celery_singleflight.testing import RedisServer

from .conftest import wait_for


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[LeaseStore]:
    yield LeaseStore(redis_server.client(3), KeyLayout(f"model-{uuid.uuid4().hex[:6]}"))


def _token() -> str:
    return uuid.uuid4().hex


def _queue(store: LeaseStore, key: str) -> list[bytes]:
    return list(store.client.lrange(store.layout.key(QUEUE, key), 0, -1))


def test_a_park_sent_again_after_its_run_took_the_key_parks_nothing(store: LeaseStore) -> None:
    """PARK ran, its reply was lost; the holder released and handed the key to the parked run,
    which started. The re-sent PARK must not park the run again (found by the model: the run's
    own release then handed the key to its second entry and it ran twice)."""
    holder = _token()
    store.acquire("k", holder, 10, Holder("holder"))
    handoff = _token()
    first = store.handoff.park("k", "p", handoff, '{"m": "p"}', None)
    assert isinstance(first, Parked)
    settlement = store.release("k", holder, task_id="holder")
    assert settlement.handoff == '{"m": "p"}'
    taken = store.acquire("k", _token(), 10, Holder("p"), handoff=handoff)
    assert isinstance(taken, Acquired)
    again = store.handoff.park("k", "p", handoff, '{"m": "p"}', None)
    assert isinstance(again, Parked)
    assert _queue(store, "k") == []


def test_a_park_sent_again_after_the_key_fell_free_does_not_answer_free(store: LeaseStore) -> None:
    """PARK ran, its reply was lost; the holder's lease ran out (its worker died). The re-sent
    PARK answered FREE, so its caller took the key as a new run while its parked entry was handed
    the key too (found by the model: the run ran twice). It answers PARKED: the entry waits."""
    store.acquire("k", _token(), 0.2, Holder("holder"))
    handoff = _token()
    assert isinstance(store.handoff.park("k", "p", handoff, '{"m": "p"}', None), Parked)
    wait_for(lambda: store.time_left("k") is None)  # the holder's lease ran out (its worker died)
    again = store.handoff.park("k", "p", handoff, '{"m": "p"}', None)
    assert isinstance(again, Parked)
    assert _queue(store, "k") == [f"p|{handoff}".encode()]


def test_a_coalesce_sent_again_after_its_run_took_the_key_is_pending_once(store: LeaseStore) -> None:
    """COALESCE made a run pending, replacing an older one; its reply was lost; the holder
    released and the pending run started. The re-sent COALESCE must not make it pending again,
    and must still name the run it replaced, so that its caller answers it (found by the model:
    a re-park ran it twice; an answer without the replaced run left that run waiting)."""
    holder = _token()
    store.acquire("k", holder, 10, Holder("holder"))
    older = store.newest.coalesce("k", "old", _token(), '{"m": "old"}', "last", "1")
    assert older == ()
    handoff = _token()
    first = store.newest.coalesce("k", "new", handoff, '{"m": "new"}', "last", "2")
    assert first == ('{"m": "old"}',)
    settlement = store.release("k", holder, task_id="holder")
    assert settlement.handoff == '{"m": "new"}'
    assert isinstance(store.acquire("k", _token(), 10, Holder("new"), handoff=handoff), Acquired)
    again = store.newest.coalesce("k", "new", handoff, '{"m": "new"}', "last", "2")
    assert again == ('{"m": "old"}',)
    assert _queue(store, "k") == []


@pytest.mark.worker
def test_a_hand_off_of_a_run_that_succeeded_does_not_run_it_again(
    sfapp: ModuleType, start_worker: object
) -> None:
    """The lease Redis came back from a snapshot taken while a run was parked, after the run had
    been handed the key and succeeded: the snapshot has its entry and message, but not the token
    that adopted its slot, so the next hand-off sends it again (found by the model). Its start
    finds it SUCCESS already and does not run it; its result stays."""
    q = start_worker(concurrency=1).queue  # type: ignore[operator]
    first = sfapp.queued.apply_async(("stale", 1, 0.01), queue=q)
    assert first.get(timeout=30) == 1
    # what that hand-off sends: the run's own message, with a hand-off token
    sfapp.queued.apply_async(("stale", 1, 0.01), task_id=first.id, queue=q,
                             headers={HEADER_HANDOFF: uuid.uuid4().hex})
    assert sfapp.queued.apply_async(("stale", 2, 0.01), queue=q).get(timeout=30) == 2  # one pool process
    assert [int(n) for n in sfapp.recorder.lrange("order:stale", 0, -1)] == [1, 2]
    assert sfapp.queued.AsyncResult(first.id).get(timeout=5) == 1
