"""Counting in this process: the counters and histograms of :mod:`.catalog`, through
``prometheus_client`` (an optional dependency), off until a worker turns it on.

Why the client's multiprocess mode: under the prefork pool a run is counted in a pool process
that may exit at any moment (``--max-tasks-per-child``, a recycled child). Each process writes
its counts to a file of its own in one directory, made by the worker's main process before the
pool forks; the exporter sums the files, and a child's file stays after it exits.

Why counts wait in memory first: every run counts its take and its hold, and a write to the
file (a lock, a process-id check, a pack per value) costs several times a dict update. Counts
are added up here and written at most a second later (:data:`FLUSH_AFTER`), by the next count
or a timer, and at once when the process exits (``worker_process_shutdown`` of a pool process,
``atexit`` of the others): a process killed with SIGKILL loses at most its last second. One
write at a time, whole: an exit's flush waits for a timer's write in flight, and so does a fork.
Off, every call returns at its first line.
"""

from __future__ import annotations

import atexit
import bisect
import os
import threading
import time
from typing import Any

from ..errors import ConfigurationError
from .catalog import BUCKETS, PREFIX, SERIES

__all__ = ["FLUSH_AFTER", "client", "count", "flush", "observe", "recording", "start_recording",
           "stop_recording"]

#: the longest a count waits in memory before it is written where the exporter reads it
FLUSH_AFTER = 1.0

_on = [False]
_families: dict[str, Any] = {}
_lock = threading.Lock()
#: held for a whole write: a flush at exit must not return while a timer's write is half done
#: (the pool kills a process that reported its exit; the timer thread's counts would go with it)
_writing = threading.Lock()
#: (series, labels) -> amount not written yet
_counts: dict[tuple[str, tuple[str, ...]], float] = {}
#: (series, labels) -> observations per bucket (the last: above every bound), then their sum
_observed: dict[tuple[str, tuple[str, ...]], list[float]] = {}


class _Writes:
    """When pending counts were last written, and the timer that will write the next ones."""

    written = 0.0
    timer: threading.Timer | None = None


_writes = _Writes()


def recording() -> bool:
    """True once :func:`start_recording` ran in this process or the one it was forked from."""
    return _on[0]


def client() -> Any:
    """The ``prometheus_client`` module, or a :class:`ConfigurationError` saying how to get it."""
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigurationError("celery_singleflight's metrics need prometheus_client: pip install"
                                 " 'celery-singleflight[metrics]'") from exc
    return prometheus_client


def start_recording(directory: str | None) -> None:
    """Count from now on, in this process and the processes it forks. ``directory``: where each
    process writes its counts (multiprocess mode); None counts in this process's memory."""
    prometheus_client = client()
    from prometheus_client import values

    if directory:
        os.makedirs(directory, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        if not getattr(values.ValueClass, "_multiprocess", False):  # imported before the variable was set
            values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    with _lock:
        _forget()
        for series in SERIES:
            if series.kind == "counter":
                _families[series.name] = prometheus_client.Counter(
                    PREFIX + series.name, series.help, series.labels, registry=None)
            elif series.kind == "histogram":
                _families[series.name] = prometheus_client.Histogram(
                    PREFIX + series.name, series.help, series.labels, registry=None, buckets=BUCKETS)
        _on[0] = True
    atexit.unregister(flush)  # once, however often recording starts
    atexit.register(flush)


def stop_recording() -> None:
    """Write what is pending and stop counting in this process (tests)."""
    flush()
    with _lock:
        _on[0] = False
        _forget()
        _families.clear()


def count(name: str, *labels: str, amount: float = 1.0) -> None:
    """Add ``amount`` to the counter ``name`` (of :mod:`.catalog`) for ``labels``, in order."""
    if not _on[0]:
        return
    key = (name, labels)
    with _lock:
        _counts[key] = _counts.get(key, 0.0) + amount
    _written_soon()


def observe(name: str, value: float, *labels: str) -> None:
    """Observe ``value`` (seconds) in the histogram ``name`` for ``labels``."""
    if not _on[0]:
        return
    key = (name, labels)
    value = max(0.0, value)
    with _lock:
        seen = _observed.get(key)
        if seen is None:
            seen = _observed[key] = [0.0] * (len(BUCKETS) + 2)
        seen[bisect.bisect_left(BUCKETS, value)] += 1
        seen[-1] += value
    _written_soon()


def flush() -> None:
    """Write every pending count where the exporter reads it (this process's file); returns
    once every count taken so far is written, also those another thread's flush is writing."""
    with _writing:
        _write()


def _write() -> None:
    with _lock:
        counts, observed = dict(_counts), {k: list(v) for k, v in _observed.items()}
        _counts.clear()
        _observed.clear()
        _writes.written = time.monotonic()
        families = dict(_families)
    for (name, labels), amount in counts.items():
        family = families.get(name)
        if family is not None:
            (family.labels(*labels) if labels else family).inc(amount)
    for (name, labels), seen in observed.items():
        family = families.get(name)
        if family is None:
            continue
        child = family.labels(*labels) if labels else family
        # the histogram's own per-bucket values (prometheus_client keeps the counts per bucket,
        # not cumulated): one write per bucket that saw values instead of two per observation
        for bucket, hits in zip(child._buckets, seen[:-1], strict=True):
            if hits:
                bucket.inc(hits)
        child._sum.inc(seen[-1])


def _written_soon() -> None:
    """Write now if the last write is a second old, else make sure a timer will."""
    if time.monotonic() - _writes.written >= FLUSH_AFTER:
        flush()
    elif _writes.timer is None:
        with _lock:
            if _writes.timer is None:
                timer = threading.Timer(FLUSH_AFTER, _timed_flush)
                timer.daemon = True
                _writes.timer = timer
                timer.start()


def _timed_flush() -> None:
    with _lock:
        _writes.timer = None
    flush()


def _forget() -> None:
    """Drop what is pending (also in a forked process: its parent writes what it counted)."""
    _counts.clear()
    _observed.clear()
    _writes.timer = None
    _writes.written = time.monotonic()


_fork_waited = [False]


def _before_fork() -> None:
    # no fork in the middle of a write: the client's own lock, taken inside it, would stay held
    # in the child, and the child's first count would wait on it for ever (bounded: a fork from
    # a signal handler that interrupted this thread's own write must not wait on itself)
    _fork_waited[0] = _writing.acquire(timeout=2.0)


def _after_fork_in_parent() -> None:
    if _fork_waited[0]:
        _writing.release()


def _after_fork_in_child() -> None:
    global _lock, _writing
    _lock = threading.Lock()  # another thread of the parent may have held them at the fork
    _writing = threading.Lock()
    _forget()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
