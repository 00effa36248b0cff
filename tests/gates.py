"""Gates: a run a test must outlast waits for the test, not for a duration it hopes is enough.

Task bodies of the test apps (``sfapp``, the chaos apps) call :func:`hold`; the test sets the gate
key in the app's recorder db when it is done looking (``conftest.open_gate``). The recorder db is
emptied before each test, so every gate starts closed.

A run waiting at a gate says so (:func:`waiting_at`): a gate opened as a test ends must be seen
by its runs before the next test empties the db, or they would hold a shared worker's process
until their cap (``conftest._clean_state`` waits for them).
"""

from __future__ import annotations

import os
import time

import redis

#: a waiting run's mark outlives its last look at the gate this long (a killed run's goes by itself)
MARK_MS = 1000


def waiting_at(recorder: redis.Redis, gate: str) -> str:
    """Mark this process as waiting at ``gate`` (again at each look); returns the mark's key."""
    mark = f"held:{gate}:{os.getpid()}"
    recorder.set(mark, 1, px=MARK_MS)
    return mark


def gates_awaited(recorder: redis.Redis) -> list[str]:
    """The open gates that a run still waits at (its mark is there: it has not seen it yet)."""
    return [gate for mark in recorder.scan_iter("held:*", count=1000)
            if recorder.exists(gate := mark.decode()[len("held:"):].rsplit(":", 1)[0])]


def hold(recorder: redis.Redis, seconds: float, gate: str | None) -> None:
    """Work for ``seconds`` (the cap), or less once the key ``gate`` exists in ``recorder``."""
    if gate is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    mark = ""
    while time.monotonic() < deadline and not recorder.exists(gate):
        mark = waiting_at(recorder, gate)
        time.sleep(min(0.02, seconds))
    if mark:
        recorder.delete(mark)
