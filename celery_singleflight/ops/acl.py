"""The least-privilege Redis ACL rule for the lease Redis of one namespace.

One source for the rule that ``celery singleflight acl`` prints, the docs show
(``docs/isolation.md``, ``docs/operations.md``) and the tests apply: the keys of the namespace
only (``<ns>:{*`` and the namespace's own keys, ``<ns>:waiting`` and the others of
:data:`..protocol.store.INDEXES`; not ``<ns>:*``, which also matches a namespace ``<ns>:x``),
the namespace's channels only (``<ns>:inbox:*``: the push to a holder's process), and exactly the
commands a full run uses.
"""

from __future__ import annotations

import re

from ..protocol.servers import ServerKind
from ..protocol.store import CHANNELS, INDEXES
from ..protocol.timing import ACL_COMMANDS

__all__ = ["CLUSTER_COMMANDS", "LIBRARY_COMMANDS", "MAINT_NOTIFICATIONS", "SETINFO", "TIME_POLICY_COMMANDS",
           "acl_rule", "channel_patterns", "connection_commands", "key_patterns"]

#: every command the library sends to the lease Redis in a full run
LIBRARY_COMMANDS: tuple[str, ...] = (
    # the scripts: EVALSHA, and SCRIPT LOAD when Redis does not know a script yet (NOSCRIPT)
    "evalsha", "script|load",
    # inside the scripts (Redis checks the user's ACL there too); GET and SET also at top level for
    # the idempotency window and the run records, LLEN and TIME for status and the sweeper
    "del", "get", "hdel", "hexists", "hget", "hset", "llen", "lpos", "lpush", "lrange", "lrem", "mget",
    "pexpire", "pttl", "rpush", "set", "time", "xadd",
    # fair share: a gate's queue kept in order, its weights, its recent run times, its waiters
    "linsert", "ltrim", "hgetall",
    # status, listing (SCAN ... TYPE string) and watching
    "scan", "xrange", "xread",
    # the namespace's indexes of waiting and delayed runs, and of live workers (the sweeper); a
    # key's parked runs that took their slot
    "zadd", "zrangebyscore", "zrem", "zremrangebyscore", "zscore",
    # the push to a holder's process (PUBLISH inside the scripts), which each process subscribes to
    "publish", "subscribe",
    # redis-py's health check
    "ping",
    # the worker's start checks: the server's family and version, role, eviction policy and
    # persistence (never CONFIG, whose values include secrets)
    "info",
)

#: what redis-py sends on every new connection: its name and version (for CLIENT LIST), and
#: over RESP3 (redis-py 8's default) a request for maintenance notices
SETINFO, MAINT_NOTIFICATIONS = "client|setinfo", "client|maint_notifications"


def connection_commands(server: ServerKind | None) -> tuple[str, ...]:
    """What ``server`` needs granted of redis-py's handshake (None: Redis 7.2 and later, Valkey).

    A server that does not know a subcommand answers it as unknown, which is no ACL refusal; but
    Redis 6 checks the ACL first (and takes any subcommand name in a rule), and Redis 7.0 and 7.1
    refuse ``client|setinfo`` in a rule (they do not have it)."""
    if server is not None and server.family == "Redis":
        if server.version < (7,):
            return (SETINFO, MAINT_NOTIFICATIONS)
        if server.version < (7, 2):
            return ()
    return (SETINFO,)

#: what redis-py's cluster client sends besides: the slot map (CLUSTER SLOTS) and the key
#: positions of commands (COMMAND), when it connects
CLUSTER_COMMANDS: tuple[str, ...] = ("cluster|slots", "command")


#: what the time policies (``debounce``, ``key_rate_limit``) use besides (see :mod:`..protocol.timing`)
TIME_POLICY_COMMANDS: tuple[str, ...] = ACL_COMMANDS


def _glob_escape(text: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def key_patterns(namespace: str) -> list[str]:
    """The Redis glob patterns of every key of ``namespace``: ``<ns>:{*`` (every lock) and each
    key of the namespace itself (``<ns>:waiting``, ``<ns>:protocol``, ...)."""
    ns = _glob_escape(namespace)
    return [f"{ns}:{{*", *(f"{ns}:{part.name}" for part in INDEXES)]


def channel_patterns(namespace: str) -> list[str]:
    """The Redis glob patterns of every pub/sub channel of ``namespace`` (``<ns>:inbox:*``)."""
    ns = _glob_escape(namespace)
    return [f"{ns}:{part.name}:*" for part in CHANNELS]


def acl_rule(
    namespace: str, password: str = "PASSWORD", *, database: int = 0, cluster: bool = False,
    time_policies: bool = False, server: ServerKind | None = None,
) -> list[str]:
    """The rule (the words after ``ACL SETUSER <user>``) for a user of ``namespace``'s leases.

    ``database`` other than 0 adds ``select`` (redis-py selects it on every connection; Redis ACLs
    cannot limit databases); ``cluster`` adds :data:`CLUSTER_COMMANDS`; ``time_policies`` adds
    :data:`TIME_POLICY_COMMANDS`; ``server`` (the family and version the rule is for) picks
    :func:`connection_commands`.
    """
    commands = [
        *LIBRARY_COMMANDS, *(TIME_POLICY_COMMANDS if time_policies else ()),
        *(["select"] if database else []), *(CLUSTER_COMMANDS if cluster else ()),
        *connection_commands(server),
    ]
    return [
        "reset", "on", f">{password}",
        *(f"~{pattern}" for pattern in key_patterns(namespace)),
        "resetchannels", *(f"&{pattern}" for pattern in channel_patterns(namespace)),
        "-@all", *(f"+{command}" for command in commands),
    ]
