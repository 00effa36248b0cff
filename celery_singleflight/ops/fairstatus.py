"""A fair task's gate as any process sees it: the runs holding its slots, the runs waiting (in
the order they will start, each with its fair key, position and ETA) and the weights set at run
time.

    fs = sync_account.fair_status()
    for run in fs.running:
        print(run.task_id, run.age)
    for waiter in fs.waiting:
        print(waiter.position, waiter.fair_key, waiter.task_id, waiter.eta)

The positions are read live, so they move as the queue moves. A waiting run's ``QUEUED`` meta
(``AsyncResult.info``) holds its position and ETA when it parked: rewriting it later could land
after the run's own result and replace it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from ..policies.fair import FairShare
from ..protocol.fair import Waiter
from .keystatus import KeyStatus
from .status import StatusReader

__all__ = ["FairStatus", "fair_status", "set_fair_weight"]


@dataclass(frozen=True)
class FairStatus:
    """One fair task's gate: its key and slots, who runs, who waits, the weights set at run time."""

    gate: str
    slots: int
    running: list[KeyStatus] = field(default_factory=list)
    waiting: list[Waiter] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"gate": self.gate, "slots": self.slots, "running": [r.as_dict() for r in self.running],
                "waiting": [w.as_dict() for w in self.waiting], "weights": dict(self.weights)}


def fair_status(task: Any, limit: int = 100) -> FairStatus | None:
    """The gate of ``task`` (None if it has no ``fair_concurrency``): the first ``limit`` waiters."""
    stage = _stage(task)
    if stage is None:
        return None
    store, slots = task.store, int(stage.opts.fair_concurrency)
    running = StatusReader(store, task.app).read_all(stage.gate, slots=slots)
    return FairStatus(stage.gate, slots, running, store.fair.waiters(stage.gate, slots, limit),
                      store.fair.weights(stage.gate))


def set_fair_weight(task: Any, fair_key: str, weight: float | None) -> None:
    """Give ``fair_key`` the ``weight`` at ``task``'s gate from now on, until cleared (None: back to
    ``fair_weights``); the gate's next parked run of that key is placed by it. Raises
    :class:`~..errors.ConfigurationError` for a task without ``fair_concurrency`` or a weight
    that is not above zero."""
    stage = _stage(task)
    if stage is None:
        name = getattr(task, "name", task)
        raise ConfigurationError(f"task {name} has no fair_concurrency: it has no gate to weigh")
    if weight is not None and (isinstance(weight, bool) or not weight > 0 or weight == float("inf")):
        raise ConfigurationError(f"fair key {fair_key!r}: a weight is a number above zero, not {weight!r}")
    task.store.fair.set_weight(stage.gate, fair_key, weight)


def _stage(task: Any) -> FairShare | None:
    pipeline = getattr(task, "pipeline", None)  # a task proxy (before the app is finalized) has it too
    stage = pipeline.stage(FairShare) if pipeline is not None else None
    return stage if isinstance(stage, FairShare) else None
