"""What each setting and task option means, and the configuration reference page built from it.

:data:`SETTINGS` documents every entry of :data:`.settings.DEFAULTS` (a test checks that none is
missing and that ``docs/configuration.md`` is exactly :func:`configuration_page`), so the page's
defaults and option names come from the code. After changing a setting, write the page again::

    python -m celery_singleflight.settings_doc > docs/configuration.md
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from .settings import DEFAULTS, POLICIES, REDIS_ERROR_MODES

__all__ = ["SETTINGS", "TASK_ONLY", "SettingDoc", "configuration_page"]


@dataclass(frozen=True)
class SettingDoc:
    """The documentation of one setting (or task option)."""

    meaning: str  #: what it does, in a paragraph of Markdown
    values: str  #: what it accepts, and what is refused
    default: str | None = None  #: the default in words, where the built-in value is computed (``None``)
    precedence: str | None = None  #: where it differs from "task option > setting > default"


_POLICY_LIST = ", ".join(f"`{p}`" for p in POLICIES)

#: setting name (without ``singleflight_``) -> its documentation; one per :data:`.settings.DEFAULTS` entry
SETTINGS: dict[str, SettingDoc] = {
    "redis_url": SettingDoc(
        "The Redis that holds the leases, their status, queues and markers: the broker's Redis (another "
        "database of it) or a Redis of its own. The worker checks it when it starts "
        "([guarantees](guarantees.md#what-the-library-checks-when-a-worker-starts)).",
        "A `redis://`, `rediss://` (TLS) or `unix://` URL, with user and password if the server needs "
        "them; Sentinel as `sentinel://[:password@]host:port[;sentinel://host:port…]` (with `master_name` "
        "in `singleflight_redis_transport_options`); a Cluster as `redis+cluster://` or "
        "`rediss+cluster://host:port[,host:port…]` (startup nodes, no database number) "
        "([operations](operations.md)). Anything else is refused when the task is bound, naming the "
        "setting.",
        default="the broker URL if it is Redis, else the result backend URL if it is Redis, else a "
        "`ConfigurationError` asking for this setting",
    ),
    "namespace": SettingDoc(
        "The prefix of every Redis key the library writes: `<namespace>:{<key>}:run` and so on "
        "([how it works](how-it-works.md#redis-keys)). The same key in two namespaces is two unrelated "
        "locks: give each app or tenant that shares a Redis its own ([isolation](isolation.md)).",
        "A non-empty string without whitespace or braces.",
    ),
    "ttl": SettingDoc(
        "How long a lease lives without a renewal, in seconds. The heartbeat renews it while the task "
        "runs, so it bounds how long a key stays taken after its host died, not how long a task may "
        "run.",
        "A number of seconds, more than zero.",
    ),
    "heartbeat_interval": SettingDoc(
        "How often the process's heartbeat thread renews the leases it holds (all of them in one round "
        "trip).",
        "A number of seconds, more than zero and shorter than the TTL.",
        default="a third of the TTL",
    ),
    "on_duplicate": SettingDoc(
        "What a run does when another run holds its key: see [duplicate policies](policies.md). A task "
        "called directly or eagerly (`task()`, `.apply()`, `task_always_eager`) has no message to "
        "re-send, so a duplicate there always raises `LockHeld`.",
        f"One of {_POLICY_LIST}. `join` also needs `ignore_result=False`, a result backend and "
        "`max_concurrency=1`.",
    ),
    "max_wait": SettingDoc(
        "The `retry` policy: how long, in seconds from its first attempt, a duplicate keeps being "
        "re-sent. After that it fails with `LockHeld`, as `raise` would. Each re-send waits a jittered "
        "backoff that doubles from 0.1 s and is never longer than the holder's lease time left "
        "([details](policies.md#retry)).",
        "A number of seconds, zero or more (zero: give up at the first duplicate).",
    ),
    "on_redis_error": SettingDoc(
        "What a task does when Redis cannot serve its key now (unreachable, or answering `OOM`, "
        "`READONLY`, `LOADING`, `MASTERDOWN`, `BUSY`, `TRYAGAIN`, `CLUSTERDOWN` or `NOREPLICAS`). "
        "`fail_closed`: it does not run unguarded; it is re-sent every `redis_retry_delay` seconds "
        "(state `RETRY`, not counted against `max_retries`) until `redis_max_wait`. `fail_open`: it "
        "runs unguarded, with a WARNING, the `unguarded_run` signal and `counters.unguarded_runs`. "
        "Other Redis errors (a `NOPERM`, a script error) fail the task either way; `hold()` always "
        "raises `RedisUnavailable`.",
        " or ".join(f"`{mode}`" for mode in REDIS_ERROR_MODES) + ".",
    ),
    "redis_retry_delay": SettingDoc(
        "`fail_closed`: the delay before a task that found Redis unavailable is tried again.",
        "A number of seconds, more than zero.",
    ),
    "redis_max_wait": SettingDoc(
        "`fail_closed`: how long a task keeps being re-sent while Redis is unavailable; then it fails "
        "with `RedisUnavailable`.",
        "A number of seconds, zero or more; `\"none\"` or `float(\"inf\")` for no limit. `None` means "
        "\"not set\" here, like for every other setting, so it gives the default.",
    ),
    "fence_retention": SettingDoc(
        "No longer used: fences need no counter (a fence is the larger of the key's last fence + 1 "
        "and Redis's clock in microseconds, see [fencing](fencing.md)). Still accepted and validated, "
        "and ignored.",
        "A number of seconds, more than zero.",
    ),
    "status_retention": SettingDoc(
        "How long a run's record (its status, outcome and fence) outlives the run, for `status()`, "
        "`celery singleflight show`, watchers and the next fence.",
        "A number of seconds; values under 30 are raised to 30 (a re-sent release script and the "
        "watchers' replay need the record that long).",
    ),
    "history_length": SettingDoc(
        "How many progress events a key's history stream keeps (`XADD ... MAXLEN ~`), replayed to a "
        "watcher that starts late.",
        "A whole number, at least 1.",
    ),
    "progress_rate": SettingDoc(
        "The most `self.progress()` writes per second per run. Calls in between are coalesced and the "
        "last one is always written, so a tight loop costs a handful of writes.",
        "A number, more than zero.",
    ),
    "progress_max_bytes": SettingDoc(
        "The largest progress update (state, numbers, message and fields, as JSON); a larger one "
        "raises `ProgressError`.",
        "A whole number of bytes, at least 64.",
    ),
    "progress_events": SettingDoc(
        "Whether `self.progress()` sends a Celery `task-progress` event, which is what makes Flower "
        "show the task as PROGRESS ([Flower](flower.md)).",
        "`True`, `False`, or unset.",
        default="follow the worker: on when it sends task events (`-E`, `worker_send_task_events`)",
    ),
    "status_include_args": SettingDoc(
        "Store the task's arguments in its status record (`KeyStatus.args`, `show`). Off by default: "
        "arguments may hold personal data, and status is readable by anyone who can read the "
        "namespace.",
        "`True` or `False`.",
    ),
    "max_queued": SettingDoc(
        "The `queue` policy: how many runs may wait per key. A duplicate beyond it fails with "
        "`QueueFull` (a `LockHeld`), logged at WARNING. Periodic tasks should set 1 "
        "([beat](beat.md)).",
        "A whole number, zero or more.",
        default="no limit",
    ),
    "idempotency_ttl": SettingDoc(
        "How long a successful run is remembered under its `idempotency_key`: a later run with the same "
        "idempotency key returns the remembered result without running "
        "([idempotency](idempotency.md)).",
        "A number of seconds, more than zero.",
    ),
    "dedup_enqueue": SettingDoc(
        "Enqueue-time dedup: `delay()` / `apply_async()` of a task whose key is already queued or "
        "running returns that task's `AsyncResult` instead of sending a second message "
        "([flow control](flow.md#enqueue-time-dedup)). Sends by name (`send_task`, beat) and sends "
        "with their own `task_id` are not deduplicated; the lease still covers them when they run.",
        "`True` or `False`.",
    ),
    "dedup_ttl": SettingDoc(
        "A safety expiry of an enqueue marker, for a message lost in the broker. The marker normally "
        "goes when its run ends.",
        "A number of seconds, more than zero.",
    ),
    "on_beat_duplicate": SettingDoc(
        "The policy for a `celery beat` tick that finds its key held (beat marks its messages with the "
        "`celery_beat_task` header, Celery 5.5 and later); calls from your code keep `on_duplicate`. "
        "See [beat](beat.md).",
        f"One of {_POLICY_LIST}.",
        default="`\"skip\"`",
        precedence="the task's `on_beat_duplicate` > the task's own `on_duplicate` (if it sets one) > "
        "this setting > `\"skip\"`",
    ),
    "max_concurrency": SettingDoc(
        "How many runs of one key may run at once, each with its own lease slot and heartbeat; "
        "duplicates beyond it get the task's policy ([flow control](flow.md#max_concurrencyn)).",
        "A whole number, at least 1. `join` needs 1.",
    ),
    "retry_backoff": SettingDoc(
        "The `retry` policy's first wait, doubling after it; never longer than the holder's lease "
        "time left ([policies](policies.md#retry)). Named as Celery's autoretry option, and shared "
        "with it on a task that also uses `autoretry_for`. Unset: 0.1 s.",
        "Seconds, more than zero; `True` for 1 s; `False` keeps every wait at 0.1 s (no doubling).",
        default="0.1 s",
    ),
    "retry_backoff_max": SettingDoc(
        "The `retry` policy's longest wait. Unset: only the holder's lease time left and `max_wait` "
        "cap the waits.",
        "Seconds, more than zero.",
        default="none (the holder's lease time left and `max_wait` cap the waits)",
    ),
    "retry_jitter": SettingDoc(
        "Whether the `retry` policy waits a random time between half and all of the computed wait, "
        "so that many duplicates do not come back at once.",
        "`True` or `False`.",
    ),
    "redis_transport_options": SettingDoc(
        "Connection options for the lease Redis that a URL cannot carry, following Celery's "
        "`result_backend_transport_options`: `master_name` (Sentinel), `sentinel_kwargs` (the "
        "sentinels' own password or TLS), TLS files (`ssl_cert_reqs`, `ssl_ca_certs`, `ssl_certfile`, "
        "`ssl_keyfile`, `ssl_check_hostname`), `socket_timeout`, `socket_connect_timeout`, "
        "`health_check_interval`, `max_connections`, `username`, `password` "
        "([operations](operations.md)).",
        "A dict with those names. An unknown name, TLS options with a `redis://` URL, or a "
        "`sentinel://` URL without `master_name` is refused when the worker starts, naming the setting.",
        default="`{}`",
    ),
    "redis_client": SettingDoc(
        "A callable (or its dotted path, `\"proj.redis:make_client\"`) that returns a ready "
        "`redis.Redis` or `redis.cluster.RedisCluster` for the leases, for anything the URL and the "
        "transport options cannot say. It is called once per process (after a fork again).",
        "A callable without arguments, or a string `module.attribute`. With it, "
        "`singleflight_redis_transport_options` must be unset.",
        default="`None`: the client is built from `singleflight_redis_url`",
    ),
    "coalesce_keep": SettingDoc(
        "The `coalesce` policy: which duplicate stays the one pending run of a held key. `\"last\"`: "
        "a later-sent duplicate replaces the pending run, which ends SUCCESS with a \"coalesced into "
        "<id>\" result (`is_coalesced()`); `\"first\"`: the pending run stays and later duplicates "
        "end that way ([policies](policies.md#coalesce)).",
        "`\"last\"` or `\"first\"`.",
    ),
    "supersede_grace": SettingDoc(
        "The `supersede` policy: how long a superseded run may take to stop by itself (it learns at "
        "its next `self.lease.check()` or `self.progress()`, which raise `Superseded`, or from "
        "`self.lease.superseded`) before it is revoked with `terminate=True` "
        "([policies](policies.md#supersede)). Zero revokes at once.",
        "A number of seconds, zero or more.",
    ),
    "supersede_signal": SettingDoc(
        "The `supersede` policy: the signal of the revoke that stops a superseded run after "
        "`supersede_grace` (`SIGTERM` lets the task's `finally` blocks run; `SIGKILL` does not, and the "
        "worker's main process releases the key).",
        "A signal name: `\"SIGTERM\"`, `\"SIGINT\"`, `\"SIGKILL\"`, ...",
    ),
    "ordered": SettingDoc(
        "The `queue` policy: runs of a key start in the order their messages were sent, also in a "
        "burst and across workers. `apply_async` takes a per-key sequence number (one Redis round "
        "trip) and carries it in the message; a run whose predecessors have not all started parks in "
        "sequence order ([policies](policies.md#ordered-queue)). Sends by name (`send_task`, beat) "
        "carry no number and are ordered by arrival.",
        "`True` or `False`. Needs `on_duplicate=\"queue\"` and `max_concurrency=1`.",
    ),
    "order_timeout": SettingDoc(
        "`ordered=True`: how long runs wait for a sequence number whose message never arrives (its "
        "publish failed, it was purged or revoked) before it is skipped, with a WARNING and the "
        "`order_gap_skipped` signal.",
        "A number of seconds, more than zero.",
    ),
}

#: task options that have no app-wide setting
TASK_ONLY: dict[str, SettingDoc] = {
    "lock_key": SettingDoc(
        "The key a run holds: a template (`\"sync:<account_id>\"`, `<invoice.id>`, `<@task>`) or a "
        "callable receiving the task's arguments ([key templates](keys.md)). A template naming a "
        "parameter the task does not have fails when the task is defined.",
        "A string template or a callable returning a string. Required.",
        default="none: a `SingleFlightTask` without one fails when it is defined",
    ),
    "idempotency_key": SettingDoc(
        "The key under which a successful run is remembered for `idempotency_ttl` "
        "([idempotency](idempotency.md)); independent of `lock_key`.",
        "A template or callable, as `lock_key`.",
        default="none: no idempotency window",
    ),
    "key_rate_limit": SettingDoc(
        "How many runs of one key may start per second, minute or hour, counted in Redis across every "
        "worker and process (Celery's own `rate_limit` counts per process). A run over it is not "
        "refused: it is re-sent to start at the next free slot, shows `RETRY` meanwhile, and does not "
        "spend `max_retries` ([time policies](time-policies.md)). Combines with `max_concurrency`.",
        "`\"N/s\"`, `\"N/m\"` or `\"N/h\"` with N above zero (`\"10/m\"`, `\"0.5/s\"`), or a number "
        "(per second). `\"10/x\"`, zero, negative and non-numeric values fail when the task is defined.",
        default="none: no rate limit",
    ),
    "key_rate_burst": SettingDoc(
        "How many runs of one key may start at once on an idle key, with `key_rate_limit`. Any window "
        "of W seconds holds at most `rate * W + key_rate_burst` starts.",
        "A whole number of at least 1; only with `key_rate_limit`.",
        default="1: runs are spread evenly",
    ),
    "debounce": SettingDoc(
        "Seconds of quiet before a burst of calls on one key becomes one run ([time "
        "policies](time-policies.md)). Each `apply_async` records the call (one round trip) and sends "
        "it with a countdown; the burst's first call runs, with the last call's arguments "
        "(`debounce_keep`), once no call came for this long; the other calls end `SUCCESS` with "
        "`{\"singleflight\": \"debounced\", \"into\": <run's task id>}` (`is_debounced()`).",
        "A number of seconds above zero.",
        default="none: no debounce",
    ),
    "debounce_max_wait": SettingDoc(
        "The longest a burst waits for quiet: its run starts at most this many seconds after its first "
        "call, even while calls keep coming.",
        "A number of seconds, at least `debounce`; only with `debounce`.",
        default="none: a burst waits as long as calls keep coming",
    ),
    "debounce_keep": SettingDoc(
        "Which call's arguments the burst's run gets: the last one's (stored as JSON in Redis) or the "
        "first one's.",
        "`\"last\"` or `\"first\"`; only with `debounce`.",
        default="`\"last\"`",
    ),
    "debounce_key": SettingDoc(
        "The key calls are grouped by, when it is not the lock key (e.g. debounce per chat, lock per "
        "account).",
        "A template or callable, as `lock_key`; only with `debounce`.",
        default="the lock key",
    ),
}

_STANDARD_PRECEDENCE = "task option > setting > default"


def _default_text(setting: str, doc: SettingDoc) -> str:
    value: Any = DEFAULTS[setting][1]
    if doc.default is not None:
        return doc.default
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _entry(heading: str, rows: list[tuple[str, str]], doc: SettingDoc) -> list[str]:
    lines = [f"### `{heading}`", "", doc.meaning, "", "| | |", "| --- | --- |"]
    lines += [f"| {name} | {value} |" for name, value in rows]
    return [*lines, ""]


def configuration_page() -> str:
    """The Markdown of ``docs/configuration.md``."""
    missing = sorted(set(DEFAULTS) - set(SETTINGS))
    if missing:
        raise KeyError(f"settings without documentation in settings_doc.SETTINGS: {', '.join(missing)}")
    out = [
        "# Configuration reference",
        "",
        "<!-- generated by celery_singleflight.settings_doc.configuration_page(); do not edit here: edit",
        "     SETTINGS in that module, then run",
        "     python -m celery_singleflight.settings_doc > docs/configuration.md -->",
        "",
        "Settings live in the Celery app's configuration as `singleflight_<name>` (`app.conf.singleflight_ttl"
        " = 10`). A Django project that loads its Celery settings with"
        " `app.config_from_object(\"django.conf:settings\", namespace=\"CELERY\")` writes them as"
        " `CELERY_SINGLEFLIGHT_<NAME>` (`CELERY_SINGLEFLIGHT_TTL = 10`).",
        "",
        "Most settings also have a **task option**, a keyword of `@app.task(...)` (or a class attribute of a"
        " `SingleFlightTask` subclass) that overrides it for one task. The precedence, unless a setting says"
        f" otherwise: **{_STANDARD_PRECEDENCE}**. A task option or setting left at `None` counts as not set.",
        "",
        "Everything is read and validated when a guarded task is bound to its app (when the worker starts,"
        " or when another process first uses the task): a bad value raises `ConfigurationError` with a"
        " sentence naming the task, the option and what to change. `hold()`, the status functions and the"
        " CLI read the same settings, without a task's options.",
        "",
        "| setting | task option | default |",
        "| --- | --- | --- |",
    ]
    for setting, (attr, _default) in DEFAULTS.items():
        doc = SETTINGS[setting]
        option = f"`{attr}`" if attr else "—"
        link = f"[`singleflight_{setting}`](#singleflight_{setting})"
        out.append(f"| {link} | {option} | {_default_text(setting, doc)} |")
    for option, doc in TASK_ONLY.items():
        out.append(f"| — | [`{option}`](#{option}) | {doc.default} |")
    out += ["", "## Settings", ""]
    for setting, (attr, _default) in DEFAULTS.items():
        doc = SETTINGS[setting]
        rows = [
            ("default", _default_text(setting, doc)),
            ("values", doc.values),
            ("task option", f"`{attr}`" if attr else "none: app-wide only"),
            ("Django", f"`CELERY_SINGLEFLIGHT_{setting.upper()}`"),
            ("precedence", doc.precedence or (_STANDARD_PRECEDENCE if attr else "setting > default")),
        ]
        out += _entry(f"singleflight_{setting}", rows, doc)
    out += ["## Task options without a setting", ""]
    for option, doc in TASK_ONLY.items():
        rows = [("default", doc.default or "none"), ("values", doc.values)]
        out += _entry(option, rows, doc)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":  # pragma: no cover - the docs' generator
    sys.stdout.write(configuration_page())
