"""Who holds a key and how far along it is, readable from any process.

    from celery_singleflight import status, watch, held

    st = status(app, "sync:42")          # KeyStatus, or None if nothing is known of the key
    for event in watch(app, "sync:42"):  # replays the run's history, then follows it live
        print(event.state, event.percent)
    for st in held(app, prefix="sync:"):  # every held key of the app's namespace
        ...

A read is one round trip (a pipeline of HGETALL lease, PTTL lease, HGETALL status). Watching
replays the run's history stream and then blocks on it with ``XREAD`` from the last entry seen, so
nothing between "read" and "subscribe" is missed; it ends with the run. Listing uses ``SCAN``
over the namespace's lease keys, never ``KEYS`` (see docs/status.md for why not an index).
"""

from __future__ import annotations

import json
import logging
import re
import time as mod_time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from . import signals
from .keys import stored_key
from .lease import LeaseStore
from .settings import Options, resolve_options

__all__ = ["KeyStatus", "StatusReader", "WatchEvent", "force_release", "held", "reader", "status", "watch"]

log = logging.getLogger("celery_singleflight.release")
_TERMINAL_KINDS = ("end",)


def _text(raw: dict[Any, Any]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
        for k, v in raw.items()
    }


def _num(value: str | None) -> float | None:
    if value in (None, ""):
        return None
    number = float(json.loads(value))
    return int(number) if number.is_integer() else number


def _ms_to_s(value: str | None) -> float | None:
    return None if not value else int(value) / 1000.0


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


def _combine(
    key: str, lease: dict[str, str], pttl: int, st: dict[str, str], queued: int = 0
) -> KeyStatus | None:
    if not lease and not st and not queued:
        return None
    is_held = bool(lease)
    same_run = bool(st) and (not is_held or st.get("fence") == lease.get("fence"))
    run = st if same_run else {}
    holder = lease if is_held else st
    state = run.get("state") or ("running" if is_held else "unknown")
    if lease.get("reserved") == "1":
        state = "handing-off"  # reserved for the next parked run, which has not started yet
    current, total = _num(run.get("current")), _num(run.get("total"))
    percent = round(100.0 * current / total, 2) if current is not None and total else None
    pid = holder.get("pid")
    fence = holder.get("fence")
    return KeyStatus(
        key=key,
        held=is_held,
        state=state,
        task_id=holder.get("task_id") or None,
        task_name=holder.get("task_name") or None,
        worker=holder.get("worker") or None,
        host=holder.get("host") or None,
        pid=int(pid) if pid else None,
        fence=int(fence) if fence else None,
        current=current,
        total=total,
        percent=percent,
        message=run.get("message"),
        fields=json.loads(run["fields"]) if run.get("fields") else {},
        started=_ms_to_s(holder.get("since") if is_held else holder.get("started")),
        updated=_ms_to_s(run.get("updated")),
        ended=None if is_held else _ms_to_s(run.get("ended")),
        outcome=None if is_held else run.get("outcome"),
        ttl_left=max(0, pttl) / 1000.0 if is_held else None,
        queued=queued,
        duplicates=int(run.get("duplicates") or 0),
        released_by=run.get("released_by"),
        args=json.loads(run["args"]) if run.get("args") else None,
    )


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _event(entry_id: Any, raw: dict[Any, Any]) -> WatchEvent:
    data = _text(raw)
    fence = int(data["fence"]) if data.get("fence") else None
    ts = _ms_to_s(data.get("ts"))
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


def _run_events(entries: Any, fence: int | None, cursor: list[str]) -> Iterator[WatchEvent]:
    """The events of the run with ``fence`` among stream ``entries``; ``cursor[0]`` advances past
    every entry read (other runs' too), so the next XREAD starts after them."""
    for entry_id, raw in entries:
        event = _event(entry_id, raw)
        cursor[0] = event.id
        if event.fence == fence:
            yield event


class StatusReader:
    """Read, list, watch and force-release the keys of one namespace."""

    def __init__(self, store: LeaseStore) -> None:
        self.store = store
        self.client = store.client

    def read(self, key: str) -> KeyStatus | None:
        """The status of ``key`` in one round trip; None if nothing is known about it."""
        key = stored_key(key)
        pipe = self.client.pipeline(transaction=False)
        pipe.hgetall(self.store.lease_key(key))
        pipe.pttl(self.store.lease_key(key))
        pipe.hgetall(self.store.status_key(key))
        pipe.llen(self.store.queue_key(key))
        lease, pttl, st, queued = pipe.execute()
        return _combine(key, _text(lease), int(pttl), _text(st), int(queued))

    def held(self, prefix: str = "", count: int = 1000) -> list[KeyStatus]:
        """Every held key whose user key starts with ``prefix``, found with SCAN (never KEYS)."""
        escaped = self.store.layout.redis_key(prefix, "lease")
        head = escaped[: -len("}:lease")]
        pattern = _glob_escape(head) + "*}:lease"
        keys: list[str] = []
        for raw in self.client.scan_iter(match=pattern, count=count, _type="hash"):
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            user_key = self.store.layout.user_key(name)
            if user_key is not None and user_key.startswith(prefix):
                keys.append(user_key)
        out: list[KeyStatus] = []
        for start in range(0, len(keys), 200):
            batch = keys[start : start + 200]
            pipe = self.client.pipeline(transaction=False)
            for key in batch:
                pipe.hgetall(self.store.lease_key(key))
                pipe.pttl(self.store.lease_key(key))
                pipe.hgetall(self.store.status_key(key))
                pipe.llen(self.store.queue_key(key))
            replies = pipe.execute()
            for i, key in enumerate(batch):
                lease, pttl, st, queued = replies[4 * i : 4 * i + 4]
                found = _combine(key, _text(lease), int(pttl), _text(st), int(queued))
                if found is not None and found.held:
                    out.append(found)
        return sorted(out, key=lambda s: s.key)

    def watch(
        self, key: str, timeout: float | None = None, poll: float = 0.5
    ) -> Iterator[WatchEvent]:
        """Yield the run's updates as they happen (history first), ending with its ``end`` event.

        Follows the run that holds ``key`` now (or the last one, if it already ended). Stops after
        ``timeout`` seconds if given. Yields nothing if nothing is known about the key.
        """
        key = stored_key(key)
        snapshot = self.read(key)
        if snapshot is None:
            return
        fence = snapshot.fence
        stream = self.store.history_key(key)
        deadline = None if timeout is None else mod_time.monotonic() + timeout
        cursor = ["0-0"]
        history: list[Any] = self.client.xrange(stream, min="-", max="+")  # type: ignore[assignment]
        for event in _run_events(history, fence, cursor):
            yield event
            if event.final:
                return
        if not snapshot.held:
            yield WatchEvent(kind="end", state=snapshot.outcome or snapshot.state, fence=fence,
                             ts=snapshot.ended)
            return
        while deadline is None or mod_time.monotonic() < deadline:
            block = poll if deadline is None else max(0.001, min(poll, deadline - mod_time.monotonic()))
            reply: Any = self.client.xread({stream: cursor[0]}, block=max(1, int(block * 1000)), count=100)
            streams = reply.items() if isinstance(reply, dict) else (reply or [])  # RESP3 / RESP2
            for _, entries in streams:
                for event in _run_events(entries, fence, cursor):
                    yield event
                    if event.final:
                        return
            if not reply:
                now = self.read(key)
                if now is None or not now.held or now.fence != fence:
                    # ended without a history entry (it never reported progress, or expired)
                    ended = now if now is not None and now.fence == fence else None
                    state = ended.outcome or ended.state if ended is not None else "expired"
                    yield WatchEvent(kind="end", state=state, fence=fence,
                                     ts=ended.ended if ended is not None else mod_time.time())
                    return

    def force_release(self, key: str, by: str, expected_holder: str = "") -> str | None:
        """Free ``key`` whoever holds it; returns the released task id (None if not held).

        Logged at WARNING with who asked, and signalled (``lease_force_released``). The holder's
        heartbeat then reports its lease lost.
        """
        key = stored_key(key)
        released = self.store.force_release(key, by, expected_holder)
        if released is None:
            return None
        task_id, fence = released
        log.warning("force-released key=%r held by task %s (fence %s), by %s", key, task_id, fence, by)
        signals.lease_force_released.send(sender=None, key=key, task_id=task_id, fence=fence, by=by)
        return task_id


class _AppDefaults:
    """Stands in for a task when resolving an app's settings (no per-task values)."""

    name = "app"


_readers: dict[tuple[int, int], StatusReader] = {}


def app_options(app: Any) -> Options:
    return resolve_options(_AppDefaults, app.conf)


def reader(app: Any) -> StatusReader:
    """The status reader for ``app``'s Redis and namespace."""
    from .task import store_for

    opts = app_options(app)
    store = store_for(opts.redis_url, opts.namespace, opts.status_retention, opts.history_length)
    cache_key = (id(app), id(store))
    found = _readers.get(cache_key)
    if found is None or found.store is not store:
        found = _readers[cache_key] = StatusReader(store)
    return found


def status(app: Any, key: str) -> KeyStatus | None:
    """Who holds ``key`` and how far along it is (None if nothing is known about it)."""
    return reader(app).read(key)


def held(app: Any, prefix: str = "") -> list[KeyStatus]:
    """The held keys of ``app``'s namespace whose key starts with ``prefix``."""
    return reader(app).held(prefix)


def watch(app: Any, key: str, timeout: float | None = None) -> Iterator[WatchEvent]:
    """Follow the run on ``key`` live until it ends (see :meth:`StatusReader.watch`)."""
    return reader(app).watch(key, timeout=timeout)


def force_release(app: Any, key: str, by: str, expected_holder: str = "") -> str | None:
    """Free ``key`` whoever holds it, recording ``by``; returns the released task id or None."""
    return reader(app).force_release(key, by, expected_holder)
