"""Runs sent again after the lease Redis lost its data (:mod:`..worker.recovery`): where each
worker journals its waiting runs (``singleflight_journal_dir``), and the stage that drops a
recovered run which already ran, runs, or waits again, so that recovery does not run a run twice.

Its result state tells whether it started (``STARTED``, written when a run that waited starts:
:mod:`.lostruns`). A task that keeps no state (no result backend, ``ignore_result``), or a state
that cannot be read, is not checked there: such a run goes on if it neither holds its key nor waits
again (at least once: if its first run has started and lost its lease with the data, it runs again).
A run that takes its key also marks the hand-off token it was parked with as adopted, so that its
earlier hand-off message, if still on its way, is dropped as a copy.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from typing import Any

import redis
from celery import states as celery_states
from celery.backends.base import DisabledBackend
from celery.exceptions import Ignore

from ..config.option import Option, OptionGroup, Resolving
from ..errors import ConfigurationError
from ..run.journal import HEADER_RECOVERED, HEADER_RECOVERED_HANDOFF
from ..run.messages import header
from ..run.stage import Ended, Run, Stage
from ..states import PROGRESS

__all__ = ["JournalOptions", "Recovered", "already_placed"]

log = logging.getLogger("celery_singleflight.queue")

#: the states of a run that ended and must not run again: a hand-off of it is dropped
_ENDED = frozenset({celery_states.SUCCESS, celery_states.REVOKED})
#: the states of a run that started (or ended): a recovered copy of it is dropped
_STARTED = frozenset({*celery_states.READY_STATES, celery_states.STARTED, PROGRESS})


def _directory(where: str, value: Any, ctx: Resolving) -> str:
    if value is None:  # one per user and app: another's journal is not read as this one's
        uid = os.getuid() if hasattr(os, "getuid") else None
        main = getattr(getattr(ctx.task, "app", None), "main", None)
        app = re.sub(r"[^A-Za-z0-9._-]", "_", str(main or ""))
        return os.path.join(tempfile.gettempdir(), "-".join(
            str(part) for part in ("celery-singleflight", uid, app) if part not in (None, "")))
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ConfigurationError(f"{where} must be a directory path, not {value!r}")
    return str(os.fspath(value))


class JournalOptions(OptionGroup):
    """Where each worker journals the runs waiting in the lease Redis."""

    __slots__ = ()
    title = "Recovery of waiting runs"

    journal_dir = Option[str](
        check=_directory,
        default_text="`celery-singleflight-<uid>-<app.main>` in the temporary directory",
        meaning="Where each worker node journals the runs it parked or delayed, to send them again if the"
        " lease Redis loses its data ([guarantees](guarantees.md#waiting-runs-and-the-faults-they-survive));"
        " also read at the worker's restart, so keep it on a persistent disk.",
        values="A directory; created if missing.",
    )


def already_placed(run: Run) -> str | None:
    """Why a recovered run must not go on (it started or ended, holds its key, or waits in its
    key's queue again), or None. Its state is not read where none is kept, nor trusted when the
    backend fails: such a run goes on rather than be lost (its journal line is gone)."""
    task = run.task
    if not (isinstance(task.backend, DisabledBackend) or task.ignore_result or run.request.ignore_result):
        try:
            state = task.backend.get_task_meta(run.task_id).get("status")
        except Exception as exc:  # noqa: BLE001 - any backend's error: run it rather than lose it
            log.warning("%s[%s] on key=%r: its state cannot be read (%s): it runs if it holds nothing",
                        task.name, run.task_id, run.key, exc)
            state = None
        if state in _STARTED:
            return f"is {state} already"
    if any(st.task_id == run.task_id for st in task.status_all(*run.args, **run.kwargs)):
        return "holds its key"
    if task.store.epoch.parked(run.key, run.task_id):
        return "waits in its key's queue again"
    return None


class Recovered(Stage):
    """The stage every guarded task has: a run sent again by the recovery goes on only if it
    has not started elsewhere meanwhile; a hand-off of a run that already succeeded (a lease
    Redis back from an older snapshot still had it parked) does not run it again."""

    options = JournalOptions

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls()

    def before_key(self, run: Run) -> Ended | None:
        # a hand-off of a run parked again after its recovery carries the header too: it goes on
        if run.eager or run.handoff or not header(run.request, HEADER_RECOVERED):
            return None
        why = already_placed(run)
        if why is None:
            return None
        log.info("%s[%s] on key=%r, sent again after the lease Redis lost its data, %s: not run again",
                 run.task.name, run.task_id, run.key, why)
        raise Ignore()

    @staticmethod
    def drop_a_stale_hand_off(run: Run) -> None:
        """Raise Ignore (its result stays) if the run this hand-off carries already succeeded or
        was revoked: an older snapshot of the lease Redis brought back its parked entry, and the
        token that adopted its slot is not in that snapshot (found by the model of the protocol).
        One read of the result backend per hand-off, where it keeps state."""
        task = run.task
        if isinstance(task.backend, DisabledBackend) or task.ignore_result or run.request.ignore_result:
            return
        try:
            state = task.backend.get_task_meta(run.task_id).get("status")
        except Exception:  # noqa: BLE001 - any backend's error: the run goes on, as before
            return
        if state in _ENDED:
            log.warning("%s[%s] on key=%r: handed the key, but it is %s already (the lease Redis came back"
                        " with older data): not run again", task.name, run.task_id, run.key, state)
            raise Ignore()

    def on_start(self, run: Run) -> Ended | None:
        if run.handoff and not run.eager:
            self.drop_a_stale_hand_off(run)
        token = "" if run.eager else str(header(run.request, HEADER_RECOVERED_HANDOFF) or "")
        if not token or run.guard is None or run.lease is None:
            return None
        try:  # its earlier hand-off message, if still on its way, is now a copy: dropped at its take
            run.guard.store.handoff.mark_adopted(run.key, token, run.lease.fence)
        except redis.RedisError as exc:  # the run goes on; that message could run it once more
            log.warning("%s[%s] on key=%r: its earlier hand-off %s cannot be marked adopted: %s",
                        run.task.name, run.task_id, run.key, token, exc)
        return None
