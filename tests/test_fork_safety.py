"""A prefork pool process is forked while threads of the worker's main process run (the sweeper,
the noter, the inbox): a lock of the library that one of them held at that instant stays held in
the child, whose first client, heartbeat or fenced write would then wait on it for ever (its
``worker_process_init`` never ends: the pool process never takes a task). Each module lock is
new in a child. Found by a loaded run: one of ten pool processes never took a task.
"""

from __future__ import annotations

import os
import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from celery_singleflight.connection import clients
from celery_singleflight.protocol import fences
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run import heartbeat


def _new_client() -> None:
    clients.redis_client(f"redis://127.0.0.1:1/{uuid.uuid4().int % 16}")  # built, not connected


def _new_heartbeat() -> None:
    heartbeat.heartbeat_for(LeaseStore(clients.redis_client("redis://127.0.0.1:1/0"), KeyLayout("fork")))


def _fenced_script() -> None:
    fences._script(clients.redis_client("redis://127.0.0.1:1/0"))


@pytest.mark.parametrize(("module", "lock", "first_use"), [
    (clients, "_lock", _new_client),
    (heartbeat, "_lock", _new_heartbeat),
    (fences, "_guard", _fenced_script),
], ids=["clients", "heartbeat", "fences"])
def test_a_child_forked_while_another_thread_held_a_lock_goes_on(
    module: Any, lock: str, first_use: Callable[[], None]
) -> None:
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with getattr(module, lock):
            held.set()
            done.wait(10)

    thread = threading.Thread(target=holder)
    thread.start()
    assert held.wait(5)
    try:
        pid = os.fork()
        if pid == 0:  # the child: its first use must not wait on the parent's thread
            signal.alarm(5)  # a child waiting on the lock is ended by it (exit code 1)
            code = 1
            try:
                first_use()
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        thread.join()
    assert os.waitstatus_to_exitcode(status) == 0, "the child waited on a lock held at the fork"
