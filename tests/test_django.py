"""The example Django site (``example_project/django_site``) with real Django, its test client and
a real worker: ``CELERY_SINGLEFLIGHT_*`` settings, a view that dispatches, views that read the
status, and celery-progress's own view reading our ``PROGRESS`` meta."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from celery import current_app

from celery_singleflight.testing import RedisServer, WorkerProcess

from .conftest import ROOT, wait_for

pytestmark = pytest.mark.worker
SITE = ROOT / "example_project" / "django_site"


@pytest.fixture(scope="module")
def site() -> Iterator[SimpleNamespace]:
    """Django set up on the site's settings, on a private Redis, with a worker of the site."""
    saved = {name: os.environ.get(name) for name in ("REDIS_URL", "DJANGO_SETTINGS_MODULE")}
    previous_app = current_app._get_current_object()
    worker: WorkerProcess | None = None
    with RedisServer() as server:
        # everything set here is undone however the set-up ends: a DJANGO_SETTINGS_MODULE left
        # behind would make every later worker of the session a Django one
        try:
            os.environ.update(REDIS_URL=server.url, DJANGO_SETTINGS_MODULE="mysite.settings")
            sys.path.insert(0, str(SITE))
            import django

            django.setup()
            from django.test import Client
            from mysite import celery_app
            from reports.tasks import build_report

            celery_app.set_current()  # what the shared_task proxy and celery-progress's view use
            worker = WorkerProcess("mysite", concurrency=2, cwd=str(SITE), env={
                "REDIS_URL": server.url, "DJANGO_SETTINGS_MODULE": "mysite.settings",
                "PYTHONPATH": os.pathsep.join([str(SITE), str(ROOT)]),
            })
            worker.start(celery_app)
            yield SimpleNamespace(app=celery_app, client=Client(), task=build_report, redis=server)
        finally:
            if worker is not None:
                worker.discard()
            previous_app.set_current()
            if str(SITE) in sys.path:
                sys.path.remove(str(SITE))
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def test_singleflight_settings_come_from_django(site: SimpleNamespace) -> None:
    """``CELERY_SINGLEFLIGHT_*`` in settings.py reach the task's options through
    ``config_from_object("django.conf:settings", namespace="CELERY")``."""
    options = site.task.options
    assert options.namespace == "mysite" and options.ttl == 10 and options.on_duplicate == "join"
    assert options.redis_url == f"{site.redis.url}/2"


def test_dispatch_join_status_and_progress_views(site: SimpleNamespace) -> None:
    client = site.client
    # Given two requests for the same report (a double click)
    first = client.post("/reports/acme/")
    second = client.post("/reports/acme/")
    assert first.status_code == second.status_code == 202
    task_ids = {first.json()["task_id"], second.json()["task_id"]}
    key = first.json()["key"]
    assert key == second.json()["key"] == site.task.render_key("acme")
    assert all(r.json()["progress_url"] == f"/progress/{r.json()['task_id']}/" for r in (first, second))

    # the status view reads the key: held by the first request's task, with its progress
    def running() -> dict[str, Any] | None:
        st = client.get("/reports/acme/status").json()["status"]
        return st if st and st["held"] and st["current"] else None

    st = wait_for(running, timeout=15)
    assert st["task_id"] in task_ids and st["state"] == "building" and st["total"] == 5
    holder = st["task_id"]  # whichever request's task took the key first
    (joined,) = task_ids - {holder}
    progress_url = f"/celery-progress/{holder}/"

    # the site's progress view answers for the joined request too, as a bar that waits
    def waiting() -> dict[str, Any] | None:
        body = client.get(f"/progress/{joined}/").json()
        return body if body["state"] == "JOINED" else None

    body = wait_for(waiting, timeout=15)
    assert body["complete"] is False and body["success"] is None
    assert body["progress"]["pending"] is True and body["progress"]["percent"] == 0
    assert body["progress"]["description"] == f"waiting for {holder} on {key}"
    # ...and the lease lives under the site's namespace, in the Redis the settings name
    assert site.redis.client(2).exists(f"mysite:{{{key}}}:run")

    # celery-progress's own view, included in urls.py, draws the holder's bar from our PROGRESS meta
    def progressing() -> dict[str, Any] | None:
        body = client.get(progress_url).json()
        return body if body["state"] == "PROGRESS" else None

    body = wait_for(progressing, timeout=60)  # a condition: a loaded machine starts the run late
    progress = body["progress"]
    assert body["complete"] is False and progress["total"] == 5 and progress["pending"] is False
    assert progress["percent"] == 100.0 * progress["current"] / 5
    assert progress["description"] == f"section {progress['current']} of 5"

    # the streaming view follows the run live until it ends
    response = client.get("/reports/acme/events")
    assert response["Content-Type"] == "text/event-stream"
    events = []
    deadline = time.monotonic() + 30
    for chunk in response.streaming_content:
        kind, data = chunk.decode().strip().split("\n")
        events.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
        assert time.monotonic() < deadline
    assert events[-1][0] == "end" and events[-1][1]["state"] == "succeeded"
    currents = [data["current"] for kind, data in events if kind == "progress"]
    assert currents == sorted(currents) and currents[-1] == 5

    # Then the second request joined the first: the same report, built once
    one, two = (site.app.AsyncResult(task_id).get(timeout=15) for task_id in task_ids)
    assert one == two == {"tenant": "acme", "sections": 5, "fence": one["fence"]}
    done = client.get("/reports/acme/status").json()["status"]
    assert done["held"] is False and done["outcome"] == "succeeded" and done["duplicates"] == 1
    assert done["task_id"] == holder
    assert client.get(progress_url).json()["result"] == one
    assert client.get(f"/progress/{joined}/").json()["result"] == one
    assert client.get("/reports/acme/").status_code == 405  # dispatching takes a POST


def test_a_misspelled_setting_stops_django_at_start(tmp_path: Any) -> None:
    """The site's settings with ``CELERY_SINGLEFLIGHT_TLL = 5`` (for ``..._TTL``): ``django.setup()``
    fails, naming the setting as written and the right one; the same settings without the typo
    start. (The site's AppConfig.ready() calls check_app.)"""
    import subprocess

    for typo, expected in (("CELERY_SINGLEFLIGHT_TLL = 5", 1), ("", 0)):
        (tmp_path / "typo_settings.py").write_text(f"from mysite.settings import *  # noqa: F403\n{typo}\n")
        done = subprocess.run(
            [sys.executable, "-c", "import django; django.setup()"], capture_output=True, text=True,
            timeout=60, cwd=tmp_path,
            env={**os.environ, "DJANGO_SETTINGS_MODULE": "typo_settings", "REDIS_URL": "redis://127.0.0.1:1",
                 "PYTHONPATH": os.pathsep.join([str(tmp_path), str(SITE), str(ROOT)])},
        )
        assert done.returncode == expected, done.stderr
        if expected:
            assert ("unknown setting 'CELERY_SINGLEFLIGHT_TLL'; did you mean CELERY_SINGLEFLIGHT_TTL?"
                    in done.stderr), done.stderr
