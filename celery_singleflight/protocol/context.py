"""What every feature's calls share: the Redis client, the namespace's layout, the store's
constants, each script registered once on the client; and the few conversions at the edge
(seconds in the API, milliseconds in Redis)."""

from __future__ import annotations

import time as mod_time
from collections.abc import Sequence
from typing import Any

from ..connection.scripts import ClientScript
from ..connection.targets import is_cluster
from .layout import Layout
from .lua import Script

__all__ = ["Context", "Feature", "due_ms", "ms", "text", "texts"]


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, at least 1."""
    return max(1, int(seconds * 1000))


def due_ms(seconds_from_now: float) -> int:
    """Epoch milliseconds ``seconds_from_now`` from now (the indexes' scores)."""
    return int((mod_time.time() + seconds_from_now) * 1000)


def text(value: Any) -> str:
    """A reply's string (redis-py answers bytes or str, as the client decodes)."""
    return value.decode() if isinstance(value, bytes) else str(value)


def texts(values: Sequence[Any]) -> tuple[str, ...]:
    return tuple(text(v) for v in values)


class Context:
    """One namespace on one Redis: ``keep_ms`` is how long a run record outlives its run,
    ``history_length`` caps a key's history stream."""

    __slots__ = ("_scripts", "client", "cluster", "history_length", "keep_ms", "layout")

    def __init__(self, client: Any, layout: Layout, keep_ms: int, history_length: int) -> None:
        self.client = client
        self.layout = layout
        self.keep_ms = keep_ms
        self.history_length = history_length
        self.cluster = is_cluster(client)
        self._scripts: dict[str, ClientScript] = {}

    def script(self, script: Script) -> ClientScript:
        """``script`` registered on this client (once)."""
        found = self._scripts.get(script.name)
        if found is None:
            found = self._scripts[script.name] = ClientScript(self.client, script.source)
        return found


class Feature:
    """The calls of one feature of the protocol, on one :class:`Context`."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
