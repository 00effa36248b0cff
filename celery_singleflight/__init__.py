"""celery_singleflight: only one run per key at a time, safe, observable and fast, for Celery."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import signals, states

# settings
from .config.options import Options, resolve_options

# errors
from .errors import (
    ConfigurationError,
    KeyTemplateError,
    LeaseLost,
    LockHeld,
    NotInsideRun,
    ProgressError,
    ProtocolMismatch,
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

# status, progress and operations
from .ops.status import KeyStatus, StatusReader, WatchEvent, force_release, held, status, status_all, watch
from .ops.timestatus import TimeStatus, time_status

# time policies
from .policies.debounce import DebouncedRun, is_debounced

# outcomes
from .policies.duplicates import SkippedRun, is_skipped
from .policies.newest import CoalescedRun, is_coalesced
from .protocol.replies import Acquired, Held, Holder, Parked, Settlement
from .protocol.store import KeyLayout, LeaseStore, store_for

# leases
from .run.lease import Lease

# the task base class
from .task import SingleFlightTask, counters

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
    "ProtocolMismatch",
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
