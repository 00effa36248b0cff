"""OpenTelemetry spans on a real Redis and a real Celery worker (in this process, so the SDK's
in-memory exporter sees the worker's spans): the acquire, duplicate and release spans, their
attributes, their parent (the Celery task span, with opentelemetry-instrumentation-celery on),
and the link from a duplicate to the holder's span, whose context the holder left in its run
record. Also: with tracing off nothing is written, and without the API the package works.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from opentelemetry import trace
from opentelemetry.instrumentation.celery import CeleryInstrumentor
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

from celery_singleflight import SingleFlightTask, hold, tracing
from celery_singleflight.protocol.fields import PLAIN
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .conftest import ROOT, wait_for

POLICIES = ("join", "queue", "coalesce", "supersede", "skip")


class Switch(Sampler):
    """Samples while on: the provider is global to the process, and the other tests in it run
    untraced (their acquires then write no trace context)."""

    on = False

    def should_sample(self, parent_context: Any, trace_id: int, name: str, kind: Any = None,
                      attributes: Any = None, links: Any = None, trace_state: Any = None) -> SamplingResult:
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.on else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "Switch"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """The process's tracer provider (set once: the API allows one), exporting to memory, with
    the Celery instrumentation on; sampling only during these tests."""
    memory = InMemorySpanExporter()
    switch = Switch()
    current = trace.get_tracer_provider()
    provider = current if isinstance(current, TracerProvider) else TracerProvider(sampler=switch)
    if provider is not current:
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    instrumentor = CeleryInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    Switch.on = True
    yield memory
    Switch.on = False
    instrumentor.uninstrument()
    memory.shutdown()


#: what the tasks' bodies wait for, by key: the test lets the holder end when it is ready
gates: dict[str, threading.Event] = {}


def _gate(key: str) -> threading.Event:
    return gates.setdefault(key, threading.Event())


@pytest.fixture(scope="module")
def app(redis_server: RedisServer, exporter: InMemorySpanExporter) -> Iterator[Celery]:
    """An app of its own (its queue, its namespace) with one task per policy, and a worker
    (threads) running in this process."""
    url = redis_server.url
    app = Celery("tracing", broker=f"{url}/0", backend=f"{url}/1")
    app.conf.update(
        singleflight_redis_url=f"{url}/2", singleflight_namespace=f"tr{uuid.uuid4().hex[:6]}",
        task_default_queue=f"tr-{uuid.uuid4().hex[:12]}", worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True, result_expires=600, singleflight_require_persistence="off",
    )

    for policy in POLICIES:
        @app.task(bind=True, base=SingleFlightTask, lock_key="tr:<key>", on_duplicate=policy,
                  name=f"tr.{policy}")
        def run(self: Any, key: str, n: int) -> dict[str, Any]:
            assert _gate(key).wait(20), f"the test never let the run on {key} end"
            return {"n": n, "fence": self.lease.fence}

    with start_worker(app, concurrency=4, pool="threads", perform_ping_check=False, loglevel="WARNING",
                      shutdown_timeout=15) as worker:
        yield app
    for step in worker.steps:  # a worker thread ends without stopping its steps: the sweeper's thread
        if getattr(step, "label", "") == "singleflight":
            step.stop(worker)


def _spans(exporter: InMemorySpanExporter, name: str, key: str | None = None) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name
            and (key is None or (span.attributes or {}).get(tracing.KEY) == key)]


def _run_span(exporter: InMemorySpanExporter, task_id: str) -> ReadableSpan:
    """The Celery instrumentation's span of the run of ``task_id`` (``run/<task name>``)."""
    return wait_for(lambda: next((span for span in exporter.get_finished_spans()
                                  if span.name.startswith("run/")
                                  and (span.attributes or {}).get("messaging.message.id") == task_id), None))


def _within(span: ReadableSpan, run: ReadableSpan) -> bool:
    """``span`` is a child of ``run`` (same trace, ``run`` its parent)."""
    assert span.parent is not None and span.context is not None and run.context is not None
    return span.context.trace_id == run.context.trace_id and span.parent.span_id == run.context.span_id


def test_the_acquire_and_release_are_spans_under_the_task_span(app: Celery,
                                                               exporter: InMemorySpanExporter) -> None:
    """Given tracing and the Celery instrumentation on, when a run takes its key and ends, then
    its acquire and release spans are children of its Celery task span, with the key template
    (the task's lock_key), the rendered key, the policy, the outcome and the fence."""
    task = app.tasks["tr.join"]
    key = uuid.uuid4().hex[:8]
    _gate(key).set()
    result = task.delay(key, 1)
    fence = result.get(timeout=20)["fence"]
    run = _run_span(exporter, result.id)
    rendered = task.render_key(key, 0)  # a string argument is quoted: tr:"<key>"
    (acquire,) = _spans(exporter, tracing.ACQUIRE, rendered)
    (release,) = _spans(exporter, tracing.RELEASE, rendered)
    assert _within(acquire, run) and _within(release, run)
    assert dict(acquire.attributes or {}) == {
        tracing.KEY_TEMPLATE: "tr:<key>", tracing.KEY: rendered, tracing.POLICY: "join",
        tracing.OUTCOME: "acquired", tracing.FENCE: fence,
    }
    assert dict(release.attributes or {}) == {
        tracing.KEY_TEMPLATE: "tr:<key>", tracing.KEY: rendered, tracing.POLICY: "join",
        tracing.OUTCOME: "succeeded", tracing.FENCE: fence,
    }
    assert acquire.end_time is not None and release.start_time is not None
    assert acquire.end_time <= release.start_time
    assert _spans(exporter, tracing.DUPLICATE, rendered) == []


@pytest.mark.parametrize(("policy", "outcome"), [("join", "joined"), ("queue", "queued"),
                                                   ("coalesce", "queued"), ("supersede", "superseding"),
                                                   ("skip", "skipped")])
def test_a_duplicate_links_to_the_holders_span(app: Celery, exporter: InMemorySpanExporter,
                                               policy: str, outcome: str) -> None:
    """Given a run holding its key (sent from its own trace), when a duplicate arrives (another
    trace), then the duplicate's acquire span says ``held`` and its decision span, a child of its
    own task span, has the policy's outcome and one link: to the holder's task span (its trace
    id and span id), read from the holder's run record through ACQUIRE's HELD answer."""
    task = app.tasks[f"tr.{policy}"]
    key = uuid.uuid4().hex[:8]
    rendered = task.render_key(key, 0)
    holder = task.delay(key, 1)
    wait_for(lambda: _spans(exporter, tracing.ACQUIRE, rendered))
    dup = task.delay(key, 2)
    decision = wait_for(lambda: _spans(exporter, tracing.DUPLICATE, rendered))[0]
    # the duplicate's deciding run ends before the holder is let go: a parked (or pending) run is
    # sent again under the same task id when the holder releases, and the instrumentation keeps a
    # run's span by task id, so two runs of one id at once would swap their spans
    dup_run = _run_span(exporter, dup.id)
    _gate(key).set()
    first = holder.get(timeout=20)
    ended = dup.get(timeout=20)
    holder_run = _run_span(exporter, holder.id)
    assert holder_run.context is not None and dup_run.context is not None
    assert dup_run.context.trace_id != holder_run.context.trace_id  # two traces: only a link joins them

    assert _within(decision, dup_run)
    attributes = dict(decision.attributes or {})
    assert attributes == {tracing.KEY_TEMPLATE: "tr:<key>", tracing.KEY: rendered, tracing.POLICY: policy,
                          tracing.OUTCOME: outcome, tracing.HOLDER: holder.id}
    (link,) = decision.links
    assert (link.context.trace_id, link.context.span_id) == (holder_run.context.trace_id,
                                                             holder_run.context.span_id)
    held = [span for span in _spans(exporter, tracing.ACQUIRE, rendered)
            if (span.attributes or {}).get(tracing.OUTCOME) == "held"]
    assert len(held) == 1 and _within(held[0], dup_run)
    assert (held[0].attributes or {})[tracing.HOLDER] == holder.id
    if policy == "join":
        assert ended == first
    elif policy == "skip":
        assert ended["singleflight"] == "skipped"
    else:  # the parked (or pending) run was handed the key, and ran after the holder
        assert ended["n"] == 2 and ended["fence"] > first["fence"]


def test_the_trace_context_rides_on_the_acquire_and_comes_back_with_held() -> None:
    """A traced acquire sends its trace context in the same call: an uncontended pair still makes
    2 round trips and at most 8 Redis commands (counted by the server), the record stays a plain
    one (read as text by the next release and acquire), and a duplicate's HELD answer carries the
    holder's context, on one slot (the plain path) and on several (the general path)."""
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    with RedisServer() as server:
        client = server.client(0)
        store = LeaseStore(client, KeyLayout("traced"))
        for i in range(3):  # warm: the scripts are loaded
            got = store.acquire("k", f"w{i}", 10, Holder("warm"), trace=parent)
            assert isinstance(got, Acquired)
            store.release("k", f"w{i}", fence=got.fence)
        before = int(client.info("stats")["total_commands_processed"])
        for i in range(10):
            got = store.acquire("k", f"t{i}", 10, Holder("t"), trace=parent)
            assert isinstance(got, Acquired)
            assert store.release("k", f"t{i}", fence=got.fence).ours
        used = int(client.info("stats")["total_commands_processed"]) - before - 1  # the INFO itself
        assert used <= 80, used
        for slots in (1, 2):
            key = f"held{slots}"
            for i in range(slots):
                assert isinstance(store.acquire(key, f"h{i}", 10, Holder(f"h{i}"), trace=parent, slots=slots),
                                  Acquired)
            raw = client.get(store.layout.run(key))
            assert raw is not None and raw.startswith(PLAIN.encode())  # still a plain run's record
            assert store.record(key).trace == parent
            held = store.acquire(key, "dup", 10, Holder("dup"), slots=slots)
            assert isinstance(held, Held) and held.holder == "h0" and held.trace == parent
        untraced = store.acquire("free", "u", 10, Holder("u"))
        assert isinstance(untraced, Acquired) and "trace" not in store.record("free")
        held = store.acquire("free", "dup", 10, Holder("dup"))
        assert isinstance(held, Held) and held.trace == ""


def test_a_run_records_its_trace_context_only_when_traced(app: Celery,
                                                          exporter: InMemorySpanExporter) -> None:
    """A traced hold() (no Celery span around it) leaves its own acquire span's context in its
    run record; an untraced one (sampling off) leaves none, and makes no span."""
    task = app.tasks["tr.join"]
    key = f"tr:{uuid.uuid4().hex[:8]}"
    with hold(app, key):
        record = task.store.record(key)
    (acquire,) = _spans(exporter, tracing.ACQUIRE, key)
    assert acquire.context is not None and acquire.parent is None
    assert record.trace == tracing.traceparent(acquire.context)
    assert (acquire.attributes or {})[tracing.OUTCOME] == "acquired"

    Switch.on = False
    try:
        other = f"tr:{uuid.uuid4().hex[:8]}"
        with hold(app, other):
            untraced = task.store.record(other)
    finally:
        Switch.on = True
    assert untraced.trace == "" and "trace" not in untraced
    assert _spans(exporter, tracing.ACQUIRE, other) == []


def test_without_a_provider_no_span_is_started(app: Celery, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the API but no SDK (the API's proxy provider), the spans are one shared no-op: no
    tracer is asked for a span, nothing is recorded."""
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)  # as before any provider is set
    monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.ProxyTracerProvider())
    task = app.tasks["tr.join"]
    opts = task.options
    assert tracing.acquire(opts, "k") is tracing.release(opts, "k")
    with tracing.acquire(opts, "k") as span:
        assert span is None
    key = f"tr:{uuid.uuid4().hex[:8]}"
    with hold(app, key):
        assert "trace" not in task.store.record(key)


def test_the_package_works_without_the_opentelemetry_api(redis_server: RedisServer) -> None:
    """In a process where ``opentelemetry`` cannot be imported, the package imports, tracing is
    off, and a hold takes and frees its key."""
    script = textwrap.dedent(f"""
        import sys

        class NoOtel:
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry" or name.startswith("opentelemetry."):
                    raise ImportError(name)
                return None

        sys.meta_path.insert(0, NoOtel())
        from celery import Celery
        from celery_singleflight import hold, tracing

        app = Celery("plain", broker="memory://")
        app.conf.singleflight_redis_url = "{redis_server.url}/2"
        with hold(app, "tr:no-otel") as lease:
            assert lease.fence > 0
        assert tracing.acquire(None, "tr:no-otel").__class__.__name__ == "_Off"
        assert "opentelemetry" not in sys.modules
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=str(ROOT))
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
