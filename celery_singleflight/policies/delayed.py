"""The stage every guarded task has for runs the library delayed (:mod:`..run.delay`): a delayed
run claims its copy in Redis when it starts, so that of its countdown message and a copy a
sweeper sent again (:mod:`..worker.copies`), one runs."""

from __future__ import annotations

import logging
from typing import Any

from celery.exceptions import Ignore

from ..run.delay import claim, delayed_token
from ..run.stage import Ended, Run, Stage

__all__ = ["DelayedCopies"]

log = logging.getLogger("celery_singleflight.queue")


class DelayedCopies(Stage):
    """Claims a delayed run's copy before anything else looks at the run."""

    @classmethod
    def build(cls, task_cls: type, opts: Any, defined: Any) -> Stage | None:
        return cls()

    def before_key(self, run: Run) -> Ended | None:
        if run.eager or claim(run.task.store, run.request):
            return None
        log.info("%s[%s]: another copy of this delayed run runs or ran; this one is dropped",
                 run.task.name, run.task_id)
        raise Ignore()

    def error_key(self, run: Run) -> str:
        found = delayed_token(run.request)
        return found[1] if found else run.key
