"""A key's time policies as any process sees them: its open debounce burst and its rate state.

    from celery_singleflight import time_status

    ts = time_status(app, "chat:42")
    if ts.debounce:
        print(f"{ts.debounce.calls} calls folded, run planned at {ts.debounce.planned}")
    if ts.rate:
        print(f"next free slot at {ts.rate.next_free}, {ts.rate.planned} runs waiting")

One round trip (a pipeline of three reads). ``sync_account.time_status(42)`` reads the key of a
call in the task's own namespace; ``celery singleflight show`` prints both under the key's
status.
"""

from __future__ import annotations

import time as mod_time
from dataclasses import asdict, dataclass
from typing import Any

from .debounce import DebounceState, parse_burst
from .ratelimit import RateState, parse_state
from .settings import app_options
from .store import LeaseStore, store_for

__all__ = ["TimeStatus", "read_time_status", "time_status"]


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


def read_time_status(store: LeaseStore, key: str) -> TimeStatus:
    """The time policies of ``key`` in ``store``'s namespace (one round trip)."""
    layout = store.layout
    now_us = round(mod_time.time() * 1_000_000)
    pipe = store.client.pipeline(transaction=False)
    pipe.hmget(layout.debounce(key), "leader", "count", "first", "due")
    pipe.get(layout.rate(key))
    pipe.zcount(layout.planned(key), now_us, "+inf")
    burst, rate_raw, waiting = pipe.execute()
    rate = None if rate_raw is None else parse_state(rate_raw, int(waiting), now_us)
    return TimeStatus(key, parse_burst(burst), rate)


def time_status(app: Any, key: str) -> TimeStatus:
    """The debounce window and rate state of ``key`` in ``app``'s namespace."""
    opts = app_options(app)
    return read_time_status(store_for(opts.redis_url, opts.namespace), key)
