"""One mix of real-worker runs that every Redis topology test (TLS + ACL, Cluster, Sentinel) runs:
skip, raise, queue, join, max_concurrency, progress and the heartbeat, with their outcomes and
the independent run recorder (no overlaps) checked."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

from celery_singleflight import LockHeld
from celery_singleflight.ops.status import StatusReader
from celery_singleflight.policies.duplicates import is_skipped
from celery_singleflight.protocol.handoff import JOINED, QUEUE
from celery_singleflight.protocol.store import LeaseStore

from .conftest import wait_for


def run_policy_mix(sfapp: ModuleType, queue: str, tag: str, store: LeaseStore) -> dict[str, Any]:
    """Run the mix on the worker consuming ``queue`` (with 6 pool processes: five holders run at
    once, and one is left for the duplicates); keys are made unique with ``tag``; ``store`` reads
    the worker's lease Redis (the queue and join holders run until their waiters are in it).

    Returns the rendered lock keys used (for status checks against the lease Redis)."""
    skip_key, raise_key, q_key, j_key, lim_key, r_key, hb_key = (f"{tag}-{n}" for n in
                                                                  ("s", "r", "q", "j", "l", "p", "hb"))
    renewing = sfapp.heartbeat_check.apply_async((hb_key, 2.0), queue=queue)  # TTL 1.5 s
    # the holders run until their duplicates have taken their way (each opens its gate, below)
    skip_holder = sfapp.hold_skip.apply_async((skip_key, 60), queue=queue)
    raise_holder = sfapp.hold_raise.apply_async((raise_key, 60), queue=queue)
    q_holder = sfapp.queued.apply_async((q_key, 0, 60), queue=queue)
    j_holder = sfapp.joined.apply_async((j_key, "v", 60), queue=queue)
    wait_for(lambda: all(sfapp.recorder.llen(f"runs:{k}") for k in (skip_key, raise_key, q_key, j_key)),
             timeout=20)
    skipped = sfapp.hold_skip.apply_async((skip_key,), queue=queue)
    refused = sfapp.hold_raise.apply_async((raise_key,), queue=queue)
    parked = [sfapp.queued.apply_async((q_key, n, 0.01), queue=queue) for n in (1, 2)]
    joiner = sfapp.joined.apply_async((j_key, "w", 0.01), queue=queue)
    limited = [sfapp.limited.apply_async((lim_key, 0.3), queue=queue) for _ in range(5)]
    report = sfapp.reporting.apply_async((r_key, 3, 0.05), queue=queue)
    wait_for(lambda: store.client.llen(store.layout.key(QUEUE, f"q:{q_key}")) == 2
             and store.client.llen(store.layout.key(JOINED, f"j:{j_key}")) == 1, timeout=30)
    for key in (q_key, j_key):
        sfapp.recorder.set(f"gate:{key}", 1)

    assert is_skipped(skipped.get(timeout=30))
    with pytest.raises(LockHeld):
        refused.get(timeout=30)
    for key in (skip_key, raise_key):
        sfapp.recorder.set(f"gate:{key}", 1)
    assert [r.get(timeout=30) for r in (q_holder, *parked)] == [0, 1, 2]
    assert sfapp.recorder.lrange(f"order:{q_key}", 0, -1) == [b"0", b"1", b"2"]
    joined, held = joiner.get(timeout=30), j_holder.get(timeout=30)
    assert joined == held == {"value": "v", "ran": j_holder.id}, (joined, held)
    for run in limited:
        run.get(timeout=30)
    assert max(int(n) for n in sfapp.recorder.lrange(f"concurrent:{lim_key}", 0, -1)) <= 3
    assert report.get(timeout=30) == 3
    skip_holder.get(timeout=30)
    raise_holder.get(timeout=30)
    assert renewing.get(timeout=30)["lost"] is False
    assert sfapp.recorder.llen("overlaps") == 0
    return {"q": f"q:{q_key}", "j": f"j:{j_key}", "p": f"job:{r_key}", "hb": f"k:{hb_key}",
            "s": f"k:{skip_key}", "lim": f"lim:{lim_key}"}


def check_outcomes(reader: StatusReader, keys: dict[str, str]) -> None:
    """Every run of the mix ended as succeeded in the lease Redis, and nothing is held."""
    for name in ("q", "j", "p", "hb", "s"):
        st = reader.read(keys[name])
        assert st is not None and st.outcome == "succeeded" and not st.held, (keys[name], st)
    progress = reader.read(keys["p"])
    assert progress is not None and (progress.current, progress.total) == (3, 3)
