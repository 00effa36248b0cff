"""A prefork pool process is forked while threads of the worker's main process run (the sweeper,
the noter, the inbox): a lock of the library that one of them held at that instant stays held in
the child, whose first client, heartbeat or fenced write would then wait on it for ever (its
``worker_process_init`` never ends: the pool process never takes a task). Each module lock is
new in a child, and a child closes its copies of the journal's lock files. Found by a loaded
run: one of ten pool processes never logged a line.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from celery_singleflight.connection import clients
from celery_singleflight.protocol import fences
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run import heartbeat
from celery_singleflight.run.journal import Journal


def _new_client() -> None:
    clients.redis_client(f"redis://127.0.0.1:1/{uuid.uuid4().int % 16}")  # built, not connected


def _new_heartbeat() -> None:
    heartbeat.heartbeat_for(LeaseStore(clients.redis_client("redis://127.0.0.1:1/0"), KeyLayout("fork")))


def _fenced_script() -> None:
    fences._script(clients.redis_client("redis://127.0.0.1:1/0"))


@contextlib.contextmanager
def _held_in_another_thread(locked: Callable[[], AbstractContextManager[Any]]) -> Iterator[None]:
    """While the block runs, another thread of this process holds ``locked()``."""
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with locked():
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(5)
    try:
        yield
    finally:
        done.set()
        thread.join()


def _fork(child: Callable[[], None]) -> int:
    """Fork a child that runs ``child``: exit code 0 if it returned, else 1 (an error, or its 5 s
    alarm ended a wait on a lock)."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(5)
        code = 1
        try:
            child()
            code = 0
        finally:
            os._exit(code)
    return pid


@pytest.mark.parametrize(("module", "lock", "first_use"), [
    (clients, "_lock", _new_client),
    (heartbeat, "_lock", _new_heartbeat),
    (fences, "_guard", _fenced_script),
], ids=["clients", "heartbeat", "fences"])
def test_a_child_forked_while_another_thread_held_a_lock_goes_on(
    module: Any, lock: str, first_use: Callable[[], None]
) -> None:
    with _held_in_another_thread(lambda: getattr(module, lock)):
        _, status = os.waitpid(_fork(first_use), 0)  # its first use must not wait on that thread
    assert os.waitstatus_to_exitcode(status) == 0, "the child waited on a lock held at the fork"


def test_a_child_forked_while_the_journal_was_locked_leaves_it_to_the_others(tmp_path: Path) -> None:
    """The journal's ``flock`` belongs to the open lock file, which a forked child shares: had the
    child kept its copy, the lock would stay held as long as it lives, and every append of the
    worker node, the child's own first, would wait for ever (a loaded run: the pool process that
    took a debounced run never logged a line, its run never started)."""
    journal = Journal(str(tmp_path), "node@host")

    def pool_process() -> None:  # it appends, then lives on
        journal.append({"n": "child"})
        time.sleep(2)

    with _held_in_another_thread(journal._locked):  # as the main process's sweeper reads it
        pid = _fork(pool_process)
    started = time.monotonic()
    journal.append({"n": "parent"})  # while the child lives
    took = time.monotonic() - started
    _, status = os.waitpid(pid, 0)
    assert took < 1.0, f"the parent's append waited {took:.1f} s on the child's copy of the lock"
    assert os.waitstatus_to_exitcode(status) == 0, "the child's own append waited on its copy of the lock"
    lines = (tmp_path / "node@host.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["n"] for line in lines) == ["child", "parent"]
