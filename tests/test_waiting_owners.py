"""Every waiting run has an owner until it is started and watched, or ends: the safeguards the
protocol's model (model/waiting.pml) asked for, each against the case it found.

- a run whose start Redis could not be told (its claimed delayed copy's CLAIM_DONE failed) is
  sent again, never dropped nor run unwatched;
- a delayed run holding its claim that finds its key held by its own task id (an earlier attempt
  whose claim was taken back) waits for that lease instead of being turned away as a redelivery;
- the lost-run sweeper counts a later attempt of the same run that took the lease over as live;
- a fair run's second reservation (its first ran out while its message was slow) is never a
  second run: FAIR_ENTER renews the first, and ACQUIRE drops a copy whose token was adopted;
- a run that waited is watched from before its take (a provisional member of the started
  index), so that its worker dying between the take and its start still ends it.
"""

from __future__ import annotations

import json
import uuid
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import redis
from celery.canvas import Signature
from celery.exceptions import Retry

from celery_singleflight import RunLost
from celery_singleflight.policies import delayed as delayed_stage
from celery_singleflight.policies import duplicates
from celery_singleflight.policies.delayed import started
from celery_singleflight.protocol.delayed import Claim
from celery_singleflight.protocol.fair import Admitted
from celery_singleflight.protocol.record import RunRecord
from celery_singleflight.protocol.replies import Acquired, Held, Holder
from celery_singleflight.protocol.started import StartedRun, Verdict, verdict, verdict_of
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.messages import HEADER_DELAYED, HEADER_EARLIER
from celery_singleflight.run.stage import Run
from celery_singleflight.testing import RedisServer


def _record(**fields: Any) -> RunRecord:
    return RunRecord.decode(json.dumps(fields))


def _run_of(task: Any, task_id: str, headers: dict[str, Any]) -> Run:
    task.push_request(id=task_id, hostname="w@host", headers=headers, args=("k", 1), kwargs={},
                      delivery_info={}, retries=0, is_eager=False, called_directly=False)
    return Run(task, ("k", 1), {}, task.pipeline)


def test_a_start_redis_could_not_be_told_is_sent_again_with_its_token(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a delayed run that claimed its copy, when telling Redis it starts fails (the claim may
    or may not be done), then it does not start: it is sent again as fail_closed sends it, with
    the same delayed token (of it and a copy a sweeper may send, one claims) and its lease token
    (it takes its lease over if still there), and ends RETRY."""
    task, task_id = sfapp.queued, f"err-{uuid.uuid4().hex[:6]}"
    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(dict(self.options)))

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise redis.ConnectionError("Redis went away")

    monkeypatch.setattr(delayed_stage, "claim_done", refused)
    run = _run_of(task, task_id, {HEADER_DELAYED: "tok-1 q:k"})
    try:
        run.claim = Claim("q:k", task_id, "tok-1")
        with pytest.raises(Retry):
            started(run)
    finally:
        task.pop_request()
    assert len(sent) == 1 and sent[0]["task_id"] == task_id
    headers = sent[0]["headers"]
    assert headers[HEADER_DELAYED] == "tok-1 q:k" and headers[HEADER_EARLIER] == run.lease_token


def test_a_claimed_run_held_by_its_own_earlier_attempt_waits_for_it(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a delayed run holding its claim whose key is held by its own task id (an attempt whose
    claim was taken back took the lease: it will not start), then it is delayed again by that
    lease's time left, with a copy under its claim's key, whatever its policy; it parks no own copy
    (that attempt's release would drop it, and the run would never run)."""
    task, task_id = sfapp.queued, f"own-{uuid.uuid4().hex[:6]}"
    delayed: list[tuple[float, str]] = []

    def resend_delayed(task: Any, args: Any, kwargs: Any, delay: float, *rest: Any) -> Any:
        delayed.append((delay, rest[-1]))
        raise Retry()

    monkeypatch.setattr(duplicates, "resend_delayed", resend_delayed)
    monkeypatch.setattr(duplicates, "turn_away_redelivery", lambda dup: pytest.fail("turned away"))
    run = _run_of(task, task_id, {HEADER_DELAYED: "tok-2 q:k"})
    try:
        run.claim = Claim("q:k", task_id, "tok-2")
        run.guard = SimpleNamespace(store=task.store, key="q:k")  # type: ignore[assignment]
        stage = task.pipeline.stage(duplicates.DuplicatePolicies)
        with pytest.raises(Retry):
            stage.on_duplicate(run, Held(holder=task_id, ttl_left=1.5))
    finally:
        task.pop_request()
    assert delayed == [(1.5, "q:k")]


def test_a_later_attempt_that_took_the_lease_over_is_live_for_the_lost_run_sweeper() -> None:
    """A started run (fence 10) whose lease a copy of the same run took over (fence 12, same task
    id, live) is LIVE, not lost; once that copy's lease ran out unreleased, it is lost."""
    run = StartedRun("k", 0, "t1", 10, "w")
    copy = _record(token="c", fence="12", task_id="t1", deadline="5000", prev_task_id="t1",
                   prev_outcome="expired")
    assert verdict(copy, 4000, run) == (Verdict.LIVE, 1.0)
    assert verdict(copy, 6000, run)[0] is Verdict.LOST
    other = _record(token="o", fence="12", task_id="t2", deadline="5000", prev_task_id="t1",
                    prev_outcome="succeeded")
    assert verdict(other, 4000, run)[0] is Verdict.ENDED


def test_a_provisional_member_finds_its_run_by_task_id_on_any_slot() -> None:
    """A run entered before its take (slot and fence unknown) is found on any slot: holding a
    lease (LIVE) or a reservation for it (LIVE), its lease run out (LOST), released (ENDED),
    replaced by another run after its lease ran out (LOST); without a trace it never held the
    key (it waits again, or was turned away): ENDED."""
    run = StartedRun.provisional("k", 2, "t1", "w")
    assert run.slots == [0, 1] and StartedRun.parse(run.member()) == run
    free, held = _record(), _record(token="x", task_id="t2", deadline="9000")
    holding = _record(token="a", task_id="t1", deadline="5000")
    assert verdict_of([held, holding], 4000, run) == (Verdict.LIVE, 1.0)
    reserved = _record(token="h", task_id="t1", deadline="5000", reserved="1")
    assert verdict_of([reserved, free], 4000, run)[0] is Verdict.LIVE
    assert verdict_of([held, _record(token="a", task_id="t1", deadline="3000")], 4000, run)[0] is Verdict.LOST
    assert verdict_of([_record(task_id="t1", outcome="succeeded"), held], 4000, run)[0] is Verdict.ENDED
    replaced = _record(token="y", task_id="t3", deadline="9000", prev_task_id="t1", prev_outcome="expired")
    assert verdict_of([held, replaced], 4000, run)[0] is Verdict.LOST
    assert verdict_of([held, free], 4000, run)[0] is Verdict.ENDED


def test_a_provisional_run_that_adopted_the_key_is_judged_by_its_fence_once_no_record_names_it() -> None:
    """A parked run handed the key (its provisional member names the handoff token) whose whole
    worker died between its take and its start, after which two more runs took the key (so no
    record names it any more, by task id or as the previous run): the fence it adopted the key
    with (the key's ``adopted`` set) is among the later record's lost fences, so it is LOST, not
    forgotten as a run that never held the key. Without that fence nothing changes."""
    run = StartedRun.provisional("k", 1, "t1", "w", "h-1")
    assert StartedRun.parse(run.member()) == run and run.handoff == "h-1"
    plain = StartedRun.provisional("k", 1, "t1", "w")
    assert StartedRun.parse(plain.member()) == StartedRun("k", -1, "t1", 0, "w")
    later = _record(token="z", fence="30", task_id="t3", deadline="9000", prev_task_id="t2",
                    prev_outcome="succeeded", lost="10")
    assert verdict_of([later], 4000, run) == (Verdict.ENDED, 0.0)  # by task id alone: never held
    assert verdict_of([later], 4000, run, adopted=10)[0] is Verdict.LOST
    ended = _record(token="z", fence="30", task_id="t3", deadline="9000", prev_task_id="t2",
                    prev_outcome="succeeded", lost="")
    assert verdict_of([ended], 4000, run, adopted=10)[0] is Verdict.ENDED
    # two slots: the other slot's older record tells nothing; the run's slot's later one does
    other = _record(token="o", fence="5", task_id="t0", deadline="9000")
    two = StartedRun.provisional("k", 2, "t1", "w", "h-1")
    assert verdict_of([other, later], 4000, two, adopted=10)[0] is Verdict.LOST
    assert verdict_of([other], 4000, run, adopted=10)[0] is Verdict.LOST  # no later record: Redis lost it


def test_a_fair_runs_second_reservation_is_never_a_second_run() -> None:
    """Given a fair run admitted (its slot reserved) whose reservation ran out while its message was
    slow, when a second copy of its message comes, FAIR_ENTER renews that same reservation
    instead of reserving the other slot; and a copy that finds a reservation for a token that
    already took its slot (and holds it) is dropped (ADOPTED), not run."""
    with RedisServer() as server:
        store = LeaseStore(server.client(2), KeyLayout(f"fr-{uuid.uuid4().hex[:6]}"))
        gate, ttl = "fair:t", 5.0

        def enter(task_id: str) -> Any:
            return store.fair.enter(gate, 2, task_id, f"tok-{task_id}", "{}", "A", 1.0, ttl)

        assert enter("r") == Admitted(0)
        run0 = store.layout.run(gate, 0)
        record = json.loads(store.client.get(run0))
        record["deadline"] = "1"  # its reservation ran out
        store.client.set(run0, json.dumps(record))
        assert enter("r") == Admitted(0)  # renewed, not the other slot
        assert json.loads(store.client.get(run0))["deadline"] != "1"
        assert store.client.get(store.layout.run(gate, 1)) is None
        got = store.acquire(gate, "lease-a", ttl, Holder("r"), handoff="tok-r", slots=2)
        assert isinstance(got, Acquired) and got.slot == 0
        # a second reservation for the same token (an older snapshot, or a race before the renewal)
        forged = {**json.loads(store.client.get(run0)), "token": "tok-r", "reserved": "1", "by": "x"}
        store.client.set(store.layout.run(gate, 1), json.dumps(forged))
        copy = store.acquire(gate, "lease-b", ttl, Holder("r"), handoff="tok-r", slots=2)
        assert isinstance(copy, Held) and copy.copy  # while the run holds its slot
        assert store.release(gate, "lease-a", "succeeded", ttl, slots=2)
        copy = store.acquire(gate, "lease-c", ttl, Holder("r"), handoff="tok-r", slots=2)
        assert isinstance(copy, Held) and copy.copy  # and once it ran


def test_a_run_that_waited_is_watched_from_before_its_take(sfapp: ModuleType) -> None:
    """Given a run handed the key (it waited: QUEUED), entered in the started index before its take
    (provisional), whose worker dies after the take and before its start, then the lost-run
    sweeper ends it FAILURE RunLost once its lease ran out, on a key nobody uses afterwards."""
    from celery_singleflight.policies.lostruns import FailLostRuns

    task, task_id = sfapp.queued, f"handed-{uuid.uuid4().hex[:6]}"
    key = f"q:idle-{uuid.uuid4().hex[:6]}"
    store = task.store
    sfapp.app.backend.store_result(task_id, {"key": key}, "QUEUED")
    entry = StartedRun.provisional(key, 1, task_id, "gone@host")
    store.started.enter(entry, 0.0)  # due at once
    taken = store.acquire(key, "its-token", 0.05, Holder(task_id, "gone@host", task.name))
    assert isinstance(taken, Acquired)
    job = FailLostRuns(sfapp.app, store)
    from .conftest import wait_for

    def ended() -> bool:
        job.sweep_once()
        result = sfapp.app.AsyncResult(task_id)
        return result.state == "FAILURE" and isinstance(result.result, RunLost)

    wait_for(ended, timeout=5, interval=0.1)
    assert entry.member() not in store.started.due()


def test_a_stale_attempt_never_delays_its_run_again(
    sfapp: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Given a delayed run whose claim a sweeper took back (its worker seemed gone: a copy sent
    again runs the run), when that stale attempt wakes and would delay the run again (its key
    held by the copy, its own task id; or its rate-limit cell not due), then nothing is written
    and it ends (Ignore): a second live delay would run the run twice. The run's claimant delays
    it again as before."""
    from celery.exceptions import Ignore

    from celery_singleflight.run.delay import delay_again

    task, task_id = sfapp.queued, f"stale-{uuid.uuid4().hex[:6]}"
    store = task.store
    sent: list[str] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self.options["task_id"]))
    store.delayed.delay("q:k", task_id, "tok-1", "{}", 0.0)
    assert store.delayed.claim("q:k", task_id, "tok-1", "w#gone", "lease-1") is not None
    entry = json.loads(store.client.hget(store.layout.delayed("q:k"), task_id))
    entry["ca"] = "0"  # claimed long ago: a sweeper takes it back
    store.client.hset(store.layout.delayed("q:k"), task_id, json.dumps(entry))
    assert store.delayed.resend("q:k", task_id, "tok-2", []) is not None
    before = store.client.hget(store.layout.delayed("q:k"), task_id)
    task.push_request(id=task_id, hostname="w@host", headers={HEADER_DELAYED: "tok-1 q:k"}, args=("k", 1),
                      kwargs={}, delivery_info={}, retries=0, is_eager=False, called_directly=False)
    try:
        with pytest.raises(Ignore):
            delay_again(task, ("k", 1), {}, 1.0, "q:k")
        assert store.client.hget(store.layout.delayed("q:k"), task_id) == before and sent == []
    finally:
        task.pop_request()
    # the copy sent again claims, and delays the run again: that stands
    assert store.delayed.claim("q:k", task_id, "tok-2", "w#2", "lease-2") is not None
    task.push_request(id=task_id, hostname="w@host", headers={HEADER_DELAYED: "tok-2 q:k"}, args=("k", 1),
                      kwargs={}, delivery_info={}, retries=0, is_eager=False, called_directly=False)
    try:
        delay_again(task, ("k", 1), {}, 1.0, "q:k")
    finally:
        task.pop_request()
    assert sent == [task_id]
