"""Every release path carries out every duty a release hands back, on a real worker.

One key, four parties: a holder (a task with ``dedup_enqueue=True``, so it owns the key's enqueue
marker), a run parked behind it (``queue``), a run joined to it (``join``), and the key's status.
Whichever way the holder's run ends, then:

- the parked run is handed the key and runs (at once, or within one TTL for a lost host);
- the joined run ends terminal: the holder's result when it succeeded, else an error;
- the enqueue marker no longer points at the ended run: the next ``delay()`` sends a new message;
- the ended run's outcome is recorded (where no newer run has overwritten it yet).

Paths: the task body returns, raises, calls ``self.retry()``; a ``hold()`` ends; the pool process
is SIGKILLed, revoked with ``terminate=True``, hit by its hard time limit (the worker's main process
releases); an operator force-releases; the whole worker dies (the sweeper of another worker hands
the key on).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from billiard.exceptions import WorkerLostError
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

import celery_singleflight as sf
from celery_singleflight import LeaseLost, hold
from celery_singleflight.testing import WorkerProcess

from .conftest import HOLD, let_go, met, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

#: the keys of this test (:func:`_fresh`): their gates are opened after it (a failed test must not
#: leave a holder busy on the shared worker)
_keys: list[str] = []


@pytest.fixture(autouse=True)
def _gates_open_after(sfapp: ModuleType) -> Iterator[None]:
    yield
    let_go(sfapp, *_keys, *(f"{key}:retry" for key in _keys))  # a retry's attempt of mx_holder waits there
    _keys.clear()


def _wait_running(sfapp: ModuleType, key: str) -> int:
    return int(wait_for(lambda: sfapp.recorder.get(f"pid:{key}"), timeout=20))


def _behind(sfapp: ModuleType, key: str, counted: bool = True) -> tuple[AsyncResult, AsyncResult]:
    """A parked run and a joined run behind the current holder of ``key``. ``counted``: and both
    counted on the holder's status, so parked and joined: QUEUED and JOINED are stored just before,
    and a holder ending between the two would leave the run to run by itself (not under a time
    limit, which ends the holder on its own clock, whatever the test waits for)."""
    parked = sfapp.mx_queued.delay(key)
    joined = sfapp.mx_joiner.delay(key)
    wait_for(lambda: parked.state == "QUEUED" and joined.state == "JOINED", timeout=20)
    if counted:
        wait_for(lambda: met(sfapp.mx_holder, 2, key), timeout=20)
    return parked, joined


def _check_duties(
    sfapp: ModuleType, key: str, holder: AsyncResult | str, parked: AsyncResult, joined: AsyncResult,
    joined_ok: Callable[[Any], bool], outcome: str, within: float = 15.0,
) -> None:
    assert parked.get(timeout=within) == "queued-ran"  # handed the key, ran
    # the ended run's outcome was recorded: the parked run's record says who ran before it, and how
    # that ended
    holder_id = holder if isinstance(holder, str) else holder.id
    st = sf.status(sfapp.app, sfapp.mx_holder.render_key(key))
    assert st is not None and st.task_id == parked.id, st
    assert (st.previous_task_id, st.previous_outcome) == (holder_id, outcome), st
    joined_value: Any
    try:
        joined_value = joined.get(timeout=within)
    except Exception as exc:  # noqa: BLE001 - the error is the outcome under test
        joined_value = exc
    assert joined.ready() and joined_ok(joined_value), joined_value
    # the marker of the ended holder no longer counts: a new delay() sends a new message; but a
    # holder that ended to retry is queued again under its id, and its marker stays with it
    again = sfapp.mx_holder.delay(key, "succeed", 0.05)
    if outcome == "retried":
        assert again.id == holder_id
        return
    assert again.id != holder_id
    assert again.get(timeout=within)["ran"] == again.id


def _fresh() -> str:
    key = f"mx-{uuid.uuid4().hex[:8]}"
    _keys.append(key)
    return key


def test_the_body_returns(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "succeed", HOLD)
    _wait_running(sfapp, key)
    assert sfapp.mx_holder.delay(key).id == holder.id  # the marker dedups while it runs
    parked, joined = _behind(sfapp, key)
    let_go(sfapp, key)
    result = holder.get(timeout=15)
    _check_duties(sfapp, key, holder, parked, joined, lambda v: v == result, "succeeded")


def test_the_body_raises(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "fail", HOLD)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)
    let_go(sfapp, key)
    with pytest.raises(ValueError, match="failed"):
        holder.get(timeout=15)
    _check_duties(sfapp, key, holder, parked, joined, lambda v: isinstance(v, ValueError), "failed")


def test_the_body_retries(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """``self.retry()`` releases before the retry is sent: the parked run goes first, the joined run
    waits for the next run that ends (a retry has no result yet), and the retry runs after."""
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "retry", HOLD)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)
    let_go(sfapp, key)  # the first attempt retries; the retry's attempt holds until its own gate opens
    _check_duties(sfapp, key, holder, parked, joined, lambda v: v == "queued-ran", "retried")
    let_go(sfapp, f"{key}:retry")
    assert holder.get(timeout=20)["ran"] == holder.id  # the retry (2 s later) ran too


def test_a_hold_ends(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """The case that stayed JOINED forever: a join-policy task that arrived during a hold() runs
    (a hold has no result to give it) once the hold ends, and so does the parked run."""
    key = _fresh()
    with hold(sfapp.app, sfapp.mx_holder.render_key(key)) as lease:
        parked, joined = _behind(sfapp, key)
    _check_duties(sfapp, key, lease.holder, parked, joined, lambda v: v in ("joiner-ran", "queued-ran"),
                  "succeeded")


def test_the_pool_process_is_killed(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "succeed", HOLD)
    pid = _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        holder.get(timeout=15)
    _check_duties(sfapp, key, holder, parked, joined, lambda v: isinstance(v, WorkerLostError),
                  "worker-lost")


def test_the_run_is_revoked_with_terminate(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "succeed", HOLD)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)
    holder.revoke(terminate=True)
    wait_for(lambda: holder.state == "REVOKED", timeout=15)
    # the child ends first (terminated) or the main process releases for it (revoked); the recorded
    # outcome is corrected to revoked either way
    _check_duties(sfapp, key, holder, parked, joined,
                  lambda v: isinstance(v, LeaseLost) and ("revoked" in str(v) or "terminated" in str(v)),
                  "revoked")


def test_the_hard_time_limit_ends_the_run(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    key = _fresh()
    holder = sfapp.mx_time_limited.delay(key)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key, counted=False)
    with pytest.raises(TimeLimitExceeded):
        holder.get(timeout=15)
    _check_duties(sfapp, key, holder, parked, joined, lambda v: isinstance(v, TimeLimitExceeded),
                  "time-limit")


def test_an_operator_force_releases(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """The key is handed to the parked run at once (no wait for the sweeper), the joined run gets
    a LeaseLost naming the operator, and the old body, still running, learns it lost the key."""
    key = _fresh()
    holder = sfapp.mx_holder.delay(key, "succeed", HOLD)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)
    released_at = time.monotonic()
    assert sf.force_release(sfapp.app, sfapp.mx_holder.render_key(key), by="ops@matrix") == holder.id
    assert parked.get(timeout=10) == "queued-ran"
    assert time.monotonic() - released_at < 3.0, "the parked run waited for the sweeper"
    assert not holder.ready()  # the old body still runs
    let_go(sfapp, key)
    holder.get(timeout=15)  # the old body ends (its marker goes with it); its release finds the key gone
    _check_duties(sfapp, key, holder, parked, joined,
                  lambda v: isinstance(v, LeaseLost) and "ops@matrix" in str(v), "force-released")
    lost = f"lease lost: key='{sfapp.mx_holder.render_key(key)}'"
    wait_for(lambda: lost in shared_worker.log(), timeout=10)


def test_the_whole_worker_dies(sfapp: ModuleType, shared_worker: WorkerProcess, start_worker: Any) -> None:
    """A lost host: nothing releases. Within one TTL (3 s here) the sweeper of the surviving worker
    hands the key to the parked run and answers the joined run with an error; the dead run's
    marker no longer counts."""
    doomed: WorkerProcess = start_worker(concurrency=1, env={"SF_TEST_TTL": "3"})
    key = _fresh()
    holder = sfapp.mx_holder.apply_async((key, "succeed", HOLD), queue=doomed.queue)
    _wait_running(sfapp, key)
    parked, joined = _behind(sfapp, key)  # to the shared worker
    killed_at = time.monotonic()
    doomed.kill()
    assert parked.get(timeout=20) == "queued-ran"
    figures_s = time.monotonic() - killed_at
    assert figures_s < 3.0 + 3.0, figures_s  # the TTL, plus the sweeper's look (about a second)
    _check_duties(sfapp, key, holder, parked, joined, lambda v: isinstance(v, LeaseLost), "expired")


# -- coalesce, supersede and ordered through the paths that run no code in the holder --------

#: (policy, path): every pair when SF_POLICY_MATRIX_FULL=1, else one path per policy plus a blip
_NEW_POLICIES = ("coalesce", "supersede", "ordered")
_PATHS = ("killed", "revoked", "time-limit", "redis-blip")
_DEFAULT_CASES = {("coalesce", "killed"), ("supersede", "revoked"), ("ordered", "time-limit"),
                  ("ordered", "redis-blip")}
_CASES = [(p, path) for p in _NEW_POLICIES for path in _PATHS
          if os.environ.get("SF_POLICY_MATRIX_FULL") == "1" or (p, path) in _DEFAULT_CASES]


@pytest.mark.parametrize(("policy", "path"), _CASES)
def test_new_policies_leave_nothing_pending(
    sfapp: ModuleType, shared_worker: WorkerProcess, start_worker: Any, redis_server: Any, policy: str,
    path: str,
) -> None:
    """Given a holder and two runs behind it (coalesce: the second replaces the first; supersede:
    both supersede it; ordered: both wait in send order), whichever way the holder ends without
    running its own release (SIGKILL, revoke with terminate, hard time limit) or with its lease
    Redis cut until its worker met the outage, the runs behind it end terminal, the last one sent
    runs, and nothing is left held or queued."""
    from .chaos.proxy import TcpProxy

    task = getattr(sfapp, f"pm_{policy}")
    key = _fresh()
    proxy = None
    blipped: WorkerProcess | None = None
    queue = None
    if path == "redis-blip":  # the holder's worker reaches its lease Redis through a proxy
        proxy = TcpProxy(redis_server.port).start()
        blipped = start_worker(concurrency=1, env={"SF_TEST_LEASE_REDIS": proxy.url(2)})
        queue = blipped.queue  # type: ignore[union-attr]
    try:
        options: dict[str, Any] = {"time_limit": 1.5} if path == "time-limit" else {}
        # the holder holds until the test ends it (or lets it go after the blip), HOLD s at most
        holder = task.apply_async((key, 0, HOLD), queue=queue, **options)
        pid = _wait_running(sfapp, key)
        behind = [task.delay(key, 1), task.delay(key, 2)]
        st_key = task.render_key(key, 0)

        def met() -> bool:
            """Waiting behind the holder, both counted on its status (not under a time limit, which
            ends the holder on its own clock: a run still on its way then comes after it)."""
            st = sf.status(sfapp.app, st_key)
            if st is None or st.queued < 1:
                return False
            return path == "time-limit" or (st.held and st.duplicates >= 2)

        wait_for(met, timeout=20)
        if path == "killed":
            os.kill(pid, signal.SIGKILL)
        elif path == "revoked":
            holder.revoke(terminate=True)
        elif path == "redis-blip":
            assert proxy is not None and blipped is not None
            proxy.cut()
            # cut until the holder's worker has met the outage (its sweeper looks every second and
            # logs a look that failed), then healed while the holder still runs
            wait_for(lambda: "queue sweep failed" in blipped.log(), timeout=15)
            proxy.heal()
            let_go(sfapp, key)
        outcomes = []
        for result in behind:
            try:
                outcomes.append(result.get(timeout=30))
            except Exception as exc:  # noqa: BLE001 - the error is the outcome under test
                outcomes.append(exc)
        assert all(r.ready() for r in (holder, *behind))
        assert outcomes[-1] == 2  # the last one sent ran
        if policy == "coalesce":
            assert sf.is_coalesced(outcomes[0])
        elif policy == "supersede":
            assert isinstance(outcomes[0], sf.Superseded)
        else:
            assert outcomes[0] == 1
            assert [int(x) for x in sfapp.recorder.lrange(f"pm:{key}", 0, -1)] == [0, 1, 2]
        st = sf.status(sfapp.app, st_key)
        assert st is not None and not st.held and st.queued == 0, st
    finally:
        if proxy is not None:
            proxy.close()
