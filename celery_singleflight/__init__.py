"""celery_singleflight: only one run per key at a time, safe, observable and fast, for Celery."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import signals, states

# time policies
from .debounce import DebouncedRun, is_debounced

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
    Superseded,
    Throttled,
    UnstableKeyError,
)

# outside tasks
from .hold import HoldLease, hold

# keys
from .keys import MAX_KEY_LENGTH, canonical, compile_key, digest_key
from .layout import KeyLayout

# leases
from .lease import Lease

# outcomes
from .outcome import CoalescedRun, SkippedRun, is_coalesced, is_skipped
from .replies import Acquired, Held, Holder, Parked, Settlement

# settings
from .settings import Options, resolve_options

# status, progress and operations
from .status import KeyStatus, StatusReader, WatchEvent, force_release, held, status, status_all, watch
from .store import LeaseStore, store_for

# the task base class
from .task import SingleFlightTask, counters
from .timestatus import TimeStatus, time_status

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
    "Throttled",
    "Superseded",
    "UnstableKeyError",
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
    "Parked",
    "Settlement",
    # outcomes
    "SkippedRun",
    "is_skipped",
    "CoalescedRun",
    "is_coalesced",
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
    # time policies
    "DebouncedRun",
    "TimeStatus",
    "is_debounced",
    "time_status",
    # modules: signals, custom states and their meta
    "signals",
    "states",
    "__version__",
]
