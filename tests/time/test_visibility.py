"""The time policies seen from outside: time_status(), the task's time_status(), the CLI's
``show``, and the task events Flower builds its states from."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.policies import debounce, ratelimit
from celery_singleflight.testing import RedisServer, WorkerProcess

from ..conftest import wait_for, worker_env
from .conftest import HERE


def test_time_status_shows_the_burst_and_the_next_free_slot(
    timeapp: ModuleType, redis_server: RedisServer
) -> None:
    """Given 3 calls folded on a debounce key and 3 cells taken at 1/m on a rate-limited key,
    then time_status() and the task's time_status() show the burst (calls, planned run) and the
    rate state (next free slot 3 minutes ahead, 2 runs planned), and the CLI's show prints both."""
    redis_server.client(2).flushdb()
    settled, paced = timeapp.settled, timeapp.paced
    deb = settled._sf_defined[debounce.Debouncing]
    for n in range(3):
        debounce.record(settled.store, "deb:v", f"call-{n}", deb, ("v", n), {})
    rate = ratelimit.parse_rate("t", "1/m", 1)
    assert rate is not None
    for n in range(3):
        ratelimit.reserve(paced.store, "pace:v", rate, f"cell-{n}")
    burst = settled.time_status("v").debounce
    assert burst is not None and burst.calls == 3 and burst.leader == "call-0"
    assert 0 < burst.planned - time.time() <= 1.0
    state = sf.time_status(timeapp.app, "pace:v").rate
    assert state is not None and state.planned == 2 and state.per_second == pytest.approx(1 / 60)
    assert 179 < state.next_free - time.time() <= 180
    assert sf.time_status(timeapp.app, "pace:idle").empty

    env = {**os.environ, **worker_env(redis_server)}
    cli = [sys.executable, "-m", "celery", "-A", "timeapp", "singleflight", "show"]
    show = subprocess.run([*cli, "deb:v"], cwd=HERE, env=env, capture_output=True, text=True, timeout=60)
    assert show.returncode == 1, show.stderr  # not held: the burst has not run yet
    assert "debounce:    3 call(s) folded" in show.stdout and "run planned" in show.stdout, show.stdout
    shown = subprocess.run([*cli, "pace:v", "--json"], cwd=HERE, env=env, capture_output=True, text=True,
                           timeout=60)
    assert json.loads(shown.stdout)["time"]["rate"]["planned"] == 2


@pytest.mark.worker
def test_flower_sees_debounced_and_throttled_runs(
    timeapp: ModuleType, time_workers: Callable[..., WorkerProcess]
) -> None:
    """Given a worker sending task events (-E), Flower's view (celery.events.state, which Flower
    uses) shows a burst's leader as DEBOUNCED and a throttled run as RETRY, and both end SUCCESS."""
    queue = time_workers(concurrency=2, env={"SF_RATE": "2/s", "SF_BURST": "1"},  # type: ignore[attr-defined]
                         extra=("-E",)).queue
    app = timeapp.app
    state = app.events.State()
    seen: dict[str, set[str]] = {}
    ready = threading.Event()
    receivers: list[Any] = []

    def listen() -> None:
        def on_event(event: dict[str, object]) -> None:
            state.event(event)
            uuid_ = event.get("uuid")
            if isinstance(uuid_, str) and uuid_ in state.tasks:
                seen.setdefault(uuid_, set()).add(str(state.tasks[uuid_].state))

        with app.connection_for_read() as conn:
            receiver = app.events.Receiver(conn, handlers={"*": on_event})
            receivers.append(receiver)
            # no timeout: a quiet second between events must not end the listening (with one,
            # kombu raises a timeout in this thread); it looks at should_stop once a second
            for _ in receiver.itercapture(limit=None, timeout=None, wakeup=False):
                ready.set()  # the first step: its queue is bound, so no event is missed from now

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert ready.wait(10)
    key = uuid.uuid4().hex[:6]
    leader = timeapp.settled.apply_async((key, 1), queue=queue)
    time.sleep(0.8)  # the leader comes due at 1 s and finds the burst due at 1.8 s: it waits
    timeapp.settled.apply_async((key, 2), queue=queue)
    paced = [timeapp.paced.apply_async((key, n), queue=queue) for n in range(2)]
    assert leader.get(timeout=20) == 2 and sorted(r.get(timeout=20) for r in paced) == [0, 1]

    def all_seen() -> bool:
        task = state.tasks.get(leader.id)
        return ("DEBOUNCED" in seen.get(leader.id, set()) and task is not None and task.state == "SUCCESS"
                and any("RETRY" in seen.get(r.id, set()) for r in paced))

    # the last events reach the receiver; if they never do, the asserts below say which is missing
    with contextlib.suppress(AssertionError):
        wait_for(all_seen, timeout=10)
    receivers[0].should_stop = True
    thread.join(5)
    assert not thread.is_alive()
    assert "DEBOUNCED" in seen.get(leader.id, set()), seen
    assert any("RETRY" in seen.get(r.id, set()) for r in paced), seen
    assert state.tasks[leader.id].state == "SUCCESS"
