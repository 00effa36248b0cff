"""celery_singleflight: only one run per key at a time, safe, observable and fast, for Celery.

The stable API is exactly ``__all__`` (with the public modules ``fencing``, ``testing`` and
``compat``); everything else is internal and may change in any release (docs/versioning.md).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from . import signals, states

# checking an app's settings and tasks at import
from .checks import check_app

# errors
from .errors import (
    ConfigurationError,
    KeyPaused,
    KeyTemplateError,
    LeaseLost,
    LockHeld,
    NotInsideRun,
    ProgressError,
    ProtocolMismatch,
    QueueFull,
    QueueTimeout,
    RedisUnavailable,
    ReplicasUnavailable,
    RetryAfter,
    RunLost,
    SingleFlightError,
    Superseded,
    Throttled,
    UnstableKeyError,
    WaitingLost,
)

# outside tasks
from .hold import HoldLease, hold

# keys
from .keys import MAX_KEY_LENGTH, canonical, compile_key, digest_key

# status and watch for asyncio (ASGI) apps
from .ops.astatus import astatus, awatch

# run-time controls of a key
from .ops.controls import Limits, clear_limits, controls, pause, resume, set_limits

# status, progress and operations
from .ops.fairstatus import FairStatus, set_fair_weight
from .ops.status import KeyStatus, WatchEvent, force_release, held, status, status_all, watch
from .ops.timestatus import TimeStatus, time_status

# time policies
from .policies.debounce import DebouncedRun, is_debounced

# outcomes
from .policies.duplicates import SkippedRun, is_skipped
from .policies.newest import CoalescedRun, is_coalesced

# fair share
from .protocol.fair import Waiter

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
    "Lease",
    "check_app",
    "counters",
    # errors
    "ConfigurationError",
    "KeyPaused",
    "KeyTemplateError",
    "LeaseLost",
    "LockHeld",
    "NotInsideRun",
    "ProgressError",
    "ProtocolMismatch",
    "QueueFull",
    "QueueTimeout",
    "RedisUnavailable",
    "ReplicasUnavailable",
    "RetryAfter",
    "RunLost",
    "SingleFlightError",
    "Throttled",
    "Superseded",
    "UnstableKeyError",
    "WaitingLost",
    # keys
    "MAX_KEY_LENGTH",
    "canonical",
    "compile_key",
    "digest_key",
    # outcomes
    "SkippedRun",
    "is_skipped",
    "CoalescedRun",
    "is_coalesced",
    # status, progress and operations
    "KeyStatus",
    "WatchEvent",
    "force_release",
    "held",
    "status",
    "status_all",
    "watch",
    "astatus",
    "awatch",
    # fair share
    "FairStatus",
    "Waiter",
    "set_fair_weight",
    # run-time controls of a key
    "Limits",
    "clear_limits",
    "controls",
    "pause",
    "resume",
    "set_limits",
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
