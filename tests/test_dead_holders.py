"""Holders that died (their leases ran out unreleased) on a key runs waited on end FAILURE with
``RunLost``, every one of them, from one place: the scripts that take, hand on or reserve a slot
name them in their replies, and ``settle()`` ends them, whichever path called the script."""

from __future__ import annotations

import uuid
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight import RunLost
from celery_singleflight.protocol.handoff import WAITING
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.run import settle as settle_module
from celery_singleflight.run.guard import Guard

from .conftest import wait_for

TTL = 0.3


def _two_dead_holders(sfapp: ModuleType, key: str) -> list[str]:
    """Two runs of ``sfapp.queued`` holding both slots of ``key`` (STARTED), a run parked behind
    them, then both leases run out unreleased (their worker died)."""
    store, backend, name = sfapp.queued.store, sfapp.app.backend, sfapp.queued.name
    holders = [f"dead-{n}-{uuid.uuid4().hex[:6]}" for n in range(2)]
    for holder in holders:
        backend.store_result(holder, {"key": key}, "STARTED")
        got = store.acquire(key, f"tok-{holder}", TTL, Holder(holder, "gone@host", name), slots=2)
        assert isinstance(got, Acquired)
    message = f'{{"task": "{name}", "options": {{"task_id": "parked-{key}"}}}}'
    assert store.handoff.park(key, f"parked-{key}", "hp", message, None, 2) is not None
    wait_for(lambda: all(store.reads.held(key, slot)[0] is None for slot in range(2)), timeout=5)
    return holders


def _lost(sfapp: ModuleType, task_id: str) -> bool:
    result = sfapp.app.AsyncResult(task_id)
    return result.state == "FAILURE" and isinstance(result.result, RunLost)


def test_the_sweepers_look_ends_every_dead_holder_of_the_key(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given both holders of a 2-slot key dead with a run parked behind them, when the sweeper
    looks (it reads no record itself: RESUME names them), then both end RunLost, not only the one
    whose slot was handed on, and the parked run is sent once."""
    from celery_singleflight.worker import sweeper
    from celery_singleflight.worker.registry import guarded_tasks

    sent: list[str] = []
    monkeypatch.setattr(settle_module, "send_parked", lambda app, message, key, **kw: sent.append(message))
    key = f"q:dead-{uuid.uuid4().hex[:6]}"
    holders = _two_dead_holders(sfapp, key)
    store = sfapp.queued.store
    store.client.zadd(store.ctx.layout.index(WAITING), {key: 0})
    (job,) = [j for j in sweeper.hand_on_sweeps(sfapp.app, guarded_tasks(sfapp.app))
              if isinstance(j, sweeper.HandOn) and j.store.ctx.layout.namespace == store.ctx.layout.namespace]
    monkeypatch.setattr(job, "slots_of", lambda key: 2)
    job.sweep_once()
    assert len(sent) == 1
    assert [_lost(sfapp, holder) for holder in holders] == [True, True]


def test_a_take_after_a_hand_on_ends_the_second_dead_holder_too(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given both holders of a 2-slot key dead with one run parked, when a newcomer takes the key,
    its first ACQUIRE hands slot 1 to the parked run (naming the first dead holder) and its next
    takes slot 2 in place of the second (TOOK, naming it): both end RunLost."""
    sent: list[str] = []
    monkeypatch.setattr(settle_module, "send_parked", lambda app, message, key, **kw: sent.append(message))
    key = f"q:dead-{uuid.uuid4().hex[:6]}"
    holders = _two_dead_holders(sfapp, key)
    opts = sfapp.queued.options.replace(max_concurrency=2)
    name = sfapp.queued.name
    guard = Guard(sfapp.app, key, opts, Holder("newcomer", "w@host", name), sender=name)
    got: Any = guard.take()
    assert isinstance(got, Held) and got.handoff is not None and len(sent) == 1
    got = guard.take()
    assert isinstance(got, Acquired) and got.dead is not None and got.dead.task_id in holders
    assert [_lost(sfapp, holder) for holder in holders] == [True, True]
