"""The stages of a guarded run, one per feature, in the order a run passes them; and the choice
of duplicate policy.

==========================  =================================================================
:mod:`.recovered`           a run sent again after the lease Redis lost data, unless it ran
:mod:`.debounce`            a burst of calls becomes one run (before the key)
:mod:`.newest`              ``coalesce`` and ``supersede``: newest wins
:mod:`.idempotency`         a finished run remembered by its idempotency key
:mod:`.ratelimit`           a per-key rate limit across every worker
:mod:`.enqueue`             enqueue-time dedup
:mod:`.ordering`            strict send order for ``queue``
:mod:`.duplicates`          ``raise``, ``skip``, ``retry``, ``queue``, ``join``
:mod:`.lostruns`            a run that waited, then was lost with its worker, ends FAILURE
==========================  =================================================================

Each stage owns its options (declared once, in its module) and its hooks (:mod:`..run.stage`);
a task's :class:`~..run.pipeline.Pipeline` holds the stages that apply to it.
"""

from __future__ import annotations

from typing import Any

from ..config.option import Option, OptionGroup, Resolving, choice
from ..errors import ConfigurationError
from ..run.pipeline import Pipeline
from ..run.stage import Stage
from .debounce import Debouncing
from .delayed import DelayedCopies
from .duplicates import DuplicatePolicies
from .enqueue import EnqueueDedup
from .fair import FairShare
from .idempotency import Idempotency
from .lostruns import LostRuns
from .newest import Newest
from .ordering import Ordering
from .ratelimit import RateLimit
from .recovered import Recovered

__all__ = ["POLICY_NAMES", "STAGES", "PolicyOptions", "define_stages", "pipeline_for"]

#: every stage, in the order a run passes them (a recovered run that ran already is dropped
#: first, then a delayed run claims its copy; on the send side too: debounce decides first, the
#: newest stamp comes before the enqueue marker, the sequence number is taken last)
STAGES: tuple[type[Stage], ...] = (Recovered, DelayedCopies, Debouncing, Newest, Idempotency, RateLimit,
                                   EnqueueDedup, Ordering, FairShare, DuplicatePolicies, LostRuns)
#: every ``on_duplicate`` policy, by name
POLICY_NAMES: tuple[str, ...] = (*DuplicatePolicies.POLICIES, *Newest.POLICY_NAMES)


def _beat_policy(option: Option[Any], ctx: Resolving) -> Any:
    """beat ticks: per-task ``on_beat_duplicate`` > the task's own ``on_duplicate`` > the setting > skip."""
    task = ctx.task
    return (getattr(task, "on_beat_duplicate", None) or getattr(task, "on_duplicate", None)
            or ctx.setting("on_beat_duplicate") or "skip")


_POLICY_LIST = ", ".join(f"`{name}`" for name in POLICY_NAMES)


class PolicyOptions(OptionGroup):
    """What a run does when another run holds its key."""

    __slots__ = ()
    title = "The duplicate policy"

    on_duplicate = Option[str](
        task="on_duplicate", default="raise", check=choice(POLICY_NAMES),
        meaning="What a run does when another run holds its key ([duplicate policies](policies.md)). A"
        " direct or eager call (`task()`, `.apply()`, `task_always_eager`) has no message to re-send: a"
        " duplicate there raises `LockHeld`.",
        values="`raise`, `skip`, `retry`, `queue`, `join`, `coalesce` or `supersede`; `join` needs"
        " `ignore_result=False`, a result backend and `max_concurrency=1`.",
    )
    on_beat_duplicate = Option[str](
        task="on_beat_duplicate", check=choice(POLICY_NAMES), read=_beat_policy, default_text="`\"skip\"`",
        precedence="the task's `on_beat_duplicate` > its own `on_duplicate` > this setting > `\"skip\"`",
        meaning="The policy for a `celery beat` tick that finds its key held (beat marks its messages with"
        " the `celery_beat_task` header, Celery 5.5+); other calls keep `on_duplicate` ([beat](beat.md)).",
        values="As `on_duplicate`.",
    )


def define_stages(task_cls: type, signature: Any, name: str) -> dict[type[Stage], Any]:
    """What each stage checks when a guarded task is defined (raises ConfigurationError)."""
    return {stage: stage.define(task_cls, signature, name) for stage in STAGES}


def pipeline_for(task_cls: type, opts: Any) -> Pipeline:
    """The pipeline of a bound task: the stages that apply to it, in order."""
    defined: dict[type[Stage], Any] = getattr(task_cls, "_sf_defined", None) or {}
    built = [stage.build(task_cls, opts, defined.get(stage)) for stage in STAGES]
    pipeline = Pipeline([stage for stage in built if stage is not None])
    missing = {opts.on_duplicate, opts.on_beat_duplicate} - set(pipeline.policies)
    if missing:  # a policy whose stage is not there: a bug, not a setting
        name = getattr(task_cls, "name", task_cls)
        raise ConfigurationError(f"task {name}: no stage gives {sorted(missing)}")
    return pipeline
