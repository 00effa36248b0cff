"""The `supersede` policy on real workers: the newest run wins. The holder is told (its lease is
flagged within one heartbeat interval; ``check()`` raises ``Superseded``), revoked after the grace
if it does not stop, and the newcomer starts only once the key is released, with a larger fence."""

from __future__ import annotations

import pickle
import time
import uuid
from types import ModuleType, SimpleNamespace

import pytest
from celery import states as celery_states

import celery_singleflight as sf
from celery_singleflight import Superseded
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.fencing import fenced_get, fenced_set
from celery_singleflight.protocol.newest import COALESCE, ProgressNotice, RenewNotice
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import wait_for
from .lua_sources import SOURCE

pytestmark = pytest.mark.share_workers  # start_worker may lend a worker an earlier test left idle


def started(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"started:{key}", 0, -1)]


def done(sfapp: ModuleType, key: str) -> list[int]:
    return [int(x) for x in sfapp.recorder.lrange(f"done:{key}", 0, -1)]


def test_superseded_pickles_and_is_a_lease_lost() -> None:
    error = pickle.loads(pickle.dumps(Superseded("sup:k", "new-id", 12.5, 3.0)))
    assert isinstance(error, sf.LeaseLost) and isinstance(error, sf.SingleFlightError)
    assert (error.key, error.by, error.at, error.grace_left) == ("sup:k", "new-id", 12.5, 3.0)
    assert "superseded by task new-id" in str(error)


@pytest.mark.worker
def test_a_checking_holder_stops_at_its_next_check_and_the_newcomer_runs_after_it(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a long holder that checks its lease, when a newcomer is sent, then the holder's
    lease turns superseded within one heartbeat interval (1 s here), its next check raises
    Superseded (FAILURE), and the newcomer starts only after the holder released, with a larger
    fence, so the holder's late fenced write is refused."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    holder = sfapp.superseding.apply_async(("chk", 0, 30.0), queue=q)
    wait_for(lambda: started(sfapp, "chk") == [0], timeout=15)
    sent = time.time()
    newcomer = sfapp.superseding.apply_async(("chk", 1, 0.2), queue=q)
    with pytest.raises(Superseded) as info:
        holder.get(timeout=15)
    assert info.value.by == newcomer.id
    seen = float(sfapp.recorder.get("seen:chk:0"))
    assert seen - sent < 1.0 + 0.5  # one heartbeat interval (lock_ttl 3 -> 1 s), plus a margin
    result = newcomer.get(timeout=15)
    assert result["n"] == 1 and result["written"] is True
    assert done(sfapp, "chk") == [1]  # the holder never completed
    # the holder's fence is older: its write now is refused where it lands
    old_fence = int(sfapp.recorder.get("fence:chk:0"))
    assert old_fence < result["fence"]
    assert fenced_set(sfapp.recorder, "fenced:chk", "0", old_fence) is False
    assert fenced_get(sfapp.recorder, "fenced:chk").value == b"1"  # type: ignore[union-attr]
    st = sf.status(sfapp.app, "sup:chk")
    assert st is not None and st.task_id == newcomer.id and st.previous_outcome == "superseded"
    assert sfapp.recorder.llen("overlaps") == 0


@pytest.mark.worker
@pytest.mark.core
def test_a_holder_that_never_checks_is_revoked_after_the_grace(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a holder that never checks its lease, its lease still turns superseded within one
    heartbeat interval; after supersede_grace (2 s) a worker's sweeper revokes it with
    terminate=True (REVOKED), and the newcomer then runs."""
    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    holder = sfapp.superseding.apply_async(("rev", 0, 60.0, False), queue=q)
    wait_for(lambda: started(sfapp, "rev") == [0], timeout=15)
    sent = time.time()
    newcomer = sfapp.superseding.apply_async(("rev", 1, 0.1), queue=q)
    assert newcomer.get(timeout=20)["n"] == 1
    ended = time.time()
    assert wait_for(lambda: holder.state == celery_states.REVOKED, timeout=5)
    assert 2.0 <= ended - sent < 2.0 + 1.0 + 3.0  # grace, one sweep, the hand-off and the run
    assert float(sfapp.recorder.get("seen:rev:0")) - sent < 1.5
    assert done(sfapp, "rev") == [1]
    st = sf.status(sfapp.app, "sup:rev")
    assert st is not None and st.previous_outcome == "superseded"


@pytest.mark.worker
def test_a_burst_of_ten_supersedes_completes_only_the_last_one_sent(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a holder, when 10 newcomers are sent in a burst to a worker with 4 processes, then
    exactly one run completes, the last one sent; the holder and the 9 others end terminal
    (FAILURE with Superseded)."""
    q = start_worker(concurrency=4).queue  # type: ignore[operator]
    holder = sfapp.superseding.apply_async(("burst", 0, 30.0), queue=q)
    wait_for(lambda: started(sfapp, "burst") == [0], timeout=15)
    burst = [sfapp.superseding.apply_async(("burst", n, 0.3), queue=q) for n in range(1, 11)]
    assert burst[-1].get(timeout=20)["n"] == 10
    for result in (holder, *burst[:-1]):
        with pytest.raises(Superseded):
            result.get(timeout=10)
    assert done(sfapp, "burst") == [10]
    # the holder is ended at once, and the key goes to the newest run sent by then: on a loaded
    # machine the burst can arrive slower than that, so a run between may start before a newer
    # one supersedes it in turn (it ends Superseded, above). Runs start in send order, never
    # two at once, and the last one sent is the last to start
    runs = started(sfapp, "burst")
    assert runs[0] == 0 and runs[-1] == 10 and runs == sorted(set(runs)), runs
    assert sfapp.recorder.llen("overlaps") == 0
    st = sf.status(sfapp.app, "sup:burst")
    assert st is not None and not st.held and st.queued == 0


def test_supersede_script_run_twice_answers_the_same_and_the_renewal_reports_it(
    redis_server: RedisServer,
) -> None:
    """Given the first reply of every COALESCE (supersede mode) and RENEW call dropped, the
    newcomer that replaced a pending newcomer still learns which (so it ends it), the holder is
    marked once with the first supersede's time and the newest newcomer, and its renewal answers
    2 (renewed, superseded)."""
    with FaultProxy(redis_server.port) as proxy:
        proxy.add_rule(DROP_REPLY, script=SOURCE["COALESCE"], first_time_only=True)
        proxy.add_rule(DROP_REPLY, script=SOURCE["RENEW"], first_time_only=True)
        store = LeaseStore(redis_client(proxy.url(2)), KeyLayout(f"sup-{uuid.uuid4().hex[:6]}"))
        token = uuid.uuid4().hex
        got = store.acquire("k", token, 10, Holder("old"))
        assert isinstance(got, Acquired)
        grace = {"supersede_grace": 5.0, "supersede_signal": "SIGTERM"}
        assert store.newest.coalesce("k", "new1", "h1", '{"n": 1}', "supersede", "1", **grace) == ()
        first = store.record("k")
        assert first["sup_by"] == "new1" and int(first["sup_due"]) - int(first["sup_at"]) == 5000
        second = store.newest.coalesce("k", "new2", "h2", '{"n": 2}', "supersede", "2", **grace)
        assert second == ('{"n": 1}',)
        marked = store.record("k")
        assert marked["sup_by"] == "new2" and marked["sup_at"] == first["sup_at"]  # the grace is not reset
        assert store.newest.coalesce("k", "new0", "h0", '{"n": 0}', "supersede", "0", **grace) == "new2"
        assert store.newest.due_superseding() == [] and store.client.zscore(store.layout.superseding(), "k")

        lease = SimpleNamespace(key="k", token=token, slot=0, ttl=10.0, store=store, layout=store.layout)
        assert store.renew([lease]) == [RenewNotice.RENEWED_SUPERSEDED]  # type: ignore[list-item]
        # a progress write tells the holder too, before its next renewal (and is written)
        written = store.lease.progress("k", 0, token, '{"state": "x"}', "x", 1)
        assert written == (ProgressNotice.WRITTEN_SUPERSEDED, "new2")
        assert store.record("k")["state"] == "x"
        settlement = store.release("k", token, "failed", fence=got.fence)
        assert settlement.handoff == '{"n": 2}'
        assert store.record("k")["prev_outcome"] == "superseded"
        assert len(proxy.faults) >= 4


@pytest.mark.worker
def test_the_revoke_happens_even_if_the_newcomers_process_died_before_indexing_it(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a newcomer whose process died right after its supersede script (so it never entered
    the key in the superseding index), the holder's own process enters it when it learns of the
    supersede (by the push, or else its renewal): a worker's sweeper still revokes the holder
    after the grace, and the newcomer, handed the key by that release, runs."""
    from kombu.utils.json import dumps

    from celery_singleflight.run.messages import HEADER_HANDOFF

    q = start_worker(concurrency=2).queue  # type: ignore[operator]
    task = sfapp.superseding
    holder = task.apply_async(("orphan", 0, 60.0, False), queue=q)
    wait_for(lambda: started(sfapp, "orphan") == [0], timeout=15)
    newcomer_id, handoff = uuid.uuid4().hex, uuid.uuid4().hex
    message = dumps(dict(task.signature(("orphan", 1, 0.1), task_id=newcomer_id, queue=q,
                                        headers={HEADER_HANDOFF: handoff})))
    store, key = task.store, task.render_key("orphan", 0)
    layout = store.layout
    # what SUPERSEDE does in the newcomer's process, without the index entry that follows it
    store.ctx.script(COALESCE)(
        keys=[layout.run(key), layout.queue(key), layout.parked(key), layout.coalesce(key),
              layout.adopted(key)],
        args=[f"{newcomer_id}|{handoff}", message, "supersede", 1, "", 2000, "SIGTERM"])
    wait_for(lambda: store.client.zscore(layout.superseding(), key), timeout=5)  # the holder's process
    assert wait_for(lambda: holder.state == celery_states.REVOKED, timeout=15)
    assert task.AsyncResult(newcomer_id).get(timeout=20)["n"] == 1
    assert done(sfapp, "orphan") == [1]
