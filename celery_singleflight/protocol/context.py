"""What every feature's calls share: the Redis client, the namespace's layout, the store's
constants, each script registered once on the client; and the few conversions at the edge
(seconds in the API, milliseconds in Redis)."""

from __future__ import annotations

import time as mod_time
from collections.abc import Callable, Sequence
from typing import Any

import redis

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

    def pipelined(self, script: Script, calls: Sequence[tuple[list[str], list[Any]]],
                  then: Callable[[Any], Any] | None = None) -> list[Any]:
        """``script`` once per ``(keys, args)`` of ``calls``, then ``then(pipe)``, in one round trip
        (a script Redis does not know yet is loaded and run again, which is safe: every script is).
        A Cluster's pipelines refuse scripts: there each is one call, then ``then(client)``. The
        scripts' replies; an error of any command is raised."""
        called = self.script(script)
        if self.cluster:
            replies: list[Any] = [called(keys=keys, args=args) for keys, args in calls]
            if then is not None:
                then(self.client)
            return replies
        pipe = self.client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(called.sha.decode(), len(keys), *keys, *args)
        if then is not None:
            then(pipe)
        found = pipe.execute(raise_on_error=False)
        replies, rest = found[: len(calls)], found[len(calls):]
        for i, ((keys, args), reply) in enumerate(zip(calls, replies, strict=True)):
            if isinstance(reply, redis.exceptions.NoScriptError):
                replies[i] = called(keys=keys, args=args)  # loads it
            elif isinstance(reply, Exception):
                raise reply
        for error in rest:
            if isinstance(error, Exception):
                raise error
        return replies

    def call(self, script: Script, keys: list[str], args: list[Any],
             then: Callable[[Any], Any] | None = None) -> Any:
        """``script`` with ``keys`` and ``args``, and ``then(pipe)`` in the same round trip (None:
        the script alone). Its reply."""
        if then is None:
            return self.script(script)(keys=keys, args=args)
        return self.pipelined(script, [(keys, args)], then)[0]


class Feature:
    """The calls of one feature of the protocol, on one :class:`Context`."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
