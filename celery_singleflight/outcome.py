"""The result a skipped duplicate ends with, and how callers recognise it.

A skipped duplicate ends as SUCCESS (it is not an error, and ``.get()`` returns at once), but its
result says what happened instead of a silent ``None``::

    {"singleflight": "skipped", "key": "sync:42", "holder": "<task id>", "ttl_left": 12.5}
"""

from __future__ import annotations

from typing import Any, TypedDict

__all__ = ["SkippedRun", "is_skipped", "skipped"]


class SkippedRun(TypedDict):
    """Result of a duplicate that did not run because ``key`` was held by ``holder``."""

    singleflight: str
    key: str
    holder: str
    ttl_left: float


def skipped(key: str, holder: str, ttl_left: float) -> SkippedRun:
    return {"singleflight": "skipped", "key": key, "holder": holder, "ttl_left": round(ttl_left, 3)}


def is_skipped(result: Any) -> bool:
    """True if ``result`` (e.g. ``AsyncResult.get()``) is the outcome of a skipped duplicate."""
    return isinstance(result, dict) and result.get("singleflight") == "skipped"
