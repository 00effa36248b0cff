"""Newest by send order survives a re-send: a message re-sent by ``fail_closed``, the sweeper or a
redelivery keeps its original send stamp, so an older call that comes back after a newer one has
started or ran never runs its older arguments last (``coalesce``) nor takes over (``supersede``).
The re-sent message is sent here as the library re-sends it: the same stamp header, later."""

from __future__ import annotations

import time
import uuid
from types import ModuleType

import pytest

import celery_singleflight as sf
from celery_singleflight.run.messages import HEADER_SENT

from .conftest import HOLD, let_go, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]



def _payloads(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"payloads:{key}", 0, -1)]


def test_an_older_coalesce_call_that_comes_back_late_does_not_run(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given call 0 sent, then call 1 sent and run, when call 0's re-sent message arrives (key free)
    it ends SUCCESS coalesced into call 1 without running; while call 2 (newer) holds the key, an
    older re-send gives way to it instead of becoming the pending run."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    key = f"so-{uuid.uuid4().hex[:6]}"
    sent_first = time.time_ns()
    newer = sfapp.coalesced.apply_async((key, 1), queue=q)
    assert newer.get(timeout=15) == 1
    late = sfapp.coalesced.apply_async((key, 0), queue=q, headers={HEADER_SENT: sent_first})
    result = late.get(timeout=15)
    assert sf.is_coalesced(result) and result["into"] == newer.id
    holder = sfapp.coalesced.apply_async((key, 2, HOLD), queue=q)  # until the re-send met it
    try:
        # the holder runs (it records its payload when done)
        wait_for(lambda: sfapp.recorder.llen(f"runs:{key}") == 2, timeout=15)
        late_again = sfapp.coalesced.apply_async((key, 0), queue=q, headers={HEADER_SENT: sent_first})
        result = late_again.get(timeout=15)
        assert sf.is_coalesced(result) and result["into"] == holder.id
        assert not holder.ready()
    finally:
        let_go(sfapp, key)
    assert holder.get(timeout=15) == 2
    assert _payloads(sfapp, key) == [1, 2]


def test_an_older_supersede_call_never_takes_over_from_a_newer_one(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a newer supersede run holding the key, an older call's re-sent message fails with
    Superseded naming the newer run, and the newer run completes untouched; once the key is free
    the older call still does not run."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    key = f"ss-{uuid.uuid4().hex[:6]}"
    sent_first = time.time_ns()
    newer = sfapp.superseding.apply_async((key, 1, HOLD), queue=q)  # until the re-send met it
    try:
        wait_for(lambda: sfapp.recorder.llen(f"started:{key}") == 1, timeout=15)
        late = sfapp.superseding.apply_async((key, 0), queue=q, headers={HEADER_SENT: sent_first})
        with pytest.raises(sf.Superseded) as caught:
            late.get(timeout=15)
        assert caught.value.by == newer.id
        assert not newer.ready()
    finally:
        let_go(sfapp, key)
    assert newer.get(timeout=15)["n"] == 1
    again = sfapp.superseding.apply_async((key, 0), queue=q, headers={HEADER_SENT: sent_first})
    with pytest.raises(sf.Superseded):
        again.get(timeout=15)
    assert [int(n) for n in sfapp.recorder.lrange(f"done:{key}", 0, -1)] == [1]
