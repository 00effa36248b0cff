"""What the worker's start checks found, as sentences: one :class:`Finding` per problem (or the
summary of a lease Redis), each saying what to change. :mod:`.preflight` runs the checks."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import redis

from ..connection.clients import redacted_url
from ..connection.targets import RedisTarget
from ..constants import MAX_CLOCK_SKEW
from ..protocol.fields import PROTOCOL, READS
from ..protocol.servers import TESTED, ServerKind
from .registry import guarded_tasks

__all__ = ["Finding", "LeaseRedis", "clock_finding", "clock_skew", "eviction_finding", "old_server_refusal",
           "protocol_finding", "refusal", "replica_refusal", "replication_finding", "ttl_findings",
           "unreachable", "visibility_findings"]

#: kombu's default visibility timeouts, by broker transport
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "redis+socket": 3600.0, "sentinel": 3600.0,
                        "sqs": 1800.0}
_ACL_DOC = "docs/isolation.md"


@dataclass(frozen=True)
class Finding:
    """One result of a start check.

    ``level`` is a :mod:`logging` level: INFO for the summary of a lease Redis, WARNING for
    something to fix, ERROR for a refusal (the worker does not start). ``url`` is the redacted
    URL of the Redis (or broker) concerned; ``check`` names the check (``reachability``,
    ``version``, ``scripts``, ``replication``, ``eviction``, ``persistence``, ``clock``, ``ttl``,
    ``visibility_timeout``, ``summary``).
    """

    level: int
    message: str
    url: str | None = None
    check: str = ""

    @property
    def refusal(self) -> bool:
        return self.level >= logging.ERROR


def clock_skew(before: float, server: float, after: float) -> float:
    """How far the server's clock is ahead of ours (negative: behind), in seconds.

    ``before`` and ``after`` are our ``time.time()`` around the round trip that read ``server``;
    the server read its clock somewhere in between, most likely near the midpoint, so the
    result is good to within ``(after - before) / 2``.
    """
    return server - (before + after) / 2


def _user(url: str) -> str:
    try:
        return urlsplit(url).username or "default"
    except ValueError:
        return "default"


#: the subcommand a start check sends of a command with subcommands: Redis 6 names only the
#: command in a refusal ("the 'script' command or its subcommand")
_SENT_SUBCOMMAND = {"script": "script|load"}


def _refused_command(exc: BaseException) -> str:
    found = re.search(r"'([^']+)' command", str(exc))
    command = found.group(1).lower() if found else "a command"
    return _SENT_SUBCOMMAND.get(command, command)


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _names(tasks: list[Any]) -> str:
    return ", ".join(sorted(str(getattr(task, "name", task)) for task in tasks))


@dataclass
class LeaseRedis:
    """One lease Redis and the guarded tasks that use it."""

    url: str
    client: redis.Redis
    tasks: list[Any] = field(default_factory=list)
    target: RedisTarget | None = None

    @property
    def shown(self) -> str:
        return self.target.describe() if self.target is not None else redacted_url(self.url)


def refusal(target: LeaseRedis, exc: BaseException, what: str) -> Finding:
    command = _refused_command(exc)
    user = _user(target.url)
    if command == "script|load":
        what = "to load its scripts (at first use and after every restart of Redis)"
    return Finding(
        logging.ERROR,
        f"the lease Redis {target.shown} refuses the '{command}' command to user {user} (NOPERM), and"
        f" the library needs it {what}: grant it as in the ACL rule of {_ACL_DOC}",
        target.shown, "scripts" if command in ("evalsha", "script|load") else "reachability",
    )


def unreachable(target: LeaseRedis, exc: BaseException) -> Finding:
    modes = sorted({task.options.on_redis_error for task in target.tasks})
    what = {
        "fail_closed": "fail_closed tasks are re-sent and wait for it",
        "fail_open": "fail_open tasks run unguarded",
    }
    return Finding(
        logging.WARNING,
        f"the lease Redis {target.shown} is unreachable ({exc}): the worker starts anyway, and until"
        f" it answers, tasks follow on_redis_error ({'; '.join(what[m] for m in modes)})",
        target.shown, "reachability",
    )


def old_server_refusal(target: LeaseRedis, kind: ServerKind) -> Finding:
    """The refusal of a server older than the oldest the library supports."""
    oldest = ".".join(map(str, kind.oldest or ()))
    return Finding(
        logging.ERROR,
        f"the lease Redis {target.shown} is {kind}, older than {kind.family} {oldest}, the oldest this"
        f" library supports (tested on {TESTED}; docs/versioning.md): upgrade that server",
        target.shown, "version",
    )


def eviction_finding(limit: int, policy: str, shown: str) -> Finding | None:
    """A WARNING for a lease Redis that may evict keys under memory pressure."""
    if limit > 0 and policy != "noeviction":
        return Finding(
            logging.WARNING,
            f"the lease Redis {shown} has maxmemory={limit} with maxmemory-policy={policy}: under memory"
            " pressure it may evict lease keys (they carry TTLs), letting a second run take a held"
            " key; use maxmemory-policy noeviction for the singleflight Redis",
            shown, "eviction",
        )
    return None


def replication_finding(info: dict[str, Any], shown: str) -> Finding | None:
    replicas = int(info.get("connected_slaves", 0) or 0)
    # min_slaves_good_slaves is in INFO only while min-replicas-to-write (and its max lag) is set
    if info.get("role") == "master" and replicas > 0 and "min_slaves_good_slaves" not in info:
        return Finding(
            logging.WARNING,
            f"the lease Redis {shown} is a primary with {replicas} connected replica(s) and no"
            " min-replicas-to-write: replication is asynchronous, so a failover can promote a replica"
            " that never saw a lease and hand a held key (and an equal fence) to a second holder"
            " (docs/guarantees.md, 'What is not guaranteed'); set min-replicas-to-write to narrow the"
            " window, or keep leases on a single primary",
            shown, "replication",
        )
    return None


def replica_refusal(target: LeaseRedis, primary: str) -> Finding:
    of = f" of {primary}" if primary else ""
    return Finding(
        logging.ERROR,
        f"the lease Redis {target.shown} is a replica{of}: leases written there would be refused"
        " (READONLY) or lost at its next sync with the primary; point singleflight_redis_url at the primary",
        target.shown, "replication",
    )


def clock_finding(before: float, server: float, after: float, url: str) -> Finding | None:
    """The WARNING for a Redis clock that differs from ours by more than :data:`MAX_CLOCK_SKEW`.

    Only a skew that exceeds the limit whatever the round trip hid (``(after - before) / 2``)
    counts, so a slow reply cannot raise a false alarm.
    """
    skew = clock_skew(before, server, after)
    if abs(skew) - (after - before) / 2 <= MAX_CLOCK_SKEW:
        return None
    side = "ahead of" if skew > 0 else "behind"
    return Finding(
        logging.WARNING,
        f"the clock of the lease Redis {url} is {abs(skew):.3f} s {side} this worker's: fences are"
        " seeded from Redis TIME, and the since/ttl_left that status() and the CLI show are read"
        " against local time; synchronise both clocks (NTP)",
        url, "clock",
    )


def ttl_findings(target: LeaseRedis) -> list[Finding]:
    """A WARNING when a renewal can block longer than the lease TTL of some tasks.

    The heartbeat renews through the shared client, whose call is bounded by its timeouts, not
    by the lease: on dropped packets one renewal blocks ``attempts x socket_timeout`` (3 x 5 s).
    ``self.lease.check()``, ``progress()`` and ``lease.lost`` read the lease's own clock and stop
    in time anyway; a body that reads none of them, and the ``lease_lost`` signal and its log line,
    wait for the blocked call.
    """
    kwargs = target.client.connection_pool.connection_kwargs
    timeout = kwargs.get("socket_timeout")
    retry: Any = kwargs.get("retry")
    if not timeout:
        return []
    retries = 0
    if retry is not None:
        getter = getattr(retry, "get_retries", None)
        retries = int(getter() if callable(getter) else getattr(retry, "_retries", 0))
    attempts = 1 + max(0, retries)
    bound = attempts * float(timeout)
    short: dict[float, list[Any]] = {}
    for task in target.tasks:
        if task.options.ttl < bound:
            short.setdefault(task.options.ttl, []).append(task)
    if not short:
        return []
    groups = "; ".join(f"{_names(tasks)} ({_seconds(ttl)})" for ttl, tasks in sorted(short.items()))
    return [Finding(
        logging.WARNING,
        f"on the lease Redis {target.shown}, one renewal that meets dropped packets can block the"
        f" heartbeat for up to {_seconds(bound)} ({attempts} attempts x socket_timeout"
        f" {_seconds(float(timeout))}), longer than the lease TTL of tasks {groups}: for them"
        " the lease_lost signal and its log line can come after the lease expired and another run took"
        " the key (self.lease.check(), self.lease.lost and self.progress() read the lease's own clock"
        f" and stop in time); use a TTL of at least {_seconds(bound)} where code relies on the signal",
        target.shown, "ttl",
    )]


def protocol_finding(found: int | None, namespace: str, shown: str) -> Finding | None:
    """A WARNING when a worker of another protocol version started in ``namespace`` (its mark
    says ``found``): name both versions, and whether this worker reads its records."""
    if found is None or found == PROTOCOL:
        return None
    if found in READS:
        what = "this worker reads its records; workers of both versions take the same keys safely"
    else:
        what = ("this worker refuses the keys whose records it wrote (each such run is re-sent, not run"
                " unguarded): stop the workers of the other version before starting these")
    return Finding(
        logging.WARNING,
        f"a worker of protocol version {found} started in namespace {namespace!r} on the lease Redis {shown};"
        f" this worker speaks version {PROTOCOL} (reads {', '.join(map(str, READS))}): {what}",
        shown, "protocol",
    )


def _broker(app: Any) -> tuple[str, str]:
    """(transport name, URL) of the app's broker, read from the settings (nothing is imported)."""
    conf = app.conf
    url: Any = conf.get("broker_write_url") or conf.get("broker_url") or ""
    if isinstance(url, (list, tuple)):
        url = url[0] if url else ""
    url = str(url).split(";")[0].strip()
    scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    transport = scheme or str(conf.get("broker_transport") or "").lower()
    return transport, url


def visibility_findings(app: Any, worker_time_limit: float | None = None) -> list[Finding]:
    """One WARNING when guarded ``acks_late`` tasks can outlive the broker's visibility timeout."""
    transport, url = _broker(app)
    if transport not in _VISIBILITY_DEFAULTS:
        return []
    options = app.conf.get("broker_transport_options") or {}
    visibility = float(options.get("visibility_timeout", _VISIBILITY_DEFAULTS[transport]))
    default_limit = worker_time_limit if worker_time_limit is not None else app.conf.get("task_time_limit")
    longer: list[str] = []
    unlimited: list[Any] = []
    for task in guarded_tasks(app):
        acks_late = getattr(task, "acks_late", None)
        if acks_late is None:
            acks_late = app.conf.get("task_acks_late")
        if not acks_late:
            continue
        limit = getattr(task, "time_limit", None)
        if limit is None:
            limit = default_limit
        if not limit:
            unlimited.append(task)
        elif float(limit) >= visibility:
            longer.append(f"{task.name} (time_limit {_seconds(float(limit))})")
    if not longer and not unlimited:
        return []
    parts = []
    if longer:
        parts.append(f"tasks {', '.join(sorted(longer))} may run longer than that")
    if unlimited:
        parts.append(f"tasks {_names(unlimited)} have no time limit, so any of their runs longer than"
                     f" {_seconds(visibility)} is delivered again")
    shown = redacted_url(url) if url else transport
    return [Finding(
        logging.WARNING,
        f"the broker ({shown}) delivers an unacknowledged message again after its visibility timeout"
        f" ({_seconds(visibility)}), and guarded tasks run with acks_late: {'; '.join(parts)}."
        " The second delivery is turned away while the first one runs, but each costs a delivery;"
        " set broker_transport_options['visibility_timeout'] above the longest time_limit",
        shown, "visibility_timeout",
    )]


