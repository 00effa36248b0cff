"""Prometheus metrics: a real Prometheus server scrapes a real worker's exporter while each
policy runs, and the counts it stores are the runs and duplicates that happened; the series no
duplicate moves (a lost lease, renewals, a queue timeout, a Redis down; the time policies' in
tests/time/test_time_metrics.py) count what real runs did; a prefork worker whose pool
processes are replaced after every task loses no count, nor does a flush or a fork beside a
write in flight; the gauges read from Redis show a held key and its parked runs; the standalone
exporter serves the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.metrics.catalog import SERIES, markdown_table
from celery_singleflight.metrics.record import FLUSH_AFTER
from celery_singleflight.testing import free_port

from .conftest import HOLD, IN_CI, ROOT, TESTS, let_go, stays, wait_for, worker_env

pytestmark = pytest.mark.worker
PROMETHEUS = shutil.which("prometheus")


def scrape(port: int) -> dict[str, float]:
    """The worker's /metrics as {series with labels: value} (comments left out)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def sample(values: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` whose labels include ``labels`` (0 if no such series)."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    found = [v for series, v in values.items()
             if series.split("{")[0] == name and all(w in series for w in wanted)]
    return sum(found)


@pytest.fixture
def metrics_worker(start_worker: Callable[..., Any], tmp_path: Path) -> Callable[..., tuple[Any, int]]:
    def start(*extra: str, concurrency: int = 4, env: dict[str, str] | None = None) -> tuple[Any, int]:
        port = free_port()
        directory = tmp_path / f"metrics-{port}"
        worker = start_worker(concurrency=concurrency, extra=extra, env={
            "SF_TEST_METRICS_PORT": str(port), "SF_TEST_METRICS_DIR": str(directory), **(env or {})})
        wait_for(lambda: _answers(port), timeout=15)
        return worker, port
    return start


def _answers(port: int) -> bool:
    try:
        scrape(port)
    except OSError:
        return False
    return True


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[int], Callable[[str], list[dict[str, Any]]]]]:
    """A real Prometheus server scraping the given port every 0.5 s; yields its query function."""
    if PROMETHEUS is None:
        message = "Prometheus is needed (apt-get install prometheus)"
        if IN_CI:
            pytest.fail(f"{message} and CI=true")
        pytest.skip(message)
    procs: list[subprocess.Popen[bytes]] = []

    def start(target: int) -> Callable[[str], list[dict[str, Any]]]:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
            "scrape_configs:\n"
            f"  - job_name: worker\n    static_configs: [{{targets: ['127.0.0.1:{target}']}}]\n")
        proc = subprocess.Popen(
            [str(PROMETHEUS), f"--config.file={config}", f"--web.listen-address=127.0.0.1:{port}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))  # noqa: SIM115
        procs.append(proc)

        def query(expr: str) -> list[dict[str, Any]]:
            url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
            with urllib.request.urlopen(url, timeout=5) as reply:
                body = json.loads(reply.read())
            assert body["status"] == "success", body
            return list(body["data"]["result"])

        def up() -> bool:
            try:
                return any(r["value"][1] == "1" for r in query("up"))
            except OSError:
                return False
        wait_for(up, timeout=30, interval=0.2)
        return query

    yield start
    for proc in procs:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def held(task: Any, *args: Any) -> bool:
    status = task.status(*args)
    return status is not None and bool(status.held)


def holding(task: Any, args: tuple[Any, ...], queue: str) -> Any:
    """Send a run of ``task`` and wait until it holds the key of ``args``: its duplicates then
    meet a holder."""
    result = task.apply_async(args, queue=queue)
    wait_for(lambda: held(task, *args))
    return result


def _value(query: Callable[[str], list[dict[str, Any]]], expr: str) -> float:
    result = query(expr)
    return sum(float(r["value"][1]) for r in result)


def _scraped_after_every_count(query: Callable[[str], list[dict[str, Any]]]) -> None:
    """Every run has ended: wait for a scrape from after their counts were written (a process
    writes what it counted within FLUSH_AFTER)."""
    ended = time.time() + FLUSH_AFTER
    wait_for(lambda: _value(query, "timestamp(up)") > ended + 0.1, timeout=20, interval=0.2)


def test_prometheus_scrapes_what_each_policy_did(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]],
    prometheus: Callable[[int], Callable[[str], list[dict[str, Any]]]],
) -> None:
    # each holder holds until its duplicates met it: other processes take the duplicates meanwhile
    worker, port = metrics_worker(concurrency=8)
    query = prometheus(port)
    queue = worker.queue
    key = uuid.uuid4().hex[:8]
    try:
        # skip: one holder, three duplicates turned away
        holder = holding(sfapp.hold_skip, (f"s{key}", HOLD), queue)
        skipped = [sfapp.hold_skip.apply_async((f"s{key}",), queue=queue) for _ in range(3)]
        wait_for(lambda: all(r.ready() for r in skipped), timeout=15)
        let_go(sfapp, f"s{key}")
        # raise: two duplicates fail with LockHeld
        raiser = holding(sfapp.hold_raise, (f"r{key}", HOLD), queue)
        raised = [sfapp.hold_raise.apply_async((f"r{key}",), queue=queue) for _ in range(2)]
        wait_for(lambda: all(r.ready() for r in raised), timeout=15)
        let_go(sfapp, f"r{key}")
        # queue: a holder and three parked runs, each handed the key in turn; they stay parked a
        # second at least (the wait the histogram must show, below)
        first = holding(sfapp.queued, (f"q{key}", 0, HOLD), queue)
        parked = [sfapp.queued.apply_async((f"q{key}", n, 0.05), queue=queue) for n in (1, 2, 3)]
        wait_for(lambda: all(r.state == "QUEUED" for r in parked), timeout=15)
        stays(lambda: all(r.state == "QUEUED" for r in parked), 1.0)
        let_go(sfapp, f"q{key}")
        # join: two runs get the holder's result
        joined_holder = holding(sfapp.joined, (f"j{key}", 7, HOLD), queue)
        joins = [sfapp.joined.apply_async((f"j{key}", 8), queue=queue) for _ in range(2)]
        wait_for(lambda: all(r.state == "JOINED" for r in joins), timeout=15)
    finally:
        let_go(sfapp, *(f"{kind}{key}" for kind in "srqj"))

    for result in (holder, *skipped, raiser, first, *parked, joined_holder):
        result.get(timeout=30, propagate=False)
    assert [join.get(timeout=30)["value"] for join in joins] == [7, 7]  # they did join the holder
    for result in raised:
        with pytest.raises(Exception, match="held"):
            result.get(timeout=30)

    _scraped_after_every_count(query)
    name = "celery_singleflight_duplicates_total"
    for task, policy, outcome, expected in (
            ("hold_skip", "skip", "skipped", 3), ("hold_raise", "raise", "raised", 2),
            ("queued", "queue", "queued", 3), ("joined", "join", "joined", 2)):
        expr = f'{name}{{task="sfapp.{task}",policy="{policy}",outcome="{outcome}"}}'
        assert _value(query, expr) == expected, expr
    # the query the docs give: increase over a minute equals the duplicates sent (the series was
    # made at 0 when the worker started, so the first duplicate is an increase too)
    increase = _value(query, f'increase({name}{{task="sfapp.hold_skip",policy="skip"}}[1m])')
    assert round(increase) == 3, increase
    acquired = "celery_singleflight_leases_acquired_total"
    assert _value(query, f'{acquired}{{task="sfapp.queued"}}') == 4
    assert _value(query, f'{acquired}{{task="sfapp.hold_skip"}}') == 1
    # the three parked runs waited for the key, and were each handed it by a release
    for histogram in ("wait_seconds", "handoff_seconds"):
        expr = f'celery_singleflight_{histogram}_count{{task="sfapp.queued",policy="queue"}}'
        assert _value(query, expr) == 3, histogram
    handoff_sum = _value(query, 'celery_singleflight_handoff_seconds_sum{task="sfapp.queued"}')
    assert 0 < handoff_sum < 3 * 1.0, handoff_sum  # each hand-off well under a second
    wait_sum = _value(query, 'celery_singleflight_wait_seconds_sum{task="sfapp.queued"}')
    assert wait_sum >= 0.9, wait_sum  # the parked runs waited for the holder, a second at least
    assert _value(query, 'celery_singleflight_hold_seconds_count{task="sfapp.hold_skip"}') == 1
    assert _value(query, "celery_singleflight_renewal_round_trips_total") >= 0
    assert _value(query, "celery_singleflight_redis_up") == 1


# about 15 s: a worker serving metrics and a real Prometheus, which scrapes each second: the series are
# read as Prometheus stored them
def test_prometheus_scrapes_retry_coalesce_and_supersede(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]],
    prometheus: Callable[[int], Callable[[str], list[dict[str, Any]]]],
) -> None:
    """The other three policies, each with a holder and its duplicates, and the series only
    they move (a retried run's wait, a lease taken over)."""
    worker, port = metrics_worker(concurrency=8)
    query = prometheus(port)
    queue = worker.queue
    key = uuid.uuid4().hex[:8]
    try:
        # retry: the duplicate retries until the holder is done (3 s at least after the test saw it
        # retry: the wait the histogram must show, below), then runs
        holder = holding(sfapp.hold_retry, (f"t{key}", HOLD), queue)
        retried = sfapp.hold_retry.apply_async((f"t{key}",), queue=queue)
        wait_for(lambda: retried.state == "RETRY", timeout=15)
        stays(lambda: not retried.ready(), 3.0)
        let_go(sfapp, f"t{key}")
        # coalesce: two duplicates while the holder runs; the second replaces the first as the pending run
        co_holder = holding(sfapp.coalesced, (f"c{key}", 0, HOLD), queue)
        co_first = sfapp.coalesced.apply_async((f"c{key}", 1), queue=queue)
        wait_for(lambda: co_first.state == "QUEUED")
        co_last = sfapp.coalesced.apply_async((f"c{key}", 2), queue=queue)
        wait_for(lambda: co_last.state == "QUEUED")
        let_go(sfapp, f"c{key}")
    finally:
        let_go(sfapp, f"t{key}", f"c{key}")
    # supersede: a newer run takes the key over from the holder, which stops at its next check
    # (HOLD s at most: it runs until then)
    old = holding(sfapp.superseding, (f"u{key}", 0, HOLD), queue)
    newer = sfapp.superseding.apply_async((f"u{key}", 1), queue=queue)

    for result in (holder, retried, co_holder, co_first, co_last, newer):
        result.get(timeout=30, propagate=False)
    old.get(timeout=30, propagate=False)
    assert old.state == "FAILURE" and newer.state == "SUCCESS", (old.state, newer.state)
    assert sf.is_coalesced(co_first.get()) and co_last.get() == 2

    _scraped_after_every_count(query)
    name = "celery_singleflight_duplicates_total"
    # one count per retry: the duplicate retried at least once
    assert _value(query, f'{name}{{task="sfapp.hold_retry",policy="retry",outcome="retry"}}') >= 1
    for task, policy, outcome, expected in (
            ("coalesced", "coalesce", "queued", 2), ("superseding", "supersede", "superseding", 1)):
        expr = f'{name}{{task="sfapp.{task}",policy="{policy}",outcome="{outcome}"}}'
        assert _value(query, expr) == expected, expr
    acquired = "celery_singleflight_leases_acquired_total"
    for task in ("hold_retry", "coalesced", "superseding"):  # the holder and the run after it
        assert _value(query, f'{acquired}{{task="sfapp.{task}"}}') == 2, task
    assert _value(query, 'celery_singleflight_leases_taken_over_total{task="sfapp.superseding"}') == 1
    # the retried run waited for the key from its first attempt: the holder held 3 s more once it retried
    assert _value(query, 'celery_singleflight_wait_seconds_count{task="sfapp.hold_retry"}') == 1
    assert _value(query, 'celery_singleflight_wait_seconds_sum{task="sfapp.hold_retry"}') >= 2.0


def test_losses_renewals_and_queue_timeouts_are_counted(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]], redis_server: Any,
) -> None:
    """Series no duplicate moves, each from a real run: a lease lost, renewals, a queue timeout
    (the time policies' are in tests/time/test_time_metrics.py). The fair holder holds its slot
    until the run behind it timed out, however long a loaded machine takes."""
    worker, port = metrics_worker(concurrency=4)
    queue = worker.queue
    key = uuid.uuid4().hex[:8]
    # a fair slot held until the test lets it go (HOLD s at most): the run behind it waits past
    # its 0.5 s queue_timeout
    fair_holder = sfapp.fair_metered.apply_async((key, 0, HOLD), queue=queue)
    try:
        wait_for(lambda: sfapp.fair_metered.fair_status().running, timeout=15)
        timed_out = sfapp.fair_metered.apply_async((key, 1), queue=queue)
        # a lease renewed for 4.5 s (a TTL of 1.5 s), and one deleted behind its holder's back
        renewed = sfapp.heartbeat_check.apply_async((f"r{key}",), queue=queue)
        lost = sfapp.loses_lease.apply_async((f"l{key}",), queue=queue)
        wait_for(lambda: sfapp.recorder.get(f"started:l{key}"), timeout=15)
        redis_server.client(2).delete(sfapp.loses_lease.store.layout.run(sfapp.loses_lease.render_key(f"l{key}")))

        assert renewed.get(timeout=30)["lost"] is False and lost.get(timeout=30)["lost"] is True
        with pytest.raises(sf.QueueTimeout):
            timed_out.get(timeout=30)
    finally:
        let_go(sfapp, key)
    fair_holder.get(timeout=30)

    def counted() -> dict[str, float] | None:
        values = scrape(port)
        found = {name: sample(values, f"celery_singleflight_{name}", task=f"sfapp.{task}") for name, task in (
            ("leases_lost_total", "loses_lease"), ("queue_timeouts_total", "fair_metered"))}
        found["renewals_total"] = sample(values, "celery_singleflight_renewals_total")
        return (found["leases_lost_total"] == 1 and found["queue_timeouts_total"] == 1
                and found["renewals_total"] >= 4)

    wait_for(counted, timeout=FLUSH_AFTER + 5)


def test_runs_without_their_lease_redis_are_counted_by_mode(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]],
) -> None:
    """With the lease Redis down: a ``fail_open`` run runs unguarded and a ``fail_closed`` one is
    sent again, each counted under its mode; the gauge says the Redis is down."""
    dead = f"redis://127.0.0.1:{free_port()}/2"
    worker, port = metrics_worker(env={"SF_TEST_LEASE_REDIS": dead, "SF_TEST_REDIS_RETRY": "0.5"})
    assert sfapp.open_on_error.apply_async(("open",), queue=worker.queue).get(timeout=30) == "ran"
    closed = sfapp.hold_raise.apply_async(("closed", 0.01), queue=worker.queue)
    wait_for(lambda: closed.state == "RETRY", timeout=20)

    def counted() -> bool:
        values = scrape(port)
        return (sample(values, "celery_singleflight_redis_unavailable_total", task="sfapp.open_on_error",
                       mode="fail_open") == 1
                and sample(values, "celery_singleflight_redis_unavailable_total", task="sfapp.hold_raise",
                           mode="fail_closed") >= 1
                and sample(values, "celery_singleflight_redis_up") == 0)

    wait_for(counted, timeout=FLUSH_AFTER + 5)
    closed.revoke()


def test_counts_survive_pool_processes_replaced_after_every_task(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]],
) -> None:
    """``--max-tasks-per-child 1``: each task runs in a new pool process, which exits after it;
    every lease taken and every duplicate is still counted."""
    worker, port = metrics_worker("--max-tasks-per-child", "1", concurrency=2)
    key = uuid.uuid4().hex[:8]
    results = [sfapp.plain.apply_async((f"{key}-{n}",), queue=worker.queue) for n in range(12)]
    for result in results:
        result.get(timeout=30)
    # the holder outlasts the duplicate's decision however slowly the pool makes the process
    # that takes it (a new one per task: under load that took seconds); it is not counted
    holder = holding(sfapp.hold_skip, (f"s{key}", 60.0), worker.queue)
    skipped = sfapp.hold_skip.apply_async((f"s{key}",), queue=worker.queue)
    assert skipped.get(timeout=30)["singleflight"] == "skipped"
    holder.revoke(terminate=True, signal="SIGKILL")
    # each pool process writes its counts as it exits (its timer thread dies with it): none lost
    def all_counted() -> bool:
        values = scrape(port)
        return (sample(values, "celery_singleflight_leases_acquired_total", task="sfapp.plain") == 12
                and sample(values, "celery_singleflight_duplicates_total", task="sfapp.hold_skip",
                           outcome="skipped") == 1)
    wait_for(all_counted, timeout=FLUSH_AFTER + 5)
    values = scrape(port)
    assert sample(values, "celery_singleflight_leases_acquired_total", task="sfapp.plain") == 12
    # the pool processes really were replaced: more of them wrote counts than run at once
    files = list(Path(worker.env["SF_TEST_METRICS_DIR"]).glob("counter_*.db"))
    assert len(files) > 3, files


def test_gauges_read_held_keys_and_parked_runs_from_redis(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]],
) -> None:
    worker, port = metrics_worker()
    key = uuid.uuid4().hex[:8]
    holder = holding(sfapp.queued_sleeper, (f"g{key}", 30.0), worker.queue)
    for _ in range(3):
        sfapp.queued_sleeper.apply_async((f"g{key}", 0.01), queue=worker.queue)

    def gauges() -> bool:
        values = scrape(port)
        return (sample(values, "celery_singleflight_keys_held", task="sfapp.queued_sleeper") == 1
                and sample(values, "celery_singleflight_runs_waiting", task="sfapp.queued_sleeper") == 3)
    wait_for(gauges, timeout=15, interval=0.1)
    values = scrape(port)
    assert sample(values, "celery_singleflight_keys_held", task="sfapp.hold_skip") == 0  # made at 0
    sfapp.app.control.revoke(holder.id, terminate=True, signal="SIGKILL")


def test_the_standalone_exporter_serves_the_workers_counts_and_the_gauges(
    sfapp: ModuleType, metrics_worker: Callable[..., tuple[Any, int]], redis_server: Any,
) -> None:
    worker, _port = metrics_worker()
    directory = worker.env["SF_TEST_METRICS_DIR"]
    sfapp.plain.apply_async(("standalone",), queue=worker.queue).get(timeout=30)
    port = free_port()
    env = {**os.environ, **worker_env(redis_server)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "sfapp", "singleflight", "metrics", "--port", str(port),
         "--dir", directory], cwd=str(TESTS), env=env, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: _answers(port), timeout=20)
        wait_for(lambda: sample(scrape(port), "celery_singleflight_leases_acquired_total",
                                task="sfapp.plain") >= 1, timeout=FLUSH_AFTER + 5)
        values = scrape(port)
        assert sample(values, "celery_singleflight_redis_up") == 1
    finally:
        proc.terminate()
        proc.wait(10)


def test_the_docs_list_every_series() -> None:
    page = (ROOT / "docs" / "metrics.md").read_text()
    assert markdown_table() in page
    assert all(series.exported in page for series in SERIES)


def test_metrics_without_prometheus_client_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from celery_singleflight import ConfigurationError
    from celery_singleflight.metrics import record

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ConfigurationError, match=r"celery-singleflight\[metrics\]"):
        record.start_recording(None)
    assert not record.recording()


def test_a_flush_at_exit_waits_for_a_timer_write_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool process writes its counts as it exits, and the pool kills it as soon as it says it
    exited: if the timer thread had just taken the counts and was still writing them, the exit's
    flush must wait for that write, not return at once with nothing left to write."""
    import threading

    from celery_singleflight.metrics import record

    record.start_recording(None)
    try:
        family = record._families["leases_acquired"]
        labels, taking, go = family.labels, threading.Event(), threading.Event()

        def slow_labels(*values: str) -> Any:
            taking.set()
            assert go.wait(10)  # the timer's write, half done until the test lets it go on
            return labels(*values)

        monkeypatch.setattr(family, "labels", slow_labels)
        record.count("leases_acquired", "t", "skip")
        timer = threading.Thread(target=record.flush)
        timer.start()
        assert taking.wait(5)
        seen: list[float] = []  # the count once the exit's flush returned

        def exit_flush() -> None:
            record.flush()
            seen.append(labels("t", "skip")._value.get())

        exiting = threading.Thread(target=exit_flush)
        exiting.start()
        try:
            stays(exiting.is_alive, 0.3)  # the exit's flush waits while the write is in flight...
        finally:
            go.set()
            exiting.join(10)
            timer.join(10)
        assert seen == [1]  # ...and returns once it is whole
    finally:
        record.stop_recording()


def test_a_fork_waits_for_a_write_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's main process counts too (its sweeper's queue timeouts) and forks new pool
    processes: a fork must not happen halfway through a write, or the client's lock taken inside
    it stays held in the child, whose first count then waits for ever. The child sees the write
    done."""
    import threading

    from celery_singleflight.metrics import record

    record.start_recording(None)
    try:
        family = record._families["leases_acquired"]
        labels, taking, go = family.labels, threading.Event(), threading.Event()

        def slow_labels(*values: str) -> Any:
            taking.set()
            assert go.wait(10)  # the write, half done until the test lets it go on
            return labels(*values)

        monkeypatch.setattr(family, "labels", slow_labels)
        record.count("leases_acquired", "t", "skip")
        writer = threading.Thread(target=record.flush)
        writer.start()
        assert taking.wait(5)
        forked: list[int] = []

        def fork() -> None:  # on a thread of its own: this one watches it wait
            pid = os.fork()
            if pid == 0:  # the child: the write it was forked beside is whole
                os._exit(0 if labels("t", "skip")._value.get() == 1 else 1)
            forked.append(pid)

        forking = threading.Thread(target=fork)
        forking.start()
        try:
            # the fork waits while the write is in flight (its wait is bounded at 2 s)...
            stays(lambda: not forked, 0.3)
        finally:
            go.set()
            forking.join(10)
            writer.join(10)
            statuses = [os.waitpid(pid, 0)[1] for pid in forked]
        assert [os.waitstatus_to_exitcode(status) for status in statuses] == [0]  # ...the child sees it whole
    finally:
        record.stop_recording()


def test_the_dashboard_queries_only_series_that_exist() -> None:
    """Every query of the Grafana dashboard in the docs names declared series (a renamed series
    would leave a panel empty without an error)."""
    import re

    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exported = {series.exported for series in SERIES}
    histograms = {f"{s.exported}{suffix}" for s in SERIES if s.kind == "histogram"
                  for suffix in ("_bucket", "_sum", "_count")}
    named = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"celery_singleflight_\w+", target["expr"])}
    assert named, "no queries"
    assert named <= exported | histograms, named - exported - histograms
    assert len(dashboard["panels"]) >= 8


def test_a_worker_whose_metrics_port_is_taken_says_so_and_does_not_start(
    start_worker: Callable[..., Any], tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match="singleflight_metrics_port: cannot serve metrics"):
            start_worker(env={"SF_TEST_METRICS_PORT": str(port), "SF_TEST_METRICS_DIR": str(tmp_path / "m")})
