"""``SingleFlightTask``: a Celery Task base class that runs at most one execution per key.

Worker side::

    @app.task(bind=True, base=SingleFlightTask, lock_key="sync:<account_id>", on_duplicate="skip")
    def sync_account(self, account_id):
        ...
        write(page, fence=self.lease.fence)
        self.lease.check()          # raises LeaseLost if another run took over

The lease is taken in ``__call__``, before the body runs (a ``task_prerun`` receiver cannot stop
a run), and released in its ``finally`` (success, failure, Retry, Ignore, Reject, soft time
limit). ``self.retry()`` releases first, so the retry is never its own duplicate. Ends that run
no code in the pool child (SIGKILL, hard time limit, revoke with ``terminate=True``) are released
by the worker's main process (:mod:`.worker`). The run's life is one :class:`~.guard.Guard`; a
duplicate gets its policy from :mod:`.policies`.
"""

from __future__ import annotations

import inspect
import logging
import time as mod_time
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import redis
from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from . import debounce as debouncing
from . import idempotency, ratelimit, signals, worker
from .connection import is_unavailable
from .enqueue import send_once
from .errors import ConfigurationError, KeyTemplateError, LockHeld, NotInsideRun, RedisUnavailable, Superseded
from .events import send_task_event, worker_sends_task_events
from .guard import Guard, options_store
from .keys import KeyFunction, canonical, compile_key
from .lease import Lease
from .messages import HEADER_EARLIER, HEADER_HANDOFF, HEADER_SENT, HEADER_SEQ, header, resend, wait_state
from .option_names import check_task_options
from .ordering import pass_gate, pass_turn, take_sequence
from .policies import ACQUIRE_AGAIN, coalesce_started, handle_duplicate
from .progress import make_update, result_meta
from .registry import guarded_tasks
from .replies import Acquired, Holder
from .settings import Options, resolve_options, task_option_names
from .settle import NO_RESULT
from .states import PROGRESS
from .status import KeyStatus, StatusReader, WatchEvent
from .store import LeaseStore
from .timestatus import TimeStatus, read_time_status

__all__ = ["SingleFlightTask", "counters", "guarded_tasks"]

log_acquire = logging.getLogger("celery_singleflight.acquire")
log_duplicate = logging.getLogger("celery_singleflight.duplicate")

_ACQUIRE_ATTEMPTS = 5
_REQUEST_ATTR = "singleflight_guard"


#: names Celery itself takes as task options or attributes (never taken for a misspelling of ours)
_CELERY_NAMES = frozenset(dir(Task)) | {
    "autoretry_for", "dont_autoretry_for", "retry_kwargs", "retry_backoff", "retry_backoff_max",
    "retry_jitter", "override_max_retries", "bind", "base", "shared", "lazy", "filter", "pydantic",
    "pydantic_strict", "pydantic_context", "pydantic_dump_kwargs", "dump_pydantic_arguments",
}


def _run_signature(cls: type) -> inspect.Signature | None:
    """The signature callers use: ``run`` without ``self`` for ``bind=True`` tasks."""
    run = cls.__dict__.get("run")
    if run is None:
        run = getattr(cls, "run", None)
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    sig = inspect.signature(run)
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params else sig


def _with_key(exc: BaseException, key: str) -> None:
    """Name the key on a Redis error that is not an outage (a refused command, a script error)."""
    if hasattr(exc, "add_note"):
        exc.add_note(f"celery_singleflight: Redis refused a command for key {key!r}; if it is NOPERM, the"
                     " Redis user's ACL lacks a command or key pattern the library needs (docs/isolation.md)")


class SingleFlightTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Task that holds a Redis lease on its rendered ``lock_key`` while it runs.

    Options (class attributes / ``@app.task(...)`` keywords; ``None`` means the app setting):

    - ``lock_key``: template (``"sync:<account_id>"``, ``<obj.field>``, ``<@task>``) or callable.
    - ``on_duplicate``: ``"raise"`` (default), ``"skip"``, ``"retry"``, ``"queue"``, ``"join"``,
      ``"coalesce"`` (``coalesce_keep``: ``"last"`` or ``"first"``) or ``"supersede"``
      (``supersede_grace``, ``supersede_signal``).
    - ``lock_ttl``: lease TTL in seconds (default 30); ``heartbeat_interval``: default TTL/3.
    - ``max_wait``: how long the ``retry`` policy keeps trying, in seconds (default 60).
    - ``on_redis_error``: ``"fail_closed"`` (default) or ``"fail_open"``.
    - ``lock_namespace``: key prefix (default ``singleflight_namespace``, ``"sf"``).
    - ``max_concurrency``, ``max_queued``, ``idempotency_key``, ``dedup_enqueue``: see the README.
    - ``key_rate_limit`` (``"10/m"``), ``key_rate_burst``: starts per key, across every worker
      (:mod:`.ratelimit`).
    - ``debounce`` (seconds of quiet), ``debounce_max_wait``, ``debounce_keep`` (``"last"`` or
      ``"first"``), ``debounce_key`` (default: the lock key): a burst of calls becomes one run
      (:mod:`.debounce`).
    """

    lock_key: ClassVar[Any] = None
    on_duplicate: ClassVar[str | None] = None
    lock_ttl: ClassVar[float | None] = None
    heartbeat_interval: ClassVar[float | None] = None
    max_wait: ClassVar[float | None] = None
    on_redis_error: ClassVar[str | None] = None
    redis_retry_delay: ClassVar[float | None] = None
    redis_max_wait: ClassVar[float | None] = None
    lock_namespace: ClassVar[str | None] = None
    idempotency_key: ClassVar[Any] = None
    idempotency_ttl: ClassVar[float | None] = None
    dedup_enqueue: ClassVar[bool | None] = None
    on_beat_duplicate: ClassVar[str | None] = None
    max_concurrency: ClassVar[int | None] = None
    key_rate_limit: ClassVar[str | float | None] = None
    key_rate_burst: ClassVar[int | None] = None
    debounce: ClassVar[float | None] = None
    debounce_max_wait: ClassVar[float | None] = None
    debounce_keep: ClassVar[str | None] = None
    debounce_key: ClassVar[Any] = None
    coalesce_keep: ClassVar[str | None] = None
    supersede_grace: ClassVar[float | None] = None
    supersede_signal: ClassVar[str | None] = None
    ordered: ClassVar[bool | None] = None
    order_timeout: ClassVar[float | None] = None
    #: a duplicate refused under ``raise`` is expected: log it at INFO, without a traceback
    throws: ClassVar[tuple[type[BaseException], ...]] = (LockHeld, Superseded)

    _sf_render: ClassVar[KeyFunction | None] = None
    _sf_idem_render: ClassVar[KeyFunction | None] = None
    _sf_options: ClassVar[Options | None] = None
    _sf_rate: ClassVar[ratelimit.Rate | None] = None
    _sf_debounce: ClassVar[debouncing.Debounce | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        check_task_options(cls, name, task_option_names(), _CELERY_NAMES)
        spec = cls.__dict__.get("lock_key")
        if spec is None and cls.__dict__.get("run") is None:
            return  # an intermediate base class, not a task yet
        if spec is None:
            spec = cls.lock_key
        if spec is None:
            raise KeyTemplateError(
                f"task {cls.__dict__.get('name') or cls.__name__}: SingleFlightTask needs lock_key="
                " (a template such as 'sync:<account_id>' or a callable)"
            )
        signature = _run_signature(cls)
        cls._sf_render = compile_key(spec, signature, name)
        idem = cls.__dict__.get("idempotency_key") or cls.idempotency_key
        cls._sf_idem_render = None if idem is None else compile_key(idem, signature, name)
        cls._sf_rate = ratelimit.parse_rate(f"task {name}", cls.key_rate_limit, cls.key_rate_burst)
        cls._sf_debounce = debouncing.parse_debounce(cls, f"task {name}", signature, name)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Resolve and validate options against the app's settings; wire the worker side."""
        super().on_bound(app)
        if cls._sf_render is None:
            return
        cls._sf_options = resolve_options(cls, app.conf)
        if cls._sf_options.on_duplicate == "join" and cls.ignore_result:
            raise ConfigurationError(
                f"task {cls.name}: on_duplicate='join' hands the holder's result to its"
                " duplicates, so it needs ignore_result=False"
            )
        worker.install(app)

    # -- caller-facing helpers ------------------------------------------------------------

    def render_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock key this task would use for ``args`` and ``kwargs`` (what ``status()``,
        ``watch()``, ``hold()`` and the CLI take)."""
        render = type(self)._sf_render
        assert render is not None, "SingleFlightTask subclasses always compile their lock_key"
        return render(args, kwargs)

    def status(self, *args: Any, **kwargs: Any) -> KeyStatus | None:
        """Who holds the key of this call and how far along it is: ``sync_account.status(42)``
        reads what ``status(app, sync_account.render_key(42))`` would, in this task's namespace.
        With ``max_concurrency`` > 1, the first held slot (see :meth:`status_all`); None if
        nothing is known about the key."""
        key = self.render_key(*args, **kwargs)
        reader = StatusReader(self.store, self.app)
        runs = reader.read_all(key, slots=self.options.max_concurrency)
        return runs[0] if runs else reader.read(key)

    def time_status(self, *args: Any, **kwargs: Any) -> TimeStatus:
        """The debounce window (of the call's debounce key) and the rate state (of its lock key)
        of this call, in this task's namespace: ``notify.time_status(42)``."""
        lock = read_time_status(self.store, self.render_key(*args, **kwargs))
        key = self.debounce_key_for(*args, **kwargs)
        burst = lock.debounce if key == lock.key else read_time_status(self.store, key).debounce
        return TimeStatus(lock.key, burst, lock.rate)

    def debounce_key_for(self, *args: Any, **kwargs: Any) -> str:
        """The debounce key of a call: ``debounce_key`` rendered, else the lock key."""
        deb = type(self)._sf_debounce
        if deb is not None and deb.render is not None:
            return str(deb.render(args, kwargs))
        return self.render_key(*args, **kwargs)

    def status_all(self, *args: Any, **kwargs: Any) -> list[KeyStatus]:
        """Every held slot of the key of this call (one for a plain task); empty if none is held."""
        key = self.render_key(*args, **kwargs)
        return StatusReader(self.store, self.app).read_all(key, slots=self.options.max_concurrency)

    def watch(self, *args: Any, **kwargs: Any) -> Iterator[WatchEvent]:
        """Follow the run on the key of this call live until it ends (its history first):
        ``for event in sync_account.watch(42): ...``. The first held slot; slot 0 when none is
        held (the watch then ends at once with the last run's outcome). For a timeout, use
        ``watch(app, task.render_key(...), timeout=...)``."""
        key = self.render_key(*args, **kwargs)
        reader = StatusReader(self.store, self.app)
        runs = reader.read_all(key, slots=self.options.max_concurrency)
        return reader.watch(key, slot=runs[0].slot if runs else 0)

    @property
    def options(self) -> Options:
        opts = type(self)._sf_options
        if opts is None:
            opts = type(self)._sf_options = resolve_options(type(self), self.app.conf)
        return opts

    @property
    def store(self) -> LeaseStore:
        return options_store(self.options)

    @property
    def lease(self) -> Lease:
        """The lease of the current run; raises :class:`NotInsideRun` outside one."""
        guard = getattr(self.request, _REQUEST_ATTR, None)
        if guard is None or guard.lease is None:
            raise NotInsideRun(f"task {self.name}: self.lease is only available while the task body runs")
        lease: Lease = guard.lease
        return lease

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, **options: Any) -> Any:
        """Render the key first, so arguments that cannot give a stable key are refused here,
        before anything is sent. With ``dedup_enqueue=True``, a duplicate send returns the queued
        or running task's AsyncResult instead of sending a second message (one non-blocking
        Redis call); sends that carry a ``task_id`` (retries, re-sent runs) are never deduplicated.
        """
        if type(self)._sf_render is None:
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        key = self.render_key(*(args or ()), **(kwargs or {}))
        opts = self.options
        deb = type(self)._sf_debounce
        if deb is not None and task_id is None and not self.app.conf.task_always_eager:
            return self._sf_send_debounced(deb, key, args, kwargs, rest, options)
        eager = self.app.conf.task_always_eager
        if opts.on_duplicate in ("coalesce", "supersede"):
            headers = options.get("headers") or {}
            if HEADER_SENT not in headers:  # a re-sent run keeps the time it was first sent
                options["headers"] = {**headers, HEADER_SENT: mod_time.time_ns()}

        def send(new_id: str | None) -> Any:
            if opts.ordered and not eager and HEADER_SEQ not in (options.get("headers") or {}):
                new_id = new_id or str(uuid.uuid4())
                seq = take_sequence(self.store, key, new_id)  # one round trip; None: sent unordered
                if seq is not None:
                    options["headers"] = {**(options.get("headers") or {}), HEADER_SEQ: seq}
            return super(SingleFlightTask, self).apply_async(args, kwargs, new_id, *rest, **options)

        if not opts.dedup_enqueue or task_id is not None or eager:
            return send(task_id)
        return send_once(self, self.store, key, opts.dedup_ttl, opts.max_concurrency, send)

    def _sf_send_debounced(self, deb: debouncing.Debounce, lock_key: str, args: Any, kwargs: Any,
                           rest: tuple[Any, ...], options: dict[str, Any]) -> Any:
        """Record the call in its burst (one round trip) and send it with the countdown to the
        burst's run; the debounce decides the time, so a countdown or eta given is replaced."""

        def publish(new_id: str, countdown: float | None, headers: dict[str, Any]) -> Any:
            sent = dict(options)
            if countdown is not None:
                sent.pop("eta", None)
                sent["countdown"] = countdown
            sent["headers"] = {**(sent.get("headers") or {}), **headers}
            return super(SingleFlightTask, self).apply_async(args, kwargs, new_id, *rest, **sent)

        key = lock_key if deb.render is None else str(deb.render(tuple(args or ()), dict(kwargs or {})))
        return debouncing.send(self, self.store, key, deb, args, kwargs, str(uuid.uuid4()), publish)

    # -- the run ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        opts = self.options
        deb = type(self)._sf_debounce
        if deb is not None and not (request.called_directly or request.is_eager) and not header(
            request, debouncing.HEADER_RAN
        ):
            debounce_key = self.debounce_key_for(*args, **kwargs)
            try:
                decided = debouncing.on_due(self, self.store, debounce_key, deb, args, kwargs)
            except redis.RedisError as exc:
                if not is_unavailable(exc):
                    _with_key(exc, debounce_key)
                    raise
                return self._sf_redis_unavailable(debounce_key, exc, args, kwargs, "")
            if isinstance(decided, dict):
                return decided  # folded into the burst's run
            args, kwargs = decided  # the burst's chosen arguments
        key = self.render_key(*args, **kwargs)
        task_id = request.id or ""
        handoff = str(header(request, HEADER_HANDOFF) or "")
        guard = Guard(self.app, key, opts, Holder(task_id, request.hostname or "", self.name),
                      sender=self.name, clear_marker=opts.dedup_enqueue)
        idem = type(self)._sf_idem_render
        idem_key = None if idem is None else idem(args, kwargs)
        if idem_key is not None and not handoff:
            # a parked run must adopt the slot reserved for it (and hand it on), so it checks
            # only under the lease, below
            found = idempotency.remembered(guard.store, idem_key, self.name, request.id)
            if found is not idempotency.NOTHING:
                if opts.ordered:
                    pass_turn(self, guard.store, key, args, kwargs)  # its number must not become a gap
                return found
        try:
            rate = type(self)._sf_rate
            if rate is not None and not handoff and not (request.called_directly or request.is_eager):
                # a parked run handed the key took its cell when it first came (before it parked)
                slot = ratelimit.admit(self, guard.store, key, rate, args, kwargs)
                setattr(request, ratelimit.PLANNED_ATTR, slot.planned)
            # ordered=True: wait for this run's turn; the next run is let through once this one
            # holds the key or waits in its queue (gate.done)
            gate = pass_gate(self, guard.store, key, args, kwargs) if opts.ordered else None
            try:
                for _ in range(_ACQUIRE_ATTEMPTS):
                    got = guard.take(handoff=handoff, earlier=str(header(request, HEADER_EARLIER) or ""))
                    if isinstance(got, Acquired):
                        break
                    if handoff and got.holder != task_id:
                        # a parked run whose turn has not come: its entry is still in the queue
                        log_duplicate.info("%s[%s] stays parked on key=%r behind %s", self.name, task_id, key,
                                           got.holder)
                        raise Ignore()
                    decided = handle_duplicate(self, guard, got, args, kwargs)
                    if decided is not ACQUIRE_AGAIN:
                        return decided
                else:
                    raise LockHeld(key, None, None)
            finally:
                if gate is not None:
                    gate.done()
        except redis.RedisError as exc:
            if not is_unavailable(exc):
                _with_key(exc, key)
                raise
            guard.forget_attempt()
            return self._sf_redis_unavailable(key, exc, args, kwargs, guard.token)
        lease = guard.begin(got)
        setattr(request, _REQUEST_ATTR, guard)
        outcome, result, error = "failed", NO_RESULT, None
        try:
            if handoff and {"coalesce", "supersede"} & {opts.on_duplicate, opts.on_beat_duplicate}:
                coalesce_started(self, guard)
                if got.superseded_by:
                    lease.check()  # superseded on its way here: raises Superseded, never runs
            if idem_key is not None:
                # checked again under the lease: a duplicate that waited for this key (queue,
                # retry) finds the run that finished meanwhile
                found = idempotency.remembered(guard.store, idem_key, self.name, request.id)
                if found is not idempotency.NOTHING:
                    outcome, result = "succeeded", found
                    return found
            result = super().__call__(*args, **kwargs)
            outcome = "succeeded"
            if idem_key is not None:
                idempotency.remember(guard.store, idem_key, self.name, request.id, result,
                                     opts.idempotency_ttl)
            return result
        except Retry:
            outcome = "retried"
            raise
        except Ignore:
            outcome = "ignored"
            raise
        except Reject:
            outcome = "rejected"
            raise
        except BaseException as exc:
            # SystemExit: the pool child was told to stop (revoke with terminate, shutdown)
            outcome = "failed" if isinstance(exc, Exception) else "terminated"
            error = exc
            raise
        finally:
            setattr(request, _REQUEST_ATTR, None)
            guard.end(outcome, result=result, error=error, answer_joined=outcome != "retried")

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Release the lease before the retry is published, so it is not its own duplicate."""
        guard = getattr(self.request, _REQUEST_ATTR, None)
        if guard is not None:
            guard.end("retried", answer_joined=False)
        return super().retry(*args, **kwargs)

    # -- progress -----------------------------------------------------------------------

    def progress(
        self, state: str, current: float | None = None, total: float | None = None,
        message: str | None = None, **fields: Any,
    ) -> bool:
        """Report how far this run is, by key: ``self.progress("loading", current=3, total=10)``.

        One Redis round trip (status, history, live watchers), a ``task-progress`` event for
        Flower and the result backend's ``PROGRESS`` meta (``AsyncResult.info``). Throttled to
        ``progress_rate`` writes a second: calls in between are coalesced and the last one is
        always written. Returns True if written now. Raises :class:`LeaseLost` once the lease is
        gone, :class:`NotInsideRun` outside a run, :class:`ProgressError` for bad values.
        """
        guard = getattr(self.request, _REQUEST_ATTR, None)
        if guard is None or guard.lease is None:
            raise NotInsideRun(
                f"task {self.name}: self.progress() is only available while the task body runs"
            )
        guard.lease.check()
        if guard.on_progress is None:  # built at the first report, from this run's request
            guard.on_progress = self._sf_progress_hook()
        opts = self.options
        args = None
        if opts.status_include_args:
            request = self.request
            args = canonical({"args": list(request.args or ()), "kwargs": dict(request.kwargs or {})})
        update = make_update(state, current, total, message, fields, max_bytes=opts.progress_max_bytes,
                             args=args)
        return bool(guard.progress(update))

    def _sf_progress_hook(self) -> Any:
        """What a progress write adds for Celery, with what it needs captured now: the write may
        run on the heartbeat thread. ``PROGRESS`` meta in the result backend (also what
        celery-progress bars read: current, total, percent, description) and a ``task-progress``
        event for Flower."""
        request = self.request
        task_id, hostname = request.id, request.hostname
        opts = self.options
        store_meta = bool(task_id) and not (request.ignore_result or self.ignore_result)
        send_event = bool(task_id) and (
            worker_sends_task_events() if opts.progress_events is None else bool(opts.progress_events)
        )
        app, backend = self.app, self.backend

        def hook(lease: Lease, data: dict[str, Any]) -> None:
            meta = result_meta(data, lease.key, lease.fence)
            if store_meta:
                backend.store_result(task_id, meta, PROGRESS)
            if send_event:
                send_task_event(app, "task-progress", hostname, enabled=True, uuid=task_id, progress=meta)

        return hook

    # -- Redis trouble ----------------------------------------------------------------------

    def _sf_redis_unavailable(
        self, key: str, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any], token: str
    ) -> Any:
        opts = self.options
        request = self.request
        if opts.on_redis_error == "fail_open":
            log_acquire.warning(
                "Redis cannot guard key=%r now (%s); running %s[%s] UNGUARDED (fail_open)",
                key, exc, self.name, request.id,
            )
            counters.unguarded_runs += 1
            signals.unguarded_run.send(sender=self.name, key=key, task_id=request.id, error=exc)
            return super().__call__(*args, **kwargs)
        first_seen, attempt = wait_state(request)
        waited = mod_time.time() - first_seen
        error = RedisUnavailable(key, str(exc) or type(exc).__name__, waited)
        if request.called_directly or request.is_eager:
            raise error
        if opts.redis_max_wait is None or waited + opts.redis_retry_delay <= opts.redis_max_wait:
            log_acquire.warning(
                "Redis cannot serve key=%r now; %s[%s] will be retried in %.1fs (fail_closed): %s",
                key, self.name, request.id, opts.redis_retry_delay, exc,
            )
            resend(self, args, kwargs, opts.redis_retry_delay, first_seen, attempt + 1, error,
                   **{HEADER_EARLIER: token})
        log_acquire.error("Redis could not serve key=%r for %.1fs; %s[%s] fails (redis_max_wait)",
                          key, waited, self.name, request.id)
        raise error


class _Counters:
    """Process-wide counts an operator may want to export (e.g. to Prometheus)."""

    unguarded_runs = 0


counters = _Counters()
