"""What a status read answers: :class:`KeyStatus` (who holds a key, how far along it is, how its
last run ended) built from a run record, and :class:`WatchEvent` (one step of a run, read from its
history stream)."""

from __future__ import annotations

import json
import re
import time as mod_time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from ..protocol.record import RunRecord

__all__ = ["KeyStatus", "WatchEvent", "combine", "event_of", "glob_escape", "run_events"]

_TERMINAL_KINDS = ("end",)


def _text(raw: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
        for k, v in raw.items()
    }


def _seconds(ms: int | None) -> float | None:
    return None if not ms else ms / 1000.0


@dataclass(frozen=True)
class KeyStatus:
    """What is known about one key: its holder (if held) and the latest status of its run."""

    key: str
    held: bool
    state: str  # "running" while held without progress; the outcome once ended
    task_id: str | None = None
    task_name: str | None = None
    worker: str | None = None
    host: str | None = None
    pid: int | None = None
    fence: int | None = None
    current: float | None = None
    total: float | None = None
    percent: float | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    started: float | None = None  # epoch seconds
    updated: float | None = None
    ended: float | None = None
    outcome: str | None = None
    ttl_left: float | None = None  # seconds of lease left, while held
    queued: int = 0
    duplicates: int = 0  # duplicates that arrived while this run held the key
    released_by: str | None = None
    args: Any = None  # only when the task opts in (status_include_args)
    slot: int = 0  # which of the key's max_concurrency slots this run holds (0 for most keys)
    previous_task_id: str | None = None  # the run on this slot before this one
    previous_outcome: str | None = None  # how it ended (succeeded, failed, revoked, expired, ...)
    superseded_by: str | None = None  # on_duplicate="supersede": the newest run that took over this one

    @property
    def age(self) -> float | None:
        """Seconds since the run started."""
        return None if self.started is None else max(0.0, mod_time.time() - self.started)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["age"] = self.age
        return out


@dataclass(frozen=True)
class WatchEvent:
    """One step of a run as a watcher sees it: ``progress`` updates, then one ``end``."""

    kind: str  # "progress", "duplicate" (another run was turned away) or "end"
    state: str
    fence: int | None
    ts: float | None
    current: float | None = None
    total: float | None = None
    percent: float | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    id: str = ""

    @property
    def final(self) -> bool:
        return self.kind in _TERMINAL_KINDS

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def combine(key: str, record: RunRecord, now_ms: int, queued: int = 0, slot: int = 0) -> KeyStatus | None:
    """The status of one slot from its run record, at server time ``now_ms``."""
    if not record and not queued:
        return None
    deadline = record.deadline or 0
    is_held = bool(record.token) and deadline > now_ms
    ran_out = bool(record.token) and not is_held
    state = record.state or ("running" if is_held else "unknown")
    if record.reserved:
        state = "handing-off"  # reserved for the next parked run, which has not started yet
    progress = record.progress or {}
    current, total = progress.get("current"), progress.get("total")
    percent = round(100.0 * current / total, 2) if current is not None and total else None
    outcome = None if is_held else (record.outcome or ("expired" if ran_out else None))
    return KeyStatus(
        key=key,
        held=is_held,
        state=state,
        task_id=record.task_id or None,
        task_name=record.task_name or None,
        worker=record.worker or None,
        host=record.host or None,
        pid=record.pid or None,
        fence=record.fence or None,
        current=current,
        total=total,
        percent=percent,
        message=progress.get("message"),
        fields=progress.get("fields") or {},
        started=_seconds(record.since),
        updated=_seconds(record.updated),
        ended=None if is_held else _seconds(record.ended),
        outcome=outcome,
        ttl_left=(deadline - now_ms) / 1000.0 if is_held else None,
        queued=queued,
        duplicates=record.duplicates or 0,
        released_by=record.released_by or None,
        args=record.args,
        slot=slot,
        previous_task_id=record.prev_task_id or None,
        previous_outcome=record.prev_outcome or None,
        superseded_by=record.sup_by or None,
    )


def event_of(entry_id: Any, raw: dict[Any, Any]) -> WatchEvent:
    """A watch event from a history stream entry."""
    data = _text(raw)
    fence = int(data["fence"]) if data.get("fence") else None
    ts = _seconds(int(data["ts"])) if data.get("ts") else None
    eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    if data.get("kind") == "progress":
        body = json.loads(data.get("data") or "{}")
        return WatchEvent(
            kind="progress", state=body.get("state", ""), fence=fence, ts=ts,
            current=body.get("current"), total=body.get("total"), percent=body.get("percent"),
            message=body.get("message"), fields=body.get("fields") or {}, id=eid,
        )
    fields = {name: data[name] for name in ("by", "task_id") if data.get(name)}
    kind = "duplicate" if data.get("kind") == "duplicate" else "end"
    return WatchEvent(kind=kind, state=data.get("state", ""), fence=fence, ts=ts, fields=fields, id=eid)


def run_events(entries: Any, fence: int | None, cursor: list[str]) -> Iterator[WatchEvent]:
    """The events of the run with ``fence`` among stream ``entries``; ``cursor[0]`` advances past
    every entry read (other runs' too), so the next XREAD starts after them."""
    for entry_id, raw in entries:
        event = event_of(entry_id, raw)
        cursor[0] = event.id
        if event.fence == fence:
            yield event


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
