"""The checks a worker runs once at start against each lease Redis, and against its broker settings.

They run in the worker's main process (the library's worker bootstep, before the pool forks), once per
distinct lease Redis used by the app's guarded tasks, on a short-lived client of their own: one
connection attempt (2 s), no retries, so a Redis that is down costs the start seconds at most.

Per lease Redis, one summary INFO line (``lease Redis redis://…: Redis 7.0.15, role master, 12
scripts loaded, clock skew +0.003 s``; passwords are redacted) and, where needed:

- **reachability** (``PING``): unreachable is a WARNING, the worker starts and tasks follow
  ``on_redis_error`` until Redis answers;
- **permissions**: ``EVALSHA`` (probed with an unknown script, so nothing runs) and ``SCRIPT LOAD``
  of every lease script (which also warms the script cache). A NOPERM for a command the library
  needs on every run (``PING``, ``SELECT``, ``EVALSHA``, ``SCRIPT LOAD``) stops the worker;
- **role**: from ``HELLO`` (which needs no permission) and ``INFO replication``. A replica stops the
  worker; a primary with connected replicas and no ``min-replicas-to-write`` is a WARNING;
- **eviction**: ``CONFIG GET maxmemory*``; a policy other than ``noeviction`` is a WARNING;
- **clock**: Redis ``TIME`` against ``time.time()`` (midpoint of the round trip), a WARNING beyond
  :data:`MAX_CLOCK_SKEW`;
- **lease TTL** against the client's timeouts, a WARNING (see :func:`_ttl_findings`).

``CONFIG`` and ``INFO`` are optional: a refusal is logged at DEBUG and the check skipped. Every
refusal is an entry in Redis's ``ACL LOG``, so after a refused ``CONFIG GET`` the worker does not
try ``INFO`` as well (the role still comes from ``HELLO``). Under the recommended per-tenant ACL
(docs/isolation.md) a worker start therefore adds exactly one entry, ``config|get``.

Once per app: the broker's visibility timeout against the time limits of guarded ``acks_late``
tasks (Redis and SQS brokers), a WARNING.

Any unexpected error inside a check is logged at DEBUG and never keeps a worker from starting;
only a refusal (a :class:`Finding` at ERROR) does.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time as mod_time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from . import scripts
from .clients import RedisTarget, build_client, is_cluster, target_from_settings
from .connection import UNREACHABLE, redacted_url
from .errors import ConfigurationError
from .guard import options_store
from .registry import guarded_tasks

__all__ = [
    "MAX_CLOCK_SKEW",
    "Finding",
    "clock_finding",
    "clock_skew",
    "preflight",
    "run_at_worker_start",
    "visibility_findings",
]

log = logging.getLogger("celery_singleflight.preflight")

#: seconds of difference between Redis ``TIME`` and the worker's clock beyond which a worker warns
MAX_CLOCK_SKEW = 1.0
#: the probe client's timeouts: one connection attempt, no retries
PROBE_CONNECT_TIMEOUT = 2.0
PROBE_SOCKET_TIMEOUT = 3.0
#: kombu's default visibility timeouts, by broker transport
_VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "redis+socket": 3600.0, "sentinel": 3600.0,
                        "sqs": 1800.0}
#: a script SHA nobody loaded: EVALSHA answers NOSCRIPT when permitted and NOPERM when not, and runs nothing
_UNKNOWN_SHA = "0" * 40
_ACL_DOC = "docs/isolation.md"


@dataclass(frozen=True)
class Finding:
    """One result of a start check.

    ``level`` is a :mod:`logging` level: INFO for the summary of a lease Redis, WARNING for
    something to fix, ERROR for a refusal (the worker does not start). ``url`` is the redacted
    URL of the Redis (or broker) concerned; ``check`` names the check (``reachability``,
    ``scripts``, ``replication``, ``eviction``, ``clock``, ``ttl``, ``visibility_timeout``,
    ``summary``).
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


def _refused_command(exc: BaseException) -> str:
    found = re.search(r"'([^']+)' command", str(exc))
    return found.group(1) if found else "a command"


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _names(tasks: list[Any]) -> str:
    return ", ".join(sorted(str(getattr(task, "name", task)) for task in tasks))


@dataclass
class _LeaseRedis:
    """One lease Redis and the guarded tasks that use it."""

    url: str
    client: redis.Redis
    tasks: list[Any] = field(default_factory=list)
    target: RedisTarget | None = None

    @property
    def shown(self) -> str:
        return self.target.describe() if self.target is not None else redacted_url(self.url)


def _lease_redises(app: Any) -> list[_LeaseRedis]:
    """The distinct lease Redis clients of the app's guarded tasks (one per URL and process)."""
    found: dict[int, _LeaseRedis] = {}
    for task in guarded_tasks(app):
        opts = task.options
        client = options_store(opts).client
        target = found.get(id(client))
        if target is None:
            target = found[id(client)] = _LeaseRedis(opts.redis_url, client, target=opts.redis)
        target.tasks.append(task)
    return list(found.values())


def _probe_client(target: _LeaseRedis) -> Any:
    """A client of its own for the checks: one attempt, short timeouts, closed afterwards (built
    like the lease client: TLS, Sentinel, Cluster; a client factory's own client is used as is)."""
    settings = target.target or target_from_settings(target.url)
    if settings.factory is not None:
        return target.client
    common: dict[str, Any] = {
        "socket_connect_timeout": PROBE_CONNECT_TIMEOUT, "socket_timeout": PROBE_SOCKET_TIMEOUT,
        "retry": Retry(NoBackoff(), 0),
    }
    if not settings.cluster:
        common["health_check_interval"] = 0
    return build_client(settings, common)


class _Unreachable(Exception):
    """Redis stopped answering in the middle of the checks: skip the rest."""


def _safely(name: str, url: str, check: Callable[[], Any]) -> Any:
    """Run one check; an unexpected error is logged at DEBUG and the check gives nothing."""
    try:
        return check()
    except _Unreachable:
        raise
    except UNREACHABLE as exc:
        log.debug("start check %s of %s: Redis stopped answering: %s", name, url, exc)
        raise _Unreachable(str(exc)) from exc
    except Exception as exc:  # a check must never keep a worker from starting
        log.debug("start check %s of %s failed, skipped: %s", name, url, exc, exc_info=True)
        return None


def _refusal(target: _LeaseRedis, exc: BaseException, what: str) -> Finding:
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


def _unreachable(target: _LeaseRedis, exc: BaseException) -> Finding:
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


# -- the checks of one lease Redis ---------------------------------------------------------------


def _hello(client: redis.Redis) -> dict[str, str]:
    """``HELLO`` without arguments: server version and role. Needs no ACL permission (Redis 6+)."""
    execute: Any = client.execute_command  # redis-py does not wrap HELLO (it would switch protocols)
    reply: Any = execute("HELLO")
    if isinstance(reply, list):
        reply = dict(zip(reply[::2], reply[1::2], strict=False))

    def text(value: Any) -> str:
        return value.decode() if isinstance(value, bytes) else str(value)

    return {text(k): text(v) for k, v in reply.items() if not isinstance(v, list)}


def _eviction(client: redis.Redis, shown: str) -> Finding | None:
    conf: Any = client.config_get("maxmemory*")
    limit = int(conf.get("maxmemory", 0) or 0)
    policy = str(conf.get("maxmemory-policy", "noeviction"))
    if limit > 0 and policy != "noeviction":
        return Finding(
            logging.WARNING,
            f"the lease Redis {shown} has maxmemory={limit} with maxmemory-policy={policy}: under memory"
            " pressure it may evict lease keys (they carry TTLs), letting a second run take a held"
            " key; use maxmemory-policy noeviction for the singleflight Redis",
            shown, "eviction",
        )
    return None


def _replication(info: dict[str, Any], shown: str) -> Finding | None:
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


def _replica_refusal(target: _LeaseRedis, primary: str) -> Finding:
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


def _clock(client: redis.Redis, shown: str) -> tuple[float, Finding | None]:
    before = mod_time.time()
    seconds, micros = client.time()
    after = mod_time.time()
    server = seconds + micros / 1e6
    return clock_skew(before, server, after), clock_finding(before, server, after, shown)


def _scripts() -> list[str]:
    return list(scripts.ALL_SCRIPTS)


def _load_scripts(client: redis.Redis) -> int:
    """Probe EVALSHA, then SCRIPT LOAD every lease script; raises NoPermissionError when refused."""
    with contextlib.suppress(redis.exceptions.NoScriptError):
        client.evalsha(_UNKNOWN_SHA, 0)  # permitted: NOSCRIPT; refused: NOPERM
    texts = _scripts()
    if not texts:
        return 0
    client.script_load(texts[0])  # a refusal raises here, once (one ACL LOG entry)
    pipe = client.pipeline(transaction=False)
    for text in texts[1:]:
        pipe.script_load(text)
    pipe.execute()
    return len(texts)


def _ttl_findings(target: _LeaseRedis) -> list[Finding]:
    """A WARNING when a renewal can block longer than the lease TTL of some tasks.

    The heartbeat renews through the shared client, whose call is bounded by its timeouts, not
    by the lease: on dropped packets one renewal blocks ``attempts x socket_timeout`` (3 x 5 s).
    ``self.lease.check()`` and ``progress()`` read the lease's own clock and stop in time anyway;
    ``lease.lost``, the ``lease_lost`` signal and its log line wait for the blocked call.
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
        " lease.lost, the lease_lost signal and its log line can come after the lease expired and"
        " another run took the key (self.lease.check() and self.progress() read the lease's own clock"
        f" and stop in time); use a TTL of at least {_seconds(bound)} where code relies on lease.lost",
        target.shown, "ttl",
    )]


def _check_lease_redis(target: _LeaseRedis) -> list[Finding]:
    """The checks of one lease Redis, over a probe client of their own."""
    shown = target.shown
    client = _probe_client(target)
    if is_cluster(client):
        return _check_cluster(target, client)
    try:
        try:
            client.ping()
        except UNREACHABLE as exc:
            return [_unreachable(target, exc)]
        except redis.exceptions.NoPermissionError as exc:  # PING, or SELECT of the URL's database
            return [_refusal(target, exc, "on every connection")]
        return _check_reachable(target, client, shown)
    finally:
        if client is not target.client:
            with contextlib.suppress(Exception):
                client.close()


def _check_cluster(target: _LeaseRedis, cluster: Any) -> list[Finding]:
    """The checks of each primary of a Cluster, each over a plain client of that node."""
    findings: list[Finding] = []
    try:
        try:
            primaries = cluster.get_primaries()
        except UNREACHABLE as exc:
            return [_unreachable(target, exc)]
        for node in primaries:
            client = node.redis_connection
            shown = f"{target.shown} (primary {node.host}:{node.port})"
            try:
                client.ping()
            except UNREACHABLE as exc:
                findings.append(_unreachable(target, exc))
                continue
            findings += _check_reachable(target, client, shown)
        return findings
    finally:
        if cluster is not target.client:
            with contextlib.suppress(Exception):
                cluster.close()


def _check_reachable(target: _LeaseRedis, client: redis.Redis, shown: str) -> list[Finding]:
    findings: list[Finding] = []
    facts: list[str] = []
    hello: dict[str, str] = {}
    info: dict[str, Any] = {}
    loaded: int | None = None
    skew: float | None = None
    try:
        hello = _safely("HELLO", shown, lambda: _hello(client)) or {}

        def load() -> int | Finding:
            try:
                return _load_scripts(client)
            except redis.exceptions.NoPermissionError as exc:
                return _refusal(target, exc, "for every lease operation")

        scripts_result = _safely("scripts", shown, load)
        if isinstance(scripts_result, Finding):
            findings.append(scripts_result)
            loaded = -1
        elif isinstance(scripts_result, int):
            loaded = scripts_result

        admin_refused = False

        def eviction() -> Finding | None:
            nonlocal admin_refused
            try:
                return _eviction(client, shown)
            except redis.exceptions.NoPermissionError as exc:
                admin_refused = True
                log.debug("%s: CONFIG GET refused (%s), eviction check skipped", shown, exc)
                return None

        evicts = _safely("eviction", shown, eviction)
        if evicts is not None:
            findings.append(evicts)

        def replication() -> dict[str, Any]:
            if admin_refused:
                log.debug("%s: INFO not tried after CONFIG was refused (each refusal is an ACL LOG"
                          " entry); the role comes from HELLO", shown)
                return {}
            try:
                reply: Any = client.info("replication")
                return dict(reply)
            except redis.exceptions.NoPermissionError as exc:
                log.debug("%s: INFO refused (%s), replication check skipped", shown, exc)
                return {}

        info = _safely("replication", shown, replication) or {}

        def clock() -> tuple[float, Finding | None]:
            return _clock(client, shown)

        timed = _safely("clock", shown, clock)
        if timed is not None:
            skew, late = timed
            if late is not None:
                findings.append(late)
    except _Unreachable as exc:
        findings.append(_unreachable(target, exc))

    if hello.get("version"):
        facts.append(f"Redis {hello['version']}")
    role = str(info.get("role", "")) or hello.get("role", "")  # INFO says slave, HELLO replica
    role = "replica" if role == "slave" else role
    if role:
        facts.append(f"role {role}")
    if role == "replica":
        primary = f"{info['master_host']}:{info['master_port']}" if info.get("master_host") else ""
        findings.append(_replica_refusal(target, primary))
    elif info:
        replicas = int(info.get("connected_slaves", 0) or 0)
        facts.append(f"{replicas} replica{'' if replicas == 1 else 's'}")
        failover = _replication(info, shown)
        if failover is not None:
            findings.append(failover)
    if loaded is not None:
        facts.append("scripts refused" if loaded < 0 else f"{loaded} scripts loaded")
    if skew is not None:
        facts.append(f"clock skew {skew:+.3f} s".replace("-0.000", "+0.000"))
    summary = Finding(logging.INFO, f"lease Redis {shown}: {', '.join(facts) or 'answers'}", shown, "summary")
    return [summary, *findings]


# -- once per app ---------------------------------------------------------------------------------


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


def preflight(app: Any, *, worker_time_limit: float | None = None) -> list[Finding]:
    """Run every start check for ``app`` and return what they found; logs only at DEBUG.

    ``worker_time_limit``: the worker's default hard time limit (``--time-limit``), if known.
    Refusals are findings at ERROR (:attr:`Finding.refusal`); the caller decides what to do.
    """
    findings: list[Finding] = []
    targets: list[_LeaseRedis] = _safely_app("lease Redis list", lambda: _lease_redises(app)) or []
    for target in targets:
        findings += _safely_app(f"lease Redis {target.shown}", partial(_check_lease_redis, target)) or []
        findings += _safely_app(f"TTL of {target.shown}", partial(_ttl_findings, target)) or []
    findings += _safely_app("visibility timeout", lambda: visibility_findings(app, worker_time_limit)) or []
    return findings


def _safely_app(name: str, check: Callable[[], Any]) -> Any:
    try:
        return check()
    except Exception as exc:  # a check must never keep a worker from starting
        log.debug("start check %s failed, skipped: %s", name, exc, exc_info=True)
        return None


def run_at_worker_start(app: Any, worker: Any = None) -> list[Finding]:
    """The worker-start entry point: run :func:`preflight`, log its findings, stop on a refusal.

    Raises :class:`~celery_singleflight.errors.ConfigurationError` with the first refusal's
    sentence (further refusals are logged at ERROR); anything else is only logged.
    """
    limit = getattr(worker, "time_limit", None)
    limit = limit if isinstance(limit, (int, float)) else None
    run = partial(preflight, app, worker_time_limit=limit)
    findings: list[Finding] = _safely_app("start checks", run) or []
    refusals = [finding for finding in findings if finding.refusal]
    for finding in findings:
        if not finding.refusal:
            log.log(finding.level, "%s", finding.message)
    for finding in refusals[1:]:
        log.error("%s", finding.message)
    if refusals:
        raise ConfigurationError(refusals[0].message)
    return findings
