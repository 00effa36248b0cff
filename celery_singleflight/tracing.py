"""OpenTelemetry spans around a run's lease: its acquire, the duplicate decision, its release.

Optional: without ``opentelemetry-api`` (the ``otel`` extra), or with it but no tracer provider
set (no SDK configured), each call here returns at once, no span is made, nothing is written to
Redis. With a provider, a guarded run (a task, a fair gate's slot, a ``hold()``) makes, under
the current span (the Celery task's own with ``opentelemetry-instrumentation-celery``):

- ``singleflight.acquire``: the take of the lease (one round trip);
- ``singleflight.duplicate``: when every slot is held, the duplicate policy's decision, with a
  link to the holder's span;
- ``singleflight.release``: the release, and the settling of what it hands on.

Their attributes (:data:`KEY_TEMPLATE`, :data:`KEY`, :data:`POLICY`, :data:`OUTCOME`,
:data:`FENCE`, :data:`HOLDER`) are built only for a span that records.

**The link.** A run whose acquire span records sends its trace context with the acquire: the
span current at the take (the Celery task's), or the acquire span when there is none, as a W3C
``traceparent``. ACQUIRE keeps it in the run record (``trace``) and answers a duplicate's
acquire with it (``Held.trace``), so the duplicate's decision span links to the holder's span,
whichever process or trace the holder runs in.
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar, Token
from importlib import metadata
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from .protocol.controls import Paused
from .protocol.replies import Acquired, Held, Settlement

try:  # the ``otel`` extra
    from opentelemetry import context as otel_context
    from opentelemetry import trace as otel_trace

    _API = True
except ImportError:  # pragma: no cover - tracing is off without it
    _API = False

#: whether "no provider set yet" can be read from the API's global itself (about 20 times
#: cheaper than ``get_tracer_provider()``, which reads the environment on each call): a run
#: asks on each acquire and release, and a provider may be set at any time (in
#: ``worker_process_init``, say); else, or with a provider named in the environment, it asks
_PROVIDER_GLOBAL = _API and hasattr(otel_trace, "_TRACER_PROVIDER") \
    and "OTEL_PYTHON_TRACER_PROVIDER" not in os.environ

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

__all__ = [
    # span names
    "ACQUIRE", "DUPLICATE", "RELEASE",
    # attributes
    "FENCE", "HANDED_ON", "HOLDER", "JOINED", "KEY", "KEY_TEMPLATE", "OUTCOME", "POLICY",
    # spans
    "Traced", "acquire", "decided", "duplicate", "release", "traceparent",
]

# -- span names
ACQUIRE = "singleflight.acquire"
DUPLICATE = "singleflight.duplicate"
RELEASE = "singleflight.release"

# -- attributes
#: the task's ``lock_key`` as declared (a template, or the qualified name of a key function)
KEY_TEMPLATE = "singleflight.key_template"
#: the key as rendered for this run (a span's attribute only: never a metric's label)
KEY = "singleflight.key"
#: the task's ``on_duplicate`` (on a duplicate span: the policy applied, e.g. ``redelivery``)
POLICY = "singleflight.policy"
#: acquire: ``acquired``, ``held``, ``handed-on``, ``paused``, ``copy``; duplicate: the code the
#: policy reports (``skipped``, ``queued``, ``joined``, ...; ``again`` when the key was free);
#: release: the run's outcome (``succeeded``, ``failed``, ``retried``, ``lost``, ...)
OUTCOME = "singleflight.outcome"
#: the run's fencing token (acquire, release)
FENCE = "singleflight.fence"
#: the holder's task id (acquire when held, duplicate)
HOLDER = "singleflight.holder"
#: release: the parked run handed the key, and how many joined runs were answered
HANDED_ON = "singleflight.handed_on"
JOINED = "singleflight.joined"

_SCOPE = "celery_singleflight"
#: what ends a run on purpose: not an error of the span it leaves
_EXPECTED: tuple[type[BaseException], ...] = (Ignore, Retry, Reject)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
#: the duplicate span of the decision being made in this context (for :func:`decided`)
_deciding: ContextVar[Traced | None] = ContextVar("singleflight_deciding", default=None)
_tracer_of: list[Any] = [None, None]  # [provider, its tracer]


def _version() -> str:
    try:
        return metadata.version("celery-singleflight")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return ""


def _tracer() -> Tracer | None:
    """The tracer of the global provider; None when tracing is off (no API, or no provider set:
    the API's proxy, which makes only spans that do not record)."""
    if not _API or (_PROVIDER_GLOBAL and otel_trace._TRACER_PROVIDER is None):
        return None
    provider = otel_trace.get_tracer_provider()
    if isinstance(provider, (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)):
        return None
    cached = _tracer_of
    if cached[0] is not provider:
        cached[1] = provider.get_tracer(_SCOPE, _version())
        cached[0] = provider
    return cached[1]  # type: ignore[no-any-return]


def traceparent(context: Any) -> str:
    """A span context as a W3C ``traceparent`` ('' for an invalid one)."""
    if not context.is_valid:
        return ""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def _link(parent: str) -> list[Any]:
    """The link to the span ``parent`` (a traceparent) names; none for '' or a malformed one."""
    found = _TRACEPARENT.fullmatch(parent) if parent else None
    if found is None:
        return []
    trace_id, span_id, flags = (int(part, 16) for part in found.groups())
    if not (trace_id and span_id):
        return []
    flagged = otel_trace.TraceFlags(flags)
    context = otel_trace.SpanContext(trace_id, span_id, is_remote=True, trace_flags=flagged)
    return [otel_trace.Link(context, {"singleflight.link": "holder"})]


def _template(spec: Any) -> str:
    if spec is None or isinstance(spec, str):
        return spec or ""
    name = getattr(spec, "__qualname__", None) or type(spec).__qualname__
    return f"{getattr(spec, '__module__', '') or ''}.{name}".lstrip(".")


class Traced:
    """A recording span of this module, current while its ``with`` block runs."""

    __slots__ = ("_context", "_decision", "holder_context", "span")

    def __init__(self, span: Span) -> None:
        self.span = span
        #: the trace context the holder leaves for its duplicates' links (acquire)
        self.holder_context = ""
        self._context: Any = None  # the token that detaches its context
        self._decision: Token[Traced | None] | None = None

    def outcome(self, outcome: str, **more: Any) -> None:
        """Set the outcome (and ``more`` attributes: ``fence``, ``holder``)."""
        self.span.set_attribute(OUTCOME, outcome)
        for name, value in more.items():
            if value is not None and value != "":
                self.span.set_attribute(f"singleflight.{name}", value)

    def took(self, got: Acquired | Held) -> None:
        """The acquire's answer."""
        if isinstance(got, Acquired):
            self.outcome("acquired", fence=got.fence)
        elif got.copy:
            self.outcome("copy")
        elif got.handoff is not None:
            self.outcome("handed-on", holder=got.holder)
        elif isinstance(got, Paused):
            self.outcome("paused")
        else:
            self.outcome("held", holder=got.holder)

    def released(self, outcome: str, fence: int, settlement: Settlement) -> None:
        """The release's outcome, and what it handed on."""
        self.outcome(outcome, fence=fence)
        if settlement.handoff is not None:
            self.span.set_attribute(HANDED_ON, True)
        if settlement.joined:
            self.span.set_attribute(JOINED, len(settlement.joined))

    def failed(self, error: BaseException) -> None:
        """The span's work failed with ``error`` (caught: the run goes on)."""
        self.span.record_exception(error)
        status = otel_trace.Status(otel_trace.StatusCode.ERROR, f"{type(error).__name__}: {error}")
        self.span.set_status(status)


class _Scope:
    """Starts a span on ``with``: yields a :class:`Traced` if it records, else None."""

    __slots__ = ("expected", "held", "key", "name", "options", "traced", "tracer")

    def __init__(self, tracer: Tracer, name: str, options: Any, key: str, held: Held | None = None,
                 expected: tuple[type[BaseException], ...] = ()) -> None:
        self.tracer, self.name, self.options, self.key = tracer, name, options, key
        self.held, self.expected = held, expected
        self.traced: Traced | None = None

    def __enter__(self) -> Traced | None:
        parent = otel_trace.get_current_span()
        held = self.held
        span = self.tracer.start_span(self.name, links=_link(held.trace) if held is not None else None)
        if not span.is_recording():
            span.end()
            return None
        traced = self.traced = Traced(span)
        opts = self.options
        attributes = {KEY: self.key}
        template = _template(getattr(opts, "lock_key", None))
        if template:
            attributes[KEY_TEMPLATE] = template
        policy = getattr(opts, "on_duplicate", None)
        if policy:
            attributes[POLICY] = str(policy)
        if held is not None and held.holder:
            attributes[HOLDER] = held.holder
        span.set_attributes(attributes)
        if self.name == ACQUIRE:
            traced.holder_context = traceparent(parent.get_span_context()) \
                or traceparent(span.get_span_context())
        elif self.name == DUPLICATE:
            traced._decision = _deciding.set(traced)
        traced._context = otel_context.attach(otel_trace.set_span_in_context(span))
        return traced

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: Any) -> None:
        traced = self.traced
        if traced is None:
            return
        if error is not None and not isinstance(error, (*_EXPECTED, *self.expected)):
            traced.failed(error)
        otel_context.detach(traced._context)
        if traced._decision is not None:
            _deciding.reset(traced._decision)
        traced.span.end()


class _Off:
    """The ``with`` of tracing that is off: yields None, costs two calls."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


def acquire(options: Any, key: str) -> _Scope | _Off:
    """The span of one acquire of ``key`` (``options``: the task's, or a hold's)."""
    tracer = _tracer()
    return _OFF if tracer is None else _Scope(tracer, ACQUIRE, options, key)


def duplicate(options: Any, key: str, held: Held,
              expected: tuple[type[BaseException], ...] = ()) -> _Scope | _Off:
    """The span of a duplicate's decision, linked to the holder's span (``held.trace``).
    ``expected``: the errors the policies end a run with (``LockHeld``, ...): not the span's."""
    tracer = _tracer()
    return _OFF if tracer is None else _Scope(tracer, DUPLICATE, options, key, held, expected)


def release(options: Any, key: str) -> _Scope | _Off:
    """The span of a run's release and settle."""
    tracer = _tracer()
    return _OFF if tracer is None else _Scope(tracer, RELEASE, options, key)


def decided(policy: str, outcome: str) -> None:
    """The duplicate policy ``policy`` decided ``outcome`` (the stable code it reports): set on
    the duplicate span being made, if any."""
    traced = _deciding.get()
    if traced is not None:
        traced.span.set_attribute(POLICY, policy)
        traced.outcome(outcome)
