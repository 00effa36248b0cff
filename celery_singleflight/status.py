"""Who holds a key and how far along it is, readable from any process.

    from celery_singleflight import status, watch, held

    st = status(app, "sync:42")          # KeyStatus, or None if nothing is known of the key
    for event in watch(app, "sync:42"):  # replays the run's history, then follows it live
        print(event.state, event.percent)
    for st in held(app, prefix="sync:"):  # every held run of the app's namespace
        ...
    for st in status_all(app, "sync:42"):  # every held slot of a max_concurrency > 1 key
        ...

A read is one round trip (a pipeline of the server's ``TIME``, the slot's run record and the
queue's length). Watching replays the run's history stream and then blocks on it with ``XREAD``
from the last entry seen, so nothing between "read" and "subscribe" is missed; it ends with the
run. Listing uses ``SCAN`` over the namespace's run records, never ``KEYS`` (see docs/status.md
for why not an index).

A key with ``max_concurrency=N`` > 1 has one run record per slot (``run``, ``run1`` ...
``run{N-1}``), each with its own history. ``held()`` lists one :class:`KeyStatus` per held slot
(``slot`` says which); ``read(key)`` reads slot 0 (``read(key, slot=2)`` another),
``read_all(key)`` every held slot.
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
from .cluster import clocks_ms
from .errors import LeaseLost
from .keys import stored_key
from .registry import known_slots
from .settings import app_options
from .settle import Ending, settle
from .store import LeaseStore, store_for

__all__ = [
    "KeyStatus",
    "StatusReader",
    "WatchEvent",
    "force_release",
    "held",
    "reader",
    "status",
    "status_all",
    "watch",
]

log = logging.getLogger("celery_singleflight.release")
_TERMINAL_KINDS = ("end",)
#: the part of a run record's Redis key: ``run`` (slot 0) or ``run<slot>`` (slot >= 1, no leading 0)
_RUN_PART = re.compile(r"run(?:[1-9][0-9]*)?")
_BATCH = 200


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


def _combine(
    key: str, record: dict[str, Any], now_ms: int, queued: int = 0, slot: int = 0
) -> KeyStatus | None:
    """The status of one slot from its run record, at server time ``now_ms``."""
    if not record and not queued:
        return None
    token = record.get("token")
    deadline = int(record.get("deadline") or 0)
    is_held = bool(token) and deadline > now_ms
    ran_out = bool(token) and not is_held
    state = record.get("state") or ("running" if is_held else "unknown")
    if record.get("reserved"):
        state = "handing-off"  # reserved for the next parked run, which has not started yet
    progress = json.loads(record["progress"]) if record.get("progress") else {}
    current, total = progress.get("current"), progress.get("total")
    percent = round(100.0 * current / total, 2) if current is not None and total else None
    pid, fence = record.get("pid"), record.get("fence")
    outcome = None if is_held else (record.get("outcome") or ("expired" if ran_out else None))
    return KeyStatus(
        key=key,
        held=is_held,
        state=state,
        task_id=record.get("task_id") or None,
        task_name=record.get("task_name") or None,
        worker=record.get("worker") or None,
        host=record.get("host") or None,
        pid=int(pid) if pid else None,
        fence=int(fence) if fence else None,
        current=current,
        total=total,
        percent=percent,
        message=progress.get("message"),
        fields=progress.get("fields") or {},
        started=_ms_to_s(record.get("since")),
        updated=_ms_to_s(record.get("updated")),
        ended=None if is_held else _ms_to_s(record.get("ended")),
        outcome=outcome,
        ttl_left=(deadline - now_ms) / 1000.0 if is_held else None,
        queued=queued,
        duplicates=int(record.get("duplicates") or 0),
        released_by=record.get("released_by"),
        args=json.loads(record["args"]) if record.get("args") else None,
        slot=slot,
        previous_task_id=record.get("prev_task_id") or None,
        previous_outcome=record.get("prev_outcome") or None,
        superseded_by=record.get("sup_by") or None,
    )


def _record(raw: Any) -> dict[str, Any]:
    """A run record, or nothing for a value that is not one (a foreign key of that name)."""
    if not raw:
        return {}
    try:
        record = json.loads(raw)
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


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

    def __init__(self, store: LeaseStore, app: Any = None) -> None:
        self.store = store
        self.client = store.client
        self.app = app  # to send what a force-release hands on; without it the sweeper does

    def _run_slot(self, name: str) -> tuple[str, int] | None:
        """(user key, slot) of a run record's Redis key name of this namespace, else None.

        Only names the layout itself would produce for that user key and slot are accepted
        (``<ns>:{<escaped key>}:run`` or ``...:run<slot>``), so a user key containing ``}:run1``
        (escaped in the name) or a foreign name such as ``...:run01`` is never taken for a slot.
        """
        layout = self.store.layout
        user_key = layout.user_key(name)
        if user_key is None:
            return None
        part = name.rpartition("}:")[2]
        if not _RUN_PART.fullmatch(part):
            return None
        slot = int(part[len("run"):] or 0)
        return (user_key, slot) if layout.run(user_key, slot) == name else None

    def _scan_runs(self, pattern: str, count: int) -> set[tuple[str, int]]:
        found: set[tuple[str, int]] = set()
        for raw in self.client.scan_iter(match=pattern, count=count, _type="string"):
            parsed = self._run_slot(raw.decode() if isinstance(raw, bytes) else str(raw))
            if parsed is not None:
                found.add(parsed)
        return found

    def _read_many(self, runs: list[tuple[str, int]]) -> list[KeyStatus | None]:
        """The status of each (key, slot), pipelined in batches (one round trip per batch)."""
        out: list[KeyStatus | None] = []
        layout = self.store.layout
        for start in range(0, len(runs), _BATCH):
            batch = runs[start : start + _BATCH]
            pipe = self.client.pipeline(transaction=False)
            if not self.store.cluster:
                pipe.time()
            for key, slot in batch:
                pipe.get(layout.run(key, slot))
                pipe.llen(layout.queue(key))
            replies = pipe.execute()
            if self.store.cluster:  # each lease against the clock of its own node
                clocks = clocks_ms(self.client, [layout.run(key, slot) for key, slot in batch])
                replies = [None, *replies]
            else:
                seconds, micros = replies[0]
                clocks = [int(seconds) * 1000 + int(micros) // 1000] * len(batch)
            for i, (key, slot) in enumerate(batch):
                raw, queued = replies[1 + 2 * i : 3 + 2 * i]
                out.append(_combine(key, _record(raw), clocks[i], int(queued), slot))
        return out

    def read(self, key: str, slot: int = 0) -> KeyStatus | None:
        """The status of ``key`` in one round trip; None if nothing is known about it.

        Reads slot 0, the only one of a key with ``max_concurrency=1``; ``slot`` reads another
        slot of a ``max_concurrency`` > 1 key (see :meth:`read_all` for every held one).
        """
        if slot < 0:
            raise ValueError(f"slot must be 0 or more, not {slot}")
        return self._read_many([(stored_key(key), slot)])[0]

    def read_all(self, key: str, slots: int | None = None, count: int = 1000) -> list[KeyStatus]:
        """The status of every held slot of ``key``, by slot; empty if no slot is held.

        Without ``slots``, the key's run records are found with SCAN (never KEYS; like
        :meth:`held`, its cost grows with the size of the keyspace), then read in one round trip.
        With ``slots=N`` (the key's ``max_concurrency``, when the caller knows it), slots 0 to
        N-1 are read in one round trip, without SCAN.
        """
        key = stored_key(key)
        if slots is None:
            pattern = _glob_escape(self.store.layout.run(key)) + "*"
            wanted = sorted(slot for found, slot in self._scan_runs(pattern, count) if found == key)
        else:
            if slots < 1:
                raise ValueError(f"slots must be 1 or more, not {slots}")
            wanted = list(range(slots))
        return [st for st in self._read_many([(key, slot) for slot in wanted]) if st is not None and st.held]

    def held(self, prefix: str = "", count: int = 1000) -> list[KeyStatus]:
        """Every held run whose user key starts with ``prefix``, found with SCAN (never KEYS).

        One :class:`KeyStatus` per held slot (a ``max_concurrency=3`` key with three runs is
        listed three times, with ``slot`` 0, 1 and 2), sorted by key, then slot.
        """
        escaped = self.store.layout.run(prefix)
        head = escaped[: -len("}:run")]
        pattern = _glob_escape(head) + "*}:run*"  # run and run<slot>; parsed exactly below
        runs = sorted(run for run in self._scan_runs(pattern, count) if run[0].startswith(prefix))
        return [st for st in self._read_many(runs) if st is not None and st.held]

    def watch(
        self, key: str, timeout: float | None = None, poll: float = 0.5, slot: int = 0
    ) -> Iterator[WatchEvent]:
        """Yield the run's updates as they happen (history first), ending with its ``end`` event.

        Follows the run that holds ``key`` now (or the last one, if it already ended): the run
        of slot 0, or of ``slot`` for a ``max_concurrency`` > 1 key (one run per watch). Stops
        after ``timeout`` seconds if given. Yields nothing if nothing is known about the key.
        """
        key = stored_key(key)
        snapshot = self.read(key, slot)
        if snapshot is None:
            return
        fence = snapshot.fence
        stream = self.store.layout.history(key, slot)
        deadline = None if timeout is None else mod_time.monotonic() + timeout
        cursor = ["0-0"]
        history: list[Any] = self.client.xrange(stream, min="-", max="+")  # type: ignore[assignment]
        for event in _run_events(history, fence, cursor):
            yield event
            if event.final:
                return
        if not snapshot.held:
            by = {"by": snapshot.released_by} if snapshot.released_by else {}
            yield WatchEvent(kind="end", state=snapshot.outcome or snapshot.state, fence=fence,
                             ts=snapshot.ended, fields=by)
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
                now = self.read(key, slot)
                if now is None or not now.held or now.fence != fence:
                    # ended without a history entry (it never reported progress, or expired)
                    ended = now if now is not None and now.fence == fence else None
                    state = ended.outcome or ended.state if ended is not None else "expired"
                    by = {"by": ended.released_by} if ended is not None and ended.released_by else {}
                    yield WatchEvent(kind="end", state=state, fence=fence, fields=by,
                                     ts=ended.ended if ended is not None else mod_time.time())
                    return

    def force_release(self, key: str, by: str, expected_holder: str = "", slot: int = 0,
                      slots: int | None = None, ttl: float = 30.0) -> str | None:
        """Free ``key`` whoever holds it; returns the released task id (None if not held).

        Frees slot 0, or ``slot`` of a ``max_concurrency`` > 1 key (find the slot of a run with
        :meth:`read_all`; ``slots``: the key's slot count, so that the key can be handed to a
        parked run at once). With ``expected_holder``, only that task's lease is released.
        Logged at WARNING with who asked, and signalled (``lease_force_released``). The holder's
        heartbeat then reports its lease lost. With the reader's app (``reader(app)``,
        ``force_release(app, ...)``, the CLI) a parked run is sent at once and runs that joined the
        released run get a :class:`LeaseLost` error; a reader without one leaves both to the
        queue sweeper of a worker.
        """
        if slot < 0:
            raise ValueError(f"slot must be 0 or more, not {slot}")
        key = stored_key(key)
        released = self.store.force_release(key, by, expected_holder, slot, max(slots or 1, slot + 1), ttl,
                                            hand_on=self.app is not None)
        if released is None:
            return None
        task_id, fence, settlement = released
        where = f" slot {slot}" if slot else ""
        log.warning("force-released key=%r%s held by task %s (fence %s), by %s",
                    key, where, task_id, fence, by)
        if self.app is not None:
            settle(self.app, settlement, Ending(
                key, "operator", task_id, "force-released", signal=False,
                error=LeaseLost(key, f"the run it joined was force-released by {by}"),
            ))
        signals.lease_force_released.send(sender=None, key=key, task_id=task_id, fence=fence, by=by)
        return task_id


_readers: dict[tuple[int, int], StatusReader] = {}


def reader(app: Any) -> StatusReader:
    """The status reader for ``app``'s Redis and namespace."""
    opts = app_options(app)
    store = store_for(opts.redis, opts.namespace, opts.status_retention, opts.history_length)
    cache_key = (id(app), id(store))
    found = _readers.get(cache_key)
    if found is None or found.store is not store:
        found = _readers[cache_key] = StatusReader(store, app)
    return found


def status(app: Any, key: str, slot: int = 0) -> KeyStatus | None:
    """Who holds ``key`` (its slot 0, or ``slot``) and how far along it is (None if nothing is
    known about it)."""
    return reader(app).read(key, slot)


def status_all(app: Any, key: str, slots: int | None = None) -> list[KeyStatus]:
    """Every held slot of ``key`` (see :meth:`StatusReader.read_all`); empty if none is held."""
    return reader(app).read_all(key, slots)


def held(app: Any, prefix: str = "") -> list[KeyStatus]:
    """The held runs of ``app``'s namespace whose key starts with ``prefix``, one per held slot."""
    return reader(app).held(prefix)


def watch(app: Any, key: str, timeout: float | None = None, slot: int = 0) -> Iterator[WatchEvent]:
    """Follow the run on ``key`` (its slot 0, or ``slot``) live until it ends (see
    :meth:`StatusReader.watch`)."""
    return reader(app).watch(key, timeout=timeout, slot=slot)


def force_release(app: Any, key: str, by: str, expected_holder: str = "", slot: int = 0) -> str | None:
    """Free ``key`` (its slot 0, or ``slot``) whoever holds it, recording ``by``; returns the
    released task id or None. A parked run is handed the key at once."""
    opts = app_options(app)
    return reader(app).force_release(key, by, expected_holder, slot, slots=known_slots(app), ttl=opts.ttl)
