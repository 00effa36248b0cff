"""The docs' code samples (``docs/examples/*.py``, included in the pages) run as written: against a
private redis-server and a real prefork worker started with ``celery -A proj worker -I ...``, as
the quickstart tells a reader to.

Every sample file must be run by a test here (``test_every_sample_is_run``), so a page cannot show
code that no longer works.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from celery_singleflight import LockHeld, is_skipped
from celery_singleflight.testing import RedisServer, WorkerProcess

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
#: the sample modules the worker imports besides ``proj`` (``-I``)
WORKER_MODULES = ("policies_example", "progress_example", "idempotency_example", "compat_once_example")
#: every sample, and the test that runs it
SAMPLES = {
    "proj.py": "test_quickstart",
    "quickstart_client.py": "test_quickstart",
    "keys_example.py": "test_key_templates",
    "policies_example.py": "test_duplicate_policies",
    "progress_example.py": "test_progress_and_status",
    "idempotency_example.py": "test_idempotency_layers",
    "settings_example.py": "test_settings",
    "compat_once_example.py": "test_celery_once_tasks_run_unchanged",
    "test_with_helpers.py": "test_the_testing_sample_passes_under_pytest",
}
_OURS = ("proj", "quickstart_client", *WORKER_MODULES, "keys_example", "settings_example")

pytestmark = pytest.mark.worker


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ModuleType]]:
    """The sample modules, imported in this process against a private Redis, with a worker running
    them. Modules of the same name imported before (another project's ``proj``) are put back after."""
    saved = {name: sys.modules.pop(name) for name in _OURS if name in sys.modules}
    payments = tmp_path_factory.mktemp("payments") / "payments.sqlite3"
    env = {"REDIS_URL": "", "PAYMENTS_DB": str(payments)}
    old_env = {name: os.environ.get(name) for name in env}
    sys.path.insert(0, str(EXAMPLES))
    with RedisServer() as redis_server:
        env["REDIS_URL"] = redis_server.url
        os.environ.update(env)
        modules = {name: importlib.import_module(name) for name in _OURS}
        worker = WorkerProcess(
            "proj", concurrency=6, cwd=str(EXAMPLES), loglevel="WARNING",
            env={**env, "PYTHONPATH": os.pathsep.join([str(EXAMPLES), str(ROOT)])},
            extra=("-I", ",".join(WORKER_MODULES)),
        )
        try:
            worker.start(modules["proj"].app)
            yield modules
        finally:
            worker.discard()
            sys.path.remove(str(EXAMPLES))
            for name in _OURS:
                sys.modules.pop(name, None)
            sys.modules.update(saved)
            for name, value in old_env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def test_every_sample_is_run() -> None:
    found = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert found == sorted(SAMPLES), "a sample in docs/examples/ has no test here (add it to SAMPLES)"
    names = {name for name in globals() if name.startswith("test_")}
    assert set(SAMPLES.values()) <= names


def test_quickstart(samples: dict[str, ModuleType]) -> None:
    first_id, skipped, done = samples["quickstart_client"].main()

    assert is_skipped(skipped)
    assert skipped["key"] == "sync:42"
    assert skipped["holder"] == first_id
    assert done["account"] == 42 and done["pages"] == 5 and done["fence"] > 0


def test_key_templates(samples: dict[str, ModuleType]) -> None:
    key = samples["keys_example"].main()  # its asserts are the page's examples

    assert key == "report:acme:2026"


def test_duplicate_policies(samples: dict[str, ModuleType]) -> None:
    firsts, seconds = samples["policies_example"].main()

    with pytest.raises(LockHeld):
        seconds["raise"].get(timeout=10)
    assert seconds["raise"].state == "FAILURE"
    skipped = seconds["skip"].get(timeout=10)
    assert is_skipped(skipped) and skipped["holder"] == firsts["skip"].id
    assert seconds["retry"].get(timeout=10) == f"report acme in {seconds['retry'].id}"  # ran itself, after
    assert seconds["queue"].get(timeout=10) == f"replied 'world' in {seconds['queue'].id}"
    assert seconds["join"].get(timeout=10) == firsts["join"].get(timeout=10)  # the holder's result
    assert all(result.state == "SUCCESS" for policy, result in seconds.items() if policy != "raise")


def test_progress_and_status(samples: dict[str, ModuleType]) -> None:
    events, st, value = samples["progress_example"].main()

    loading = [e for e in events if e.kind == "progress" and e.state == "loading"]
    assert [e.current for e in loading] == sorted(e.current for e in loading)  # in order
    assert 3 <= len(loading) <= 21  # throttled to 10 writes/s: 2 s of calls give about 20
    assert [e.state for e in events[-2:]] == ["finishing", "succeeded"]  # the last state always lands
    assert events[-1].kind == "end"
    assert st is not None and not st.held and st.outcome == "succeeded"
    assert value == {"tenant": "acme", "rows": 20}


def test_progress_meta_is_what_a_view_reads(samples: dict[str, ModuleType]) -> None:
    module = samples["progress_example"]
    result = module.import_rows.delay("globex", rows=40)
    key = module.import_rows.render_key("globex")
    module.wait_until_held(key)

    seen = []
    for _event in module.sf.watch(module.app, key, timeout=60):
        view = module.celery_view(result)
        if "percent" in view:
            seen.append(view)
    result.get(timeout=30)

    assert seen, "the view never saw the PROGRESS meta while the run reported progress"
    # never PROGRESS paired with the run's return value
    assert all(v["state"] in ("loading", "finishing") for v in seen), seen
    assert module.celery_view(result) == {"state": "SUCCESS"}


def test_idempotency_layers(samples: dict[str, ModuleType]) -> None:
    answers, rows = samples["idempotency_example"].main()

    first, again1, again2, other = answers
    assert first == {"delivery": "evt_1", "recorded": True}
    assert again1 == first and again2 == first  # remembered: returned without running
    assert other == {"delivery": "evt_2", "recorded": False}  # ran; the unique constraint said no
    assert rows == [(7, 1000, "evt_1")]  # one payment


def test_settings(samples: dict[str, ModuleType]) -> None:
    sync_options, charge_options = samples["settings_example"].main()

    assert (sync_options.ttl, sync_options.on_duplicate) == (20.0, "skip")
    assert sync_options.heartbeat_interval == pytest.approx(20 / 3)
    assert (charge_options.ttl, charge_options.on_duplicate) == (60.0, "raise")
    assert charge_options.redis_url == "redis://localhost:6379/2"


def test_celery_once_tasks_run_unchanged(samples: dict[str, ModuleType]) -> None:
    first, other, done, again = samples["compat_once_example"].main()

    assert first.get(timeout=10) == 2
    assert other.get(timeout=10) == 4
    assert done.get(timeout=10) == "Done!" and again.id == done.id


def test_the_testing_sample_passes_under_pytest(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("REDIS_URL", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(EXAMPLES / "test_with_helpers.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
