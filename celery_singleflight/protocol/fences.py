"""Fenced values in the user's Redis (``fencing.fenced_set`` / ``fenced_get``): a value and the
fence it was written with, in one hash, and a write that is refused when its fence is older.

The script runs on whatever client the caller passes (a pipeline too), registered once per client:
its SHA is computed once, and redis-py loads it again after a Redis restart (NOSCRIPT).
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any

from redis.commands.core import Script as RegisteredScript

from ..connection.scripts import loading
from .lua import Replies, Script

__all__ = ["FENCED_SET", "SCRIPTS", "FenceReply", "fenced_get", "fenced_set"]


class FenceReply(Replies):
    STALE = 0, "{STALE, stored fence}: the stored fence is newer; nothing is written"
    WRITTEN = 1, "{WRITTEN, fence}: written (the stored fence was older, equal or absent)"


FENCED_SET = Script("FENCED_SET", "fences/fenced_set.lua", replies=(FenceReply,))
SCRIPTS = (FENCED_SET,)

_registered: weakref.WeakKeyDictionary[Any, RegisteredScript] = weakref.WeakKeyDictionary()
_guard = threading.Lock()


def _new_guard_after_fork() -> None:
    global _guard
    _guard = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_guard_after_fork)


def _script(client: Any) -> RegisteredScript:
    with _guard:
        script = _registered.get(client)
        if script is None:
            script = _registered[client] = client.register_script(FENCED_SET.source)
        return script


def fenced_set(client: Any, key: str, value: Any, fence: int, ttl_ms: int | None) -> tuple[bool, int]:
    """Write ``value`` at ``key`` unless a newer fence is stored: (written, the fence now stored)."""
    args = [value, str(fence), "" if ttl_ms is None else ttl_ms]
    script = _script(client)
    reply = loading(client, script.script, lambda: script(keys=[key], args=args, client=client))
    return int(reply[0]) == FenceReply.WRITTEN, int(reply[1])


def fenced_get(client: Any, key: str) -> tuple[Any, int] | None:
    """The value at ``key`` and its fence; None if nothing is stored."""
    value, fence = client.hmget(key, ["value", "fence"])
    if value is None:
        return None
    return value, int(fence) if fence is not None else 0
