"""Gates: a run a test must outlast waits for the test, not for a duration it hopes is enough.

Task bodies of the test apps (``sfapp``, the chaos apps) call :func:`hold`; the test sets the gate
key in the app's recorder db when it is done looking (``conftest.open_gate``). The recorder db is
emptied before each test, so every gate starts closed.
"""

from __future__ import annotations

import time

import redis


def hold(recorder: redis.Redis, seconds: float, gate: str | None) -> None:
    """Work for ``seconds`` (the cap), or less once the key ``gate`` exists in ``recorder``."""
    if gate is None:
        time.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not recorder.exists(gate):
        time.sleep(min(0.02, seconds))
