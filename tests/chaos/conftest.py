"""Fixtures of the chaos suite: two private Redis servers, the chaos app, workers and figures.

The broker, results and the run recorder live on one private Redis; the leases on another, so a
scenario can kill, restart or cut off the lease Redis while the broker stays up. Every process
here is started by the suite and stopped by its own PID (workers: their own process group).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from celery_singleflight.testing import RedisServer, WorkerProcess

from ..conftest import wait_for  # re-exported for the scenarios

CHAOS = Path(__file__).parent
ROOT = CHAOS.parent.parent


@pytest.fixture(scope="session")
def broker_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def lease_redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def chaos(broker_redis: RedisServer, lease_redis: RedisServer) -> ModuleType:
    """The chaos app module, bound to the two private servers."""
    os.environ["CHAOS_REDIS"] = broker_redis.url
    os.environ["CHAOS_LEASE_URL"] = f"{lease_redis.url}/2"
    if str(CHAOS) not in sys.path:
        sys.path.insert(0, str(CHAOS))
    return importlib.import_module("chaosapp")


@pytest.fixture(autouse=True)
def _chaos_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """Broker, results, recorder and leases start empty in every scenario."""
    if "chaos" in request.fixturenames:
        lease: RedisServer = request.getfixturevalue("lease_redis")
        if lease.proc is None:  # a scenario that killed it failed before restarting it
            lease.start()
        flush(request.getfixturevalue("broker_redis"), lease)
    yield


def flush(broker: RedisServer, lease: RedisServer) -> None:
    for db in (0, 1, 3):
        broker.client(db).flushdb()
    lease.client(2).flushdb()


class Workers:
    """Starts real ``celery worker`` processes of the chaos app; all are killed afterwards."""

    def __init__(self, chaos: ModuleType, broker: RedisServer, lease: RedisServer, logdir: Path) -> None:
        self.chaos = chaos
        self.broker = broker
        self.lease = lease
        self.logdir = logdir
        self.started: list[WorkerProcess] = []

    def make(self, queue: str, *, concurrency: int = 2, env: dict[str, str] | None = None) -> WorkerProcess:
        full = {
            "CHAOS_REDIS": self.broker.url,
            "CHAOS_LEASE_URL": f"{self.lease.url}/2",
            "PYTHONPATH": os.pathsep.join([str(CHAOS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **(env or {}),
        }
        worker = WorkerProcess("chaosapp", concurrency=concurrency, cwd=str(CHAOS), env=full,
                               extra=("-Q", queue))
        worker.queue = queue  # type: ignore[attr-defined]
        self.started.append(worker)
        return worker

    def start(self, *workers: WorkerProcess) -> list[WorkerProcess]:
        """Start ``workers`` in parallel; return once each answers a ping."""
        errors: list[BaseException] = []

        def boot(worker: WorkerProcess) -> None:
            try:
                worker.start(None, timeout=60)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)

        threads = [threading.Thread(target=boot, args=(w,)) for w in workers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for worker in workers:
            wait_for(lambda w=worker: self.chaos.app.control.ping(destination=[w.hostname], timeout=0.5),
                     timeout=30)
        return list(workers)

    def one(self, queue: str, *, concurrency: int = 2, env: dict[str, str] | None = None) -> WorkerProcess:
        return self.start(self.make(queue, concurrency=concurrency, env=env))[0]

    def finish(self) -> None:
        """Kill every worker first (SIGKILL to its own process group), then keep the logs."""
        for worker in self.started:
            if worker.proc is not None:
                with contextlib.suppress(Exception):
                    worker.kill()
        for i, worker in enumerate(self.started):
            with contextlib.suppress(OSError):
                if worker.log_path.exists():
                    shutil.copy(worker.log_path, self.logdir / f"worker-{i}.log")
            worker.cleanup()


@pytest.fixture
def workers(chaos: ModuleType, broker_redis: RedisServer, lease_redis: RedisServer,
            tmp_path: Path) -> Iterator[Workers]:
    started = Workers(chaos, broker_redis, lease_redis, tmp_path)
    yield started
    started.finish()


@pytest.fixture
def queue() -> str:
    return f"chaos-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def figures(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """The scenario's figures: printed (``-s`` shows them) and written to
    ``<pytest basetemp>/chaos-figures/<test>.json``."""
    data: dict[str, Any] = {}
    yield data
    if data:
        write_figures(tmp_path_factory, request.node.name, data)


def write_figures(tmp_path_factory: pytest.TempPathFactory, name: str, data: dict[str, Any]) -> Path:
    out = tmp_path_factory.getbasetemp() / "chaos-figures"
    out.mkdir(exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str))
    print(f"\n[chaos] {name}: {json.dumps(data, sort_keys=True, default=str)}")
    print(f"[chaos] figures written to {path}")
    return path


# -- helpers ---------------------------------------------------------------------------------------


def runs(chaos: ModuleType, key: str | None = None) -> list[dict[str, Any]]:
    """Every recorded body run (of ``key``), in start order: start/end as floats, end None if the
    run never finished (its process was killed, or it is still running)."""
    recorder = chaos.recorder
    tokens = recorder.lrange("runs" if key is None else f"runs:{key}", 0, -1)
    pipe = recorder.pipeline(transaction=False)
    for token in tokens:
        pipe.hgetall(f"run:{token.decode()}")
    out = []
    for raw in pipe.execute():
        info = {k.decode(): v.decode() for k, v in raw.items()}
        info["start"] = float(info["start"])
        info["end"] = float(info["end"]) if "end" in info else None
        out.append(info)
    return sorted(out, key=lambda r: r["start"])


def overlaps(chaos: ModuleType) -> list[dict[str, Any]]:
    return [json.loads(x) for x in chaos.recorder.lrange("overlaps", 0, -1)]


def deliveries(chaos: ModuleType, task_id: str) -> list[float]:
    return [float(x) for x in chaos.recorder.lrange(f"deliveries:{task_id}", 0, -1)]


def holder_of(task: Any, *args: Any) -> dict[str, str]:
    """The stored lease of the key ``task`` renders for ``args``, empty if free."""
    return task.store.holder_record(task.render_key(*args))  # type: ignore[no-any-return]


def renewed(store: Any, key: str, ttl: float, slot: int = 0) -> bool:
    """The run holding (``slot`` of) ``key`` renewed its lease at least once: its deadline is
    later than its take's (its start + ``ttl``, the workers' TTL)."""
    record = store.holder_record(key, slot)
    return bool(record.token) and record.deadline - record.since > ttl * 1000


def broker_empty(broker: RedisServer, queue: str) -> bool:
    """The broker holds no message of ``queue`` (nor of a queue named after it): none queued, and
    none delivered but not acknowledged (kombu's ``unacked``: a visibility timeout sends those
    again). Nothing is left there that a worker could run later."""
    client = broker.client(0)
    queued = sum(client.llen(name) for name in client.scan_iter(match=f"{queue}*")
                 if client.type(name) == b"list")
    return queued == 0 and client.hlen("unacked") == 0


def lease_pttl(task: Any, *args: Any) -> int:
    """Milliseconds left on the lease of the key ``task`` renders for ``args`` (-2: no lease)."""
    left = task.store.time_left(task.render_key(*args))
    return -2 if left is None else int(left * 1000)


def round3(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def since(later: float | None, earlier: float | None) -> float | None:
    """``later - earlier`` in seconds, rounded to the ms; None if either is unknown."""
    return None if later is None or earlier is None else round(later - earlier, 3)


def interval_overlaps(all_runs: list[dict[str, Any]], deaths: dict[int, float] | None = None) -> list[str]:
    """A second check of the recorder, offline: per key, runs sorted by start must not overlap.

    A run without an end ends when its process was killed (``deaths``: pid -> time of the kill);
    one with neither is taken as still running, so any later run on its key counts as an overlap.
    """
    deaths = deaths or {}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for run in all_runs:
        by_key.setdefault(run["key"], []).append(run)
    found = []
    for key, key_runs in by_key.items():
        key_runs.sort(key=lambda r: r["start"])
        busy_until, busy_by = float("-inf"), None
        for run in key_runs:
            if run["start"] < busy_until:
                found.append(f"{key}: {run['task_id']} started {busy_until - run['start']:.3f}s before"
                             f" {busy_by} ended")
            end = run["end"] if run["end"] is not None else deaths.get(int(run["pid"]), float("inf"))
            if end > busy_until:
                busy_until, busy_by = end, run["task_id"]
    return found


def max_at_once(key_runs: list[dict[str, Any]], deaths: dict[int, float] | None = None) -> int:
    """The most of ``key_runs`` alive at one instant (for a ``max_concurrency`` key, whose slots
    the recorder keeps apart); a run without an end ends at its process's death, else never."""
    deaths = deaths or {}
    edges: list[tuple[float, int]] = []
    for run in key_runs:
        end = run["end"] if run["end"] is not None else deaths.get(int(run["pid"]), float("inf"))
        edges += [(run["start"], 1), (end, -1)]
    alive = most = 0
    for _, step in sorted(edges):  # at a tie an end (-1) sorts before a start: touching is not overlapping
        alive += step
        most = max(most, alive)
    return most
