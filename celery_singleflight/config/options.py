"""The options of a guarded task, resolved once when the task is bound to its app: the core's
(:mod:`.core`) and every stage's, in one typed :class:`Options`.

Precedence, in one line: per-task attribute > ``app.conf.singleflight_*`` > built-in default.
Django projects that load settings with ``namespace="CELERY"`` write ``CELERY_SINGLEFLIGHT_TTL``.
Everything is validated here, so a bad value fails when the worker starts, not mid-run.
"""

from __future__ import annotations

import weakref
from typing import Any

from ..metrics.options import MetricsOptions
from ..policies import PolicyOptions
from ..policies.debounce import DebounceOptions
from ..policies.duplicates import DuplicateOptions
from ..policies.enqueue import EnqueueOptions
from ..policies.fair import FairOptions
from ..policies.idempotency import IdempotencyOptions
from ..policies.newest import NewestOptions
from ..policies.ordering import OrderOptions
from ..policies.ratelimit import RateOptions
from ..policies.recovered import JournalOptions
from .core import CoreOptions
from .option import Option, OptionGroup, Resolving
from .settings import check_settings

__all__ = ["GROUPS", "Options", "app_options", "declared", "resolve_options", "setting_names",
           "task_option_names"]

#: every group of options, in the order of the configuration page
GROUPS: tuple[type[OptionGroup], ...] = (CoreOptions, PolicyOptions, DuplicateOptions, NewestOptions,
                                         OrderOptions, IdempotencyOptions, EnqueueOptions, RateOptions,
                                         FairOptions, DebounceOptions, JournalOptions, MetricsOptions)


class Options(CoreOptions, PolicyOptions, DuplicateOptions, NewestOptions, OrderOptions, IdempotencyOptions,
              EnqueueOptions, RateOptions, FairOptions, DebounceOptions, JournalOptions, MetricsOptions):
    """The resolved, validated options of one task (or of an app, without a task's own)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Options({', '.join(f'{k}={v!r}' for k, v in self._values.items())})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and other._values == self._values

    def __hash__(self) -> int:
        return id(self)


def declared() -> list[Option[Any]]:
    """Every option, in the order of the configuration page."""
    return [option for group in GROUPS for option in group.options()]


def setting_names() -> list[str]:
    """Every ``singleflight_*`` setting, without its prefix."""
    return [option.name for option in declared() if option.setting]


def task_option_names() -> set[str]:
    """Every task option of ours."""
    return {option.task for option in declared() if option.task}


def resolve_options(task: Any, conf: Any) -> Options:
    """Resolve and validate the options of ``task`` (a class or instance) against ``conf``."""
    check_settings(conf, setting_names(), {o.task: o.name for o in declared() if o.task and o.setting},
                   getattr(getattr(task, "app", None), "namespace", None))
    ctx = Resolving(task, str(getattr(task, "name", None) or getattr(task, "__name__", "task")), conf)
    for item in Options.declared():
        ctx.values[item.name] = item.resolve(ctx)
    for group in GROUPS:
        group.validate(ctx)
    return Options(ctx.values)


class _Overrides:
    """Stands in for a task when resolving an app's settings: no per-task values but the given
    ones (task option names: ``lock_ttl``, ``progress_rate``, ``max_concurrency``)."""

    name = "app"

    def __init__(self, app: Any, overrides: dict[str, Any]) -> None:
        self.app = app
        self.__dict__.update(overrides)


_app_options: weakref.WeakKeyDictionary[Any, dict[tuple[tuple[str, Any], ...], Options]] = (
    weakref.WeakKeyDictionary()
)
#: how many sets of overrides an app keeps resolved
_KEPT_OPTIONS = 256


def app_options(app: Any, **overrides: Any) -> Options:
    """The options of ``app`` (its settings, no task's), with ``overrides``, resolved once per
    app and overrides: the settings are read when first used, as a task reads them when it is
    bound. ``hold()``, the status reader and the CLI call this on every use, so it must be cheap."""
    key = tuple(sorted(overrides.items()))
    try:
        cache = _app_options[app]
    except KeyError:
        cache = _app_options.setdefault(app, {})
    found = cache.get(key)
    if found is None:
        if len(cache) >= _KEPT_OPTIONS:  # overrides computed per call (a ttl from data) stay bounded
            cache.clear()
        found = cache[key] = resolve_options(_Overrides(app, overrides), conf=app.conf)
    return found
