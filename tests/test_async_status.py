"""``astatus``/``awatch`` for asyncio (ASGI) apps: the same answers as ``status``/``watch``, on a
real worker's run and on TLS, Sentinel and Cluster; and the example project's SSE app serving 50
clients of one key from one ASGI server, without the blocking watch and without a thread per
client."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any
from urllib.parse import quote

import pytest
import redis
import uvicorn
from celery import Celery

import celery_singleflight as sf
from celery_singleflight import ConfigurationError, KeyStatus, WatchEvent
from celery_singleflight.connection.aclients import async_client
from celery_singleflight.connection.targets import target_from_settings
from celery_singleflight.ops import status as status_module
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.protocol.replies import Holder
from celery_singleflight.testing import RedisServer, free_port

from .conftest import HOLD, ROOT, let_first_step_go, wait_for
from .test_cluster import cluster  # noqa: F401 - the Cluster fixture
from .test_sentinel import group  # noqa: F401 - the Sentinel fixture
from .test_tls_acl import tls, tls_redis  # noqa: F401 - the TLS fixtures

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]
EVENTS_APP = ROOT / "example_project" / "events_asgi.py"
CLIENTS = 50
def comparable(st: KeyStatus | None) -> dict[str, Any] | None:
    """A status without its lease's time left (which moves between two reads)."""
    if st is None:
        return None
    out = dataclasses.asdict(st)
    out.pop("ttl_left")
    return out


async def collect(
    events: AsyncIterator[WatchEvent], first: threading.Event | None = None
) -> list[WatchEvent]:
    """Every event of an asyncio watch; ``first`` is set once the watch yielded one (it is following)."""
    out: list[WatchEvent] = []
    async for event in events:
        out.append(event)
        if first is not None:
            first.set()
    return out


def follow(events: Iterator[WatchEvent], first: threading.Event) -> list[WatchEvent]:
    """Every event of a blocking watch; ``first`` is set once the watch yielded one."""
    out: list[WatchEvent] = []
    for event in events:
        out.append(event)
        first.set()
    return out


# -- the same answers as the blocking reads -------------------------------------------------------


def test_astatus_and_awatch_answer_as_status_and_watch(sfapp: ModuleType, start_worker: Any) -> None:
    """Given a free key, then a real worker's run on it reporting progress step by step: the
    asyncio reads answer exactly what the blocking ones answer (by key and by the task's
    arguments), and a blocking and an asyncio watcher started during the run see the same
    events, ending with the same ``end``; after the run, both replay it the same way."""
    worker = start_worker(concurrency=2)
    task, app = sfapp.reporting, sfapp.app
    name = f"async-{uuid.uuid4().hex[:8]}"
    key = task.render_key(name)

    # a free key: nothing known, nothing to watch
    assert sf.status(app, key) is None and asyncio.run(sf.astatus(app, key)) is None
    assert task.status(name) is None and asyncio.run(task.astatus(name)) is None
    assert list(sf.watch(app, key, timeout=0.5)) == []
    assert asyncio.run(collect(sf.awatch(app, key, timeout=0.5))) == []
    assert list(task.watch(name)) == [] == asyncio.run(collect(task.awatch(name)))

    # Given a run that holds the key and reports progress: its first step until the test has read
    # it and its watchers follow (HOLD s at most), then every 0.3 s
    result = task.apply_async((name, 8, 0.3), {"first": HOLD}, queue=worker.queue)
    with ThreadPoolExecutor(max_workers=4) as pool:
        try:
            wait_for(lambda: (st := task.status(name)) is not None and st.held and st.current is not None,
                     timeout=15)

            # Then a read at the same moment is the same status (read again if a report fell in between)
            def same_status() -> bool:
                blocking, asynchronous = sf.status(app, key), asyncio.run(sf.astatus(app, key))
                by_args, by_args_async = task.status(name), asyncio.run(task.astatus(name))
                return (blocking is not None and blocking.held
                        and comparable(blocking) == comparable(asynchronous)
                        and comparable(by_args) == comparable(by_args_async) == comparable(blocking))

            wait_for(same_status, timeout=10, interval=0.01)
            held = asyncio.run(sf.astatus(app, key))
            assert held is not None and held.held and held.task_id == result.id and held.state == "loading"
            assert held.ttl_left is not None and 0 < held.ttl_left <= 30

            # When a blocking and an asyncio watcher follow the run at once (by key and by arguments)
            following = [threading.Event() for _ in range(4)]
            blocking = pool.submit(follow, sf.watch(app, key, timeout=30), following[0])
            blocking_by_args = pool.submit(follow, task.watch(name), following[1])
            asynchronous = pool.submit(
                lambda: asyncio.run(collect(sf.awatch(app, key, timeout=30), following[2])))
            by_args = pool.submit(lambda: asyncio.run(collect(task.awatch(name), following[3])))
            # every watcher read the run's history (its first report) before the next report comes
            wait_for(lambda: all(seen.is_set() for seen in following), timeout=20)
        finally:
            let_first_step_go(sfapp, name)
        events = asynchronous.result(timeout=30)
        # Then every watcher saw the same events: the history, each report, then the end
        assert events == blocking.result(timeout=30) == blocking_by_args.result(timeout=30) \
            == by_args.result(timeout=30)
    assert [e.current for e in events if e.kind == "progress"] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert events[-1].kind == "end" and events[-1].state == "succeeded"
    assert result.get(timeout=10) == 8

    # after the run: the same outcome, and the same replay of its history
    ended = asyncio.run(sf.astatus(app, key))
    assert ended is not None and not ended.held and ended.outcome == "succeeded"
    assert comparable(ended) == comparable(sf.status(app, key)) == comparable(asyncio.run(task.astatus(name)))
    assert asyncio.run(collect(sf.awatch(app, key))) == list(sf.watch(app, key)) == events


def test_a_task_reads_the_same_slot_either_way(sfapp: ModuleType) -> None:
    """A ``max_concurrency=3`` key whose slot 0 is free and slots 1 and 2 are held:
    ``task.astatus`` answers the first held slot, as ``task.status`` does."""
    task = sfapp.limited
    key = task.render_key("aslots")
    store = task.store
    for n in range(3):
        store.acquire(key, uuid.uuid4().hex, 30, Holder(f"run-{n}", "w@h", task.name), slots=3)
    sf.force_release(sfapp.app, key, "test", slot=0)
    blocking, asynchronous = task.status("aslots"), asyncio.run(task.astatus("aslots"))
    assert blocking is not None and blocking.held and blocking.slot == 1
    assert comparable(asynchronous) == comparable(blocking)
    other = asyncio.run(sf.astatus(sfapp.app, key, 2))
    assert other is not None and other.slot == 2
    assert comparable(other) == comparable(sf.status(sfapp.app, key, 2))


def test_one_client_per_loop_closed_with_the_loop(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """Reads on one event loop share one asyncio client (one connection for reads one after the
    other); when the loop shuts down (``asyncio.run`` returns) its connections are closed."""
    app = sfapp.app
    target = sfapp.reporting.options.redis
    lease_redis = redis_server.client(2)

    def connections() -> int:
        return len(lease_redis.client_list())

    before = connections()

    async def reads() -> tuple[bool, int]:
        first = await async_client(target)
        for _ in range(5):
            await sf.astatus(app, "free:key")
        return first is await async_client(target), connections()

    shared, during = asyncio.run(reads())
    assert shared and during == before + 1
    wait_for(lambda: connections() == before, timeout=5)


def test_a_client_factory_is_refused_by_name() -> None:
    """``singleflight_redis_client`` returns blocking clients: the asyncio reads refuse it with a
    ConfigurationError naming the setting, rather than reading some other Redis."""
    app = Celery("async-factory", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_client=lambda: redis.Redis(host="127.0.0.1", port=free_port()))
    with pytest.raises(ConfigurationError, match="singleflight_redis_client"):
        asyncio.run(sf.astatus(app, "k"))
    target = target_from_settings("", None, lambda: None)
    with pytest.raises(ConfigurationError, match="astatus"):
        asyncio.run(async_client(target))


@pytest.mark.parametrize("topology", ["tls", "sentinel", "cluster"])
def test_the_same_answers_over_tls_sentinel_and_cluster(
    topology: str, request: pytest.FixtureRequest
) -> None:
    """The asyncio client is built from the same settings as the blocking one: over TLS (client
    certificate), through Sentinel (the master it names) and on a Cluster (the key's node and its
    clock), a held key reads and watches the same either way."""
    if topology == "tls":
        server = request.getfixturevalue("tls_redis")
        url, options = server.url, request.getfixturevalue("tls").transport_options()
    elif topology == "sentinel":
        sentinels = request.getfixturevalue("group")
        url, options = sentinels.url, sentinels.transport_options()
    else:
        url, options = request.getfixturevalue("cluster").url, {}
    app = Celery(f"async-{topology}", broker="memory://", set_as_current=False)
    app.conf.update(singleflight_redis_url=url, singleflight_redis_transport_options=options)
    key = f"topo:{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        with sf.hold(app, key, ttl=10) as lease:
            lease.progress("loading", current=1, total=2)
            assert comparable(asyncio.run(sf.astatus(app, key))) == comparable(sf.status(app, key))
            following = [threading.Event(), threading.Event()]
            blocking = pool.submit(lambda: follow(sf.watch(app, key, timeout=20), following[0]))
            asynchronous = pool.submit(
                lambda: asyncio.run(collect(sf.awatch(app, key, timeout=20), following[1])))
            # both watchers read the held key and its first report before the second one comes
            wait_for(lambda: all(seen.is_set() or watch.done()
                                 for seen, watch in zip(following, (blocking, asynchronous), strict=True)),
                     timeout=20)
            lease.progress("loading", current=2, total=2)
        events = asynchronous.result(timeout=20)
        assert events == blocking.result(timeout=20)
    assert [(e.kind, e.current) for e in events] == [("progress", 1), ("progress", 2), ("end", None)]
    assert comparable(asyncio.run(sf.astatus(app, key))) == comparable(sf.status(app, key))


# -- the example project's SSE app under an ASGI server, in this process ------------------------


def load_events_app() -> ModuleType:
    """``example_project/events_asgi.py``, loaded by path (the demo's own modules stay unimported)."""
    spec = importlib.util.spec_from_file_location("events_asgi", EVENTS_APP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sse_server(sfapp: ModuleType) -> Iterator[int]:
    """uvicorn serving the example's SSE app for sfapp's keys, on one thread of this process (one
    event loop); its port. Stopped, and its loop shut down, after the test."""
    app = load_events_app().events_app(sfapp.app, timeout=60)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", loop="asyncio", http="h11", ws="none"))
    thread = threading.Thread(target=server.run, name="asgi-server", daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), timeout=15)
    assert server.started
    yield port
    server.should_exit = True
    thread.join(timeout=15)
    assert not thread.is_alive()


async def sse(
    port: int, path: str, on_first: Callable[[], None] | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """GET ``path`` as an SSE client (HTTP/1.0: the body is the stream, until the server closes
    it): (the content type, the JSON of every event). Each event must be one ``data:`` line."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n".encode())
        await writer.drain()
        assert (await reader.readline()).startswith(b"HTTP/1.1 200"), path
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            header, _, value = line.decode().partition(":")
            headers[header.strip().lower()] = value.strip()
        events: list[dict[str, Any]] = []
        while line := await reader.readline():
            if line == b"\n":
                continue
            assert line.startswith(b"data: ") and line.endswith(b"\n"), line
            events.append(json.loads(line[len(b"data: "):]))
            if len(events) == 1 and on_first is not None:
                on_first()
        return headers.get("content-type", ""), events
    finally:
        writer.close()
        await writer.wait_closed()


def refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("the blocking status read or watch was used")


def test_fifty_sse_clients_of_one_key_from_one_asgi_server(
    sfapp: ModuleType, start_worker: Any, sse_server: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a real worker's run reporting progress, and the example's SSE app served by uvicorn
    in this process, where the blocking status reads and watches raise: 50 clients streaming the
    same key at once all get every update (one JSON ``data:`` line each) and the final state,
    after which the stream closes; and this process runs no more threads with 50 clients
    streaming than before (each watcher is a coroutine, not a thread)."""
    blocking: list[tuple[object, str]] = [(StatusReader, "watch"), (StatusReader, "read"),
                                          (status_module, "watch"), (sf, "watch")]
    for owner, name in blocking:
        monkeypatch.setattr(owner, name, refuse)
    worker = start_worker(concurrency=2)
    task, app = sfapp.reporting, sfapp.app
    name = f"sse-{uuid.uuid4().hex[:8]}"
    key = task.render_key(name)
    path = f"/events?key={quote(key)}"
    # a free key: the stream ends at once, empty (and the server's loop has its Redis client now)
    assert asyncio.run(sse(sse_server, "/events?key=free:key")) == ("text/event-stream", [])

    # Given a run of 12 steps holding the key: its first until the 50 clients stream (HOLD s at
    # most), the others 0.3 s each
    result = task.apply_async((name, 12, 0.3), {"first": HOLD}, queue=worker.queue)

    async def held() -> None:
        while (st := await sf.astatus(app, key)) is None or not st.held:
            await asyncio.sleep(0.02)

    async def clients() -> tuple[list[tuple[str, list[dict[str, Any]]]], int, bool]:
        streaming = 0
        all_streaming = asyncio.Event()

        def first() -> None:
            nonlocal streaming
            streaming += 1
            if streaming == CLIENTS:
                all_streaming.set()

        # When 50 clients follow it at once
        tasks = [asyncio.create_task(sse(sse_server, path, first)) for _ in range(CLIENTS)]
        await asyncio.wait_for(all_streaming.wait(), timeout=20)
        threads = threading.active_count()  # every client connected and streaming
        during = await sf.astatus(app, key)
        let_first_step_go(sfapp, name)  # the run goes on: a report every 0.3 s, then its end
        results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)
        return results, threads, during is not None and during.held

    try:
        asyncio.run(asyncio.wait_for(held(), timeout=20))
        baseline = threading.active_count()
        results, threads, still_running = asyncio.run(asyncio.wait_for(clients(), timeout=90))
    finally:
        let_first_step_go(sfapp, name)

    # Then all 50 were streaming while the run went on, on no more threads than before (a stray
    # helper thread aside: a thread per client would add 50, a thread pool at least 5)
    assert still_running
    assert threads <= baseline + 2, (baseline, threads)
    # ...and each got the run's updates in order, then its end: the same final state for all
    finals = set()
    for content_type, events in results:
        assert content_type == "text/event-stream"
        assert events[-1]["kind"] == "end" and events[-1]["state"] == "succeeded"
        currents = [e["current"] for e in events if e["kind"] == "progress"]
        assert currents == sorted(currents) and currents[-1] == 12
        finals.add(json.dumps(events[-1], sort_keys=True))
    assert len(finals) == 1
    assert result.get(timeout=10) == 12
