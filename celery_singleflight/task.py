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
by the worker's main process from the ``task_failure`` / ``task_revoked`` signals.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import time as mod_time
import uuid
from typing import Any, ClassVar, NoReturn

import redis
from celery import Task
from celery.exceptions import Ignore, Reject, Retry

from . import outcome, signals
from .connection import UNREACHABLE, redis_client
from .errors import LeaseLost, LockHeld, NotInsideRun, QueueFull, RedisUnavailable
from .heartbeat import heartbeat_for
from .joining import answer_joined
from .keys import KeyFunction, KeyLayout, canonical, compile_key
from .lease import Held, Holder, Lease, LeaseStore, Parked
from .progress import ProgressReporter, ProgressUpdate, make_update
from .queueing import RESUME_GRACE, send_parked
from .scripts import OWN_COPY
from .settings import Options, resolve_options
from .worker_setup import worker_sends_task_events

__all__ = ["SingleFlightTask", "guarded_tasks", "store_for"]

log_acquire = logging.getLogger("celery_singleflight.acquire")
log_release = logging.getLogger("celery_singleflight.release")
log_duplicate = logging.getLogger("celery_singleflight.duplicate")

#: message headers carried by re-sent duplicates (the retry policy and fail_closed)
HEADER_FIRST_SEEN = "singleflight_first_seen"
HEADER_ATTEMPT = "singleflight_attempt"
#: message header of a parked run re-sent by the ``queue`` policy: its handoff token
HEADER_HANDOFF = "singleflight_handoff"
_ACQUIRE_AGAIN = object()  # a duplicate found the key free again: try to take it
_NOTHING = object()  # no remembered result for an idempotency key
_ACQUIRE_ATTEMPTS = 5
_REQUEST_ATTR = "singleflight_lease"
_MIN_DELAY = 0.05
_BASE_DELAY = 0.1

_stores: dict[tuple[int, str], LeaseStore] = {}


def store_for(
    url: str, namespace: str, status_retention: float = 300.0, history_length: int = 100
) -> LeaseStore:
    """The lease store of this process for ``url`` and ``namespace``."""
    client = redis_client(url)
    key = (id(client), namespace)
    store = _stores.get(key)
    if store is None or store.client is not client:
        store = _stores[key] = LeaseStore(client, KeyLayout(namespace), status_retention, history_length)
    return store


def _options_store(opts: Options) -> LeaseStore:
    return store_for(opts.redis_url, opts.namespace, opts.status_retention, opts.history_length)


def guarded_tasks(app: Any) -> list[SingleFlightTask]:
    """The app's registered ``SingleFlightTask`` tasks (not intermediate base classes), by name."""
    return [
        task for _, task in sorted(app.tasks.items())
        if isinstance(task, SingleFlightTask) and type(task)._sf_render is not None
    ]


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


class SingleFlightTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Task that holds a Redis lease on its rendered ``lock_key`` while it runs.

    Options (class attributes / ``@app.task(...)`` keywords; ``None`` means the app setting):

    - ``lock_key``: template (``"sync:<account_id>"``, ``<obj.field>``, ``<@task>``) or callable.
    - ``on_duplicate``: ``"raise"`` (default), ``"skip"`` or ``"retry"``.
    - ``lock_ttl``: lease TTL in seconds (default 30); ``heartbeat_interval``: default TTL/3.
    - ``max_wait``: how long the ``retry`` policy keeps trying, in seconds (default 60).
    - ``on_redis_error``: ``"fail_closed"`` (default) or ``"fail_open"``.
    - ``lock_namespace``: key prefix (default ``singleflight_namespace``, ``"sf"``).
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
    #: a duplicate refused under ``raise`` is expected: log it at INFO, without a traceback
    throws: ClassVar[tuple[type[BaseException], ...]] = (LockHeld,)

    _sf_render: ClassVar[KeyFunction | None] = None
    _sf_idem_render: ClassVar[KeyFunction | None] = None
    _sf_options: ClassVar[Options | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        spec = cls.__dict__.get("lock_key")
        if spec is None and cls.__dict__.get("run") is None:
            return  # an intermediate base class, not a task yet
        if spec is None:
            spec = cls.lock_key
        if spec is None:
            from .errors import KeyTemplateError

            raise KeyTemplateError(
                f"task {cls.__dict__.get('name') or cls.__name__}: SingleFlightTask needs lock_key="
                " (a template such as 'sync:<account_id>' or a callable)"
            )
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        signature = _run_signature(cls)
        cls._sf_render = compile_key(spec, signature, name)
        idem = cls.__dict__.get("idempotency_key") or cls.idempotency_key
        cls._sf_idem_render = None if idem is None else compile_key(idem, signature, name)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Resolve and validate options against the app's settings (at worker start)."""
        super().on_bound(app)
        if cls._sf_render is not None:
            cls._sf_options = resolve_options(cls, app.conf)
            if cls._sf_options.on_duplicate == "join" and cls.ignore_result:
                from .errors import ConfigurationError

                raise ConfigurationError(
                    f"task {cls.name}: on_duplicate='join' hands the holder's result to its"
                    " duplicates, so it needs ignore_result=False"
                )

    # -- caller-facing helpers ------------------------------------------------------------

    def render_key(self, *args: Any, **kwargs: Any) -> str:
        """The lock key this task would use for ``args`` and ``kwargs``."""
        render = type(self)._sf_render
        assert render is not None, "SingleFlightTask subclasses always compile their lock_key"
        return render(args, kwargs)

    @property
    def options(self) -> Options:
        opts = type(self)._sf_options
        if opts is None:
            opts = type(self)._sf_options = resolve_options(type(self), self.app.conf)
        return opts

    @property
    def store(self) -> LeaseStore:
        return _options_store(self.options)

    @property
    def lease(self) -> Lease:
        """The lease of the current run; raises :class:`NotInsideRun` outside one."""
        lease = getattr(self.request, _REQUEST_ATTR, None)
        if lease is None:
            raise NotInsideRun(
                f"task {self.name}: self.lease is only available while the task body runs"
            )
        return lease  # type: ignore[no-any-return]

    # -- the run ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        opts = self.options
        key = self.render_key(*args, **kwargs)
        store = _options_store(opts)
        task_id = request.id or ""
        token = uuid.uuid4().hex
        handoff = str(self._sf_header(HEADER_HANDOFF) or "")
        holder = Holder(task_id, request.hostname or "", self.name)
        idem = type(self)._sf_idem_render
        idem_key = None if idem is None else idem(args, kwargs)
        if idem_key is not None and not handoff:
            # a parked run must adopt the lease reserved for it (and hand it on), so it checks
            # only under the lease, below
            remembered = self._sf_remembered(store, idem_key)
            if remembered is not _NOTHING:
                return remembered
        for _ in range(_ACQUIRE_ATTEMPTS):
            try:
                got = store.acquire(key, token, opts.ttl, holder, opts.fence_retention, handoff,
                                    opts.max_concurrency)
            except UNREACHABLE as exc:
                return self._sf_redis_unavailable(key, exc, args, kwargs)
            if not isinstance(got, Held):
                break
            if got.handoff is not None:
                send_parked(self.app, got.handoff, key)
            if handoff and got.holder != task_id:
                # a parked run whose turn has not come: its entry is still in the queue
                log_duplicate.info("%s[%s] stays parked on key=%r behind %s", self.name, task_id, key,
                                   got.holder)
                raise Ignore()
            outcome = self._sf_duplicate(key, got, args, kwargs)
            if outcome is not _ACQUIRE_AGAIN:
                return outcome
        else:
            raise LockHeld(key, None, None)
        lease = Lease(
            key=key, token=token, fence=got.fence, ttl=opts.ttl, interval=opts.heartbeat_interval,
            task_id=task_id, task_name=self.name, store=store, since=got.since, slot=got.slot,
        )
        beat = heartbeat_for(store)
        beat.add(lease)
        setattr(request, _REQUEST_ATTR, lease)
        log_acquire.debug("acquired key=%r task=%s[%s] fence=%s", key, self.name, task_id, lease.fence)
        signals.lease_acquired.send(sender=self.name, lease=lease)
        outcome = "failed"
        result: Any = None
        error: BaseException | None = None
        try:
            if idem_key is not None:
                # checked again under the lease: a duplicate that waited for this key (queue,
                # retry) finds the run that finished meanwhile
                result = self._sf_remembered(store, idem_key)
                if result is not _NOTHING:
                    outcome = "succeeded"
                    return result
            result = super().__call__(*args, **kwargs)
            outcome = "succeeded"
            if idem_key is not None:
                self._sf_remember(store, idem_key, result)
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
            beat.discard(lease)
            self._sf_finish_progress(lease)
            self._sf_release(lease, "lost" if lease.lost else outcome, result, error)

    # -- idempotency window and enqueue-time dedup -----------------------------------------

    def _sf_remembered(self, store: LeaseStore, idem_key: str) -> Any:
        """The remembered result of the run that finished ``idem_key`` within the window."""
        from kombu.utils.json import loads

        try:
            raw = store.remembered(idem_key)
        except redis.RedisError as exc:
            log_duplicate.warning("could not read idempotency record %r: %s", idem_key, exc)
            return _NOTHING
        if raw is None:
            return _NOTHING
        record = loads(raw)  # type: ignore[no-untyped-call]
        log_duplicate.info("%s[%s] is a repeat of %s (idempotency key %r): returning its result",
                           self.name, self.request.id, record.get("task_id"), idem_key)
        signals.duplicate.send(sender=self.name, key=idem_key, task_id=self.request.id,
                               holder=record.get("task_id"), ttl_left=None, policy="idempotency",
                               outcome="remembered")
        return record.get("result")

    def _sf_remember(self, store: LeaseStore, idem_key: str, result: Any) -> None:
        from kombu.utils.json import dumps

        try:
            record = dumps({"task_id": self.request.id, "result": result})  # type: ignore[no-untyped-call]
        except (TypeError, ValueError) as exc:
            log_duplicate.warning("result of %s[%s] is not JSON-serializable; idempotency key %r"
                                  " not remembered: %s", self.name, self.request.id, idem_key, exc)
            return
        try:
            store.remember(idem_key, record, self.options.idempotency_ttl)
        except redis.RedisError as exc:
            log_duplicate.warning("could not remember idempotency key %r: %s", idem_key, exc)

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, **options: Any) -> Any:
        """With ``dedup_enqueue=True``: a duplicate send returns the queued or running task's
        AsyncResult instead of sending a second message (one non-blocking Redis call).

        Sends that carry a ``task_id`` (retries, re-sent parked runs) are never deduplicated.
        """
        opts = self.options if type(self)._sf_render is not None else None
        if (opts is None or not opts.dedup_enqueue or task_id is not None
                or self.app.conf.task_always_eager):
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        key = self.render_key(*(args or ()), **(kwargs or {}))
        new_id = str(uuid.uuid4())
        store = self.store
        try:
            existing = store.mark_enqueued(key, new_id, opts.dedup_ttl)
        except redis.RedisError as exc:
            log_duplicate.warning("enqueue dedup unavailable for key=%r (sending anyway; the lease"
                                  " still guards the run): %s", key, exc)
            return super().apply_async(args, kwargs, None, *rest, **options)
        if existing is not None:
            log_duplicate.info("%s for key=%r is already queued or running as %s: not sent again",
                               self.name, key, existing)
            return self.AsyncResult(existing)
        try:
            return super().apply_async(args, kwargs, new_id, *rest, **options)
        except BaseException:
            with contextlib.suppress(redis.RedisError):
                store.clear_enqueued(key, new_id)  # the publish failed: leave no marker behind
            raise

    def _sf_clear_marker(self, key: str) -> None:
        """A run turned away at run time ends here: the next enqueue may send a new message."""
        if self.options.dedup_enqueue and self.request.id:
            with contextlib.suppress(redis.RedisError):
                self.store.clear_enqueued(key, self.request.id)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Release the lease before the retry is published, so it is not its own duplicate."""
        lease = getattr(self.request, _REQUEST_ATTR, None)
        if lease is not None:
            self._sf_finish_progress(lease)
            self._sf_release(lease, "retried")
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
        lease = self.lease
        lease.check()
        opts = self.options
        args = None
        if opts.status_include_args:
            request = self.request
            args = canonical({"args": list(request.args or ()), "kwargs": dict(request.kwargs or {})})
        update = make_update(state, current, total, message, fields, max_bytes=opts.progress_max_bytes,
                             args=args)
        reporter = lease.reporter
        if reporter is None:
            reporter = lease.reporter = ProgressReporter(
                opts.progress_rate, self._sf_progress_writer(lease),
                heartbeat_for(lease.store).schedule_flush,
            )
        return reporter.submit(update)

    def _sf_progress_writer(self, lease: Lease) -> Any:
        """The write of one update, with what it needs captured: it may run on the heartbeat thread."""
        request = self.request
        task_id, hostname = request.id, request.hostname
        opts = self.options
        store_meta = bool(task_id) and not (request.ignore_result or self.ignore_result)
        send_event = bool(task_id) and (
            worker_sends_task_events() if opts.progress_events is None else opts.progress_events
        )
        app, backend = self.app, self.backend

        def write(update: ProgressUpdate) -> None:
            meta = {**lease.write_progress(update), "key": lease.key, "fence": lease.fence}
            if store_meta:
                backend.store_result(task_id, meta, "PROGRESS")
            if send_event:
                with app.events.default_dispatcher(hostname=hostname) as dispatcher:
                    dispatcher.send("task-progress", uuid=task_id, progress=meta)

        return write

    def _sf_finish_progress(self, lease: Lease) -> None:
        """Write a pending (throttled) update before the run's end is recorded."""
        if lease.reporter is not None and not lease.lost:
            with contextlib.suppress(LeaseLost):  # already reported by mark_lost
                lease.reporter.flush()

    # -- release ------------------------------------------------------------------------

    def _sf_release(
        self, lease: Lease, reason: str, result: Any = None, error: BaseException | None = None
    ) -> None:
        with lease._guard:
            if lease.released:
                return
            lease.released = True
        try:
            ours = lease.store.release(lease.key, lease.token, reason, lease.ttl,
                                       answer_joined=reason != "retried", fence=lease.fence,
                                       slot=lease.slot, clear_marker=self.options.dedup_enqueue,
                                       task_id=lease.task_id, slots=self.options.max_concurrency)
        except redis.RedisError as exc:
            log_release.warning(
                "could not release key=%r task=%s[%s]; it frees when its lease expires in %.1fs: %s",
                lease.key, self.name, lease.task_id, lease.ttl, exc,
            )
            return
        if not ours:
            lease.mark_lost("the lease was gone when the run ended", at_release=True)
        if ours.handoff is not None:
            send_parked(self.app, ours.handoff, lease.key)
        if ours.joined:
            if reason != "succeeded" and error is None:
                error = LeaseLost(lease.key, f"the run it joined ended as {reason} without a result")
            answer_joined(self.app, ours.joined, lease.key, lease.task_id, result=result, error=error)
        log_release.debug("released key=%r task=%s[%s] (%s)", lease.key, self.name, lease.task_id, reason)
        signals.lease_released.send(sender=self.name, lease=lease, reason=reason)

    # -- duplicates -----------------------------------------------------------------------

    def _sf_duplicate(self, key: str, held: Held, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        request = self.request
        opts = self.options
        task_id = request.id or ""
        if held.holder and held.holder == task_id and not request.called_directly:
            # the broker delivered a running task again (visibility timeout): the first
            # delivery is still running and will store the result; this one must not run.
            self._sf_report(key, held, "redelivery", "redelivery of a running task, not run again",
                            logging.WARNING)
            self._sf_park_redelivery(key, args, kwargs)
            raise Ignore()
        # celery beat marks its messages (Celery 5.5+): a tick that finds the key held is skipped
        # unless the task says otherwise (see Options.on_beat_duplicate)
        policy = opts.on_beat_duplicate if self._sf_header("celery_beat_task") else opts.on_duplicate
        if request.called_directly or request.is_eager:
            policy = "raise"  # no message to re-send and no result to report: refuse loudly
        if policy == "skip":
            self._sf_report(key, held, "skipped", "skipped", logging.INFO)
            self._sf_clear_marker(key)
            return outcome.skipped(key, held.holder, held.ttl_left)
        error = LockHeld(key, held.holder, held.ttl_left)
        if policy == "retry":
            first_seen, attempt = self._sf_wait_state()
            waited = mod_time.time() - first_seen
            left = opts.max_wait - waited
            if left > 0:
                cap = min(_BASE_DELAY * 2**attempt, max(held.ttl_left, _MIN_DELAY), left)
                delay = max(_MIN_DELAY, random.uniform(cap / 2, cap))
                self._sf_report(key, held, "retry", f"retry in {delay:.2f}s", logging.INFO)
                self._sf_resend(args, kwargs, delay, first_seen, attempt + 1, error)
            self._sf_report(key, held, "raised", f"gave up after {waited:.1f}s", logging.WARNING)
            self._sf_clear_marker(key)
            raise error
        if policy == "queue":
            return self._sf_park(key, held, args, kwargs)
        if policy == "join":
            return self._sf_join(key, held, args, kwargs)
        self._sf_report(key, held, "raised", "raised", logging.INFO)
        self._sf_clear_marker(key)
        raise error

    def _sf_message(self, args: tuple[Any, ...], kwargs: dict[str, Any], **headers: Any) -> str:
        """This run's message, re-sendable (same task id, retries unchanged), as JSON."""
        from kombu.utils.json import dumps

        request = self.request
        merged = {**(request.headers or {}), **headers}
        sig = self.signature_from_request(request, args, kwargs, retries=request.retries, headers=merged)
        message: str = dumps(dict(sig))  # type: ignore[no-untyped-call]
        return message

    def _sf_join(self, key: str, held: Held, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Join the holder's run: this run will get its result (or error) as its own."""
        request = self.request
        joined = self.store.join(key, self._sf_message(args, kwargs), RESUME_GRACE)
        if joined is None:
            return _ACQUIRE_AGAIN
        self._sf_report(key, held, "joined", f"joined ({joined[0]} waiting for its result)", logging.INFO)
        self._sf_clear_marker(key)
        self.backend.store_result(request.id, {"key": key, "holder": held.holder}, "JOINED")
        raise Ignore()

    def _sf_park(self, key: str, held: Held, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Park this run in the key's FIFO; it is re-sent with the same task id when its turn comes."""
        request = self.request
        opts = self.options
        handoff = uuid.uuid4().hex
        message = self._sf_message(args, kwargs, **{HEADER_HANDOFF: handoff})
        parked = self.store.park(key, request.id, handoff, message, opts.max_queued,
                                 RESUME_GRACE, opts.max_concurrency)
        if parked is None:
            return _ACQUIRE_AGAIN
        if not isinstance(parked, Parked):
            self._sf_report(key, held, "queue-full", f"queue full ({parked} waiting)", logging.WARNING)
            self._sf_clear_marker(key)
            raise QueueFull(key, held.holder, held.ttl_left, parked)
        self._sf_report(key, held, "queued", f"queued at position {parked.position}", logging.INFO)
        if not (request.ignore_result or self.ignore_result):
            self.backend.store_result(
                request.id, {"key": key, "holder": held.holder, "position": parked.position}, "QUEUED"
            )
        raise Ignore()

    def _sf_park_redelivery(self, key: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Keep a copy of a turned-away redelivery until the first delivery releases.

        Acknowledging this delivery (Ignore) can acknowledge the first one too: the Redis broker
        gives both the same delivery tag. If the first delivery's worker then dies, the copy is
        all that is left of the task: it is sent when the lease ends without a release (the
        queue sweeper), and dropped by the release of a run that ended.
        """
        handoff = f"{OWN_COPY}{uuid.uuid4().hex}"  # the scripts recognise an own copy by this prefix
        message = self._sf_message(args, kwargs, **{HEADER_HANDOFF: handoff})
        try:
            parked = self.store.park(key, self.request.id, handoff, message, None, RESUME_GRACE,
                                     self.options.max_concurrency)
        except redis.RedisError as exc:
            log_duplicate.warning("could not keep a copy of redelivered %s[%s] key=%r (if the first"
                                  " delivery's worker dies too, the task is not run again): %s",
                                  self.name, self.request.id, key, exc)
            return
        if parked is None:
            log_duplicate.info("the first delivery of %s[%s] released key=%r meanwhile; this"
                               " redelivery is not run", self.name, self.request.id, key)

    def _sf_report(self, key: str, held: Held, outcome: str, detail: str, level: int) -> None:
        """Log, signal and count a duplicate. ``outcome`` is a stable code (skipped, raised,
        retry, queued, queue-full, joined, redelivery); ``detail`` is for people."""
        task_id = self.request.id
        log_duplicate.log(
            level, "duplicate %s[%s] key=%r held by %s (%.1fs left): %s",
            self.name, task_id, key, held.holder, held.ttl_left, detail,
        )
        signals.duplicate.send(
            sender=self.name, key=key, task_id=task_id, holder=held.holder, ttl_left=held.ttl_left,
            policy=self.options.on_duplicate, outcome=outcome, detail=detail,
        )
        try:
            self.store.note_duplicate(key, task_id or "", outcome)
        except redis.RedisError as exc:
            log_duplicate.debug("could not note the duplicate on key=%r: %s", key, exc)

    def _sf_header(self, name: str) -> Any:
        request = self.request
        return getattr(request, name, None) or (request.headers or {}).get(name)

    def _sf_wait_state(self) -> tuple[float, int]:
        request = self.request
        headers = request.headers or {}
        first = getattr(request, HEADER_FIRST_SEEN, None) or headers.get(HEADER_FIRST_SEEN)
        attempt = getattr(request, HEADER_ATTEMPT, None) or headers.get(HEADER_ATTEMPT) or 0
        return (float(first) if first else mod_time.time()), int(attempt)

    def _sf_resend(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], delay: float,
        first_seen: float, attempt: int, error: Exception,
    ) -> NoReturn:
        """Re-send this message after ``delay`` without spending the task's ``max_retries``."""
        request = self.request
        headers = dict(request.headers or {})
        headers.update({HEADER_FIRST_SEEN: first_seen, HEADER_ATTEMPT: attempt})
        sig = self.signature_from_request(
            request, args, kwargs, countdown=delay, retries=request.retries, headers=headers
        )
        sig.apply_async()
        raise Retry(exc=error, when=delay, sig=sig)

    # -- Redis trouble ----------------------------------------------------------------------

    def _sf_redis_unavailable(
        self, key: str, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        opts = self.options
        request = self.request
        if opts.on_redis_error == "fail_open":
            log_acquire.warning(
                "Redis unreachable, running %s[%s] UNGUARDED for key=%r (fail_open): %s",
                self.name, request.id, key, exc,
            )
            counters.unguarded_runs += 1
            signals.unguarded_run.send(sender=self.name, key=key, task_id=request.id, error=exc)
            return super().__call__(*args, **kwargs)
        first_seen, attempt = self._sf_wait_state()
        waited = mod_time.time() - first_seen
        error = RedisUnavailable(key, str(exc), waited)
        if request.called_directly or request.is_eager:
            raise error
        if opts.redis_max_wait is None or waited + opts.redis_retry_delay <= opts.redis_max_wait:
            log_acquire.warning(
                "Redis unreachable for key=%r; %s[%s] will be retried in %.1fs (fail_closed): %s",
                key, self.name, request.id, opts.redis_retry_delay, exc,
            )
            self._sf_resend(args, kwargs, opts.redis_retry_delay, first_seen, attempt + 1, error)
        log_acquire.error(
            "Redis unreachable for key=%r for %.1fs; %s[%s] fails", key, waited, self.name, request.id
        )
        raise error


class _Counters:
    """Process-wide counts an operator may want to export (e.g. to Prometheus)."""

    unguarded_runs = 0


counters = _Counters()
