"""The start check of a lease Redis's persistence, against the tasks that keep waiting runs in it.

Parked runs (``queue``, ``ordered``, ``join``, the pending run of ``coalesce`` and ``supersede``,
the runs waiting at a ``fair_concurrency`` gate) and delayed runs (``debounce``,
``key_rate_limit``, the ``retry`` policy's re-sends) exist only in the lease Redis once their
broker message was acknowledged: a Redis that restarts without an
append-only file loses them, and nothing else remembers them. The check reads ``aof_enabled``
from ``INFO`` (which the documented ACL rule grants) and, where the user may run it, ``CONFIG GET
append*`` and ``CONFIG GET save`` for the details (the fsync policy, the snapshot rule); it says
what a restart would lose, and what it does about it is ``singleflight_require_persistence``
(``warn``, ``refuse``, ``off``). A Redis that answers neither (``INFO`` refused, ``CONFIG``
renamed by a managed service) is reported at INFO: unknown is never a refusal.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import redis

from ..constants import DELAYING_OPTIONS
from ..protocol import server
from .findings import Finding

__all__ = ["ENDS_AT_ONCE", "Persistence", "persistence_finding", "read_persistence", "waiting_runs"]

#: the duplicate policies that end a duplicate at once; every other one keeps it waiting in the lease
#: Redis (parked, joined, pending or re-sent with a copy there), as a policy added later will
ENDS_AT_ONCE = ("raise", "skip")
#: what each ``appendfsync`` policy can lose
_FSYNC_LOSS = {
    "always": "a crash loses no write Redis acknowledged",
    "everysec": "a crash of the machine can lose about the last second of writes",
    "no": "a crash of the machine can lose what the OS had not flushed yet (about 30 s on Linux)",
}
_DOC = "docs/operations.md#persistence-of-the-lease-redis"
_FIX = ("set appendonly yes with appendfsync everysec (a machine crash can lose about the last second)"
        f" or always (nothing acknowledged is lost), as in {_DOC}")


def waiting_runs(task: Any) -> list[str]:
    """Why ``task`` keeps waiting runs in its lease Redis (its options that do), or [].

    ``ordered`` needs ``on_duplicate="queue"``, so it is named with it."""
    opts = task.options
    reasons = []
    duplicate = getattr(opts, "on_duplicate", None)
    if duplicate and duplicate not in ENDS_AT_ONCE:
        reasons.append(f"on_duplicate={duplicate}")
    beat = getattr(opts, "on_beat_duplicate", None)
    if beat and beat not in ENDS_AT_ONCE and beat != duplicate:
        reasons.append(f"on_beat_duplicate={beat}")
    reasons += [option for option in DELAYING_OPTIONS if getattr(opts, option, None) is not None]
    fair = getattr(opts, "fair_concurrency", None)
    if fair is not None:  # its worker's main process parks the runs that wait for a slot, acknowledged
        reasons.append(f"fair_concurrency={fair}")
    return reasons


@dataclass(frozen=True)
class Persistence:
    """What a Redis said of its persistence; ``appendonly`` is None when unknown (``unknown``
    then says why). ``save`` is None when the snapshot rule was not read (``INFO`` alone; then
    ``unread`` says why ``CONFIG GET`` was not asked)."""

    appendonly: bool | None
    appendfsync: str = ""
    save: str | None = ""
    unknown: str = ""
    unread: str = ""

    @property
    def kind(self) -> str:
        """``aof``, ``rdb`` (snapshots only), ``none``, ``no_aof`` (no append-only file, snapshot
        rule not read) or ``unknown``."""
        if self.appendonly is None:
            return "unknown"
        if self.appendonly:
            return "aof"
        if self.save is None:
            return "no_aof"
        return "rdb" if self.rules() else "none"

    def rules(self) -> list[tuple[int, int]]:
        """The ``save`` rule as (seconds, changes) pairs: a snapshot once so many seconds passed
        with at least so many writes since the last one."""
        numbers = [int(part) for part in (self.save or "").split() if part.isdigit()]
        return list(zip(numbers[::2], numbers[1::2], strict=False))

    def snapshot_age(self) -> int | None:
        """The most seconds a single write can wait for a snapshot (None: no such bound, as a
        write may never be saved when every rule needs more than one change)."""
        ages = [seconds for seconds, changes in self.rules() if changes <= 1]
        return min(ages) if ages else None

    def describe(self) -> str:
        """How the Redis keeps its data, and what a crash or restart loses."""
        if self.kind == "aof":
            if not self.appendfsync:
                return (f"appendonly yes ({self.unread}): a crash loses at most what its appendfsync allows,"
                        " about the last second with everysec, the default")
            loss = _FSYNC_LOSS.get(self.appendfsync, f"appendfsync {self.appendfsync}")
            return f"appendonly yes, appendfsync {self.appendfsync}: {loss}"
        if self.kind == "no_aof":
            return (f"appendonly no ({self.unread}): a crash or restart loses the writes since the last RDB"
                    " snapshot, or everything when it takes none")
        if self.kind == "none":
            return "appendonly no, save \"\": no snapshots either, so a restart loses everything"
        age, fewest = self.snapshot_age(), min(changes for _, changes in self.rules())
        most = (f"at most the last {age} s" if age is not None else
                f"and none is taken while fewer than {fewest} writes happened")
        return (f"appendonly no, save \"{self.save}\": RDB snapshots only, so a crash loses the writes since"
                f" the last snapshot, {most}")


def read_persistence(client: Any, info: Mapping[str, Any] | None = None, *, ask_config: bool = True,
                     unread: str = "") -> Persistence:
    """The persistence of a Redis: ``aof_enabled`` from its ``INFO`` (``info``, when read), and
    ``CONFIG GET`` for the details when ``ask_config`` (else ``unread`` says why not). A refused,
    renamed or unknown ``CONFIG`` keeps what ``INFO`` said, or gives an unknown
    :class:`Persistence`; never an error."""
    from_info = None
    if info is not None and "aof_enabled" in info:
        from_info = Persistence(str(info["aof_enabled"]) == "1", save=None, unread=unread)
    if not ask_config:
        return from_info or Persistence(None, unknown=f"INFO did not say, and {unread}")
    try:
        conf = server.config_persistence(client)
    except redis.exceptions.NoPermissionError:
        why = "CONFIG GET is refused to this user (NOPERM)"
    except redis.ResponseError as exc:  # a managed Redis that renamed or removed CONFIG
        why = f"CONFIG GET answered: {exc}"
    else:
        if "appendonly" in conf:
            return Persistence(conf["appendonly"] == "yes", conf.get("appendfsync", ""), conf.get("save", ""))
        why = "CONFIG GET answered without appendonly"
    return replace(from_info, unread=why) if from_info else Persistence(None, unknown=why)


def _tasks(waiting: dict[str, list[str]]) -> str:
    return ", ".join(f"{name} ({', '.join(reasons)})" for name, reasons in sorted(waiting.items()))


def persistence_finding(shown: str, tasks: list[Any], found: Persistence, mode: str) -> Finding | None:
    """What to say of the persistence ``found`` of the lease Redis ``shown`` that ``tasks`` use:
    INFO, or a WARNING (``mode="warn"``) or a refusal (``"refuse"``) when some tasks keep waiting
    runs there and it has no append-only file; None with ``"off"``."""
    if mode == "off":
        return None
    waiting = {str(task.name): reasons for task in tasks if (reasons := waiting_runs(task))}
    there = (f"task{'s' * (len(waiting) > 1)} {_tasks(waiting)} keep{'s' * (len(waiting) == 1)} waiting runs"
             " there" if waiting else "no task keeps waiting runs there")
    if found.kind == "unknown":
        hint = f", which a restart without appendonly yes loses ({_DOC})" if waiting else ""
        return Finding(logging.INFO, f"the persistence of the lease Redis {shown} is unknown"
                       f" ({found.unknown}); {there}{hint}", shown, "persistence")
    if found.kind == "aof" or not waiting:
        lost = "" if found.kind == "aof" else ", so a restart loses only leases and status"
        return Finding(logging.INFO, f"persistence of the lease Redis {shown}: {found.describe()};"
                       f" {there}{lost}", shown, "persistence")
    level = logging.ERROR if mode == "refuse" else logging.WARNING
    return Finding(
        level,
        f"the lease Redis {shown} has no append-only file ({found.describe()}), and {there} whose broker"
        f" messages were acknowledged: a crash or restart of that Redis can lose them; {_FIX}"
        f" (singleflight_require_persistence={mode!r}, 'off' silences this)",
        shown, "persistence",
    )
