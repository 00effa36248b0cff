"""celery_singleflight: only one run per key at a time, safe, observable and fast, for Celery."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import queueing, signals, worker_hooks, worker_setup  # noqa: F401  (worker receivers, tasks)

# errors
from .errors import (
    ConfigurationError,
    KeyTemplateError,
    LeaseLost,
    LockHeld,
    NotInsideRun,
    ProgressError,
    QueueFull,
    RedisUnavailable,
    SingleFlightError,
)

# outside tasks
from .hold import HoldLease, hold

# keys
from .keys import MAX_KEY_LENGTH, KeyLayout, canonical, compile_key, digest_key

# leases
from .lease import Acquired, Held, Holder, Lease, LeaseStore

# outcomes
from .outcome import SkippedRun, is_skipped

# settings
from .settings import Options, resolve_options

# status, progress and operations
from .status import KeyStatus, StatusReader, WatchEvent, force_release, held, status, status_all, watch

# the task base class
from .task import SingleFlightTask, counters, store_for

try:
    __version__ = version("celery-singleflight")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # the task base class
    "SingleFlightTask",
    "counters",
    "store_for",
    # errors
    "ConfigurationError",
    "KeyTemplateError",
    "LeaseLost",
    "LockHeld",
    "NotInsideRun",
    "ProgressError",
    "QueueFull",
    "RedisUnavailable",
    "SingleFlightError",
    # keys
    "MAX_KEY_LENGTH",
    "KeyLayout",
    "canonical",
    "compile_key",
    "digest_key",
    # leases
    "Acquired",
    "Held",
    "Holder",
    "Lease",
    "LeaseStore",
    # outcomes
    "SkippedRun",
    "is_skipped",
    # status, progress and operations
    "KeyStatus",
    "StatusReader",
    "WatchEvent",
    "force_release",
    "held",
    "status",
    "status_all",
    "watch",
    # settings
    "Options",
    "resolve_options",
    # outside tasks
    "HoldLease",
    "hold",
    # signals module
    "signals",
    "__version__",
]
