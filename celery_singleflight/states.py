"""The custom Celery states a guarded run can be in, and a typed reader of their meta.

============  ===============================================  =====================================
state         when                                             meta (``AsyncResult.info``)
============  ===============================================  =====================================
``PROGRESS``  the run reported progress (``self.progress()``)  key, fence, state, current, total,
                                                               percent, message, fields; pending,
                                                               description (celery-progress)
``QUEUED``    a ``queue`` duplicate waits for its turn          key, holder
``JOINED``    a ``join`` duplicate waits for the holder         key, holder
``DEBOUNCED`` a burst's leader waits for the key to be quiet    key, fields: leader, calls, planned
============  ===============================================  =====================================

Each ends in a standard state: the run's own, or the holder's result for a joined run::

    from celery_singleflight import states
    meta = states.read(result)        # None for any other state
    if meta and meta.state == states.QUEUED:
        print(f"waiting behind {meta.holder} on {meta.key}")
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CUSTOM_STATES", "DEBOUNCED", "DELAYED_STATES", "JOINED", "PROGRESS", "QUEUED", "SingleFlightMeta",
    "meta_of", "read",
]

PROGRESS = "PROGRESS"
QUEUED = "QUEUED"
JOINED = "JOINED"
DEBOUNCED = "DEBOUNCED"
CUSTOM_STATES = (PROGRESS, QUEUED, JOINED, DEBOUNCED)
#: the states of a run the library delayed, until it runs (or is re-sent again)
DELAYED_STATES = frozenset({DEBOUNCED, "RETRY"})


@dataclass(frozen=True)
class SingleFlightMeta:
    """The meta of a run in one of :data:`CUSTOM_STATES`."""

    state: str  # PROGRESS, QUEUED, JOINED or DEBOUNCED
    key: str | None = None
    holder: str | None = None  # QUEUED/JOINED: the run it waits for
    progress_state: str | None = None  # PROGRESS: the state the run reported ("loading", ...)
    current: float | None = None
    total: float | None = None
    percent: float | None = None
    message: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)


def meta_of(state: str, info: Any) -> SingleFlightMeta | None:
    """The meta of a run in ``state`` with ``info`` (``AsyncResult.state`` / ``.info``)."""
    if state not in CUSTOM_STATES or not isinstance(info, dict):
        return None
    return SingleFlightMeta(
        state=state, key=info.get("key"), holder=info.get("holder"),
        progress_state=info.get("state") if state == PROGRESS else None, current=info.get("current"),
        total=info.get("total"), percent=info.get("percent"), message=info.get("message"),
        fields=dict(info.get("fields") or {}) if state != DEBOUNCED else {
            name: info.get(name) for name in ("leader", "calls", "planned")},
    )


def read(result: Any) -> SingleFlightMeta | None:
    """The meta of ``result`` (an ``AsyncResult``) if it is in one of :data:`CUSTOM_STATES`.

    The state and the meta come from one read of the result backend: ``result.state`` and
    ``result.info`` are two reads, and a run that ends between them would pair ``PROGRESS`` with
    its return value."""
    get_meta = getattr(result, "_get_task_meta", None)  # Celery's one read; cached once ready
    if get_meta is None:
        return meta_of(result.state, result.info)
    meta = get_meta()
    return meta_of(meta.get("status"), meta.get("result"))
