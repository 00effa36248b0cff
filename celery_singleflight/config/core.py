"""The core options: where the leases live, the lease itself, Redis trouble, status and progress.

The options of each feature (the duplicate policies, newest wins, ordering, idempotency,
enqueue-time dedup, the time policies) are declared with the feature, in :mod:`..policies`.
"""

from __future__ import annotations

from typing import Any

from .. import constants
from ..connection.targets import RedisTarget
from ..errors import ConfigurationError, KeyTemplateError
from ..protocol.layout import Layout
from .option import Derived, Option, OptionGroup, Resolving, anything, choice, count, flag, rate, seconds
from .settings import redis_target_for, redis_url_for

__all__ = ["PERSISTENCE_MODES", "REDIS_ERROR_MODES", "CoreOptions"]

REDIS_ERROR_MODES = ("fail_closed", "fail_open")
#: what a worker does at start when waiting runs live in a lease Redis without an append-only file
PERSISTENCE_MODES = ("warn", "refuse", "off")


def _redis_url(where: str, value: Any, ctx: Resolving) -> str:
    return redis_url_for(ctx.conf)


def _namespace(where: str, value: Any, ctx: Resolving) -> str:
    try:
        if not isinstance(value, str):
            raise KeyTemplateError(f"a namespace is a string, not {type(value).__name__}")
        Layout(value)  # the rule lives with the layout
    except KeyTemplateError as exc:
        raise ConfigurationError(f"{where} must be a non-empty string without whitespace or braces,"
                                 f" not {value!r}") from exc
    return value


def _heartbeat(where: str, value: Any, ctx: Resolving) -> float:
    ttl = ctx.values["ttl"]
    if value is None:
        return float(ttl) / 3
    interval = float(seconds()(where, value, ctx))
    if interval >= ttl:
        raise ConfigurationError(
            f"{where} is {interval}s but must be shorter than the lease TTL ({ttl}s); leave it unset for"
            " TTL/3"
        )
    return interval


def _mode(where: str, value: Any, ctx: Resolving) -> str:
    if value not in REDIS_ERROR_MODES:
        raise ConfigurationError(f"{where} is {value!r}; choose one of {', '.join(REDIS_ERROR_MODES)}")
    return str(value)


def _max_wait(where: str, value: Any, ctx: Resolving) -> float | None:
    if value in ("none", "None", float("inf")):
        return None
    return seconds(allow_zero=True)(where, value, ctx)  # type: ignore[no-any-return]


def _replica_timeout(where: str, value: Any, ctx: Resolving) -> float:
    timeout = float(seconds()(where, value, ctx))
    transport = ctx.values.get("redis_transport_options")
    limit = float((transport.get("socket_timeout") if isinstance(transport, dict) else None)
                  or constants.SOCKET_TIMEOUT)
    if timeout >= min(limit, ctx.values["ttl"]):
        raise ConfigurationError(
            f"{where} is {timeout}s but must be shorter than the lease TTL ({ctx.values['ttl']}s) and the"
            f" Redis socket timeout ({limit}s): WAIT holds the connection that long"
        )
    return timeout


def _target(ctx: Resolving) -> RedisTarget:
    return redis_target_for(ctx.conf)


class CoreOptions(OptionGroup):
    """Where the leases live, the lease, Redis trouble, status and progress."""

    __slots__ = ()
    title = "The lease"

    redis_url = Option[str](
        check=_redis_url, default_text="the broker URL if it is Redis, else the result backend's if it is,"
                          " else a `ConfigurationError`",
        meaning="The Redis that holds the leases, their status, queues and markers (a database of the"
        " broker's Redis, or a Redis of its own); checked at worker start"
        " ([guarantees](guarantees.md#what-the-library-checks-when-a-worker-starts)).",
        values="A `redis://`, `rediss://` (TLS) or `unix://` URL, with user and password if needed;"
        " Sentinel: `sentinel://[:password@]host:port[;sentinel://host:port…]`, with `master_name` in the"
        " transport options; Cluster: `redis+cluster://` or `rediss+cluster://host:port[,host:port…]`"
        " (startup nodes, no database) ([operations](operations.md)).",
    )
    redis_transport_options = Option[Any](
        check=anything, default_text="`{}`",
        meaning="Connection options a URL cannot carry, as in Celery's `result_backend_transport_options`:"
        " `master_name` (Sentinel), `sentinel_kwargs` (the sentinels' own password or TLS), `ssl_cert_reqs`,"
        " `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_check_hostname`, `socket_timeout`,"
        " `socket_connect_timeout`, `health_check_interval`, `max_connections`, `username`, `password`"
        " ([operations](operations.md)).",
        values="A dict of those names. An unknown name, TLS options with `redis://`, or `sentinel://`"
        " without `master_name` fail at worker start.",
    )
    redis_client = Option[Any](
        check=anything, default_text="`None`: built from the URL",
        meaning="A callable (or its dotted path, `\"proj.redis:make_client\"`) returning a ready"
        " `redis.Redis` or `redis.cluster.RedisCluster`, for what the URL and transport options cannot say."
        " Called once per process (again after a fork).",
        values="A callable without arguments, or its path; then `singleflight_redis_transport_options` must"
        " be unset.",
    )
    #: the URL with its transport options or client factory (one client per target)
    redis = Derived[RedisTarget](_target)
    require_persistence = Option[str](
        default="warn", check=choice(PERSISTENCE_MODES),
        meaning="What a worker does at start when some of its tasks keep parked or delayed runs in the lease"
        " Redis and that Redis has no append-only file, so a restart loses them"
        " ([operations](operations.md#persistence-of-the-lease-redis)): `warn` logs a WARNING naming the"
        " tasks, `refuse` stops the worker.",
        values="`\"warn\"`, `\"refuse\"` or `\"off\"` (no check). Read from `INFO`; a Redis that"
        " answers neither `INFO` nor `CONFIG GET` is reported at INFO, never refused.",
    )
    namespace = Option[str](
        task="lock_namespace", default="sf", check=_namespace,
        meaning="The prefix of every Redis key the library writes (`<namespace>:{<key>}:run` ..., [how it"
        " works](how-it-works.md#redis-keys)). The same key in two namespaces is two unrelated locks: give"
        " each app or tenant sharing a Redis its own ([isolation](isolation.md)).",
        values="A non-empty string without whitespace or braces.",
    )
    lock_key = Option[Any](
        setting=False, task="lock_key", check=anything,
        default_text="required",
        meaning="The key a run holds: a template (`\"sync:<account_id>\"`, `<invoice.id>`, `<@task>`) or a"
        " callable of the task's arguments ([key templates](keys.md)). Missing, or naming a parameter the"
        " task lacks, it fails when the task is defined.",
        values="A string template or a callable returning a string.",
    )
    ttl = Option[float](
        task="lock_ttl", default=30.0, check=seconds(),
        meaning="How long a lease lives without renewal. The heartbeat renews it while the task runs, so it"
        " bounds how long a dead host keeps a key, not how long a task may run.",
        values="Seconds, above zero.",
    )
    heartbeat_interval = Option[float](
        task="heartbeat_interval", check=_heartbeat, default_text="a third of the TTL",
        meaning="How often the process's heartbeat thread renews all its leases (in one round trip).",
        values="Seconds, above zero and below the TTL.",
    )
    max_concurrency = Option[int](
        task="max_concurrency", default=1, check=count(1),
        meaning="How many runs of one key may run at once, each with its own lease slot; duplicates beyond"
        " it get the task's policy ([flow control](flow.md#max_concurrencyn)).",
        values="A whole number, at least 1 (`join` needs 1).",
    )
    on_redis_error = Option[str](
        task="on_redis_error", default="fail_closed", check=_mode,
        meaning="What a task does when Redis cannot serve its key now (unreachable, or `OOM`, `READONLY`,"
        " `LOADING`, `MASTERDOWN`, `BUSY`, `TRYAGAIN`, `CLUSTERDOWN`, `NOREPLICAS`). `fail_closed`: it is"
        " re-sent every `redis_retry_delay` seconds (state `RETRY`, not counted against `max_retries`) until"
        " `redis_max_wait`. `fail_open`: it runs unguarded, with a WARNING, the `unguarded_run` signal and"
        " `counters.unguarded_runs`. Other Redis errors (`NOPERM`, a script error) fail the task either way;"
        " `hold()` always raises `RedisUnavailable`.",
        values=" or ".join(f"`{mode}`" for mode in REDIS_ERROR_MODES) + ".",
    )
    redis_retry_delay = Option[float](
        task="redis_retry_delay", default=5.0, check=seconds(),
        meaning="`fail_closed`: the delay before a task that found Redis unavailable is tried again.",
        values="Seconds, above zero.",
    )
    redis_max_wait = Option["float | None"](
        task="redis_max_wait", default=600.0, check=_max_wait,
        meaning="`fail_closed`: how long a task is re-sent while Redis is unavailable, before it fails with"
        " `RedisUnavailable`.",
        values="Seconds, zero or more; `\"none\"` or `float(\"inf\")` for no limit.",
    )
    min_replicas = Option[int](
        task="min_replicas", default=0, check=count(0),
        meaning="How many replicas must confirm a grant (`WAIT`) before the body runs, else it counts as"
        " Redis unavailable: a failover cannot hand the key out twice ([guarantees](guarantees.md"
        "#redis-failover)).",
        values="A whole number; 0 (off) or at most the lease Redis's replicas.",
    )
    min_replicas_timeout = Option[float](
        task="min_replicas_timeout", default=0.5, check=_replica_timeout,
        meaning="How long an acquire or a renewal waits for `min_replicas` replicas.",
        values="Seconds, above zero, below the TTL and the Redis socket timeout (5 s).",
    )
    status_retention = Option[float](
        default=300.0, check=seconds(allow_zero=True),
        meaning="How long a run's record (status, outcome, fence) outlives the run, for `status()`, `show`,"
        " watchers and the next fence.",
        values="Seconds; under 30 counts as 30 (re-sent release scripts and the watchers' replay need that"
        " long).",
    )
    history_length = Option[int](
        default=100, check=count(1),
        meaning="How many progress events a key's history stream keeps (`XADD ... MAXLEN ~`) for late"
        " watchers.",
        values="A whole number, at least 1.",
    )
    progress_rate = Option[float](
        task="progress_rate", default=10.0, check=rate(),
        meaning="The most `self.progress()` writes per second per run. Calls in between are coalesced; the"
        " last one is always written.",
        values="A number, above zero.",
    )
    progress_max_bytes = Option[int](
        task="progress_max_bytes", default=8192, check=count(64),
        meaning="The largest progress update, as JSON; a larger one raises `ProgressError`.",
        values="Bytes, a whole number of at least 64.",
    )
    progress_events = Option["bool | None"](
        task="progress_events", check=flag(optional=True),
        default_text="on when the worker sends task events (`-E`, `worker_send_task_events`)",
        meaning="Whether `self.progress()` sends a Celery `task-progress` event, which makes Flower show"
        " PROGRESS ([Flower](flower.md)).",
        values="`True`, `False`, or unset.",
    )
    status_include_args = Option[bool](
        task="status_include_args", default=False, check=flag(),
        meaning="Store the task's arguments in its status record (`KeyStatus.args`, `show`). Off by default:"
        " arguments may hold personal data, and anyone who can read the namespace can read status.",
        values="`True` or `False`.",
    )
