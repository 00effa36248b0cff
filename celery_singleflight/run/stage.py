"""A stage: one feature of a guarded run, with its options and its hooks, in the manner of
dramatiq's middleware. :mod:`.pipeline` runs the stages of a task in order.

A run passes the hooks in this order (a stage overrides only those it needs)::

    send(call, proceed)      at apply_async, around the publish (a stage may publish otherwise)
    before_key(run)          before the key is rendered: may replace the arguments, or end the run
    before_lease(run)        may end the run (skipped(run) then for the stages after it)
    on_duplicate(run, held)  every slot is held: the duplicate policy decides
    after_take(run)          the take is over, taken or not
    on_start(run)            under the lease, before the body: may end the run
    after_body(run, result)  the body succeeded
    finish(run, outcome)     the run is over, however it ended (after the release of its key)

A hook ends a run by returning :class:`Ended` (with the run's result), or by raising what the
run ends with (``Ignore`` once its message is re-sent, ``LockHeld``); ``None`` goes on. Stages
are built per task when it is bound (:meth:`Stage.build`; None: the feature is off for it), from
what :meth:`Stage.define` checked when the task was defined.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..config.option import OptionGroup
from ..protocol.delayed import Claim
from ..protocol.replies import Acquired, Held
from ..protocol.started import StartedRun
from .guard import Guard
from .lease import Lease
from .messages import HEADER_HANDOFF, header

__all__ = ["AGAIN", "Ended", "Run", "Send", "Stage", "Sweep", "overrides"]


@dataclass(frozen=True)
class Ended:
    """A stage ended the run: this is its result."""

    result: Any


#: what a duplicate policy returns when it found the key free again: take it
AGAIN: Any = object()


class Run:
    """One run of a guarded task as its stages see it: the task and request, the arguments (a
    stage before the key may replace them), the key, the guard and what the take got, and each
    stage's own notes."""

    __slots__ = (
        "_key",
        "_lease_token",
        "args",
        "claim",
        "got",
        "guard",
        "handoff",
        "kwargs",
        "lease",
        "notes",
        "options",
        "outcome",
        "pipeline",
        "provisional",
        "request",
        "task",
    )

    def __init__(self, task: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pipeline: Any) -> None:
        self.task = task
        self.request = task.request
        self.options = task.options
        self.pipeline = pipeline
        self.args, self.kwargs = args, kwargs
        #: the token a parked run was re-sent with ('' if it was never parked)
        self.handoff = str(header(self.request, HEADER_HANDOFF) or "")
        self.guard: Guard | None = None
        self.got: Acquired | None = None
        self.lease: Lease | None = None
        self.notes: dict[type, Any] = {}
        #: how the run ended: succeeded, failed, retried, ... (``ended``: before its lease)
        self.outcome = "failed"
        self._key: str | None = None
        self._lease_token: str | None = None
        #: the delayed run's copy this run claimed, until it says it started or ended
        self.claim: Claim | None = None
        #: the started index's members entered for this run before its takes (until it starts)
        self.provisional: list[StartedRun] = []

    @property
    def key(self) -> str:
        """The lock key, rendered from the arguments when first asked for."""
        if self._key is None:
            self._key = str(self.task.render_key(*self.args, **self.kwargs))
        return self._key

    @property
    def lease_token(self) -> str:
        """The token this run's lease will have (unique to this execution), drawn when first
        asked for: a delayed run's claim names it before the lease is taken."""
        if self._lease_token is None:
            self._lease_token = os.urandom(16).hex()
        return self._lease_token

    @property
    def task_id(self) -> str:
        return str(self.request.id or "")

    @property
    def eager(self) -> bool:
        """A direct or eager call: no message to re-send, park or answer."""
        return bool(self.request.called_directly or self.request.is_eager)


@dataclass
class Send:
    """One ``apply_async`` as the stages see it: they may change ``task_id`` and ``options``
    (headers, countdown) and call ``publish`` themselves."""

    task: Any
    key: str
    args: Any
    kwargs: Any
    task_id: str | None
    options: dict[str, Any]
    rest: tuple[Any, ...] = ()
    publish: Callable[[Send], Any] = field(default=lambda call: None, repr=False)

    @property
    def eager(self) -> bool:
        return bool(self.task.app.conf.task_always_eager)

    def headers(self) -> dict[str, Any]:
        return dict(self.options.get("headers") or {})

    def add_headers(self, **headers: Any) -> None:
        self.options["headers"] = {**self.headers(), **headers}


class Sweep:
    """A job of the worker's sweeper, run about once a second in each worker's main process."""

    def sweep_once(self) -> int:
        """Look at what is due; return how many waiting runs were sent."""
        raise NotImplementedError


class Stage:
    """One feature of a guarded run (see the module docstring)."""

    #: the feature's options, declared once (also in :class:`~..config.options.Options`)
    options: ClassVar[type[OptionGroup] | None] = None
    #: the run's release clears the enqueue marker of its task id
    clears_marker: ClassVar[bool] = False
    #: Redis commands the feature sends besides the library's own (the ACL rule must allow them)
    acl_commands: ClassVar[tuple[str, ...]] = ()
    #: errors a run of the feature ends with that are expected (Celery logs them at INFO, without
    #: a traceback: the task's ``throws``)
    throws: ClassVar[tuple[type[BaseException], ...]] = ()
    #: for each ``on_duplicate`` policy of the stage, the ``duplicate`` outcomes it reports (a
    #: worker with metrics on makes their series at 0 when it starts)
    outcomes: ClassVar[dict[str, tuple[str, ...]]] = {}

    @classmethod
    def define(cls, task_cls: type, signature: Any, name: str) -> Any:
        """Check what can be checked when the task is defined (a template naming a missing
        parameter); the value is kept for :meth:`build`. Raise ConfigurationError."""
        return None

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        """The stage of a bound task, or None when the feature is off for it."""
        return None

    @classmethod
    def sweeps(cls, app: Any, tasks: list[Any]) -> list[Sweep]:
        """The sweeper's jobs for the app's guarded ``tasks`` (each with its stages built)."""
        return []

    def policies(self) -> dict[str, Callable[..., Any]]:
        """The ``on_duplicate`` policies this stage provides, by name."""
        return {}

    def send(self, call: Send, proceed: Callable[[Send], Any]) -> Any:
        return proceed(call)

    def before_key(self, run: Run) -> Ended | None:
        return None

    def error_key(self, run: Run) -> str:
        """The key an outage in :meth:`before_key` is reported for."""
        return run.key

    def before_lease(self, run: Run) -> Ended | None:
        return None

    def skipped(self, run: Run) -> None:
        """A stage before this one ended the run before the lease."""

    def on_duplicate(self, run: Run, held: Held) -> Any:
        return AGAIN

    def after_take(self, run: Run) -> None:
        return None

    def on_start(self, run: Run) -> Ended | None:
        return None

    def after_body(self, run: Run, result: Any) -> None:
        return None

    def finish(self, run: Run, outcome: str) -> None:
        """The run is over (``outcome``: succeeded, failed, retried, ..., or ``ended`` before its
        lease): release what the stage holds for it."""


def overrides(stage: Stage, hook: str) -> bool:
    """Whether ``stage`` has a hook of its own (the pipeline calls only those)."""
    return getattr(type(stage), hook) is not getattr(Stage, hook)

