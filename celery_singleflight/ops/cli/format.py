"""How the CLI prints statuses, events and durations (plain text; ``watch`` may use rich)."""

from __future__ import annotations

import datetime as dt
import getpass
import json
import os
import socket
import time
from collections.abc import Iterable
from typing import Any

from ...ops.keystatus import KeyStatus, WatchEvent
from ...ops.timestatus import TimeStatus
from ...protocol.fair import Waiter

__all__ = ["duration", "event_line", "holder_text", "json_text", "progress_text", "released_by",
           "status_lines", "status_table", "time_lines", "when", "where_text"]



def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def progress_text(current: float | None, total: float | None, percent: float | None) -> str:
    """``3/10 30%``, ``3`` without a total, ``-`` without progress."""
    if current is None:
        return "-"
    text = _number(current)
    if total is not None:
        text += f"/{_number(total)}"
    if percent is not None:
        text += f" {percent:.0f}%"
    return text


def duration(seconds: float | None) -> str:
    """A short duration: ``4.2s``, ``3m05s``, ``2h07m``, ``3d04h``; ``-`` if unknown."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def when(ts: float | None, now: float | None = None) -> str:
    """An epoch time as local ISO 8601 plus how long ago (or from now) it is."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    iso = dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")
    delta = now - ts
    rel = f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"
    return f"{iso} ({rel})"


def _short(task_id: str | None) -> str:
    return task_id[:8] if task_id else "-"


def json_text(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(value, indent=indent, default=str, ensure_ascii=False)


def status_table(rows: Iterable[KeyStatus]) -> list[str]:
    """The ``ls`` table: one aligned line per held key (per held slot), under a header.

    A SLOT column follows KEY when a row's slot is not 0 (a ``max_concurrency`` > 1 key).
    """
    rows = list(rows)
    slots = any(st.slot for st in rows)
    header: tuple[str, ...] = ("KEY", "TASK ID", "TASK", "STATE", "PROGRESS", "AGE", "TTL")
    if slots:
        header = ("KEY", "SLOT", *header[1:])
    lines = [header]
    for st in rows:
        slot = (str(st.slot),) if slots else ()
        lines.append((
            st.key, *slot, _short(st.task_id), st.task_name or "-", st.state,
            progress_text(st.current, st.total, st.percent), duration(st.age), duration(st.ttl_left),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]


def status_lines(st: KeyStatus, now: float | None = None, slot: bool | None = None) -> list[str]:
    """Every field of a :class:`KeyStatus`, one ``name: value`` line each.

    The ``slot`` line is shown when ``slot`` is true, or (by default) when the slot is not 0.
    """
    held = "yes" if st.held else f"no (the run ended: {st.outcome or st.state})"
    pid = "-" if st.pid is None else str(st.pid)
    rows: list[tuple[str, str]] = [("key", st.key)]
    if slot or (slot is None and st.slot):
        rows.append(("slot", str(st.slot)))
    rows += [
        ("held", held),
        ("state", st.state),
        ("outcome", st.outcome or "-"),
        ("task id", st.task_id or "-"),
        ("task name", st.task_name or "-"),
        ("worker", st.worker or "-"),
        ("host / pid", f"{st.host or '-'} / {pid}"),
        ("fence", "-" if st.fence is None else str(st.fence)),
        ("progress", progress_text(st.current, st.total, st.percent)),
        ("message", st.message if st.message is not None else "-"),
        ("fields", json_text(st.fields, indent=None) if st.fields else "-"),
        ("started", when(st.started, now)),
        ("updated", when(st.updated, now)),
        ("ended", when(st.ended, now)),
        ("age", duration(st.age)),
        ("ttl left", duration(st.ttl_left)),
        ("queued", str(st.queued)),
        ("released by", st.released_by or "-"),
        ("args", "-" if st.args is None else json_text(st.args, indent=None)),
        ("previous", "-" if st.previous_task_id is None
         else f"{st.previous_task_id} ({st.previous_outcome or '?'})"),
    ]
    shown = {"key", "held", "state", "outcome", "task_id", "task_name", "worker", "host", "pid", "fence",
             "current", "total", "percent", "message", "fields", "started", "updated", "ended", "age",
             "ttl_left", "queued", "released_by", "args", "slot", "previous_task_id", "previous_outcome"}
    for name, value in st.as_dict().items():  # the fields a feature adds, shown only when set
        if name not in shown and value is not None:
            shown_value = value if isinstance(value, str) else json_text(value, indent=None)
            rows.append((name.replace("_", " "), shown_value))
    width = max(len(name) for name, _ in rows) + 1
    return [f"{(name + ':').ljust(width)} {value}" for name, value in rows]


def time_lines(ts: TimeStatus, now: float | None = None) -> list[str]:
    """The ``show`` lines of a key's time policies: its open debounce burst and its rate state."""
    return ts.lines(lambda at: when(at, now))


def event_line(event: WatchEvent) -> str:
    """One plain-text line for a watch event."""
    stamp = "--:--:--.---"
    if event.ts is not None:
        stamp = dt.datetime.fromtimestamp(event.ts).strftime("%H:%M:%S.%f")[:-3]
    if event.kind == "end":
        by = event.fields.get("by")
        return f"{stamp} end {event.state}" + (f" by {by}" if by else "")
    parts = [stamp, event.kind, event.state or "-", progress_text(event.current, event.total, event.percent)]
    if event.message:
        parts.append(event.message)
    return " ".join(parts)


def holder_text(st: KeyStatus) -> str:
    """Who holds a key, in one line."""
    where = " ".join(p for p in (st.worker, f"pid {st.pid}" if st.pid else None) if p)
    return (
        f"{where_text(st.key, st.slot)} is held by task {st.task_id or '<unknown>'}"
        + f" ({st.task_name or 'unknown task'})"
        + (f" on {where}" if where else "")
        + f", {st.state} {progress_text(st.current, st.total, st.percent)}"
        + f", for {duration(st.age)}, lease left {duration(st.ttl_left)}"
    )


def where_text(key: str, slot: int | None) -> str:
    """``key K``, or ``key K (slot N)`` for a slot other than 0."""
    return f"key {key}" + (f" (slot {slot})" if slot else "")


def released_by() -> str:
    """``user@host (celery singleflight release)``, recorded with a force-release."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (e.g. an arbitrary container uid)
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()} (celery singleflight release)"


def waiting_lines(waiting: list[Waiter]) -> list[str]:
    """The ``show`` lines of the runs waiting for a key (a fair gate's or a ``queue`` key's)."""
    if not waiting:
        return []
    lines = [f"waiting: {len(waiting)}{'+' if len(waiting) >= 20 else ''} (position, task id, fair key, ETA)"]
    for w in waiting:
        eta = "unknown" if w.eta is None else f"in {w.eta:.1f}s"
        lines.append(f"  {w.position}. {w.task_id}" + (f" [{w.fair_key}]" if w.fair_key else "") + f" {eta}")
    return lines
