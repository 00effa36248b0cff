"""When Redis cannot serve a run's key: the task's ``on_redis_error`` decides.

``fail_closed`` (the default): the run does not go ahead unguarded; its message is re-sent every
``redis_retry_delay`` seconds (``RETRY``, not counted against ``max_retries``) until
``redis_max_wait``, then it fails with :class:`~..errors.RedisUnavailable`. A re-sent message
names the token of the attempt that got no reply, so that if that attempt did take the key the
next one takes it over instead of waiting for itself. ``fail_open``: it runs unguarded, with a
WARNING, the ``unguarded_run`` signal and :data:`counters`. A key whose record was written by
another protocol version is never run unguarded: it is re-sent as under ``fail_closed``.
"""

from __future__ import annotations

import logging
import time as mod_time
from typing import Any, NoReturn

from .. import signals
from ..errors import ProtocolMismatch, RedisUnavailable
from ..metrics import record as metrics
from .messages import HEADER_EARLIER, HEADER_HANDOFF, resend, wait_state

__all__ = ["counters", "redis_unavailable", "refuse_foreign", "retry_later"]

log_acquire = logging.getLogger("celery_singleflight.acquire")


class _Counters:
    """Process-wide counts an operator may want to export (e.g. to Prometheus)."""

    unguarded_runs = 0


counters = _Counters()
"""``counters.unguarded_runs``: runs this process let run unguarded under ``fail_open``."""


def redis_unavailable(task: Any, key: str, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any],
                      token: str, run: Any, released: bool = False) -> Any:
    """Run the body unguarded (``fail_open``, through ``run()``), or re-send the run
    (``fail_closed``), or fail once ``redis_max_wait`` has passed. ``released``: the attempt
    had taken the key and gave it back (a grant too few replicas confirmed): the run is re-sent
    as a new arrival, without the tokens of a parked run or of that attempt (a parked run's
    token would read as "this run took its slot before", and the copy would be dropped)."""
    opts = task.options
    request = task.request
    metrics.count("redis_unavailable", task.name, opts.on_redis_error)
    if opts.on_redis_error == "fail_open":
        log_acquire.warning(
            "Redis cannot guard key=%r now (%s); running %s[%s] UNGUARDED (fail_open)",
            key, exc, task.name, request.id,
        )
        counters.unguarded_runs += 1
        signals.unguarded_run.send(sender=task.name, key=key, task_id=request.id, error=exc)
        return run(*args, **kwargs)
    tokens = {HEADER_EARLIER: "", HEADER_HANDOFF: ""} if released else {HEADER_EARLIER: token}
    retry_later(task, key, exc, args, kwargs, **tokens)


def retry_later(task: Any, key: str, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any],
                **headers: Any) -> NoReturn:
    """``fail_closed``: re-send the run with ``headers`` after ``redis_retry_delay`` (it ends
    ``RETRY``), or fail with :class:`RedisUnavailable` once ``redis_max_wait`` has passed."""
    opts, request = task.options, task.request
    first_seen, attempt = wait_state(request)
    waited = mod_time.time() - first_seen
    error = RedisUnavailable(key, str(exc) or type(exc).__name__, waited)
    if request.called_directly or request.is_eager:
        raise error
    if opts.redis_max_wait is None or waited + opts.redis_retry_delay <= opts.redis_max_wait:
        log_acquire.warning(
            "Redis cannot serve key=%r now; %s[%s] will be retried in %.1fs (fail_closed): %s",
            key, task.name, request.id, opts.redis_retry_delay, exc,
        )
        resend(task, args, kwargs, opts.redis_retry_delay, first_seen, attempt + 1, error, **headers)
    log_acquire.error("Redis could not serve key=%r for %.1fs; %s[%s] fails (redis_max_wait)",
                      key, waited, task.name, request.id)
    raise error


def refuse_foreign(task: Any, exc: ProtocolMismatch, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A record of the run's key was written by another protocol version: say so, naming both
    versions, and re-send the run (as ``fail_closed`` does) rather than run it unguarded; it
    fails once ``redis_max_wait`` has passed."""
    opts = task.options
    request = task.request
    first_seen, attempt = wait_state(request)
    waited = mod_time.time() - first_seen
    log_acquire.error("%s[%s]: %s (not run unguarded)", task.name, request.id, exc)
    if request.called_directly or request.is_eager:
        raise exc
    if opts.redis_max_wait is None or waited + opts.redis_retry_delay <= opts.redis_max_wait:
        resend(task, args, kwargs, opts.redis_retry_delay, first_seen, attempt + 1, exc)
    raise exc
