"""Delayed runs keep a copy in Redis (protocol/delayed.py): the scripts answer the same when a
reply is lost, exactly one copy of a run claims it, a copy is handed out again only when its
countdown message has not started a grace after its due time, and a claim whose worker is gone
before its run said it started is taken back."""

from __future__ import annotations

import json
import time
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
from celery.canvas import Signature

from celery_singleflight import constants
from celery_singleflight.connection.clients import redis_client
from celery_singleflight.protocol.delayed import DELAYED, Claim, ClaimDoneReply, ClaimReply, Resent
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.messages import HEADER_DELAYED
from celery_singleflight.testing import RedisServer
from celery_singleflight.worker.copies import SendCopies, forget_revoked

from .chaos.faultproxy import DROP_REPLY, FaultProxy
from .conftest import wait_server_time
from .lua_sources import SOURCE


def _store(url: str) -> LeaseStore:
    return LeaseStore(redis_client(url), KeyLayout(f"dl-{uuid.uuid4().hex[:6]}"))


def claim(store: LeaseStore, key: str, task_id: str, token: str, owner: str = "w#1",
          lease: str = "lease") -> ClaimReply:
    return store.delayed.claim(key, task_id, token, owner, lease)


def done(store: LeaseStore, key: str, task_id: str, token: str) -> ClaimDoneReply:
    return store.delayed.done(Claim(key, task_id, token))


def copy(message: str, took: str = "") -> Resent:
    return Resent(message, {}, took)


GRACE_MS = constants.LUA_CONSTANTS["DELAYED_GRACE_MS"]
GONE_MS = constants.LUA_CONSTANTS["WORKER_GONE_AFTER_MS"]


def grace_over(store: LeaseStore, due: float | None) -> None:
    """Wait until a copy due at ``due`` (epoch seconds, as ``delay`` answers it) is past its grace."""
    assert due is not None
    wait_server_time(store.client, round(due * 1000) + GRACE_MS)


def claimed_at(store: LeaseStore, key: str, task_id: str) -> int:
    """When the run's copy was claimed (epoch ms, the server's clock)."""
    raw = store.client.hget(store.layout.key(DELAYED, key), task_id)
    assert raw is not None
    return int(json.loads(raw)["ca"])


def test_the_countdown_message_claims_its_copy_and_a_later_delivery_goes_on(
    redis_server: RedisServer,
) -> None:
    """Given a run delayed 0.2 s, when its countdown message starts it claims the copy, which is
    kept (with its claimant, looked at a while later) until the run says it started; then it is
    dropped (nothing is left in the hash or the index); another delivery of that message finds no
    copy and goes on (the lease turns it away while the first runs)."""
    store = _store(redis_server.url + "/2")
    due = store.delayed.delay("k", "t1", "tok1", '{"task": "x"}', 0.2)
    assert abs(due - time.time()) < 1.0
    assert store.delayed.waiting("k", "t1")
    assert claim(store, "k", "t1", "tok1") == ClaimReply.GO
    assert store.delayed.waiting("k", "t1")  # claimed: kept until the run says it started
    look = store.client.zscore(store.layout.delays(), '["k", "t1"]')
    assert look is not None and look / 1000 - time.time() > constants.WORKER_GONE_AFTER
    assert claim(store, "k", "t1", "tok1") == ClaimReply.GO  # its replay
    assert done(store, "k", "t1", "tok1") == ClaimDoneReply.DONE
    assert done(store, "k", "t1", "tok1") == ClaimDoneReply.DONE  # its replay
    assert not store.delayed.waiting("k", "t1")
    assert store.client.zcard(store.layout.delays()) == 0
    assert claim(store, "k", "t1", "tok1") == ClaimReply.GO


def test_a_lost_message_is_sent_again_once_and_only_one_copy_runs(redis_server: RedisServer) -> None:
    """Given a run whose countdown message worker w1 received: a sweeper hands out nothing before
    its due time plus the grace, nor while w1 is alive (w1 is busy: the message is late, not
    lost); once w1 is gone, the copy under a new token. Then whichever copy starts first runs and
    every other copy (the first message coming back after the visibility timeout) is stale."""
    store = _store(redis_server.url + "/2")
    due = store.delayed.delay("k", "t2", "tok-a", '{"task": "x"}', 0.1)
    store.delayed.touch([("k", "t2", "tok-a")], "w1")
    assert store.delayed.resend("k", "t2", "sweep-1", []) is None  # not due yet: looked at again later
    grace_over(store, due)
    assert store.delayed.due() == [("k", "t2")]
    assert store.delayed.resend("k", "t2", "sweep-1", ["w1", "w2"]) is None  # w1 holds it
    assert store.delayed.due() == []  # looked at again in a while
    assert store.delayed.resend("k", "t2", "sweep-2", ["w2"]) == copy('{"task": "x"}')
    assert store.delayed.resend("k", "t2", "sweep-2", ["w2"]) == copy('{"task": "x"}')  # a replay
    store.delayed.sent("k", "t2")
    assert store.delayed.due() == []
    assert claim(store, "k", "t2", "sweep-2") == ClaimReply.GO_LATE  # the copy starts first
    assert claim(store, "k", "t2", "sweep-2") != ClaimReply.STALE  # its replay, or its redelivery
    # the first message, back after the visibility timeout
    assert claim(store, "k", "t2", "tok-a") == ClaimReply.STALE
    assert done(store, "k", "t2", "sweep-2") == ClaimDoneReply.DONE
    assert claim(store, "k", "t2", "tok-a") == ClaimReply.STALE  # still, once the run started
    assert store.delayed.resend("k", "t2", "sweep-3", []) is None  # done: never handed out again


def test_a_message_no_worker_noted_gets_its_copy_a_few_seconds_after_its_due_time(
    redis_server: RedisServer,
) -> None:
    """A message no worker noted receiving waits in the broker (or its worker died before it
    noted it): its copy goes DELAYED_UNSEEN_GRACE (a few seconds) after its due time, not sooner."""
    assert constants.DELAYED_UNSEEN_GRACE <= 3.0
    store = _store(redis_server.url + "/2")
    grace_over(store, store.delayed.delay("k", "t5", "tok", "{}", 0.05))
    assert store.delayed.resend("k", "t5", "sweep", []) is None
    score = store.client.zscore(store.layout.delays(), '["k", "t5"]')
    assert score is not None and 0 < score / 1000 - time.time() < constants.DELAYED_UNSEEN_GRACE
    wait_server_time(store.client, score)  # the time its NOT_DUE answer named
    assert store.delayed.resend("k", "t5", "sweep", []) == copy("{}")


def test_a_run_delayed_again_makes_its_earlier_copies_stale(redis_server: RedisServer) -> None:
    """A debounced call waits again (a newer call came): its earlier message is stale from then on."""
    store = _store(redis_server.url + "/2")
    store.delayed.delay("k", "t3", "first", "{}", 0.05)
    assert claim(store, "k", "t3", "first") != ClaimReply.STALE
    store.delayed.delay("k", "t3", "second", "{}", 0.05)
    assert claim(store, "k", "t3", "first") == ClaimReply.STALE
    assert done(store, "k", "t3", "first") == ClaimDoneReply.TAKEN_BACK  # the first run is over anyway
    assert claim(store, "k", "t3", "second") != ClaimReply.STALE


def test_lost_replies_of_the_delayed_scripts_change_nothing(redis_server: RedisServer) -> None:
    """Given the reply of every DELAY, TOUCH, CLAIM, CLAIM_DONE and RESEND dropped once (the script
    ran, redis-py sends it again), each caller gets the answer of the first run."""
    with FaultProxy(redis_server.port) as proxy:
        for name in ("DELAY", "CLAIM", "CLAIM_DONE", "RESEND", "TOUCH"):
            proxy.add_rule(DROP_REPLY, script=SOURCE[name], first_time_only=True)
        store = _store(proxy.url(2))
        first_due = store.delayed.delay("k", "t4", "tok", '{"m": 1}', 0.05)
        store.delayed.touch([("k", "t4", "tok")], "gone")
        grace_over(store, first_due)
        assert store.delayed.resend("k", "t4", "sweep", []) == copy('{"m": 1}')
        assert claim(store, "k", "t4", "tok") != ClaimReply.STALE
        assert claim(store, "k", "t4", "sweep") == ClaimReply.STALE
        assert done(store, "k", "t4", "tok") == ClaimDoneReply.DONE
        assert len(proxy.faults) >= 5  # each distinct call loses its first reply
        raw = store.client.hget(store.layout.delayed("k"), "t4")
        assert raw is not None and b'"c":"tok"' in raw.replace(b" ", b"") and b'"m"' not in raw
        assert first_due > 0


def test_a_late_first_message_of_a_run_sent_again_and_delayed_again_is_stale(
    redis_server: RedisServer,
) -> None:
    """Given a run whose countdown message (tok-0) a dead worker held: its copy (sweep-1) runs,
    takes a new rate-limit cell and is delayed again (tok-2), which then runs. When tok-0 comes
    back after the visibility timeout it is stale: the run does not run a third time."""
    store = _store(redis_server.url + "/2")
    grace_over(store, store.delayed.delay("k", "t6", "tok-0", "{}", 0.01))
    store.delayed.touch([("k", "t6", "tok-0")], "gone")
    assert store.delayed.resend("k", "t6", "sweep-1", []) is not None
    assert claim(store, "k", "t6", "sweep-1") == ClaimReply.GO_LATE
    store.delayed.delay("k", "t6", "tok-2", "{}", 0.01)
    assert claim(store, "k", "t6", "tok-2") == ClaimReply.GO
    assert done(store, "k", "t6", "tok-2") == ClaimDoneReply.DONE
    assert claim(store, "k", "t6", "tok-0") == ClaimReply.STALE
    assert claim(store, "k", "t6", "sweep-1") == ClaimReply.STALE
    assert store.client.zcard(store.layout.delayed_ends("k")) == 1  # kept until DELAYED_KEEP is over


def test_a_revoked_delayed_message_leaves_no_copy_to_run(redis_server: RedisServer, sfapp: Any) -> None:
    """Celery drops a revoked (or expired) message without running any code of the task: the
    worker's main process claims its copy with that message's token, so no sweeper sends it."""
    task = sfapp.app.tasks[sfapp.queued.name]  # as the worker's signal gets it
    store = task.store
    due = store.delayed.delay("q:k", "rv", "tok-rv", "{}", 0.01)
    store.delayed.touch([("q:k", "rv", "tok-rv")], "gone#x")
    forget_revoked(task, SimpleNamespace(id="rv", request_dict={HEADER_DELAYED: "tok-rv q:k"}))
    assert not store.delayed.waiting("q:k", "rv")
    grace_over(store, due)  # a copy left would be handed out from now on
    assert store.delayed.resend("q:k", "rv", "sweep", []) is None


def test_a_copy_that_cannot_be_sent_does_not_hold_up_the_others(
    redis_server: RedisServer, sfapp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One copy whose message cannot be read is looked at again later; the next copy is sent."""
    sent: list[str] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self.options["task_id"]))
    store = sfapp.queued.store
    good = json.dumps(dict(sfapp.queued.s("k", 1).set(task_id="good")))
    store.delayed.delay("q:a", "bad", "t1", "{not json", 0.01)
    grace_over(store, store.delayed.delay("q:b", "good", "t2", good, 0.02))  # the later of the two
    for key, task_id in (("q:a", "bad"), ("q:b", "good")):
        store.delayed.touch([(key, task_id, "t1" if task_id == "bad" else "t2")], "gone#x")
    job = SendCopies(sfapp.app, store, "me#y")
    assert job.sweep_once() == 1 and sent == ["good"]
    assert ("q:a", "bad") not in store.delayed.due()  # looked at again later


def test_a_copy_put_back_after_a_data_loss_never_replaces_a_newer_delay(
    redis_server: RedisServer,
) -> None:
    """The recovery puts back a lost copy under its journaled token; if the run was delayed again
    meanwhile (its message came, took a new rate-limit cell), that newer entry stands: its
    message must not become stale."""
    store = _store(redis_server.url + "/2")
    store.delayed.delay("k", "t7", "newer", "{}", 5.0)
    store.delayed.delay("k", "t7", "journaled", "{}", 0.0, restore=True)
    assert claim(store, "k", "t7", "newer") == ClaimReply.GO
    store.delayed.delay("k", "t8", "journaled", "{}", 0.0, restore=True)  # nothing there: put back
    assert store.delayed.waiting("k", "t8")


def test_a_run_that_claimed_while_redis_was_empty_is_delayed_again_over_its_copy_put_back(
    redis_server: RedisServer,
) -> None:
    """Found by a loaded run of the data-loss chaos test: the lease Redis came back empty while a
    rate-limited run's countdown message (token ``tok``) was starting. Its CLAIM found no entry
    (GO, nothing written); the recovery then put its copy back under ``tok``, not claimed; the
    rate limit delayed the run again, passing its claim ``tok``. DELAY answered NOT_CLAIMED (no
    claim on the entry is not ``tok``), the run was dropped (Ignore), its CLAIM_DONE then took
    the copy as its own and removed it: nothing was left to run it, and it kept RETRY for ever.
    The copy not claimed under the caller's own current token is its claim, as CLAIM_DONE has it:
    the run is delayed again, and only the new delay's message (or its copy) runs it."""
    store = _store(redis_server.url + "/2")
    assert claim(store, "k", "t11", "tok") == ClaimReply.GO  # Redis lost the entry: nothing to claim
    store.delayed.delay("k", "t11", "tok", '{"m": 11}', 0.0, restore=True)  # the recovery puts it back
    for _ in range(2):  # and a second run of the call (its reply lost) answers the same
        assert store.delayed.delay("k", "t11", "again", '{"m": 11}', 5.0, claimed="tok") is not None
    assert done(store, "k", "t11", "tok") == ClaimDoneReply.TAKEN_BACK  # the old claim is done with
    assert claim(store, "k", "t11", "tok") == ClaimReply.STALE  # the copy put back never runs
    assert store.delayed.waiting("k", "t11")
    assert claim(store, "k", "t11", "again") == ClaimReply.GO  # the new delay's message runs it
    # a caller whose token the entry does not know as current, or claimed by another, still may
    # not (its claim was taken back: the copy that claims the run runs it)
    store.delayed.delay("k", "t12", "tok", '{"m": 12}', 0.0, restore=True)
    assert store.delayed.delay("k", "t12", "later", "{}", 5.0, claimed="unknown") is None
    assert claim(store, "k", "t12", "tok") == ClaimReply.GO
    assert store.delayed.delay("k", "t12", "later", "{}", 5.0, claimed="unknown") is None


def test_a_claim_whose_worker_is_gone_is_taken_back_and_its_run_never_starts(
    redis_server: RedisServer,
) -> None:
    """Given a run whose countdown message claimed its copy (worker w1, lease token L), then w1 died
    before the run said it started: while w1 is alive the claim stands; once w1 is gone a
    sweeper takes it back and hands out the copy again, with L (the copy takes over the lease
    the claimant may have taken). The claimant, should it wake, is told TAKEN_BACK (it must not
    start), its message stays stale, and the copy sent again claims and starts."""
    store = _store(redis_server.url + "/2")
    store.delayed.delay("k", "t9", "tok", '{"m": 9}', 0.0)
    assert claim(store, "k", "t9", "tok", owner="w1#a", lease="L") == ClaimReply.GO
    assert store.delayed.resend("k", "t9", "sweep-1", ["w1#a"]) is None  # just claimed: not yet looked at
    wait_server_time(store.client, claimed_at(store, "k", "t9") + GONE_MS)
    assert store.delayed.resend("k", "t9", "sweep-1", ["w1#a", "w2#b"]) is None  # w1 is alive: it stands
    assert store.delayed.resend("k", "t9", "sweep-2", ["w2#b"]) == copy('{"m": 9}', took="L")
    assert store.delayed.resend("k", "t9", "sweep-2", ["w2#b"]) == copy('{"m": 9}', took="L")  # a replay
    assert done(store, "k", "t9", "tok") == ClaimDoneReply.TAKEN_BACK
    assert claim(store, "k", "t9", "tok") == ClaimReply.STALE
    assert claim(store, "k", "t9", "sweep-2", owner="w2#b") == ClaimReply.GO_LATE
    assert done(store, "k", "t9", "sweep-2") == ClaimDoneReply.DONE
    assert done(store, "k", "t9", "tok") == ClaimDoneReply.TAKEN_BACK
    assert store.delayed.resend("k", "t9", "sweep-3", []) is None


def test_a_claim_not_done_in_time_is_taken_back_even_while_its_worker_lives(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claimant whose worker lives but who never says its run started (its pool process was
    killed alone, or it hangs) loses its claim DELAYED_CLAIM_PATIENCE after it."""
    store = _store(redis_server.url + "/2")
    store.delayed.delay("k", "t10", "tok", "{}", 0.0)
    assert claim(store, "k", "t10", "tok", owner="w1#a", lease="L") == ClaimReply.GO
    # the claim as DELAYED_CLAIM_PATIENCE ago (the clock is Redis's: the entry is written back)
    raw = store.client.hget(store.layout.delayed("k"), "t10")
    assert raw is not None
    entry = json.loads(raw)
    entry["ca"] = str(int(entry["ca"]) - int(constants.DELAYED_CLAIM_PATIENCE * 1000) + 300)
    store.client.hset(store.layout.delayed("k"), "t10", json.dumps(entry))
    assert store.delayed.resend("k", "t10", "sweep", ["w1#a"]) is None
    wait_server_time(store.client, int(entry["ca"]) + constants.LUA_CONSTANTS["DELAYED_CLAIM_PATIENCE_MS"])
    assert store.delayed.resend("k", "t10", "sweep", ["w1#a"]) == copy("{}", took="L")


def test_the_sweeper_drops_the_copy_of_a_claimed_run_that_ended(
    redis_server: RedisServer, sfapp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool process killed after its run claimed its copy ends that run FAILURE (WorkerLostError,
    stored by the worker's main process): once the claim is taken back, the sweeper finds the run
    ended and drops the copy instead of running it a second time."""
    sent: list[str] = []
    monkeypatch.setattr(Signature, "apply_async", lambda self, *a, **kw: sent.append(self.options["task_id"]))
    store = sfapp.queued.store
    task_id = f"ended-{uuid.uuid4().hex[:6]}"
    message = json.dumps(dict(sfapp.queued.s("k", 1).set(task_id=task_id)))
    store.delayed.delay("q:e", task_id, "tok", message, 0.0)
    assert claim(store, "q:e", task_id, "tok", owner="gone#x") == ClaimReply.GO
    sfapp.app.backend.mark_as_failure(task_id, RuntimeError("worker lost"))
    wait_server_time(store.client, claimed_at(store, "q:e", task_id) + GONE_MS)  # the claim can be taken back
    store.client.zadd(store.layout.delays(), {json.dumps(["q:e", task_id]): 0})
    assert SendCopies(sfapp.app, store, "me#y").sweep_once() == 0 and sent == []
    assert not store.delayed.waiting("q:e", task_id)
    assert ("q:e", task_id) not in store.delayed.due()
