"""What the worker's start checks ask of a lease Redis (:mod:`..worker.preflight`): its family,
version and role, its eviction policy, persistence and replication (one ``INFO``, which the ACL
rule grants; ``CONFIG GET`` only for details, where the user may), its clock, whether it lets
this user run and load the protocol's scripts, and which protocol version last started in the
namespace.

Every call here is read-only, but for loading the scripts (which warms Redis's script cache) and
the namespace's protocol mark (``<namespace>:protocol``): the highest protocol version of any
worker that started in the namespace, so that a worker of another version says so at its start
instead of mixing two protocols silently.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import redis

from .context import text
from .fields import PROTOCOL
from .layout import Layout, Part

__all__ = ["MARK", "config_memory", "config_persistence", "hello", "info", "load_scripts", "mark_key",
           "mark_protocol", "ping", "server_time"]

#: a script SHA nobody loaded: EVALSHA answers NOSCRIPT when permitted and NOPERM when not, and runs nothing
_UNKNOWN_SHA = "0" * 40

MARK = Part("protocol", "string: a protocol version", "none",
            "the highest protocol version of the namespace's workers: another version warns at start",
            index=True)


def ping(client: Any) -> None:
    """``PING``: the server answers, and this user may connect (a refused PING, or SELECT of the
    URL's database, raises NoPermissionError)."""
    client.ping()


def hello(client: Any) -> dict[str, str]:
    """``HELLO`` without arguments: server version and role. Needs no ACL permission (Redis 6+)."""
    execute: Any = client.execute_command  # redis-py does not wrap HELLO (it would switch protocols)
    reply: Any = execute("HELLO")
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2], strict=False))
    return {text(k): text(v) for k, v in reply.items() if not isinstance(v, list)}


def config_memory(client: Any) -> tuple[int, str]:
    """(``maxmemory``, ``maxmemory-policy``) from ``CONFIG GET``."""
    conf: Any = client.config_get("maxmemory*")
    return int(conf.get("maxmemory", 0) or 0), str(conf.get("maxmemory-policy", "noeviction"))


def config_persistence(client: Any) -> dict[str, str]:
    """``appendonly``, ``appendfsync`` and ``save`` from ``CONFIG GET append*`` and ``CONFIG GET save``
    (only what the server answered); stops at the first refusal, as each is an ``ACL LOG`` entry."""
    conf: dict[str, str] = {text(k): text(v) for k, v in dict(client.config_get("append*")).items()}
    conf.update({text(k): text(v) for k, v in dict(client.config_get("save")).items()})
    return {name: conf[name] for name in ("appendonly", "appendfsync", "save") if name in conf}


def info(client: Any) -> dict[str, Any]:
    """``INFO`` (its default sections: server, memory, persistence, replication, ...) in one
    round trip: everything the start checks read, without ``CONFIG``."""
    reply: Any = client.info()
    return dict(reply)


def server_time(client: Any) -> float:
    """The server's clock (``TIME``), epoch seconds."""
    seconds, micros = client.time()
    return float(seconds) + int(micros) / 1e6


def load_scripts(client: Any, sources: Sequence[str], key: str) -> int:
    """Probe ``EVALSHA``, then ``SCRIPT LOAD`` every script; raises ``NoPermissionError`` when
    refused (once: each refusal is an ``ACL LOG`` entry). Returns how many were loaded.

    The probe names ``key`` (one of the namespace's, which the ACL rule grants), as every call of
    the protocol names its keys: some servers refuse a script without keys (ElastiCache
    Serverless)."""
    # permitted: NOSCRIPT, or on a Cluster node that does not own the key's slot a redirection
    # (Redis checks the ACL first); refused: NOPERM
    with contextlib.suppress(redis.exceptions.NoScriptError, redis.exceptions.MovedError,
                             redis.exceptions.AskError):
        client.evalsha(_UNKNOWN_SHA, 1, key)
    if not sources:
        return 0
    client.script_load(sources[0])
    pipe = client.pipeline(transaction=False)
    for source in sources[1:]:
        pipe.script_load(source)
    pipe.execute()
    return len(sources)


def mark_key(namespace: str) -> str:
    """The key of ``namespace``'s protocol mark."""
    return Layout(namespace).index(MARK)


def mark_protocol(client: Any, namespace: str) -> int | None:
    """Record this worker's protocol version in the namespace's mark, keeping the highest, and
    return the version that was there (None: no worker marked it yet)."""
    key = mark_key(namespace)
    found: Any = client.get(key)
    before = int(text(found)) if found is not None and text(found).isdigit() else None
    if before is None or before < PROTOCOL:
        client.set(key, str(PROTOCOL))
    return before
