"""The journal of waiting runs: one append-only file per worker node, so that a run waiting in
the lease Redis can be sent again when that Redis loses its data.

A run parked in Redis after its broker message was acknowledged (``queue``, ``join``, the pending
run of the newest-wins policies, a run waiting for its turn in send order, a delayed run) exists
only there. The process that parks it also appends one JSON line here (:func:`journal_waiting`):
its kind, namespace, key, task id and name, its re-sendable message and when. The worker's main
process (:mod:`..worker.recovery`) drops the lines of runs that no longer wait, and sends the
others again when Redis lost its data.

Each line carries a *mark* that the script which made the run wait also left beside it in Redis
(:mod:`..protocol.journaled`): a line whose run no longer waits and whose mark is gone was lost
with Redis's data, whatever the namespace's epoch says.

The file is ``<singleflight_journal_dir>/<worker node name>.jsonl``. Appends from the pool
processes and the main process's rewrite take ``flock`` on a lock file beside it; a rewrite
replaces the file whole, so a crash in the middle leaves the old one. An append after a torn
line (a short write, a full disk) first ends that line, so only the torn one is lost. Beside it,
``<node>.epochs.json``: the epoch each namespace's journal was last settled against.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import threading
import time as mod_time
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

from .messages import HEADER_SEQ, header

__all__ = ["HEADER_RECOVERED", "HEADER_RECOVERED_HANDOFF", "KINDS", "Entry", "Journal", "journal_waiting",
           "new_mark"]

log = logging.getLogger("celery_singleflight.queue")

#: the header of a run sent again by the recovery (its value: the entry's kind)
HEADER_RECOVERED = "singleflight_recovered"
#: the hand-off token the run sent again was parked with (its message may still be on its way)
HEADER_RECOVERED_HANDOFF = "singleflight_recovered_handoff"
#: what a journaled run waits as: parked by ``queue``, joined, the pending run of its key, waiting
#: for its turn in send order, delayed
KINDS = ("park", "join", "pending", "order", "delay")


@dataclass(frozen=True)
class Entry:
    """One journaled run (``line``: its line, by which it is dropped). ``seq``: the sequence
    number a run waiting for its turn has; ``due``, ``token``: when a delayed run is due (epoch
    seconds) and the token its countdown message carries. ``mark``: the mark its parking left in
    Redis ('' for a line written without one)."""

    line: str
    kind: str
    namespace: str
    key: str
    task_id: str
    task: str
    message: str
    at: float
    seq: int = 0
    due: float | None = None
    token: str = ""
    mark: str = ""

    @classmethod
    def parse(cls, line: str) -> Entry | None:
        """The entry of ``line``, or None for a line that is not one (torn by a crash)."""
        try:
            data = json.loads(line)
            return cls(line, str(data["kind"]), str(data["namespace"]), str(data["key"]),
                       str(data["task_id"]), str(data["task"]), str(data["message"]), float(data["at"]),
                       int(data.get("seq") or 0), None if data.get("due") is None else float(data["due"]),
                       str(data.get("token") or ""), str(data.get("mark") or ""))
        except (ValueError, KeyError, TypeError):
            return None


def _file_name(node: str) -> str:
    return re.sub(r"[^A-Za-z0-9@._-]", "_", node) or "worker"



#: the lock files' descriptors this process has open now. A ``flock`` belongs to the open file,
#: which a child forked meanwhile (a prefork pool process, forked while the main process's
#: sweeper reads the journal) shares: its copy would hold the lock for the child's whole life,
#: and every append of the worker node, the child's own included, would wait for ever. A child
#: closes its copies at once (never unlocks them: that would free the parent's lock).
_lock_fds: set[int] = set()
_fds_lock = threading.Lock()


def _close_inherited_locks() -> None:
    global _fds_lock
    for fd in _lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _lock_fds.clear()
    _fds_lock = threading.Lock()


# the set is whole at the fork: the fork waits for an open or close of a lock file in progress
os.register_at_fork(before=lambda: _fds_lock.acquire(), after_in_parent=lambda: _fds_lock.release(),
                    after_in_child=_close_inherited_locks)


class Journal:
    """The journal of the worker node ``node`` in ``directory``."""

    def __init__(self, directory: str, node: str) -> None:
        self.directory = directory
        self.path = os.path.join(directory, f"{_file_name(node)}.jsonl")
        self._lock_path = f"{self.path}.lock"
        self._epochs_path = os.path.join(directory, f"{_file_name(node)}.epochs.json")

    def epochs(self) -> dict[str, tuple[str, int]]:
        """The epoch (life, count) of each namespace this worker node last settled its journal
        against (kept across its restarts)."""
        try:
            with open(self._epochs_path, encoding="utf-8") as kept:
                found = json.load(kept)
            return {str(namespace): (str(life), int(count)) for namespace, (life, count) in found.items()}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def keep_epochs(self, epochs: dict[str, tuple[str, int]], sync: bool = True) -> None:
        """Remember the epochs (written whole, replaced at once; ``sync=False``: not flushed to
        the disk, for a mere larger count, whose loss only makes the next look less strict)."""
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        temporary = f"{self._epochs_path}.new"
        with open(temporary, "w", encoding="utf-8") as out:
            json.dump({namespace: list(epoch) for namespace, epoch in epochs.items()}, out)
            if sync:
                out.flush()
                os.fsync(out.fileno())
        os.replace(temporary, self._epochs_path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with _fds_lock:
            try:
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except FileNotFoundError:  # the first write (or the directory was cleaned away)
                os.makedirs(self.directory, mode=0o700, exist_ok=True)
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            _lock_fds.add(fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            with _fds_lock:
                _lock_fds.discard(fd)
                os.close(fd)  # closing releases the lock (once no forked child has a copy)

    def append(self, record: dict[str, Any]) -> None:
        """Append one entry (under the lock; after a torn last line, a newline first)."""
        data = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        with self._locked():
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # the torn line stays apart (and is dropped at a rewrite)
                while data:  # a short write (a signal, a full disk) goes on where it stopped
                    written = os.write(fd, data)
                    if not written:
                        raise OSError(errno.ENOSPC, "nothing was written", self.path)
                    data = data[written:]
            finally:
                os.close(fd)

    def entries(self) -> list[Entry]:
        """Every entry, in the order they were written (torn lines left out)."""
        with self._locked():
            lines = self._lines()
        return [entry for entry in map(Entry.parse, lines) if entry is not None]

    def drop(self, lines: Collection[str]) -> int:
        """Rewrite the journal without ``lines`` (and without torn lines); how many went."""
        if not lines:
            return 0
        gone = set(lines)
        with self._locked():
            before = self._lines()
            kept = [line for line in before if line not in gone and Entry.parse(line) is not None]
            if len(kept) == len(before):
                return 0
            temporary = f"{self.path}.new"
            with open(temporary, "w", encoding="utf-8") as out:
                out.write("".join(f"{line}\n" for line in kept))
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.path)
        return len(before) - len(kept)

    def _lines(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8") as journal:
                return [line.rstrip("\n") for line in journal if line.strip()]
        except FileNotFoundError:
            return []


def new_mark() -> str:
    """A journal line's mark, drawn before its run is parked (the script leaves it in Redis)."""
    return uuid.uuid4().hex[:16]


def journal_waiting(task: Any, key: str, message: str, kind: str, due: float | None = None,
                    token: str = "", *, mark: str = "", task_id: str | None = None, node: str | None = None
                    ) -> None:
    """Journal a run of ``task`` (the current one, or ``task_id`` of worker ``node``: the
    worker's main process parks runs it does not run), which now waits in Redis on ``key`` as
    ``kind`` (one of :data:`KINDS`) with its re-sendable ``message``, parked with ``mark`` (the
    mark its parking left in Redis). A delayed run: ``message`` as its copy in Redis, ``due``
    (epoch seconds) and the ``token`` of its countdown message (its copy is kept again under it
    after a loss, so that message still claims it). Called right after the run was parked;
    never raises (a journal that cannot be written is logged: that run is not recovered)."""
    request = task.request
    node = node if node is not None else getattr(request, "hostname", None)
    task_id = task_id if task_id is not None else request.id
    if not node or not task_id:
        return  # a direct or eager call never waits
    try:
        record: dict[str, Any] = {"kind": kind, "namespace": task.options.namespace, "key": key,
                                  "task_id": task_id, "task": task.name, "message": message,
                                  "at": mod_time.time()}
        if kind == "order":
            record["seq"] = int(header(request, HEADER_SEQ) or 0)
        if due is not None:
            record["due"] = due
        if token:
            record["token"] = token
        if mark:
            record["mark"] = mark
        Journal(task.options.journal_dir, str(node)).append(record)
    except (OSError, ValueError) as exc:
        log.warning("could not journal %s[%s] waiting on key=%r (it is not sent again if the lease Redis"
                    " loses its data): %s", task.name, task_id, key, exc)
