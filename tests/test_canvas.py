"""SingleFlightTask inside Celery canvas (chain, group, chord) on a real worker, policy by policy.

Every case first starts a holder on the key and waits until it runs (the recorder saw it), then
sends the canvas to the same worker queue. ``canvas_seen`` / ``canvas_collect`` (plain tasks)
record what they received, so the tests check what the rest of a canvas got, not only the final
result. docs/canvas.md is the table of what these tests show.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError
from celery.result import AsyncResult

from celery_singleflight import LockHeld, is_skipped
from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import HOLD, TESTS, gates_opened_after, let_go, met, stays, wait_for, worker_env

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def canvas_worker(redis_server: RedisServer, sfapp: ModuleType) -> Iterator[WorkerProcess]:
    """One prefork worker (6 processes) on its own queue, shared by this module: every test waits
    for everything it sent, and uses keys of its own."""
    queue = "q-canvas"
    worker = WorkerProcess("sfapp", concurrency=6, cwd=str(TESTS), env=worker_env(redis_server),
                           extra=("-Q", queue))
    worker.queue = queue  # type: ignore[attr-defined]
    worker.start(sfapp.app)
    yield worker
    worker.stop(timeout=15)
    worker.kill()
    worker.cleanup()


@pytest.fixture
def q(canvas_worker: WorkerProcess) -> str:
    return canvas_worker.queue  # type: ignore[attr-defined,no-any-return]


_gates_opened = gates_opened_after("craise", "cskip", "cretry", "cq", "cjerr", "cjlast", "cjeb", "cjold",
                                   "gq", "gs", "gs1", "chj", "chq", "chr", "chs", "chx")


def start_holder(sfapp: ModuleType, task: Any, q: str, key: str, *args: Any) -> AsyncResult:
    """Dispatch ``task(key, *args)`` and return once it runs (the recorder saw it start); it holds
    the key until :func:`let_go` (``args`` give it :data:`HOLD` seconds at most)."""
    holder = task.apply_async((key, *args), queue=q)
    wait_for(lambda: sfapp.recorder.llen(f"runs:{key}") >= 1, timeout=15)
    return holder


def seen(sfapp: ModuleType, tag: str) -> list[Any]:
    """What ``canvas_seen(..., tag)`` received, in the order it ran."""
    return [json.loads(raw) for raw in sfapp.recorder.lrange(f"seen:{tag}", 0, -1)]


def collected(sfapp: ModuleType, tag: str) -> list[Any]:
    """What each run of the chord body ``canvas_collect(..., tag)`` received."""
    return [json.loads(raw) for raw in sfapp.recorder.lrange(f"collected:{tag}", 0, -1)]


def runs(sfapp: ModuleType, key: str) -> list[str]:
    return [raw.decode() for raw in sfapp.recorder.lrange(f"runs:{key}", 0, -1)]


def events(sfapp: ModuleType) -> list[str]:
    """Every recorded run (SingleFlight tasks, links and chord bodies), in the order they started."""
    return [raw.decode() for raw in sfapp.recorder.lrange("runs", 0, -1)]


#: how long a test watches a link or chord body that must not run (again): no later event proves
#: it never will, and a wrongly sent one would start well within this on the idle 6-process worker
NEVER_RUNS = 0.5


# -- chain ----------------------------------------------------------------------------------------


def test_chain_raise_stops_the_chain_with_lock_held_and_calls_link_error(
    sfapp: ModuleType, q: str
) -> None:
    """Given a running holder on k:craise,
    when chain(hold_raise duplicate, canvas_seen) is sent with a link_error,
    then the chain's result raises LockHeld (naming the holder), the next link never runs, is
    marked FAILURE as Celery does for a failed chain, and the errback gets the duplicate's LockHeld."""
    holder = start_holder(sfapp, sfapp.hold_raise, q, "craise", HOLD)
    flow = chain(sfapp.hold_raise.s("craise").set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    flow.on_error(sfapp.canvas_errback.s().set(queue=q))
    result = flow.apply_async()

    with pytest.raises(LockHeld) as info:
        result.get(timeout=15)
    assert info.value.holder == holder.id
    dup = result.parent
    assert dup.state == "FAILURE"
    # the last link: no stall (get() raised the parent's error, which Celery stores before it
    # fails the links after it)
    last = AsyncResult(result.id, app=sfapp.app)
    wait_for(lambda: last.state == "FAILURE", timeout=10)
    errors = wait_for(lambda: sfapp.recorder.lrange("canvas:errors", 0, -1), timeout=10)
    assert [json.loads(e) for e in errors] == [{"id": dup.id, "error": "LockHeld"}]
    let_go(sfapp, "craise")
    holder.get(timeout=15)
    stays(lambda: seen(sfapp, "after") == [], NEVER_RUNS)
    assert runs(sfapp, "craise") == [holder.id]


def test_chain_skip_passes_the_skip_result_to_the_next_link(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on k:cskip,
    when chain(hold_skip duplicate, canvas_seen) is sent,
    then the duplicate ends SUCCESS without running and the next link runs at once with the skip
    dict (is_skipped, the key and the holder's id) as its argument."""
    holder = start_holder(sfapp, sfapp.hold_skip, q, "cskip", HOLD)
    flow = chain(sfapp.hold_skip.s("cskip").set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    result = flow.apply_async()

    out = result.get(timeout=15)
    assert not holder.ready()  # the chain did not wait for the holder
    [got] = seen(sfapp, "after")
    assert out == {"seen": got}
    assert is_skipped(got)
    assert got["key"] == "k:cskip" and got["holder"] == holder.id
    assert result.parent.state == "SUCCESS"
    let_go(sfapp, "cskip")
    holder.get(timeout=15)
    assert runs(sfapp, "cskip") == [holder.id]


def test_chain_retry_continues_with_the_duplicates_own_result_after_the_holder(
    sfapp: ModuleType, q: str
) -> None:
    """Given a running holder on k:cretry,
    when chain(hold_retry duplicate, canvas_seen) is sent,
    then the duplicate is re-sent with the same task id and its chain (state RETRY meanwhile),
    runs once the holder is done, and the next link receives the duplicate's own result."""
    holder = start_holder(sfapp, sfapp.hold_retry, q, "cretry", HOLD)
    flow = chain(sfapp.hold_retry.s("cretry", 0.05).set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    result = flow.apply_async()
    dup = result.parent
    wait_for(lambda: dup.state == "RETRY", timeout=10)
    let_go(sfapp, "cretry")

    out = result.get(timeout=30)
    first = holder.get(timeout=5)
    [got] = seen(sfapp, "after")
    assert out == {"seen": got}
    assert got["key"] == "cretry" and got["fence"] > first["fence"]  # its own run, after the holder's
    assert runs(sfapp, "cretry") == [holder.id, dup.id]  # the same task id ran
    assert dup.get(timeout=5) == got
    assert sfapp.recorder.llen("overlaps") == 0


def test_chain_queue_continues_with_the_parked_runs_result_in_order(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on q:cq,
    when two chains (queued n=1 -> canvas_seen "a", then queued n=2 -> canvas_seen "b") are sent,
    each after the previous one was parked (state QUEUED),
    then each duplicate runs later from its parked message, in the order the chains parked, one
    at a time, and each next link receives its own duplicate's result."""
    holder = start_holder(sfapp, sfapp.queued, q, "cq", 0, HOLD)
    results = []
    for n, tag in ((1, "a"), (2, "b")):
        flow = chain(sfapp.queued.s("cq", n).set(queue=q), sfapp.canvas_seen.s(tag).set(queue=q))
        result = flow.apply_async()
        wait_for(lambda r=result, n=n: r.parent.state == "QUEUED" and met(sfapp.queued, n, "cq", 0),
                 timeout=10)  # parked (counted), not only marked QUEUED: the next one parks behind it
        results.append(result)
    let_go(sfapp, "cq")

    assert [r.get(timeout=30) for r in results] == [{"seen": 1}, {"seen": 2}]
    assert holder.get(timeout=5) == 0
    assert seen(sfapp, "a") == [1] and seen(sfapp, "b") == [2]
    assert [int(n) for n in sfapp.recorder.lrange("order:cq", 0, -1)] == [0, 1, 2]
    assert runs(sfapp, "cq") == [holder.id, results[0].parent.id, results[1].parent.id]
    assert sfapp.recorder.llen("overlaps") == 0


def test_chain_join_passes_the_holders_error_on_and_stops_the_chain(sfapp: ModuleType, q: str) -> None:
    """Given a holder on j:cjerr that will fail,
    when chain(joined duplicate, canvas_seen) is sent and the duplicate joins it,
    then the chain's result raises the holder's error, the duplicate ends FAILURE with it, and the
    next link never runs. (Success: test_join.py::test_a_joined_link_in_a_chain_...)"""
    holder = start_holder(sfapp, sfapp.joined, q, "cjerr", "first", HOLD, True)
    flow = chain(sfapp.joined.s("cjerr", "dup", 0.01).set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    result = flow.apply_async()
    dup = result.parent
    wait_for(lambda: dup.state == "JOINED" and met(sfapp.joined, 1, "cjerr", "first"), timeout=10)
    let_go(sfapp, "cjerr")

    with pytest.raises(ValueError, match="holder failed on cjerr"):
        result.get(timeout=15)
    with pytest.raises(ValueError, match="holder failed on cjerr"):
        holder.get(timeout=5)
    assert dup.state == "FAILURE"
    stays(lambda: seen(sfapp, "after") == [], NEVER_RUNS)
    assert runs(sfapp, "cjerr") == [holder.id]


def test_chain_join_error_marks_the_last_link_failed_like_a_failed_link(sfapp: ModuleType, q: str) -> None:
    """Given a holder on j:cjlast that will fail and a chain whose first link joins it,
    then the chain's last link ends FAILURE, as it does when a link fails by itself (see the
    raise test), so ``AsyncResult(last_id).get()`` (no parent to follow) does not wait forever."""
    start_holder(sfapp, sfapp.joined, q, "cjlast", "first", HOLD, True)
    flow = chain(sfapp.joined.s("cjlast", "dup", 0.01).set(queue=q),
                 sfapp.canvas_seen.s("after").set(queue=q))
    result = flow.apply_async()
    wait_for(lambda: result.parent.state == "JOINED" and met(sfapp.joined, 1, "cjlast", "first"), timeout=10)
    let_go(sfapp, "cjlast")
    with pytest.raises(ValueError):
        result.parent.get(timeout=15)
    last = AsyncResult(result.id, app=sfapp.app)
    assert wait_for(lambda: last.state == "FAILURE", timeout=3)


def test_chain_join_error_calls_a_new_style_errback(sfapp: ModuleType, q: str) -> None:
    """Given a holder on j:cjeb that will fail and chain(joined duplicate, canvas_seen) with a
    new-style errback (request, exc, traceback), as in the raise test,
    then the errback runs for the duplicate with the holder's error."""
    start_holder(sfapp, sfapp.joined, q, "cjeb", "first", HOLD, True)
    flow = chain(sfapp.joined.s("cjeb", "dup", 0.01).set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    flow.on_error(sfapp.canvas_errback.s().set(queue=q))
    result = flow.apply_async()
    wait_for(lambda: result.parent.state == "JOINED" and met(sfapp.joined, 1, "cjeb", "first"), timeout=10)
    let_go(sfapp, "cjeb")
    with pytest.raises(ValueError):
        result.get(timeout=15)
    errors = wait_for(lambda: sfapp.recorder.lrange("canvas:errors", 0, -1), timeout=3)
    assert [json.loads(e) for e in errors] == [{"id": result.parent.id, "error": "ValueError"}]


@pytest.mark.core
def test_chain_join_error_calls_an_old_style_errback(sfapp: ModuleType, q: str) -> None:
    """Given a holder on j:cjold that will fail and chain(joined duplicate, canvas_seen) with an
    old-style errback (one argument: the task id),
    then the errback is called with the duplicate's task id."""
    start_holder(sfapp, sfapp.joined, q, "cjold", "first", HOLD, True)
    flow = chain(sfapp.joined.s("cjold", "dup", 0.01).set(queue=q), sfapp.canvas_seen.s("after").set(queue=q))
    flow.on_error(sfapp.canvas_errback_old.s().set(queue=q))
    result = flow.apply_async()
    wait_for(lambda: result.parent.state == "JOINED" and met(sfapp.joined, 1, "cjold", "first"), timeout=10)
    let_go(sfapp, "cjold")
    with pytest.raises(ValueError):
        result.get(timeout=15)
    errors = wait_for(lambda: sfapp.recorder.lrange("canvas:errors_old", 0, -1), timeout=10)
    assert [e.decode() for e in errors] == [result.parent.id]


# -- group ----------------------------------------------------------------------------------------


def test_group_queue_runs_every_member_one_at_a_time_results_in_member_order(
    sfapp: ModuleType, q: str
) -> None:
    """Given a running holder on q:gq,
    when a group of 5 queued members on that key is sent,
    then they are parked, then all 5 run one at a time after the holder (no overlap), and the
    group's result is the 5 results in member order."""
    holder = start_holder(sfapp, sfapp.queued, q, "gq", 0, HOLD)
    members = group(sfapp.queued.s("gq", n).set(queue=q) for n in range(1, 6))
    result = members.apply_async()
    wait_for(lambda: all(r.state == "QUEUED" for r in result.results), timeout=10)
    wait_for(lambda: met(sfapp.queued, 5, "gq", 0), timeout=10)
    let_go(sfapp, "gq")

    assert result.get(timeout=30) == [1, 2, 3, 4, 5]
    assert holder.get(timeout=5) == 0
    order = [int(n) for n in sfapp.recorder.lrange("order:gq", 0, -1)]
    assert order[0] == 0 and sorted(order) == [0, 1, 2, 3, 4, 5]
    assert sfapp.recorder.llen("overlaps") == 0


def test_group_skip_members_return_at_once_while_an_outside_holder_runs(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on k:gs,
    when a group of 5 hold_skip members on that key is sent,
    then GroupResult.get() returns at once (before the holder ends) with 5 skip results naming
    the holder, and no member ran."""
    holder = start_holder(sfapp, sfapp.hold_skip, q, "gs", HOLD)
    result = group(sfapp.hold_skip.s("gs").set(queue=q) for _ in range(5)).apply_async()

    out = result.get(timeout=10)
    assert not holder.ready()
    assert len(out) == 5 and all(is_skipped(r) and r["holder"] == holder.id for r in out)
    let_go(sfapp, "gs")
    holder.get(timeout=15)
    assert runs(sfapp, "gs") == [holder.id]


def test_group_skip_exactly_one_member_runs(sfapp: ModuleType, q: str) -> None:
    """Given no holder on k:gs1,
    when a group of 5 hold_skip members (each holding until the test lets it go) on that key is
    sent, then exactly one member runs and the other 4 are skip results naming that member."""
    result = group(sfapp.hold_skip.s("gs1", HOLD).set(queue=q) for _ in range(5)).apply_async()
    wait_for(lambda: sum(r.ready() for r in result.results) == 4, timeout=15)  # the 4 skipped
    let_go(sfapp, "gs1")

    out = result.get(timeout=15)
    ran = [(r, res) for r, res in zip(result.results, out, strict=True) if not is_skipped(res)]
    assert len(ran) == 1
    winner, value = ran[0]
    assert value["key"] == "gs1"
    assert all(res["holder"] == winner.id for res in out if is_skipped(res))
    assert runs(sfapp, "gs1") == [winner.id]


# -- chord ----------------------------------------------------------------------------------------


@pytest.mark.core
def test_chord_of_joined_duplicates_gets_the_holders_result_four_times(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on j:chj,
    when chord([4 joined duplicates on that key], canvas_collect) is sent,
    then the 4 members join the holder (state JOINED) and the body runs once, after the holder,
    with 4 copies of the holder's result; only the holder ran."""
    holder = start_holder(sfapp, sfapp.joined, q, "chj", "first", HOLD)
    header = [sfapp.joined.s("chj", f"d{i}", 0.01).set(queue=q) for i in range(4)]
    result = chord(header, sfapp.canvas_collect.s("body").set(queue=q)).apply_async()
    wait_for(lambda: all(r.state == "JOINED" for r in result.parent.results), timeout=10)
    wait_for(lambda: met(sfapp.joined, 4, "chj", "first"), timeout=10)
    let_go(sfapp, "chj")

    expected = {"value": "first", "ran": holder.id}
    assert result.get(timeout=20) == [expected] * 4
    stays(lambda: collected(sfapp, "body") == [[expected] * 4], NEVER_RUNS)  # the body ran once
    assert runs(sfapp, "chj") == [holder.id]


def test_chord_of_queued_members_runs_the_body_after_all_ran(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on q:chq,
    when chord([4 queued members on that key], canvas_collect) is sent,
    then the members run one at a time after the holder and the body runs once, after the last
    of them, with their 4 results in member order."""
    holder = start_holder(sfapp, sfapp.queued, q, "chq", 0, HOLD)
    header = [sfapp.queued.s("chq", n).set(queue=q) for n in range(1, 5)]
    result = chord(header, sfapp.canvas_collect.s("body").set(queue=q)).apply_async()
    wait_for(lambda: all(r.state == "QUEUED" for r in result.parent.results), timeout=10)
    wait_for(lambda: met(sfapp.queued, 4, "chq", 0), timeout=10)
    let_go(sfapp, "chq")

    assert result.get(timeout=30) == [1, 2, 3, 4]
    assert holder.get(timeout=5) == 0
    stays(lambda: collected(sfapp, "body") == [[1, 2, 3, 4]], NEVER_RUNS)
    log = events(sfapp)
    assert log[-1] == "collect:body" and sum(e.startswith("queue:chq:") for e in log) == 5
    assert sfapp.recorder.llen("overlaps") == 0


def test_chord_of_retried_members_gets_their_own_results(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on k:chr,
    when chord([3 hold_retry members on that key], canvas_collect) is sent,
    then the members retry until the key is free, run one at a time, and the body runs once with
    their own 3 results in member order."""
    holder = start_holder(sfapp, sfapp.hold_retry, q, "chr", HOLD)
    header = [sfapp.hold_retry.s("chr", 0.05).set(queue=q) for _ in range(3)]
    result = chord(header, sfapp.canvas_collect.s("body").set(queue=q)).apply_async()
    wait_for(lambda: all(r.state == "RETRY" for r in result.parent.results), timeout=10)
    let_go(sfapp, "chr")

    out = result.get(timeout=40)
    first = holder.get(timeout=5)
    assert [r["key"] for r in out] == ["chr"] * 3
    assert len({r["fence"] for r in out}) == 3 and min(r["fence"] for r in out) > first["fence"]
    assert [r.get(timeout=5) for r in result.parent.results] == out  # member order
    assert collected(sfapp, "body") == [out]
    assert runs(sfapp, "chr")[0] == holder.id and len(runs(sfapp, "chr")) == 4
    assert sfapp.recorder.llen("overlaps") == 0


def test_chord_of_skipped_members_gets_the_skip_results(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on k:chs,
    when chord([3 hold_skip members on that key], canvas_collect) is sent,
    then the body runs at once (before the holder ends) with 3 skip results."""
    holder = start_holder(sfapp, sfapp.hold_skip, q, "chs", HOLD)
    header = [sfapp.hold_skip.s("chs").set(queue=q) for _ in range(3)]
    result = chord(header, sfapp.canvas_collect.s("body").set(queue=q)).apply_async()

    out = result.get(timeout=10)
    assert not holder.ready()
    assert len(out) == 3 and all(is_skipped(r) and r["holder"] == holder.id for r in out)
    assert collected(sfapp, "body") == [out]
    let_go(sfapp, "chs")
    holder.get(timeout=15)


def test_chord_with_a_raised_member_fails_without_running_the_body(sfapp: ModuleType, q: str) -> None:
    """Given a running holder on k:chx,
    when chord([3 hold_raise members on that key], canvas_collect) is sent,
    then every member fails with LockHeld, the body never runs: the chord's result raises
    LockHeld and the body's own result ends FAILURE with a ChordError naming LockHeld."""
    holder = start_holder(sfapp, sfapp.hold_raise, q, "chx", HOLD)
    header = [sfapp.hold_raise.s("chx").set(queue=q) for _ in range(3)]
    result = chord(header, sfapp.canvas_collect.s("body").set(queue=q)).apply_async()

    with pytest.raises(LockHeld):  # get() follows the chord body's parent: the header
        result.get(timeout=15)
    wait_for(lambda: all(r.state == "FAILURE" for r in result.parent.results), timeout=10)
    with pytest.raises(LockHeld):
        result.parent.get(timeout=5)  # the header, a GroupResult
    body = AsyncResult(result.id, app=sfapp.app)
    wait_for(lambda: body.state == "FAILURE", timeout=10)
    assert isinstance(body.result, ChordError) and "LockHeld" in str(body.result)
    let_go(sfapp, "chx")
    holder.get(timeout=15)
    stays(lambda: collected(sfapp, "body") == [], NEVER_RUNS)
    assert runs(sfapp, "chx") == [holder.id]
