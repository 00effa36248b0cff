"""Redis misbehaving under a real worker: lost replies, stalls, and states that refuse for now.

redis-py sends a command again when its reply timed out or its connection dropped, so a Lua script
can run twice on the server while the caller sees one answer, the second. These scenarios put the
lease Redis behind a :class:`~faultproxy.FaultProxy` that lets a script run and then drops its
reply (or cuts the connection right after sending it, or holds the reply past the client's socket
timeout), for the first run of every distinct call of that script, while one workload per policy
runs on a real worker: raise, skip, retry, queue, join, enqueue-time dedup, the idempotency window,
``max_concurrency=2`` and ``hold()``.

Every scenario must end with: no task dropped, no run twice at once, every ``AsyncResult`` ready
with the outcome its policy promises, every key free, no run left parked, and the last run of each
key recorded as ``succeeded``. Figures go to ``<basetemp>/chaos-figures`` (``-s`` prints them).

Then server states (OOM, READONLY, LOADING, MASTERDOWN, BUSY, TRYAGAIN, CLUSTERDOWN): waited out
under ``fail_closed``, run unguarded under ``fail_open``; a NOPERM stays a loud failure.
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery.result import AsyncResult

import celery_singleflight as sf
from celery_singleflight import LockHeld, hold
from celery_singleflight.testing import RedisServer, WorkerProcess

from ..lua_sources import SOURCE
from .conftest import CHAOS, ROOT, renewed, wait_for
from .faultproxy import CUT_AFTER_SEND, DROP_REPLY, Action, FaultProxy, error_reply, stall_reply

pytestmark = pytest.mark.worker

QUEUE = f"lost-replies-{uuid.uuid4().hex[:8]}"
#: the scripts a workload runs (FORCE_RELEASE and REVISE_OUTCOME are an operator's and a revoke's)
SCRIPTS = ("ACQUIRE", "RELEASE", "RENEW", "PROGRESS", "PARK", "JOIN", "NOTE_DUPLICATE",
           "ENQUEUE_MARK", "CLEAR_MARK", "RESUME")


@pytest.fixture(scope="module")
def lease_redis() -> Iterator[RedisServer]:
    """The lease Redis of this module, with ``DEBUG`` allowed where the server has that switch
    (Redis 7 turns it off by default; 6.2 has no such option)."""
    try:
        server = RedisServer(extra=["--enable-debug-command", "local"]).start()
    except RuntimeError:
        server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def proxy(lease_redis: RedisServer) -> Iterator[FaultProxy]:
    with FaultProxy(lease_redis.port) as started:
        yield started


@pytest.fixture(scope="module")
def replyapp(broker_redis: RedisServer, proxy: FaultProxy) -> ModuleType:
    os.environ["CHAOS_REDIS"] = broker_redis.url
    os.environ["REPLY_LEASE_URL"] = proxy.url(2)
    os.environ["REPLY_QUEUE"] = QUEUE
    if str(CHAOS) not in sys.path:
        sys.path.insert(0, str(CHAOS))
    return importlib.import_module("replyapp")


@pytest.fixture(scope="module")
def reply_worker(replyapp: ModuleType, broker_redis: RedisServer, proxy: FaultProxy,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    env = {
        "CHAOS_REDIS": broker_redis.url, "REPLY_LEASE_URL": proxy.url(2), "REPLY_QUEUE": QUEUE,
        "PYTHONPATH": os.pathsep.join([str(CHAOS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    # every holder runs at once beside its duplicates: enough processes that no message waits
    worker = WorkerProcess("replyapp", concurrency=16, cwd=str(CHAOS), env=env, extra=("-Q", QUEUE))
    worker.start(replyapp.app, timeout=60)
    yield worker
    logs = tmp_path_factory.getbasetemp() / "chaos-figures"
    logs.mkdir(exist_ok=True)
    with_log = Path(logs / "lost-replies-worker.log")
    worker.stop(timeout=15)
    worker.kill()
    if worker.log_path.exists():
        with_log.write_text(worker.log_path.read_text(errors="replace"))
    worker.cleanup()


@pytest.fixture
def clean(broker_redis: RedisServer, lease_redis: RedisServer, proxy: FaultProxy) -> Iterator[None]:
    proxy.clear_rules()
    for db in (1, 3):  # results and the recorder (the broker's db 0 belongs to the running worker)
        broker_redis.client(db).flushdb()
    lease_redis.client(2).flushdb()
    yield
    proxy.clear_rules()


# -- the workloads: one per policy, all at once, each on its own key ---------------------------


@dataclass
class Expect:
    """What one workload must end with."""

    policy: str
    key: str  # the recorder's key (the task argument)
    results: list[AsyncResult] = field(default_factory=list)
    check: Callable[[list[Any]], None] = lambda values: None
    runs: tuple[int, ...] = (1,)  # the body runs the key may end with


def _value(result: AsyncResult) -> Any:
    """The result's value, or its exception (a refused run ends as FAILURE)."""
    try:
        return result.get(timeout=1, propagate=True)
    except Exception as exc:  # noqa: BLE001 - the outcome is what is checked
        return exc


#: the longest a holder holds its key: it ends as soon as the scenario opens its gate
HOLD_MAX = 120.0
TTL = 3.0  # replyapp's singleflight_ttl


def run_workloads(app: ModuleType, tag: str, decide_within: float = 30.0) -> list[Expect]:
    """Start every workload; return what each must end with (the waits happen in :func:`settle`).

    Holders hold their key until every duplicate met them and took its policy's way (refused,
    skipped, re-sent, parked, joined) and each holder renewed its lease once; then the scenario
    opens their gate. A stalled acquire may delay a duplicate for seconds: ``decide_within``."""
    k = {name: f"{tag}-{name}" for name in ("raise", "skip", "retry", "queue", "join", "dedup", "idem",
                                            "limited", "hold")}
    out: list[Expect] = []
    q = {"queue": QUEUE}
    gate = f"go:{tag}"
    held = {"gate": gate}

    holders = {
        "raise": app.refuse.apply_async((k["raise"], HOLD_MAX), held, **q),
        "skip": app.skip.apply_async((k["skip"], HOLD_MAX), held, **q),
        "retry": app.retry.apply_async((k["retry"], HOLD_MAX), held, **q),
        "queue": app.queue.apply_async((k["queue"], HOLD_MAX), held, **q),
        "join": app.join.apply_async((k["join"], HOLD_MAX), held, **q),
        "limited": [app.limited.apply_async((k["limited"], HOLD_MAX), held, **q) for _ in range(2)],
    }
    dedup = [app.dedup.apply_async((k["dedup"], HOLD_MAX), held, **q) for _ in range(3)]
    idem = [app.idem.apply_async((k["idem"], "m-1", 0.3), **q) for _ in range(3)]
    tasks = {"raise": app.refuse, "skip": app.skip, "retry": app.retry, "queue": app.queue, "join": app.join,
             "limited": app.limited, "dedup": app.dedup}
    counts = {name: 2 if name == "limited" else 1 for name in tasks}
    try:
        wait_for(lambda: all(app.recorder.llen(f"runs:{k[n]}") >= c for n, c in counts.items()), timeout=30,
                 interval=0.01)
        dups = {name: [task.apply_async((k[name],), **q) for _ in range(2)] for name, task in tasks.items()
                if name != "dedup"}
        dedup += [app.dedup.apply_async((k["dedup"],), **q)]
        # a send by name is not deduplicated at enqueue: at run time it meets the holder (skip)
        dedup += [app.app.send_task(app.dedup.name, (k["dedup"],), queue=QUEUE)]

        # hold(): a queued task and a joined task wait behind it; both end well: the joined one is
        # sent again at the hold's end (a hold has no result to give it) and joins the queued run,
        # or runs itself if that run already ended (a release reply held back for seconds)
        hold_key = app.queue.render_key(k["hold"])
        with hold(app.app, hold_key, ttl=3) as lease:
            lease.progress("maintenance", current=1, total=1)
            behind = [app.queue.apply_async((k["hold"], 1.0), **q),
                      app.join.apply_async((k["hold"], 1.0), **q)]
            wait_for(lambda: all(r.state in ("QUEUED", "JOINED") for r in behind), timeout=20)
            wait_for(lambda: renewed(app.queue.store, hold_key, TTL), timeout=10)  # its heartbeat renewed it

        def met_their_holders() -> bool:
            """Each duplicate took its policy's way while its holder holds, and each holder renewed."""
            return (all(r.ready() for r in [*dups["raise"], *dups["skip"], dedup[-1]])
                    and all(r.state == "RETRY" for r in dups["retry"])
                    and all(r.state == "QUEUED" for r in [*dups["queue"], *dups["limited"]])
                    and all(r.state == "JOINED" for r in dups["join"])
                    and all(renewed(app.queue.store, app.queue.render_key(k[name]), TTL, slot)
                            for name, c in counts.items() for slot in range(c)))

        wait_for(met_their_holders, timeout=decide_within, interval=0.05)
    finally:
        app.recorder.set(gate, 1)  # the holders end (also when a wait failed: the worker is shared)

    def refused(values: list[Any]) -> None:
        assert isinstance(values[0], dict), values
        assert all(isinstance(v, LockHeld) and v.holder == values[0]["ran"] for v in values[1:]), values

    def skipped(values: list[Any]) -> None:
        assert isinstance(values[0], dict) and all(sf.is_skipped(v) for v in values[1:]), values

    def each_ran(values: list[Any]) -> None:
        assert all(isinstance(v, dict) for v in values), values
        assert len({v["ran"] for v in values}) == len(values), values  # each its own run

    def joined(values: list[Any]) -> None:
        assert all(v == values[0] for v in values) and isinstance(values[0], dict), values

    def one_id(values: list[Any]) -> None:
        assert all(isinstance(v, dict) and v == values[0] for v in values), values

    def one_id_and_a_skipped_send_by_name(values: list[Any]) -> None:
        one_id(values[:-1])
        assert sf.is_skipped(values[-1]), values

    def joined_or_ran_after(values: list[Any]) -> None:
        assert all(isinstance(v, dict) for v in values), values

    out += [
        Expect("raise", k["raise"], [holders["raise"], *dups["raise"]], refused),
        Expect("skip", k["skip"], [holders["skip"], *dups["skip"]], skipped),
        Expect("retry", k["retry"], [holders["retry"], *dups["retry"]], each_ran, runs=(3,)),
        Expect("queue", k["queue"], [holders["queue"], *dups["queue"]], each_ran, runs=(3,)),
        Expect("join", k["join"], [holders["join"], *dups["join"]], joined),
        Expect("limited", k["limited"], [*holders["limited"], *dups["limited"]], each_ran, runs=(4,)),
        Expect("dedup", k["dedup"], dedup, one_id_and_a_skipped_send_by_name),
        Expect("idempotency", k["idem"], idem, one_id),
        Expect("hold", k["hold"], behind, joined_or_ran_after, runs=(1, 2)),
    ]
    assert len({r.id for r in dedup[:-1]}) == 1, "dedup_enqueue sent more than one message for one key"
    return out


def settle(app: ModuleType, expects: list[Expect], figures: dict[str, Any], timeout: float = 60.0) -> None:
    """Wait for every result, then check the invariants; record the figures."""
    everything = [r for e in expects for r in e.results]
    started = time.monotonic()
    try:
        wait_for(lambda: all(r.ready() for r in everything), timeout=timeout, interval=0.1)
    finally:
        figures["not_terminal"] = [
            (e.policy, r.id, r.state) for e in expects for r in e.results if not r.ready()
        ]
    figures["settled_s"] = round(time.monotonic() - started, 3)
    figures["overlaps"] = [x.decode() for x in app.recorder.lrange("overlaps", 0, -1)]
    runs = {e.policy: app.recorder.llen(f"runs:{e.key}") for e in expects}
    figures["runs"] = runs
    for e in expects:
        e.check([_value(r) for r in e.results])
    assert figures["overlaps"] == []
    assert all(runs[e.policy] in e.runs for e in expects), runs
    # every key free, nothing parked, the last run recorded as succeeded
    wait_for(lambda: sf.held(app.app) == [], timeout=10)
    for e in expects:
        key = app.queue.render_key(e.key)
        st = sf.status(app.app, key)
        assert st is not None and not st.held and st.queued == 0, (e.policy, st)
        assert st.outcome == "succeeded", (e.policy, st)
    # once its run ended, dedup sends again (the marker was cleared)
    dedup = next(e for e in expects if e.policy == "dedup")
    again = app.dedup.apply_async((dedup.key,), queue=QUEUE)
    assert again.id != dedup.results[0].id and isinstance(again.get(timeout=30), dict)
    assert app.recorder.llen(f"runs:{dedup.key}") == 2


def assert_no_false_redelivery(worker: WorkerProcess, tag: str) -> None:
    """No run met its own lease and was turned away as a "redelivery" (there are none here: no
    acks_late), the sign of an acquire whose second run did not recognise the first."""
    wrong = [line for line in worker.log().splitlines()
             if "redelivery of a running task" in line and tag in line]
    assert wrong == [], wrong[:3]


def _arm(proxy: FaultProxy, name: str, action: Action) -> Any:
    return proxy.add_rule(action, script=SOURCE[name], first_time_only=True)


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_reply_of_a_script_lost_once(
    script: str, replyapp: ModuleType, reply_worker: WorkerProcess, proxy: FaultProxy, clean: None,
    figures: dict[str, Any],
) -> None:
    """Given the first reply of every call of ``script`` lost after the server ran it (redis-py
    sends the call again), when every policy's workload runs, then nothing is dropped, nothing
    runs twice at once, everything ends terminal and truthful, and every key ends free."""
    rule = _arm(proxy, script, DROP_REPLY)
    expects = run_workloads(replyapp, f"drop-{script.lower()}")
    settle(replyapp, expects, figures)
    assert_no_false_redelivery(reply_worker, f"drop-{script.lower()}")
    # the sweeper looks at a waiting key when its holder's lease would have run out (~3.5 s after
    # the holder's last renewal, which can come after everything settled)
    wait_for(lambda: rule.faulted > 0, timeout=15)
    figures.update(script=script, mode="drop_reply", faulted=rule.faulted, matched=rule.matched)


@pytest.mark.parametrize("script", ("ACQUIRE", "RELEASE", "PARK", "JOIN", "ENQUEUE_MARK"))
def test_connection_cut_right_after_a_script_was_sent(
    script: str, replyapp: ModuleType, reply_worker: WorkerProcess, proxy: FaultProxy, clean: None,
    figures: dict[str, Any],
) -> None:
    """As above, with the connection cut as soon as the call was sent (it runs on the server)."""
    rule = _arm(proxy, script, CUT_AFTER_SEND)
    expects = run_workloads(replyapp, f"cut-{script.lower()}")
    settle(replyapp, expects, figures)
    assert_no_false_redelivery(reply_worker, f"cut-{script.lower()}")
    figures.update(script=script, mode="cut_after_send", faulted=rule.faulted)
    assert rule.faulted > 0


# inherent: each stalled reply is held 6 s, past the client's 5 s socket timeout (the point)
@pytest.mark.parametrize("script", ("ACQUIRE", "RELEASE"))
def test_a_reply_held_past_the_socket_timeout(
    script: str, replyapp: ModuleType, reply_worker: WorkerProcess, proxy: FaultProxy, clean: None,
    figures: dict[str, Any],
) -> None:
    """A stalled reply (as behind a server busy for longer than the client's 5 s socket timeout):
    the client gives up on it and sends the call again; the first run's effect stands."""
    rule = proxy.add_rule(stall_reply(6.0), script=SOURCE[script], first_time_only=True, times=3)
    expects = run_workloads(replyapp, f"stall-{script.lower()}", decide_within=60.0)
    settle(replyapp, expects, figures, timeout=90)
    if script == "ACQUIRE":
        assert_no_false_redelivery(reply_worker, f"stall-{script.lower()}")
    # A RELEASE reply held 6 s outlives the 3 s hand-off reservation: the sweeper sends the parked
    # run, the releasing client sends it again when its reply comes, and the second copy is turned
    # away as a redelivery of the running run. settle() has checked that every key ran its runs
    # exactly once, with no overlap.
    figures.update(script=script, mode="stall_reply 6s", faulted=rule.faulted)
    assert rule.faulted > 0


def _debug_sleep(server: RedisServer, seconds: int) -> threading.Thread:
    """``DEBUG SLEEP`` on the lease Redis from a thread of its own (the server answers nobody
    meanwhile); returns once the server is seen asleep."""
    client = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=seconds + 20)
    thread = threading.Thread(target=client.execute_command, args=("DEBUG", "SLEEP", str(seconds)))
    thread.start()
    wait_for(lambda: _asleep(server), timeout=10, interval=0.01)
    return thread


def _asleep(server: RedisServer) -> bool:
    """A PING is not answered within 50 ms (a server that answers does so in well under 1 ms).
    A raw socket: a client would retry, and take seconds of the sleep to tell."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=1) as sock:
        sock.sendall(b"PING\r\n")
        sock.settimeout(0.05)
        try:
            return not sock.recv(16)
        except TimeoutError:
            return True


# inherent: two DEBUG SLEEPs of 7 s, each past the client's 5 s socket timeout (the point)
@pytest.mark.timeout(120)
def test_debug_sleep_longer_than_the_socket_timeout(
    replyapp: ModuleType, reply_worker: WorkerProcess, lease_redis: RedisServer, clean: None,
    figures: dict[str, Any],
) -> None:
    """The real thing: the lease Redis stalls (``DEBUG SLEEP 7``) while a run acquires and while
    it releases; both calls time out on the client (5 s) and are sent again, and run after the
    first ones. The run happens once, ends SUCCESS, and its key ends free."""
    key, gate = "debug-sleep", "go:debug-sleep"
    started = time.monotonic()
    sleeper = _debug_sleep(lease_redis, 7)  # the server is asleep: the acquire waits behind it
    result = replyapp.queue.apply_async((key, HOLD_MAX), {"gate": gate}, queue=QUEUE)
    sleeper.join()
    # the body reported its start: stall the release too (and the last progress before it)
    wait_for(lambda: replyapp.recorder.llen(f"working:{key}"), timeout=30)
    sleeper = _debug_sleep(lease_redis, 7)
    replyapp.recorder.set(gate, 1)
    value = result.get(timeout=60)
    sleeper.join()
    figures.update(total_s=round(time.monotonic() - started, 3), runs=replyapp.recorder.llen(f"runs:{key}"))
    assert isinstance(value, dict) and value["ran"] == result.id
    assert replyapp.recorder.llen(f"runs:{key}") == 1
    assert replyapp.recorder.lrange("overlaps", 0, -1) == []
    st = wait_for(lambda: (s := sf.status(replyapp.app, replyapp.queue.render_key(key))) and not s.held and s)
    assert st.outcome == "succeeded"



# -- server states: "cannot serve this now" is an outage, not a failure --------------------------

#: an error Redis answers in each state (what the proxy answers in its place)
STATES = {
    "OOM": "OOM command not allowed when used memory > 'maxmemory'.",
    "READONLY": "READONLY You can't write against a read only replica.",
    "LOADING": "LOADING Redis is loading the dataset in memory",
    "MASTERDOWN": "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
    "BUSY": "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
    "TRYAGAIN": "TRYAGAIN Multiple keys request during rehashing of slot",
    "CLUSTERDOWN": "CLUSTERDOWN The cluster is down",
}


@pytest.mark.parametrize("state", sorted(STATES))
def test_a_server_state_that_refuses_for_now_is_waited_out_or_run_open(
    state: str, replyapp: ModuleType, reply_worker: WorkerProcess, proxy: FaultProxy, clean: None,
    figures: dict[str, Any],
) -> None:
    """Given Redis answering ``state`` to the first acquires, then a ``fail_closed`` task is re-sent
    (RETRY) and runs once Redis answers, and a ``fail_open`` task runs unguarded with a warning;
    neither fails with Redis's raw message."""
    rule = proxy.add_rule(error_reply(STATES[state]), script=SOURCE["ACQUIRE"], times=6)
    key = f"state-{state.lower()}"
    closed = replyapp.queue.apply_async((key,), queue=QUEUE)
    opened = replyapp.fail_open.apply_async((f"{key}-open",), queue=QUEUE)
    assert isinstance(closed.get(timeout=30), dict)
    assert isinstance(opened.get(timeout=30), dict)
    log = reply_worker.log()
    figures.update(state=state, faulted=rule.faulted)
    assert rule.faulted == 6
    assert f"key='r:{key}'" in log and "(fail_closed)" in log
    assert "UNGUARDED" in log and f"key='r:{key}-open'" in log
    assert replyapp.recorder.llen(f"runs:{key}") == 1 and replyapp.recorder.llen(f"runs:{key}-open") == 1


def test_a_refused_permission_stays_loud(
    replyapp: ModuleType, reply_worker: WorkerProcess, proxy: FaultProxy, clean: None
) -> None:
    """A NOPERM (an ACL that lacks a command) is a configuration problem: the task fails at once
    with Redis's error, is not retried as an outage, and never runs unguarded, not even fail_open."""
    proxy.add_rule(error_reply("NOPERM this user has no permissions to run the 'evalsha' command"),
                   script=SOURCE["ACQUIRE"], times=2)
    closed = replyapp.queue.apply_async(("noperm",), queue=QUEUE)
    opened = replyapp.fail_open.apply_async(("noperm-open",), queue=QUEUE)
    for result in (closed, opened):
        with pytest.raises(Exception, match="no permissions"):
            result.get(timeout=30)
        assert result.state == "FAILURE"
    assert replyapp.recorder.llen("runs:noperm") == 0 and replyapp.recorder.llen("runs:noperm-open") == 0


def test_a_real_out_of_memory_redis_is_waited_out(
    replyapp: ModuleType, reply_worker: WorkerProcess, lease_redis: RedisServer, clean: None,
    figures: dict[str, Any],
) -> None:
    """The real server: ``maxmemory`` below what it uses (noeviction), so every write script is
    refused with OOM. A fail_closed task is re-sent until memory is raised, then runs once."""
    admin = lease_redis.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")
    try:
        result = replyapp.queue.apply_async(("oom",), queue=QUEUE)
        wait_for(lambda: result.state == "RETRY", timeout=20)
        # refused and re-sent at least twice: the re-sent attempt met the full Redis too
        wait_for(lambda: reply_worker.log().count(f"[{result.id}] will be retried") >= 2, timeout=20)
        assert replyapp.recorder.llen("runs:oom") == 0
    finally:
        admin.config_set("maxmemory", "0")
    assert isinstance(result.get(timeout=30), dict)
    figures.update(runs=replyapp.recorder.llen("runs:oom"))
    assert replyapp.recorder.llen("runs:oom") == 1
