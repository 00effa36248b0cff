"""Drop-in shims for code written against celery-once, celery-singleton and celery-heimdall.

Change the import, keep the tasks::

    from celery_singleflight.compat import AlreadyQueued, QueueOnce         # was: celery_once
    from celery_singleflight.compat.singleton import Singleton              # was: celery_singleton
    from celery_singleflight.compat.heimdall import HeimdallTask            # was: celery_heimdall

Each shim is a :class:`~..task.SingleFlightTask` that reads the old library's options and
settings, maps what has an equivalent and refuses the rest with a :class:`ConfigurationError`
when the task is defined or bound (docs/migrating.md has the tables). The celery-once names are
also here, at the top, as before.
"""

from __future__ import annotations

from . import heimdall, once, singleton
from .once import AlreadyQueued, QueueOnce

__all__ = [
    # celery-once
    "AlreadyQueued",
    "QueueOnce",
    # the shims, one module per library
    "heimdall",
    "once",
    "singleton",
]
