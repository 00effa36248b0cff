"""Pausing a key, ``RetryAfter`` and limits changed at run time, on real Redis and real workers.

The worker runs this module's own app (``celery -A tests.test_pause_limits``): its tasks are
made by :func:`make_app` with ``shared=False``, in the worker from ``SF_TEST_REDIS`` and in the
test process from the session's private Redis (broker db 0, results db 1, leases db 2, the
independent recorder db 3, which the ``sfapp`` fixture empties before each test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery

import celery_singleflight as sf
from celery_singleflight import RetryAfter, SingleFlightTask, constants, states
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.lease import RELEASE
from celery_singleflight.protocol.replies import Acquired, Holder, Settlement
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer, WorkerProcess

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import ROOT, stays, wait_for, worker_env
from .gates import hold

APP_MODULE = "tests.test_pause_limits"


def make_app(base: str) -> Celery:
    """The app and its tasks (one key template, ``p:<key>``; each records what it did in db 3)."""
    app = Celery("pauselimits", broker=f"{base}/0", backend=f"{base}/1", set_as_current=False)
    app.conf.update(singleflight_redis_url=f"{base}/2", worker_hijack_root_logger=False,
                    broker_connection_retry_on_startup=True, result_expires=600)
    recorder = redis.Redis.from_url(f"{base}/3")

    def record(key: str, n: int, seconds: float, task_id: str, gate: str | None = None) -> None:
        """Works ``seconds``; with a ``gate``, until the test sets that recorder key (``seconds``:
        the cap), so a run the test must see running is still running when it looks."""
        recorder.rpush(f"started:{key}", f"{n} {time.time()} {task_id}")
        active = recorder.incr(f"active:{key}")
        recorder.rpush(f"active-seen:{key}", active)
        hold(recorder, seconds, gate)
        recorder.decr(f"active:{key}")
        recorder.rpush(f"order:{key}", n)

    @app.task(bind=True, base=SingleFlightTask, name="pl.skipping", shared=False, lock_key="p:<key>",
              on_duplicate="skip")
    def skipping(self: Any, key: str, n: int, seconds: float = 0.05) -> int:
        record(key, n, seconds, self.request.id)
        return n

    @app.task(bind=True, base=SingleFlightTask, name="pl.queued", shared=False, lock_key="p:<key>",
              on_duplicate="queue")
    def queued(self: Any, key: str, n: int, seconds: float = 0.05, gate: str | None = None) -> int:
        record(key, n, seconds, self.request.id, gate)
        return n

    @app.task(bind=True, base=SingleFlightTask, name="pl.throttled_by_api", shared=False, lock_key="p:<key>",
              on_duplicate="queue", max_retries=0)
    def throttled_by_api(self: Any, key: str, n: int, pause: float = 2.0) -> int:
        """The first attempt of each task id meets a "429": it raises RetryAfter(pause)."""
        attempt = recorder.incr(f"attempt:{self.request.id}")
        recorder.rpush(f"retries:{key}", self.request.retries)
        if attempt == 1:
            recorder.rpush(f"started:{key}", f"{n} {time.time()} {self.request.id}")
            raise RetryAfter(pause)
        record(key, n, 0.05, self.request.id)
        return n

    @app.task(bind=True, base=SingleFlightTask, name="pl.rated", shared=False, lock_key="p:<key>",
              on_duplicate="queue", key_rate_limit="100/s")
    def rated(self: Any, key: str, n: int) -> int:
        record(key, n, 0.0, self.request.id)
        return n

    app.finalize()
    return app


#: the worker's app (None in the test process before the session's Redis is known)
app = make_app(os.environ["SF_TEST_REDIS"]) if os.environ.get("SF_TEST_REDIS") else None

pytestmark = pytest.mark.worker


@pytest.fixture
def pl(sfapp: ModuleType, redis_server: RedisServer) -> Celery:
    """The test process's app (``sfapp``: db 2 and 3 start empty)."""
    return make_app(redis_server.url)


@pytest.fixture
def recorder(redis_server: RedisServer) -> redis.Redis:
    return redis_server.client(3)


@pytest.fixture
def start(redis_server: RedisServer, pl: Celery) -> Iterator[Callable[..., WorkerProcess]]:
    """Start workers of this module's app on one queue of the test; all stopped afterwards."""
    queue = f"pl-{uuid.uuid4().hex[:10]}"
    started: list[WorkerProcess] = []

    def run(concurrency: int = 4) -> WorkerProcess:
        worker = WorkerProcess(APP_MODULE, concurrency=concurrency, cwd=str(ROOT),
                               env=worker_env(redis_server), extra=("-Q", queue))
        worker.queue = queue  # type: ignore[attr-defined]
        started.append(worker)
        return worker.start(pl)

    yield run
    for worker in started:
        worker.stop(timeout=15)
        worker.kill()
        worker.cleanup()


def order(recorder: redis.Redis, key: str) -> list[int]:
    return [int(x) for x in recorder.lrange(f"order:{key}", 0, -1)]


def running(recorder: redis.Redis, key: str) -> int:
    """How many runs of ``key`` are in their body now (the recorder's count, not the library's)."""
    return int(recorder.get(f"active:{key}") or 0)


def starts(recorder: redis.Redis, key: str) -> list[tuple[int, float, str]]:
    out = []
    for raw in recorder.lrange(f"started:{key}", 0, -1):
        n, at, task_id = raw.decode().split()
        out.append((int(n), float(at), task_id))
    return out


def cli(redis_server: RedisServer, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **worker_env(redis_server)}
    return subprocess.run([sys.executable, "-m", "celery", "-A", APP_MODULE, "singleflight", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=60)


def queued_count(pl: Celery, key: str) -> int:
    st = sf.status(pl, key)
    return st.queued if st is not None else 0


# -- pause, resume ------------------------------------------------------------------------------


def test_a_paused_keys_runs_wait_parked_whatever_their_policy_then_run_in_order_after_resume(
    pl: Celery, recorder: redis.Redis, start: Any
) -> None:
    """Given a key paused until resumed, 5 runs of a `skip` task wait parked (QUEUED), none runs
    and none is skipped; after `resume` they run one at a time in the order they were sent (one
    pool process: they park in that order)."""
    q = start(concurrency=1).queue
    assert sf.pause(pl, "p:a") is None
    results = [pl.tasks["pl.skipping"].apply_async(("a", n), queue=q) for n in range(5)]
    wait_for(lambda: queued_count(pl, "p:a") == 5, timeout=20)
    # nothing is handed on while paused, for as long as the sweeper takes to look at a key parked
    # with no holder (RESUME_GRACE, then its next look: SWEEP_INTERVAL): no event marks a look
    # that finds a paused key, so this is an observation window
    stays(lambda: recorder.llen("started:a") == 0 and queued_count(pl, "p:a") == 5,
          constants.RESUME_GRACE + constants.SWEEP_INTERVAL)
    assert order(recorder, "a") == [] and queued_count(pl, "p:a") == 5
    assert {r.state for r in results} == {states.QUEUED}
    assert sf.controls(pl, "p:a")[1] is True
    assert sf.resume(pl, "p:a") is True
    assert [r.get(timeout=30) for r in results] == list(range(5))
    assert order(recorder, "a") == list(range(5))
    assert max(int(x) for x in recorder.lrange("active-seen:a", 0, -1)) == 1


def test_a_pause_for_some_seconds_ends_by_itself_and_the_cli_pauses_and_resumes(
    pl: Celery, recorder: redis.Redis, start: Any, redis_server: RedisServer
) -> None:
    """`celery singleflight pause KEY --for 2`: runs sent meanwhile start only after the pause ran
    out, in order, without a resume; `resume` of a key not paused exits 1."""
    q = start(concurrency=1).queue
    paused = cli(redis_server, "pause", "p:b", "--for", "2")
    assert paused.returncode == 0 and "paused p:b for" in paused.stdout, paused.stderr
    # when the pause ends, as the pause key holds it (server ms; a loaded machine may return from
    # the CLI well after the pause began, so the time the CLI returned is no measure of it)
    lease_db = redis_server.client(2)
    (pause_key,) = list(lease_db.scan_iter(match="*{p:b}:paused"))
    ends = int(lease_db.get(pause_key) or 0) / 1000
    results = [pl.tasks["pl.queued"].apply_async(("b", n), queue=q) for n in range(3)]
    assert [r.get(timeout=30) for r in results] == [0, 1, 2]
    assert order(recorder, "b") == [0, 1, 2]
    assert min(at for _, at, _ in starts(recorder, "b")) >= ends - 0.2
    again = cli(redis_server, "resume", "p:b")
    assert again.returncode == 1 and "was not paused" in again.stderr
    held = cli(redis_server, "pause", "p:b")
    assert held.returncode == 0 and "until resumed" in held.stdout
    resumed = cli(redis_server, "resume", "p:b")
    assert resumed.returncode == 0 and "resumed p:b" in resumed.stdout, resumed.stderr


# -- RetryAfter -----------------------------------------------------------------------------------


def test_retry_after_pauses_the_key_and_runs_the_same_task_first_without_spending_max_retries(
    pl: Celery, recorder: redis.Redis, start: Any
) -> None:
    """A run raises RetryAfter(2) (its max_retries is 0): it shows RETRY, the key is paused for
    every run, the runs sent meanwhile wait parked, and when the pause ends the same task id runs
    first, with retries still 0, then the others in order."""
    q = start(concurrency=1).queue
    task = pl.tasks["pl.throttled_by_api"]
    first = task.apply_async(("c", 0), queue=q)
    wait_for(lambda: recorder.llen("started:c") >= 1, timeout=20)
    raised_at = starts(recorder, "c")[0][1]
    wait_for(lambda: first.state == "RETRY", timeout=10)
    assert sf.controls(pl, "p:c")[1] is True
    others = [pl.tasks["pl.queued"].apply_async(("c", n), queue=q) for n in (1, 2)]
    wait_for(lambda: queued_count(pl, "p:c") == 3, timeout=10)  # the paused run is first of 3
    assert first.get(timeout=30) == 0
    assert [r.get(timeout=30) for r in others] == [1, 2]
    assert order(recorder, "c") == [0, 1, 2]
    ran = starts(recorder, "c")
    assert ran[1][2] == first.id and ran[1][1] >= raised_at + 1.9  # the same task id, after the pause
    assert recorder.lrange("retries:c", 0, -1) == [b"0", b"0"]
    assert int(recorder.get(f"attempt:{first.id}") or 0) == 2


def test_a_worker_killed_with_the_key_paused_and_runs_parked_loses_nothing(
    pl: Celery, recorder: redis.Redis, start: Any
) -> None:
    """A run raised RetryAfter(3) and two runs parked behind it; the whole worker is SIGKILLed
    during the pause. A new worker on the queue runs all three once the pause ends, the paused
    run first (its pause, park and release were one script: nothing was in between to lose)."""
    first_worker = start(concurrency=1)
    q = first_worker.queue
    paused = pl.tasks["pl.throttled_by_api"].apply_async(("d", 0, 3.0), queue=q)
    wait_for(lambda: paused.state == "RETRY", timeout=20)
    others = [pl.tasks["pl.queued"].apply_async(("d", n), queue=q) for n in (1, 2)]
    wait_for(lambda: queued_count(pl, "p:d") == 3, timeout=10)
    first_worker.kill()
    start(concurrency=2)
    assert paused.get(timeout=40) == 0
    assert [r.get(timeout=30) for r in others] == [1, 2]
    assert order(recorder, "d") == [0, 1, 2]


def test_a_lost_reply_of_the_retry_after_release_parks_once_and_pauses_once(
    redis_server: RedisServer,
) -> None:
    """The RELEASE that pauses the key and parks the run runs on the server, its reply is lost
    and redis-py sends it again: the second run answers as the first (released), the run is
    parked once, at the front, and the pause is the first run's."""
    with FaultProxy(redis_server.port) as proxy:
        store = LeaseStore(redis_client(proxy.url(2)), KeyLayout(f"ra-{uuid.uuid4().hex[:6]}"))
        parked = store.handoff.park  # a run parked earlier behind the holder
        token = uuid.uuid4().hex
        got = store.acquire("k", token, 10, Holder("holder"))
        assert isinstance(got, Acquired)
        assert parked("k", "waiter", "h-waiter", '{"m":"waiter"}', None) is not None
        rule = proxy.add_rule(DROP_REPLY, script=RELEASE.source, nth=1)
        settled = store.release("k", token, "retried", fence=got.fence, task_id="holder",
                                retry_after=(5.0, "holder|h-holder", '{"m":"holder"}'))
        assert rule.faulted == 1
        assert isinstance(settled, Settlement) and settled.ours and settled.handoff is None
        client, layout = store.client, store.layout
        assert client.lrange(layout.queue("k"), 0, -1) == [b"holder|h-holder", b"waiter|h-waiter"]
        assert client.hget(layout.parked("k"), "holder") == b'{"m":"holder"}'
        pttl = client.pttl(layout.paused("k"))
        assert 60_000 < pttl <= 65_000  # 5 s + the tail, set once
        until, active, _ = store.controls.read("k")
        assert active and until is not None
        again = store.acquire("k", uuid.uuid4().hex, 10, Holder("newcomer"))
        assert not isinstance(again, Acquired) and again.ttl_left > 4


# -- limits ---------------------------------------------------------------------------------------


def test_limit_concurrency_2_lets_two_runs_hold_the_key_and_clear_restores_1(
    pl: Celery, recorder: redis.Redis, start: Any, redis_server: RedisServer
) -> None:
    """`limit KEY --concurrency 2` on a task of max_concurrency 1: two runs hold the key at once
    (never three); after `limit KEY --clear` one at a time again."""
    q = start(concurrency=4).queue
    set_ = cli(redis_server, "limit", "p:e", "--concurrency", "2")
    assert set_.returncode == 0 and "concurrency 2" in set_.stdout, set_.stderr
    results = [pl.tasks["pl.queued"].apply_async(("e", n, 30, "gate:e1"), queue=q) for n in range(4)]
    # two run, held on the gate, and the other two wait parked: the limit let two in, not three
    wait_for(lambda: running(recorder, "e") == 2 and queued_count(pl, "p:e") == 2, timeout=20)
    recorder.set("gate:e1", 1)
    assert sorted(r.get(timeout=30) for r in results) == list(range(4))
    seen = [int(x) for x in recorder.lrange("active-seen:e", 0, -1)]
    assert max(seen) == 2, seen
    cleared = cli(redis_server, "limit", "p:e", "--clear")
    assert cleared.returncode == 0 and "cleared" in cleared.stdout, cleared.stderr
    recorder.delete("active-seen:e")
    results = [pl.tasks["pl.queued"].apply_async(("e", n, 30, "gate:e2"), queue=q) for n in range(4, 7)]
    wait_for(lambda: running(recorder, "e") == 1 and queued_count(pl, "p:e") == 2, timeout=20)
    recorder.set("gate:e2", 1)
    assert [r.get(timeout=30) for r in results] == [4, 5, 6]
    assert max(int(x) for x in recorder.lrange("active-seen:e", 0, -1)) == 1


def test_a_raised_concurrency_takes_one_more_round_trip_once_then_the_slots_are_known(
    redis_server: RedisServer
) -> None:
    """ACQUIRE named one slot; the key's limits allow 3: it answers MORE_SLOTS and the call is
    made again with 3 (two EVALSHA), later calls name 3 at once (one); a fourth run is held."""
    client = redis_server.client(2)
    store = LeaseStore(client, KeyLayout(f"more-{uuid.uuid4().hex[:6]}"))
    store.controls.set_limits("k", 3)
    before = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    got = [store.acquire("k", uuid.uuid4().hex, 10, Holder(f"t{i}")) for i in range(4)]
    calls = int(client.info("commandstats")["cmdstat_evalsha"]["calls"]) - before
    assert [g.slot for g in got[:3] if isinstance(g, Acquired)] == [0, 1, 2]
    assert not isinstance(got[3], Acquired)
    assert calls == 5


def test_an_uncontended_pair_still_costs_two_round_trips_and_eight_commands() -> None:
    """The pause and the limits are read in ACQUIRE's one MGET: an uncontended acquire and
    release of a key never paused make 2 round trips and at most 8 Redis commands (counted by
    the server, the commands inside the scripts included)."""
    with RedisServer() as server:
        client = server.client(0)
        store = LeaseStore(client, KeyLayout("cost"))
        for i in range(3):  # warm: the scripts are loaded
            got = store.acquire("k", f"w{i}", 10, Holder("warm"))
            assert isinstance(got, Acquired)
            store.release("k", f"w{i}", fence=got.fence)
        before = int(client.info("stats")["total_commands_processed"])
        for i in range(10):
            got = store.acquire("k", f"t{i}", 10, Holder("t"))
            assert isinstance(got, Acquired)
            assert store.release("k", f"t{i}", fence=got.fence).ours
        used = int(client.info("stats")["total_commands_processed"]) - before - 1  # the INFO itself
        assert used <= 80, used


def test_a_rate_set_at_run_time_delays_runs_and_clearing_it_restores_the_tasks_own(
    pl: Celery, recorder: redis.Redis, start: Any
) -> None:
    """A task with key_rate_limit="100/s": `set_limits(rate="2/s")` spaces its runs 0.5 s apart
    (RETRY meanwhile, delayed, not dropped); after `clear_limits` 4 runs start within 0.4 s."""
    q = start(concurrency=4).queue
    sf.set_limits(pl, "p:f", rate="2/s")
    results = [pl.tasks["pl.rated"].apply_async(("f", n), queue=q) for n in range(4)]
    assert sorted(r.get(timeout=30) for r in results) == list(range(4))
    times = sorted(at for _, at, _ in starts(recorder, "f"))
    assert times[-1] - times[0] >= 1.3, times  # 3 intervals of 0.5 s
    assert sf.clear_limits(pl, "p:f") is not None
    recorder.delete("started:f")
    # the cells of 2/s run half a second past the last run's start: the key's rate state expires
    # when they are spent, and only then do the task's own 100/s apply to new runs
    wait_for(lambda: sf.time_status(pl, "p:f").rate is None, timeout=10)
    results = [pl.tasks["pl.rated"].apply_async(("f", n), queue=q) for n in range(4, 8)]
    assert sorted(r.get(timeout=30) for r in results) == list(range(4, 8))
    times = sorted(at for _, at, _ in starts(recorder, "f"))
    assert times[-1] - times[0] < 0.4, times
