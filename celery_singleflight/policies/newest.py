"""Newest wins: ``coalesce`` (one run pending per key, with the newest arguments) and
``supersede`` (the newcomer takes over from the running holder, which is told, then revoked).

Both stamp a run's send time at ``apply_async`` (a re-sent run keeps it), so "newer" means sent
later, whatever order the messages arrive in; runs sent by name carry no stamp and count as the
newest. A duplicate becomes the key's one pending run (``QUEUED``; handed the key by the
holder's release, no polling); a later-sent one replaces it, and the replaced run ends SUCCESS
with a ``coalesced`` result naming the newcomer (``coalesce``), or FAILURE with
:class:`~..errors.Superseded` (``supersede``); with ``coalesce_keep="first"`` (or when it was
sent before the pending one) the newcomer ends that way instead.

``supersede`` also marks the holder superseded, atomically, and pushes the news to the holder's
process, which learns it within milliseconds (``self.lease.superseded``; ``check()`` and
``progress()`` raise ``Superseded``; ``wait_superseded()`` returns; its next renewal or progress
write learns it too, should the push be lost). Any worker's sweeper revokes it with
``terminate=True`` once ``supersede_grace`` has passed; with no grace, the newcomer revokes it at
once. A run handed the key that was superseded on its way starts and
stops at once.
"""

from __future__ import annotations

import logging
import time as mod_time
import uuid
from collections.abc import Callable
from typing import Any, TypedDict

import redis
from celery.exceptions import Ignore

from .. import constants
from ..config.option import Option, OptionGroup, Resolving, choice, seconds, signal_name
from ..errors import ConfigurationError, Superseded
from ..protocol.store import LeaseStore
from ..run.guard import HOLD_SENDER, options_store
from ..run.journal import journal_waiting, new_mark
from ..run.messages import HEADER_SENT, header
from ..run.settle import answer_joined
from ..run.stage import AGAIN, Ended, Run, Send, Stage, Sweep
from ..states import QUEUED
from .duplicates import Duplicate, effective_policy

__all__ = ["CoalescedRun", "Newest", "NewestOptions", "RevokeSuperseded", "coalesced", "is_coalesced"]

log = logging.getLogger("celery_singleflight.duplicate")
log_sweep = logging.getLogger("celery_singleflight.queue")

_POLICIES = ("coalesce", "supersede")


class NewestOptions(OptionGroup):
    """Newest wins: which duplicate stays pending (``coalesce``), how a superseded run is stopped."""

    __slots__ = ()
    title = "Newest wins"

    coalesce_keep = Option[str](
        task="coalesce_keep", default="last", check=choice(("last", "first")),
        meaning="The `coalesce` policy: which duplicate stays the key's one pending run. `\"last\"`: a later"
        " duplicate replaces it, and the replaced one ends SUCCESS with a \"coalesced into <id>\" result"
        " (`is_coalesced()`); `\"first\"`: the pending run stays and later duplicates end that way"
        " ([policies](policies.md#coalesce)).",
        values="`\"last\"` or `\"first\"`.",
    )
    supersede_grace = Option[float](
        task="supersede_grace", default=10.0, check=seconds(allow_zero=True),
        meaning="The `supersede` policy: how long a superseded run may take to stop by itself (its next"
        " `self.lease.check()` or `self.progress()` raises `Superseded`; `self.lease.superseded` tells it)"
        " before it is revoked with `terminate=True` ([policies](policies.md#supersede)). Zero revokes at"
        " once.",
        values="Seconds, zero or more.",
    )
    supersede_signal = Option[str](
        task="supersede_signal", default="SIGTERM", check=signal_name,
        meaning="The `supersede` policy: the signal of that revoke. `SIGTERM` lets `finally` blocks run;"
        " `SIGKILL` does not, and the worker's main process releases the key.",
        values="A signal name: `\"SIGTERM\"`, `\"SIGINT\"`, `\"SIGKILL\"`, ...",
    )

    @classmethod
    def validate(cls, ctx: Resolving) -> None:
        values = ctx.values
        policies = (values["on_duplicate"], values["on_beat_duplicate"])
        if "supersede" in policies and values["max_concurrency"] != 1:
            raise ConfigurationError(
                f"task {ctx.name}: on_duplicate='supersede' needs max_concurrency=1 (the newcomer takes over"
                " the one running run)"
            )


class CoalescedRun(TypedDict):
    """Result of a duplicate that did not run: run ``into`` runs in its place on ``key``."""

    singleflight: str
    key: str
    into: str


def coalesced(key: str, into: str) -> CoalescedRun:
    return {"singleflight": "coalesced", "key": key, "into": into}


def is_coalesced(result: Any) -> bool:
    """True if ``result`` is the outcome of a run coalesced into another (``result["into"]``)."""
    return isinstance(result, dict) and result.get("singleflight") == "coalesced"


def _pending(dup: Duplicate, mode: str) -> tuple[str, ...] | str | None:
    """Make ``dup`` the key's pending run (QUEUED first: once pending, it can run and store its
    own result at any moment)."""
    opts, task = dup.task.options, dup.task
    handoff = uuid.uuid4().hex
    dup.store_state(QUEUED, {"key": dup.key, "holder": dup.held.holder})
    stamp = str(header(task.request, HEADER_SENT) or "")
    message = dup.message(handoff)
    mark = new_mark()
    got = dup.guard.store.newest.coalesce(
        dup.key, dup.task_id, handoff, message, mode, stamp, opts.max_concurrency,
        supersede_grace=opts.supersede_grace, supersede_signal=opts.supersede_signal, mark=mark,
    )
    if isinstance(got, tuple):  # it is the pending run now
        journal_waiting(task, dup.key, message, "pending", mark=mark)
    return got


def coalesce(dup: Duplicate) -> Any:
    """``coalesce``: at most one run pending per key, besides the one running."""
    got = _pending(dup, dup.task.options.coalesce_keep)
    if got is None:
        return AGAIN  # runs now: its own result replaces QUEUED
    if isinstance(got, str):
        dup.report("coalesced", f"coalesced into pending {got}", logging.INFO)
        dup.clear_marker()
        return coalesced(dup.key, got)
    if got:
        _end_replaced(dup.task, dup.guard.store, dup.key, dup.task_id, got)
    dup.report("queued", f"pending (replaced {len(got)})", logging.INFO)
    raise Ignore()


def supersede(dup: Duplicate) -> Any:
    """``supersede``: newest wins; the holder is marked superseded by this run, atomically."""
    got = _pending(dup, "supersede")
    if got is None:
        return AGAIN  # runs now: its own result replaces QUEUED
    if isinstance(got, str):
        dup.report("superseded", f"superseded by pending {got}, sent after it", logging.INFO)
        dup.clear_marker()
        raise Superseded(dup.key, got)
    if got:
        _end_replaced(dup.task, dup.guard.store, dup.key, dup.task_id, got, supersede=True)
    dup.report("superseding", f"supersedes {dup.held.holder}", logging.INFO)
    if dup.task.options.supersede_grace == 0:  # no grace: the revoke goes now, not at the next sweep
        try:
            RevokeSuperseded(dup.task.app, dup.guard.store).revoke(dup.key)
        except redis.RedisError as exc:  # the sweeper revokes it (the key is in its index)
            log.warning("could not revoke the superseded holder of key=%r now: %s", dup.key, exc)
    raise Ignore()


def _end_replaced(task: Any, store: LeaseStore, key: str, into: str, messages: tuple[str, ...], *,
                  supersede: bool = False, owner: str | None = None) -> None:
    """End the runs ``owner`` (by default ``into``) replaced: SUCCESS with a result coalesced
    into ``into``, or (``supersede``) FAILURE with :class:`Superseded`; their callbacks and chains
    go on as for joined runs. Then forget them."""
    if supersede:
        answer_joined(task.app, messages, key, into, error=Superseded(key, into), label="superseded run")
    else:
        answer_joined(task.app, messages, key, into, result=coalesced(key, into), label="coalesced run")
    try:
        store.newest.answered(key, owner or into)
    except redis.RedisError as exc:  # they are ended again (the same result) when ``into`` starts
        log.debug("could not clear the replaced runs of key=%r: %s", key, exc)


class Newest(Stage):
    """The stage of a task whose ``on_duplicate`` (or ``on_beat_duplicate``) is one of these."""

    options = NewestOptions
    throws = (Superseded,)
    #: the ``on_duplicate`` policies of this stage
    POLICY_NAMES = _POLICIES
    outcomes = {"coalesce": ("coalesced", "queued"), "supersede": ("superseding", "superseded")}

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        if not {opts.on_duplicate, opts.on_beat_duplicate} & set(_POLICIES):
            return None
        return cls()

    @classmethod
    def sweeps(cls, app: Any, tasks: list[Any]) -> list[Sweep]:
        """Revoke superseded runs whose grace is over: in the namespaces of the tasks that use
        ``supersede`` (the others' Redis users need no access to the superseding index)."""
        found: dict[tuple[int, str], LeaseStore] = {}
        for task in tasks:
            opts = task.options
            if "supersede" in (opts.on_duplicate, opts.on_beat_duplicate):
                store = options_store(opts)
                found[(id(store.client), opts.namespace)] = store
        return [RevokeSuperseded(app, store) for store in found.values()]

    def policies(self) -> dict[str, Callable[..., Any]]:
        return {"coalesce": coalesce, "supersede": supersede}

    def send(self, call: Send, proceed: Callable[[Send], Any]) -> Any:
        if HEADER_SENT not in call.headers():  # a re-sent run keeps the time it was first sent
            call.add_headers(**{HEADER_SENT: mod_time.time_ns()})
        return proceed(call)

    def on_start(self, run: Run) -> Ended | None:
        """A run starts (one round trip): if a run sent after it is pending or started already
        (this one's message was re-sent or late), it does not run: it ends as replaced by that
        run. A pending run handed the key also ends the runs it replaced whose ending its caller
        may not have written (it died right after replacing them), and stops at once if a newer
        run superseded it on its way."""
        guard, lease = run.guard, run.lease
        assert guard is not None and lease is not None
        policy = effective_policy(run.task)
        supersede = policy == "supersede"
        # only a run of a newest-wins policy gives way to a newer one (with on_beat_duplicate alone,
        # the task's other runs follow their own policy)
        stamp = str(header(run.request, HEADER_SENT) or "") if policy in _POLICIES else ""
        try:
            started = guard.store.newest.started(guard.key, run.task_id, lease.slot, stamp)
        except redis.RedisError as exc:
            log.debug("could not read the replaced runs of key=%r: %s", guard.key, exc)
            return None
        if started.newer is not None:
            if started.owed:
                _end_replaced(run.task, guard.store, guard.key, started.newer, started.owed,
                              supersede=supersede, owner=run.task_id)
            log.info("%s[%s] key=%r: %s was sent after this run and is pending or started; this one does"
                     " not run", run.task.name, run.task_id, guard.key, started.newer)
            if supersede:
                raise Superseded(guard.key, started.newer)
            return Ended(coalesced(guard.key, started.newer))
        if started.owed:
            _end_replaced(run.task, guard.store, guard.key, run.task_id, started.owed, supersede=supersede)
        if started.notice is not None:
            lease.learn_superseded(started.notice)
            lease.check()  # superseded on its way here: raises Superseded, never runs
        return None


class RevokeSuperseded(Sweep):
    """Revoke (``terminate=True``) superseded holders whose grace is over; any worker of the app
    does it, so the revoke happens even when the newcomer's worker is gone."""

    def __init__(self, app: Any, store: LeaseStore) -> None:
        self.app, self.store = app, store

    def sweep_once(self) -> int:
        for key in self.store.newest.due_superseding():
            self.revoke(key)
        return 0

    def revoke(self, key: str) -> bool:
        """Revoke the superseded holder of ``key`` if its grace is over; plan the next look.
        True if a revoke was sent."""
        newest = self.store.newest
        record, _ = self.store.reads.held(key)
        if record is None or not record.sup_by:
            newest.plan_superseding(key, None)  # released (or never superseded): nothing to do
            return False
        if record.reserved or record.task_name == HOLD_SENDER:
            # on its way to a run that starts superseded and stops at once; or a hold(), which
            # has no task to revoke and stops by itself (its lease says it was superseded)
            newest.plan_superseding(key, constants.REVOKE_AGAIN)
            return False
        left = (record.sup_due or 0) / 1000.0 - mod_time.time()
        if left > 0:
            newest.plan_superseding(key, left)
            return False
        task_id, signame = record.task_id, record.sup_sig or "SIGTERM"
        log_sweep.warning("revoking %s[%s] on key=%r: superseded by %s and still running after its grace",
                          record.task_name, task_id, key, record.sup_by)
        self.app.control.revoke(task_id, terminate=True, signal=signame)
        newest.plan_superseding(key, constants.REVOKE_AGAIN)
        return True

