"""A worker killed while it holds rate-delayed (countdown) messages: their copies in Redis are sent
by the other worker's sweeper once the killed worker is seen gone, each run runs once, and when
the broker gives the killed worker's messages back (visibility timeout) they are dropped as stale.

Worker A alone receives the runs, so A holds every countdown message (and says so in Redis);
then A's whole process group is SIGKILLed and B, started beforehand on an idle queue (a worker
takes seconds to start, longer than the runs' delays), starts consuming theirs.
The Redis broker's visibility timeout is 8 s here, so the original messages come back within
the test.
"""

from __future__ import annotations

import json
import time
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight import RunLost, constants
from celery_singleflight.testing import RedisServer

from .conftest import Workers, runs, wait_for

pytestmark = pytest.mark.worker
VISIBILITY = 8.0


def _copies(chaos: ModuleType, key: str) -> dict[str, Any]:
    store = chaos.dc_rate.store
    raw = store.client.hgetall(store.layout.delayed(chaos.dc_rate.render_key(key, 0)))
    return {k.decode(): json.loads(v) for k, v in raw.items()}


# its time is inherent: A's messages come back after VISIBILITY (8 s), which must outlast the copies
# going out (a worker is seen gone WORKER_GONE_AFTER after its last sweep)
@pytest.mark.timeout(120)
def test_copies_of_a_dead_workers_delayed_runs_run_once(
    chaos: ModuleType, workers: Workers, queue: str, broker_redis: RedisServer
) -> None:
    env = {"CHAOS_TTL": "3", "CHAOS_VISIBILITY": str(VISIBILITY)}
    first, second = workers.start(workers.make(queue, env=env), workers.make(f"{queue}-idle", env=env))
    key = "dead-holder"
    sent = [chaos.dc_rate.apply_async((key, n), {"seconds": 0.05}, queue=queue) for n in range(8)]
    # 2/s with burst 1: one run now, seven delayed up to 3.5 s. Once each of the eight ran or waits
    # as a copy A noted holding, and at least four still wait, A is killed; and only once each run
    # that ended has its result stored: a kill between a body's end and Celery's store of its
    # result leaves it as plain Celery leaves a run its worker died in (the first run never waited,
    # so it is not watched: lostruns), and the test is about the runs still waiting
    wait_for(lambda: _held_by(chaos, key, first.hostname) and _stored(chaos, sent), timeout=20)
    first.kill()
    killed = time.time()
    # the countdown messages A held: delivered to it, never acknowledged (back after VISIBILITY)
    unacked = _unacked_ids(broker_redis)
    assert unacked, "A held no countdown message at its death: the scenario proves nothing"
    assert chaos.app.control.add_consumer(queue, destination=[second.hostname], reply=True, timeout=5)
    try:
        lost = _wait_terminal(sent, timeout=30)
    except AssertionError:  # say which runs did not end, and what Redis still holds for them
        pending = {n: r.state for n, r in enumerate(sent) if not r.ready()}
        raise AssertionError(f"not terminal after 30 s: {pending}; copies {_copies(chaos, key)};"
                             f" runs {runs(chaos)}") from None
    done = time.time() - killed
    assert len(lost) <= 1, lost  # only a run A was in the middle of is lost with it (RunLost)
    finished = sorted(int(r["n"]) for r in runs(chaos) if r["end"] is not None)  # every slot of the key
    assert finished == sorted(n for n in range(8) if sent[n].id not in lost), finished  # each ran once
    # the copies went once A was seen gone: its last sweep + WORKER_GONE_AFTER + a sweep, at most
    assert done < 3.5 + constants.WORKER_GONE_AFTER + 2 * constants.SWEEP_INTERVAL + 3.0, done
    # A's original messages come back after the visibility timeout (kombu restores them on its
    # own schedule, later under load): B drops each one as stale, and none runs again
    dropped = "]: another copy of this delayed run runs or ran"
    wait_for(lambda: all(f"[{i}{dropped}" in second.log() for i in unacked), timeout=VISIBILITY + 30.0,
             interval=0.2)
    assert sorted(int(r["n"]) for r in runs(chaos) if r["end"] is not None) == finished


def _unacked_ids(broker: RedisServer) -> set[str]:
    """The task ids of the messages the broker delivered and nobody acknowledged (kombu's
    ``unacked``: each entry is the message, its exchange and its routing key)."""
    return {json.loads(raw)[0]["headers"]["id"] for raw in broker.client(0).hvals("unacked")}


def _held_by(chaos: ModuleType, key: str, hostname: str) -> bool:
    waiting = [c for c in _copies(chaos, key).values() if not c.get("c")]
    return (len(waiting) + len(runs(chaos)) >= 8 and len(waiting) >= 4
            and all(any(w.startswith(f"{hostname}#") for w in (c.get("w") or {}).values()) for c in waiting))


def _stored(chaos: ModuleType, sent: list[Any]) -> bool:
    return all(sent[int(r["n"])].ready() for r in runs(chaos) if r["end"] is not None)


def _wait_terminal(sent: list[Any], timeout: float) -> set[str]:
    """Wait until every result is ready; the ids of those that ended FAILURE with RunLost (any
    other failure fails the test)."""
    wait_for(lambda: all(r.ready() for r in sent), timeout=timeout)
    lost = set()
    for result in sent:
        if result.state != "SUCCESS":
            assert isinstance(result.result, RunLost), (result.state, result.result)
            lost.add(result.id)
    return lost
