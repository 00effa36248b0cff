"""Check an app's settings and its guarded tasks' options now, rather than at first use.

Celery creates a task lazily: ``@app.task(...)`` returns a proxy until the app is finalized
(a worker does so at start) or the task is first used. A misspelled option or setting is
refused when the task is created, so in a web process that can be the first request that
sends it. ``check_app(app)`` at the end of the module that configures the app (or in Django's
``AppConfig.ready()``) finalizes the app and checks everything at import instead; tasks defined
after that are created, and checked, where they are defined.
"""

from __future__ import annotations

from typing import Any

from .config.options import app_options
from .worker.registry import guarded_tasks

__all__ = ["check_app"]


def check_app(app: Any) -> list[str]:
    """Raise :class:`~.errors.ConfigurationError` (or :class:`~.errors.KeyTemplateError`) for a
    misspelled or bad ``singleflight_*`` setting or option of any guarded task of ``app``;
    return the guarded tasks' names. Touches no Redis."""
    app_options(app)  # the settings, also when no task is guarded yet
    names = []
    for task in guarded_tasks(app):  # reading app.tasks finalizes the app: every task is created
        task.options  # noqa: B018 - resolving the options is the check
        names.append(task.name)
    return names
