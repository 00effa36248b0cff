"""The `join` policy on a real worker: duplicates get the holder's result, or its error."""

from __future__ import annotations

import os
import signal
from types import ModuleType

import pytest
from billiard.exceptions import WorkerLostError
from celery import chain

from celery_singleflight import ConfigurationError, SingleFlightTask

from .conftest import HOLD, gates_opened_after, let_go, met, wait_for

pytestmark = [pytest.mark.worker, pytest.mark.share_workers]

_gates_opened = gates_opened_after("j20", "jerr", "jchain")


def test_twenty_duplicates_all_return_the_holders_result(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a running holder, 20 duplicates join it instead of running; each ends SUCCESS with
    the holder's result, and only the holder ran."""
    q = start_worker(concurrency=3).queue  # type: ignore[operator]
    holder = sfapp.joined.apply_async(("j20", "first", HOLD), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:j20") >= 1, timeout=15)
    dups = [sfapp.joined.apply_async(("j20", f"dup{i}", 0.01), queue=q) for i in range(20)]
    wait_for(lambda: all(d.state == "JOINED" for d in dups), timeout=20)
    wait_for(lambda: met(sfapp.joined, 20, "j20", "first"), timeout=15)
    let_go(sfapp, "j20")
    expected = {"value": "first", "ran": holder.id}
    assert holder.get(timeout=15) == expected
    assert [d.get(timeout=15) for d in dups] == [expected] * 20
    assert all(d.state == "SUCCESS" for d in dups)
    assert sfapp.recorder.llen("runs:j20") == 1
    assert sfapp.recorder.llen("overlaps") == 0


@pytest.mark.core
def test_an_error_in_the_holder_reaches_the_joined_runs(sfapp: ModuleType, start_worker: object) -> None:
    q = start_worker(concurrency=3).queue  # type: ignore[operator]
    holder = sfapp.joined.apply_async(("jerr", "first", HOLD, True), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:jerr") >= 1, timeout=15)
    dups = [sfapp.joined.apply_async(("jerr", f"d{i}", 0.01), queue=q) for i in range(3)]
    wait_for(lambda: all(d.state == "JOINED" for d in dups), timeout=15)
    wait_for(lambda: met(sfapp.joined, 3, "jerr", "first"), timeout=15)
    let_go(sfapp, "jerr")
    for result in (holder, *dups):
        with pytest.raises(ValueError, match="holder failed on jerr"):
            result.get(timeout=15)


def test_a_killed_holder_answers_joined_runs_with_worker_lost(
    sfapp: ModuleType, start_worker: object
) -> None:
    q = start_worker(concurrency=3).queue  # type: ignore[operator]
    sfapp.joined_sleeper.apply_async(("jkill",), queue=q)
    pid = int(wait_for(lambda: sfapp.recorder.get("pid:jkill"), timeout=15))
    dup = sfapp.joined_sleeper.apply_async(("jkill", 0.01), queue=q)
    wait_for(lambda: dup.state == "JOINED", timeout=15)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        dup.get(timeout=15)


def test_a_joined_link_in_a_chain_passes_the_holders_result_on(
    sfapp: ModuleType, start_worker: object
) -> None:
    """Given a chain whose first link is a joined duplicate, the rest of the chain continues
    with the holder's result, as if the link had run."""
    q = start_worker(concurrency=3).queue  # type: ignore[operator]
    holder = sfapp.joined.apply_async(("jchain", "first", HOLD), queue=q)
    wait_for(lambda: sfapp.recorder.llen("runs:jchain") >= 1, timeout=15)
    flow = chain(sfapp.joined.s("jchain", "dup", 0.01).set(queue=q), sfapp.add_one.s().set(queue=q))
    result = flow.apply_async()
    wait_for(lambda: result.parent.state == "JOINED", timeout=15)
    wait_for(lambda: met(sfapp.joined, 1, "jchain", "first"), timeout=15)
    let_go(sfapp, "jchain")
    expected = {"value": "first", "ran": holder.id}
    assert result.get(timeout=20) == {"after": expected}
    assert sfapp.recorder.llen("runs:jchain") == 1


def test_join_without_a_result_backend_is_refused_at_worker_start() -> None:
    from celery import Celery

    from celery_singleflight.worker.bootstep import check_worker_app

    app = Celery("nobackend", broker="redis://127.0.0.1:1/0", set_as_current=False)

    @app.task(bind=True, base=SingleFlightTask, lock_key="k:<x>", on_duplicate="join", shared=False)
    def needs_backend(self: object, x: int) -> int:
        return x

    app.finalize()
    with pytest.raises(ConfigurationError, match="need a result backend"):
        check_worker_app(app)


def test_join_with_ignore_result_is_refused_when_the_task_is_bound() -> None:
    from celery import Celery

    app = Celery("ignored", broker="redis://127.0.0.1:1/0", backend="redis://127.0.0.1:1/1",
                 set_as_current=False)

    @app.task(bind=True, base=SingleFlightTask, lock_key="k:<x>", on_duplicate="join",
              ignore_result=True, shared=False)
    def ignores(self: object, x: int) -> int:
        return x

    with pytest.raises(ConfigurationError, match="ignore_result=False"):
        app.finalize()
        ignores.name  # noqa: B018 - evaluating the task binds it
