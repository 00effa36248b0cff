"""A key's time policies as any process sees them: its open debounce burst and its rate state.

    from celery_singleflight import time_status

    ts = time_status(app, "chat:42")
    if ts.debounce:
        print(f"{ts.debounce.calls} calls folded, run planned at {ts.debounce.planned}")
    if ts.rate:
        print(f"next free slot at {ts.rate.next_free}, {ts.rate.planned} runs waiting")

One round trip (a pipeline of three reads). ``notify.time_status(42)`` reads the keys of a call
in the task's own namespace (its debounce key, and its lock key for the rate); ``celery
singleflight show`` prints both under the key's status.
"""

from __future__ import annotations

import time as mod_time
from dataclasses import asdict, dataclass
from typing import Any

from ..config.options import app_options
from ..policies.debounce import Debouncing
from ..protocol.store import LeaseStore, store_for
from ..protocol.timing import DebounceState, RateState

__all__ = ["TimeStatus", "read_time_status", "task_time_status", "time_status"]


@dataclass(frozen=True)
class TimeStatus:
    """The debounce window (None: no open burst) and rate state (None: idle) of one key."""

    key: str
    debounce: DebounceState | None
    rate: RateState | None

    @property
    def empty(self) -> bool:
        return self.debounce is None and self.rate is None

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "debounce": None if self.debounce is None else self.debounce._asdict(),
                "rate": None if self.rate is None else asdict(self.rate)}

    def lines(self, when: Any) -> list[str]:
        """The ``show`` lines of the key's time policies (``when`` formats an epoch time)."""
        lines = []
        if self.debounce is not None:
            burst = self.debounce
            lines.append(f"debounce:    {burst.calls} call(s) folded since {when(burst.first)},"
                         f" run planned {when(burst.planned)} as {burst.leader[:8] or '-'}")
        if self.rate is not None:
            rate = self.rate
            lines.append(f"rate limit:  next free slot {when(rate.next_free)}, {rate.planned} run(s) planned"
                         f" ({rate.per_second:g}/s)")
        return lines


def read_time_status(store: LeaseStore, key: str, debounce_key: str | None = None) -> TimeStatus:
    """The time policies of ``key`` (its burst under ``debounce_key`` if given) in ``store``'s
    namespace (one round trip)."""
    burst, rate = store.timing.state(key, debounce_key or key, round(mod_time.time() * 1_000_000))
    return TimeStatus(key, burst, rate)


def task_time_status(task: Any, args: Any, kwargs: Any) -> TimeStatus:
    """The debounce window of a call's debounce key and the rate state of its lock key."""
    key = task.render_key(*args, **kwargs)
    stage = task.pipeline.stage(Debouncing)
    debounce_key = stage.key_for(task, args, kwargs) if isinstance(stage, Debouncing) else key
    return read_time_status(task.store, key, debounce_key)


def time_status(app: Any, key: str) -> TimeStatus:
    """The debounce window and rate state of ``key`` in ``app``'s namespace."""
    opts = app_options(app)
    return read_time_status(store_for(opts.redis_url, opts.namespace), key)
