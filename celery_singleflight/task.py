"""``SingleFlightTask``: a Celery Task base class that runs at most one execution per key.

Worker side::

    @app.task(bind=True, base=SingleFlightTask, lock_key="sync:<account_id>", on_duplicate="skip")
    def sync_account(self, account_id):
        ...
        write(page, fence=self.lease.fence)
        self.lease.check()          # raises LeaseLost if another run took over

A run is a pipeline of stages (:mod:`.run.pipeline`, the stages in :mod:`.policies`): the lease
is taken in ``__call__``, before the body runs (a ``task_prerun`` receiver cannot stop a run), and
released in its ``finally`` (success, failure, Retry, Ignore, Reject, soft time limit).
``self.retry()`` releases first, so the retry is never its own duplicate (an enqueue marker
stays until the retry runs). Ends that run no code
in the pool child (SIGKILL, hard time limit, revoke with ``terminate=True``) are released by the
worker's main process (:mod:`.worker.bootstep`). Every option is declared once, with the feature that
owns it (:mod:`.config`); the configuration page lists them all.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncGenerator, Iterator
from contextlib import aclosing
from typing import Any, ClassVar

from celery import Task
from celery.exceptions import Retry

from .config.names import check_task_options
from .config.options import Options, resolve_options, task_option_names
from .errors import KeyTemplateError, NotInsideRun
from .keys import KeyFunction, canonical, compile_key
from .ops.astatus import reader_for
from .ops.fairstatus import FairStatus, fair_status
from .ops.status import KeyStatus, StatusReader, WatchEvent
from .ops.timestatus import TimeStatus, task_time_status
from .policies import define_stages, pipeline_for
from .protocol.store import LeaseStore
from .run.guard import options_store
from .run.lease import Lease
from .run.outage import counters
from .run.pipeline import REQUEST_ATTR, Pipeline
from .run.progress import make_update
from .run.progress_meta import progress_hook
from .run.stage import Send
from .worker import bootstep
from .worker.registry import guarded_tasks

__all__ = ["SingleFlightTask", "counters", "guarded_tasks"]

#: names Celery itself takes as task options or attributes (never taken for a misspelling of ours)
_CELERY_NAMES = frozenset(dir(Task)) | {
    "autoretry_for", "dont_autoretry_for", "retry_kwargs", "retry_backoff", "retry_backoff_max",
    "retry_jitter", "override_max_retries", "bind", "base", "shared", "lazy", "filter", "pydantic",
    "pydantic_strict", "pydantic_context", "pydantic_dump_kwargs", "dump_pydantic_arguments",
}


def _run_signature(cls: type) -> inspect.Signature | None:
    """The signature callers use: ``run`` without ``self`` for ``bind=True`` tasks."""
    run = cls.__dict__.get("run") or getattr(cls, "run", None)
    if run is None:
        return None
    if isinstance(run, staticmethod):
        return inspect.signature(run.__func__)
    sig = inspect.signature(run)
    params = list(sig.parameters.values())
    return sig.replace(parameters=params[1:]) if params else sig


def _guard_of(task: Any) -> Any:
    """The guard of ``task``'s current run: on its request, or on one below it. Celery 5.3's
    ``Task.__call__`` pushes a fresh request for the body (later versions copy the one the run
    began with), so under ``apply()`` the body's request does not carry it."""
    guard = getattr(task.request, REQUEST_ATTR, None)
    if guard is None:
        for request in reversed(task.request_stack.stack):
            guard = getattr(request, REQUEST_ATTR, None)
            if guard is not None:
                break
    return guard


class SingleFlightTask(Task):  # type: ignore[misc]  # celery ships no type information
    """A Task that holds a Redis lease on its rendered ``lock_key`` while it runs.

    Its options (``lock_key``, ``on_duplicate``, ``lock_ttl``, ...) are class attributes or
    ``@app.task(...)`` keywords; ``None`` means the app's setting (docs/configuration.md).
    """

    _sf_render: ClassVar[KeyFunction | None] = None
    _sf_defined: ClassVar[dict[type, Any] | None] = None
    _sf_options: ClassVar[Options | None] = None
    _sf_pipeline: ClassVar[Pipeline | None] = None
    #: the worker's main process looks at a fair task's gate as each message arrives
    Strategy = "celery_singleflight.worker.fairpark:strategy"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name") or f"{cls.__module__}.{cls.__name__}"
        check_task_options(cls, name, task_option_names(), _CELERY_NAMES)
        spec = cls.__dict__.get("lock_key")
        if spec is None and cls.__dict__.get("run") is None:
            return  # an intermediate base class, not a task yet
        spec = spec if spec is not None else getattr(cls, "lock_key", None)
        if spec is None:
            raise KeyTemplateError(
                f"task {cls.__dict__.get('name') or cls.__name__}: SingleFlightTask needs lock_key="
                " (a template such as 'sync:<account_id>' or a callable)"
            )
        signature = _run_signature(cls)
        cls._sf_render = compile_key(spec, signature, name)
        cls._sf_defined = define_stages(cls, signature, name)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Resolve and validate options against the app's settings; build the run's stages;
        wire the worker side."""
        super().on_bound(app)
        if cls._sf_render is None:
            return
        cls._sf_options = resolve_options(cls, app.conf)
        cls._sf_pipeline = pipeline_for(cls, cls._sf_options)
        # a duplicate refused under ``raise`` is expected: logged at INFO, without a traceback
        cls.throws = tuple(dict.fromkeys((*cls.throws, *cls._sf_pipeline.throws)))
        bootstep.install(app)

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
        return StatusReader(self.store, self.app).read_first(self.render_key(*args, **kwargs),
                                                             self.options.max_concurrency)

    async def astatus(self, *args: Any, **kwargs: Any) -> KeyStatus | None:
        """:meth:`status` for async code (``await sync_account.astatus(42)``), read on the event loop."""
        reader = await reader_for(self.options)
        return await reader.read_first(self.render_key(*args, **kwargs), self.options.max_concurrency)

    def status_all(self, *args: Any, **kwargs: Any) -> list[KeyStatus]:
        """Every held slot of the key of this call (one for a plain task); empty if none is held."""
        key = self.render_key(*args, **kwargs)
        return StatusReader(self.store, self.app).read_all(key, slots=self.options.max_concurrency)

    def fair_status(self, limit: int = 100) -> FairStatus | None:
        """This task's fair gate (None without ``fair_concurrency``): the runs holding its slots
        and the first ``limit`` runs waiting, each with its fair key, position and ETA."""
        return fair_status(self, limit)

    def time_status(self, *args: Any, **kwargs: Any) -> TimeStatus:
        """The debounce window and the rate state of this call's keys, in this task's namespace."""
        return task_time_status(self, args, kwargs)

    def watch(self, *args: Any, **kwargs: Any) -> Iterator[WatchEvent]:
        """Follow the run on the key of this call live until it ends (its history first):
        ``for event in sync_account.watch(42): ...``. The first held slot; slot 0 when none is
        held (the watch then ends at once with the last run's outcome). For a timeout, use
        ``watch(app, task.render_key(...), timeout=...)``."""
        key = self.render_key(*args, **kwargs)
        reader = StatusReader(self.store, self.app)
        first = reader.read_first(key, self.options.max_concurrency)
        return reader.watch(key, slot=first.slot if first is not None else 0)

    async def awatch(self, *args: Any, **kwargs: Any) -> AsyncGenerator[WatchEvent, None]:
        """:meth:`watch` for async code, on the event loop: ``async for event in sync_account.awatch(42)``."""
        key = self.render_key(*args, **kwargs)
        reader = await reader_for(self.options)
        first = await reader.read_first(key, self.options.max_concurrency)
        async with aclosing(reader.watch(key, slot=first.slot if first is not None else 0)) as events:
            async for event in events:
                yield event

    @property
    def options(self) -> Options:
        opts = type(self)._sf_options
        if opts is None:
            opts = type(self)._sf_options = resolve_options(type(self), self.app.conf)
        return opts

    @property
    def pipeline(self) -> Pipeline:
        found = type(self)._sf_pipeline
        if found is None:
            found = type(self)._sf_pipeline = pipeline_for(type(self), self.options)
        return found

    @property
    def store(self) -> LeaseStore:
        return options_store(self.options)

    @property
    def lease(self) -> Lease:
        """The lease of the current run; raises :class:`NotInsideRun` outside one."""
        guard = _guard_of(self)
        if guard is None or guard.lease is None:
            raise NotInsideRun(f"task {self.name}: self.lease is only available while the task body runs")
        lease: Lease = guard.lease
        return lease

    def apply_async(self, args: Any = None, kwargs: Any = None, task_id: str | None = None,
                    *rest: Any, **options: Any) -> Any:
        """Render the key first, so arguments that cannot give a stable key are refused here,
        before anything is sent; then the stages decide how it is sent (debounce, enqueue-time
        dedup, a send stamp, a sequence number)."""
        if type(self)._sf_render is None:
            return super().apply_async(args, kwargs, task_id, *rest, **options)
        key = self.render_key(*(args or ()), **(kwargs or {}))

        def publish(call: Send) -> Any:
            return super(SingleFlightTask, self).apply_async(call.args, call.kwargs, call.task_id, *call.rest,
                                                             **call.options)

        return self.pipeline.send(Send(self, key, args, kwargs, task_id, options, rest, publish))

    # -- the run ------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.pipeline.run(self, args, kwargs, super().__call__)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Release the lease before the retry is published, so it is not its own duplicate (an
        enqueue marker stays with the retry, which keeps the task id). If no retry is sent
        (``max_retries`` reached), the run is recorded ``failed`` and its marker freed."""
        guard = _guard_of(self)
        if guard is not None:
            guard.end("retried", answer_joined=False)
        try:
            return super().retry(*args, **kwargs)
        except Retry:
            raise
        except BaseException:
            if guard is not None:
                guard.retry_not_sent()
            raise

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
        guard = _guard_of(self)
        if guard is None or guard.lease is None:
            raise NotInsideRun(
                f"task {self.name}: self.progress() is only available while the task body runs")
        guard.lease.check()
        if guard.on_progress is None:  # built at the first report, from this run's request
            guard.on_progress = progress_hook(self)
        opts = self.options
        args = None
        if opts.status_include_args:
            request = self.request
            args = canonical({"args": list(request.args or ()), "kwargs": dict(request.kwargs or {})})
        update = make_update(state, current, total, message, fields, max_bytes=opts.progress_max_bytes,
                             args=args)
        return bool(guard.progress(update))


for _option in sorted(task_option_names() - _CELERY_NAMES):  # None: the app's setting (Celery reads its own)
    setattr(SingleFlightTask, _option, None)
