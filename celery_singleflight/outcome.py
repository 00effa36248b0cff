"""The results a duplicate that did not run ends with, and how callers recognise them.

A skipped duplicate ends as SUCCESS (it is not an error, and ``.get()`` returns at once), but its
result says what happened instead of a silent ``None``::

    {"singleflight": "skipped", "key": "sync:42", "holder": "<task id>", "ttl_left": 12.5}

A run folded into another by the ``coalesce`` policy ends as SUCCESS the same way, naming the run
that stands for it (the pending run that will run with the newest arguments)::

    {"singleflight": "coalesced", "key": "sync:42", "into": "<task id>"}
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["CoalescedRun", "SkippedRun", "coalesced", "is_coalesced", "is_skipped", "skipped"]


class SkippedRun(TypedDict):
    """Result of a duplicate that did not run because ``key`` was held by ``holder``."""

    singleflight: str
    key: str
    holder: str
    ttl_left: float


class CoalescedRun(TypedDict):
    """Result of a duplicate that did not run: run ``into`` runs in its place on ``key``."""

    singleflight: str
    key: str
    into: str


def skipped(key: str, holder: str, ttl_left: float) -> SkippedRun:
    return {"singleflight": "skipped", "key": key, "holder": holder, "ttl_left": round(ttl_left, 3)}


def is_skipped(result: Any) -> bool:
    """True if ``result`` (e.g. ``AsyncResult.get()``) is the outcome of a skipped duplicate."""
    return isinstance(result, dict) and result.get("singleflight") == "skipped"


def coalesced(key: str, into: str) -> CoalescedRun:
    return {"singleflight": "coalesced", "key": key, "into": into}


def is_coalesced(result: Any) -> bool:
    """True if ``result`` is the outcome of a run coalesced into another (``result["into"]``)."""
    return isinstance(result, dict) and result.get("singleflight") == "coalesced"
