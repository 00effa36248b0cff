"""The gauges: keys held and runs waiting per task, read from the lease Redis at each scrape.

Why from Redis and not counted per process: a key is held by whichever worker took it, and a
parked run waits in Redis, not in any process; a per-process gauge summed over processes (and
over workers that died) would drift. The read is a ``SCAN`` of the namespace (never ``KEYS``)
and one pipelined read per batch of held slots, so its cost grows with the number of held keys,
not with the keys ever used.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..ops.status import held
from ..protocol.fair import GATE_PREFIX
from ..worker.registry import guarded_tasks
from .catalog import PREFIX, by_name

__all__ = ["RedisGauges"]

log = logging.getLogger("celery_singleflight.metrics")


class RedisGauges:
    """A ``prometheus_client`` collector of the gauges of :mod:`.catalog`, for ``app``."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # optional dependency

        tasks = guarded_tasks(self.app)
        keys_held: Counter[str] = Counter({task.name: 0 for task in tasks})
        waiting: Counter[str] = Counter({task.name: 0 for task in tasks})
        up = 1.0
        try:
            for namespace in sorted({task.options.namespace for task in tasks}) or [None]:
                queued: dict[tuple[str, str], int] = {}
                for status in held(self.app, namespace=namespace):
                    name = status.task_name or "unknown"
                    if not status.key.startswith(GATE_PREFIX):
                        keys_held[name] += 1
                    # every held slot of a key reads the key's one queue: count it once
                    queued[(status.key, name)] = max(queued.get((status.key, name), 0), status.queued)
                for (_key, name), count in queued.items():
                    waiting[name] += count
        except Exception as exc:  # noqa: BLE001 - a scrape must answer, with redis_up 0
            log.warning("could not read the held keys for the metrics: %s", exc)
            up = 0.0
        for series, values in (("keys_held", keys_held), ("runs_waiting", waiting)):
            family = GaugeMetricFamily(PREFIX + series, by_name(series).help, labels=["task"])
            for name, value in sorted(values.items()):
                family.add_metric([name], value)
            yield family
        yield GaugeMetricFamily(PREFIX + "redis_up", by_name("redis_up").help, value=up)
