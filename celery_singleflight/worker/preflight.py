"""The checks a worker runs once at start against each lease Redis, and against its broker settings.

They run in the worker's main process (the library's worker bootstep, before the pool forks), once per
distinct lease Redis used by the app's guarded tasks, on a short-lived client of their own: one
connection attempt (2 s), no retries, so a Redis that is down costs the start seconds at most.

Per lease Redis, one summary INFO line naming the server (``lease Redis redis://…: Valkey 8.0.1,
role master, 0 replicas, 12 scripts loaded, clock skew +0.003 s``; passwords are redacted) and,
where needed:

- **reachability** (``PING``): unreachable is a WARNING, the worker starts and tasks follow
  ``on_redis_error`` until Redis answers;
- **server** (one ``INFO``, which the documented ACL rule grants; ``HELLO``, which needs no
  permission, when it is refused): family and version (:mod:`..protocol.servers`; Valkey's
  ``redis_version`` is always 7.2.4), a server older than the oldest supported stops the worker;
- **permissions**: ``EVALSHA`` (probed with an unknown script, so nothing runs) and ``SCRIPT LOAD``
  of every lease script (which also warms the script cache). A NOPERM for a command the library
  needs on every run (``PING``, ``SELECT``, ``EVALSHA``, ``SCRIPT LOAD``) stops the worker;
- **role**: from ``INFO`` (else ``HELLO``). A replica stops the worker; a primary with connected
  replicas and no ``min-replicas-to-write`` is a WARNING;
- **eviction**: ``maxmemory`` and ``maxmemory_policy`` from ``INFO``; a policy other than
  ``noeviction`` is a WARNING;
- **persistence**: ``aof_enabled`` from ``INFO`` and, asked of the default user only, ``CONFIG
  GET append*`` and ``save`` for the details, against the tasks that keep waiting runs there
  (:mod:`.persistence`): without an append-only file, a WARNING or a refusal, as
  ``singleflight_require_persistence`` says; otherwise INFO;
- **clock**: Redis ``TIME`` against ``time.time()`` (midpoint of the round trip), a WARNING beyond
  :data:`~..constants.MAX_CLOCK_SKEW`;
- **lease TTL** against the client's timeouts, a WARNING (see :func:`.findings.ttl_findings`).

Every refusal is an entry in Redis's ``ACL LOG``, and Redis has no way for a restricted user to
ask what it may run, so the checks never ask a named ACL user for ``CONFIG`` and never ask again
after a refusal: under the documented rule (docs/isolation.md) a worker start leaves ``ACL LOG``
empty. A refused ``CONFIG`` (or one a managed service renamed) keeps what ``INFO`` said.

Once per app: the broker's visibility timeout against the time limits of guarded ``acks_late``
tasks (Redis and SQS brokers), a WARNING.

Any unexpected error inside a check is logged at DEBUG and never keeps a worker from starting;
only a refusal (a :class:`Finding` at ERROR) does.
"""

from __future__ import annotations

import contextlib
import logging
import time as mod_time
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..connection.clients import UNREACHABLE
from ..connection.targets import build_client, is_cluster, target_from_settings
from ..constants import PROBE_CONNECT_TIMEOUT, PROBE_SOCKET_TIMEOUT
from ..errors import ConfigurationError
from ..protocol import server
from ..protocol.servers import ServerKind, server_kind
from ..protocol.store import SCRIPTS
from ..run.guard import options_store
from .findings import (
    Finding,
    LeaseRedis,
    clock_finding,
    clock_skew,
    eviction_finding,
    old_server_refusal,
    protocol_finding,
    refusal,
    replica_refusal,
    replication_finding,
    ttl_findings,
    unreachable,
    visibility_findings,
)
from .persistence import persistence_finding, read_persistence
from .registry import guarded_tasks

__all__ = ["Finding", "clock_finding", "clock_skew", "preflight", "run_at_worker_start",
           "visibility_findings"]

log = logging.getLogger("celery_singleflight.preflight")


def _lease_redises(app: Any) -> list[LeaseRedis]:
    """The distinct lease Redis clients of the app's guarded tasks (one per URL and process)."""
    found: dict[int, LeaseRedis] = {}
    for task in guarded_tasks(app):
        opts = task.options
        client = options_store(opts).client
        target = found.get(id(client))
        if target is None:
            target = found[id(client)] = LeaseRedis(opts.redis_url, client, target=opts.redis)
        target.tasks.append(task)
    return list(found.values())


def _probe_client(target: LeaseRedis) -> Any:
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


def _check_lease_redis(target: LeaseRedis) -> list[Finding]:
    """The checks of one lease Redis, over a probe client of their own."""
    shown = target.shown
    client = _probe_client(target)
    if is_cluster(client):
        return _check_cluster(target, client)
    try:
        try:
            server.ping(client)
        except UNREACHABLE as exc:
            return [unreachable(target, exc)]
        except redis.exceptions.NoPermissionError as exc:  # PING, or SELECT of the URL's database
            return [refusal(target, exc, "on every connection")]
        return _check_reachable(target, client, shown)
    finally:
        if client is not target.client:
            with contextlib.suppress(Exception):
                client.close()


def _check_cluster(target: LeaseRedis, cluster: Any) -> list[Finding]:
    """The checks of each primary of a Cluster, each over a plain client of that node."""
    findings: list[Finding] = []
    try:
        try:
            primaries = cluster.get_primaries()
        except UNREACHABLE as exc:
            return [unreachable(target, exc)]
        for node in primaries:
            client = node.redis_connection
            shown = f"{target.shown} (primary {node.host}:{node.port})"
            try:
                server.ping(client)
            except UNREACHABLE as exc:
                findings.append(unreachable(target, exc))
                continue
            findings += _check_reachable(target, client, shown)
        return findings
    finally:
        if cluster is not target.client:
            with contextlib.suppress(Exception):
                cluster.close()


def _summary(target: LeaseRedis, shown: str, kind: ServerKind | None, role: str, info: dict[str, Any],
             loaded: int | None, skew: float | None, findings: list[Finding]) -> list[Finding]:
    """The INFO summary of one lease Redis (the server's family and version first), then what its
    checks found (and the replica refusal, read from its role)."""
    facts: list[str] = []
    if kind is not None:
        facts.append(str(kind))
    role = "replica" if role == "slave" else role  # INFO says slave, HELLO replica
    if role:
        facts.append(f"role {role}")
    if role == "replica":
        primary = f"{info['master_host']}:{info['master_port']}" if info.get("master_host") else ""
        findings.append(replica_refusal(target, primary))
    elif "connected_slaves" in info:
        replicas = int(info.get("connected_slaves", 0) or 0)
        facts.append(f"{replicas} replica{'' if replicas == 1 else 's'}")
        failover = replication_finding(info, shown)
        if failover is not None:
            findings.append(failover)
    if loaded is not None:
        facts.append("scripts refused" if loaded < 0 else f"{loaded} scripts loaded")
    if skew is not None:
        facts.append(f"clock skew {skew:+.3f} s".replace("-0.000", "+0.000"))
    summary = Finding(logging.INFO, f"lease Redis {shown}: {', '.join(facts) or 'answers'}", shown, "summary")
    return [summary, *findings]


def _config_not_asked(client: Any, info_refused: bool) -> str:
    """Why ``CONFIG GET`` is not asked of this connection's user ('' when it is): an ACL user
    (the documented rule grants ``INFO``, never ``CONFIG``, whose values include secrets) or one
    refused ``INFO`` already. Each refusal is an entry in Redis's ``ACL LOG``; Redis has no way to
    ask what a user may run that a restricted user may run (``ACL DRYRUN`` is refused to it)."""
    if info_refused:
        return "INFO was refused to this user, so CONFIG GET was not asked"
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    user = kwargs.get("username")
    if user and user != "default":
        return f"CONFIG GET is not asked of ACL user {user}"
    return ""


def _check_protocol(target: LeaseRedis, client: redis.Redis, shown: str) -> list[Finding]:
    """Mark this worker's protocol version in each namespace its tasks use; a warning for each
    namespace where a worker of another version started."""
    findings = []
    for namespace in sorted({task.options.namespace for task in target.tasks}):
        found = _safely("protocol", shown, partial(server.mark_protocol, client, namespace))
        mixed = protocol_finding(found, namespace, shown)
        if mixed is not None:
            findings.append(mixed)
    return findings


def _check_reachable(target: LeaseRedis, client: redis.Redis, shown: str) -> list[Finding]:
    findings: list[Finding] = []
    hello: dict[str, str] = {}
    info: dict[str, Any] = {}
    kind: ServerKind | None = None
    loaded: int | None = None
    skew: float | None = None
    try:
        hello = _safely("HELLO", shown, lambda: server.hello(client)) or {}
        info_refused = False

        def read_info() -> dict[str, Any]:
            nonlocal info_refused
            try:
                return server.info(client)
            except redis.exceptions.NoPermissionError as exc:
                info_refused = True
                log.debug("%s: INFO refused (%s): the role and version come from HELLO", shown, exc)
                return {}

        info = _safely("INFO", shown, read_info) or {}
        kind = server_kind(info, hello)
        if kind is not None and kind.too_old:
            findings.append(old_server_refusal(target, kind))

        def load() -> int | Finding:
            try:
                probe_key = server.mark_key(target.tasks[0].options.namespace)  # a LeaseRedis has tasks
                return server.load_scripts(client, [script.source for script in SCRIPTS], probe_key)
            except redis.exceptions.NoPermissionError as exc:
                return refusal(target, exc, "for every lease operation")

        scripts_result = _safely("scripts", shown, load)
        if isinstance(scripts_result, Finding):
            findings.append(scripts_result)
            loaded = -1
        elif isinstance(scripts_result, int):
            loaded = scripts_result

        not_asked = _config_not_asked(client, info_refused)

        def eviction() -> Finding | None:
            if "maxmemory_policy" in info:
                limit = int(info.get("maxmemory", 0) or 0)
                return eviction_finding(limit, str(info["maxmemory_policy"]), shown)
            if not_asked:
                return None
            try:
                return eviction_finding(*server.config_memory(client), shown)
            except redis.exceptions.NoPermissionError as exc:
                log.debug("%s: CONFIG GET refused (%s), eviction check skipped", shown, exc)
                return None

        evicts = _safely("eviction", shown, eviction)
        if evicts is not None:
            findings.append(evicts)

        def persistence() -> Finding | None:
            mode = target.tasks[0].options.require_persistence if target.tasks else "off"
            if mode == "off":
                return None  # asks nothing: one CONFIG GET fewer
            found = read_persistence(client, info or None, ask_config=not not_asked, unread=not_asked)
            return persistence_finding(shown, target.tasks, found, mode)

        persists = _safely("persistence", shown, persistence)
        if persists is not None:
            findings.append(persists)

        def clock() -> tuple[float, Finding | None]:
            before = mod_time.time()
            at = server.server_time(client)
            after = mod_time.time()
            return clock_skew(before, at, after), clock_finding(before, at, after, shown)

        timed = _safely("clock", shown, clock)
        if timed is not None:
            skew, late = timed
            if late is not None:
                findings.append(late)
        findings.extend(_check_protocol(target, client, shown))
    except _Unreachable as exc:
        findings.append(unreachable(target, exc))

    role = str(info.get("role") or hello.get("role") or "")
    return _summary(target, shown, kind, role, info, loaded, skew, findings)


# -- once per app ---------------------------------------------------------------------------------


def preflight(app: Any, *, worker_time_limit: float | None = None) -> list[Finding]:
    """Run every start check for ``app`` and return what they found; logs only at DEBUG.

    ``worker_time_limit``: the worker's default hard time limit (``--time-limit``), if known.
    Refusals are findings at ERROR (:attr:`Finding.refusal`); the caller decides what to do.
    """
    findings: list[Finding] = []
    targets: list[LeaseRedis] = _safely_app("lease Redis list", lambda: _lease_redises(app)) or []
    for target in targets:
        findings += _safely_app(f"lease Redis {target.shown}", partial(_check_lease_redis, target)) or []
        findings += _safely_app(f"TTL of {target.shown}", partial(ttl_findings, target)) or []
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
