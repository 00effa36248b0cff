"""celery-progress bars read our ``PROGRESS`` meta: the real package against a real worker."""

from __future__ import annotations

from types import ModuleType

import pytest
from celery import group
from celery_progress.backend import GroupProgress, KnownResult, Progress

from celery_singleflight import states
from celery_singleflight.run.progress import ProgressUpdate, result_meta
from celery_singleflight.testing import WorkerProcess

from .conftest import HOLD, gates_opened_after, let_first_step_go, wait_for

pytestmark = pytest.mark.worker

_gates_opened = gates_opened_after("cp:first", "cpg0:first", "cpg1:first")


def test_progress_get_info_on_a_running_task(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """Given a task reporting 5 steps, celery-progress's Progress(result).get_info() returns our
    numbers while it runs, and its own completed shape once it succeeded."""
    result = sfapp.reporting.delay("cp", 5, 0.3, first=HOLD, at=2)  # step 2 holds until the test read it

    def reached_step_two() -> dict | None:
        info = Progress(result).get_info()
        return info if info["state"] == "PROGRESS" and info["progress"]["current"] >= 2 else None

    info = wait_for(reached_step_two, timeout=15)
    progress = info["progress"]
    assert info["complete"] is False and info["success"] is None
    step = progress["current"]
    assert progress["total"] == 5 and progress["percent"] == 100.0 * step / 5
    assert progress["pending"] is False
    assert progress["description"] == f"step {step}"  # the message, as the bar's text
    # our own fields are still there, and our typed reader agrees
    assert progress["key"] == sfapp.reporting.render_key("cp") and progress["state"] == "loading"
    assert progress["fields"] == {"name": "cp"} and isinstance(progress["fence"], int)
    meta = states.meta_of(info["state"], progress)
    assert meta is not None and meta.progress_state == "loading" and meta.total == 5

    let_first_step_go(sfapp, "cp")
    assert result.get(timeout=15) == 5
    done = Progress(result).get_info()
    assert done["complete"] is True and done["success"] is True and done["result"] == 5


def test_group_progress_sums_our_numbers(sfapp: ModuleType, shared_worker: WorkerProcess) -> None:
    """GroupProgress adds up current and total of each child: they are always numbers."""
    # each child's first step holds until the test read their sum
    result = group(sfapp.reporting.s(f"cpg{i}", 4, 0.3, first=HOLD) for i in range(2)).apply_async()

    def both_reporting() -> dict | None:
        if not all(child.state == "PROGRESS" for child in result.children):
            return None
        return GroupProgress(result).get_info()

    info = wait_for(both_reporting, timeout=15)
    assert info["progress"]["total"] == 8 and 0 <= info["progress"]["current"] <= 8
    assert info["complete"] is False
    let_first_step_go(sfapp, "cpg0")
    let_first_step_go(sfapp, "cpg1")
    assert result.get(timeout=15) == [4, 4]
    assert GroupProgress(result).get_info()["progress"]["percent"] == 100


def test_a_state_without_numbers_still_draws_a_bar() -> None:
    """``self.progress("finishing")`` with no numbers: celery-progress's bar still gets numbers
    (0: "Task started...") and the state as its text; the meta keeps our fields."""
    update = ProgressUpdate("finishing")
    meta = result_meta(update.as_dict(), "report:acme", 17)
    info = Progress(KnownResult("t-1", meta, "PROGRESS")).get_info()
    assert info["progress"] == {
        "state": "finishing", "key": "report:acme", "fence": 17, "pending": False,
        "description": "finishing", "current": 0, "total": 0, "percent": 0,
    }
    with_message = result_meta(ProgressUpdate("loading", 3, 8, "page 3").as_dict(), "k", 1)
    assert (with_message["current"], with_message["total"], with_message["percent"]) == (3, 8, 37.5)
    assert with_message["description"] == "page 3" and with_message["message"] == "page 3"
