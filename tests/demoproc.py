"""The example project's demo (``example_project/demo.py``) as a subprocess, for the tests:
started as a user starts it, talked to over HTTP, stopped with SIGINT (Ctrl-C)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery_singleflight.testing import _child_setup

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "example_project" / "demo.py"
_URL = re.compile(r"Open (http://\S+/)")


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a live process, from /proc; None if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), fields[0], int(fields[19])


class Demo:
    """``python example_project/demo.py ARGS`` with its output collected line by line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(DEMO), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})}, cwd=str(ROOT), text=True, start_new_session=True,
            preexec_fn=_child_setup(),
        )
        self.lines: list[str] = []
        self.url = ""
        self._url_or_end = threading.Event()  # the URL was printed, or the output ended without it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if not self.url and (found := _URL.search(line)):
                self.url = found.group(1).rstrip("/")
                self._url_or_end.set()
        self._url_or_end.set()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_url(self, timeout: float = 90.0) -> str:
        """The URL the demo prints once the worker, beat and the web app are up."""
        self._url_or_end.wait(timeout)
        if not self.url:
            raise AssertionError(f"the demo printed no URL:\n{self.output}")
        return self.url

    def descendants(self) -> dict[int, int]:
        """{pid: start time} of every process below the demo (Redis, worker and its pool, beat)."""
        parents: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (stat := _stat(int(entry.name))) is not None:
                parents.setdefault(stat[0], []).append(int(entry.name))
        found: dict[int, int] = {}
        todo = [self.proc.pid]
        while todo:
            for child in parents.get(todo.pop(), []):
                if (stat := _stat(child)) is not None:
                    found[child] = stat[2]
                    todo.append(child)
        return found

    def interrupt(self, timeout: float = 60.0) -> int:
        """Ctrl-C: SIGINT to the demo alone (its children are in their own process groups)."""
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def kill(self) -> None:
        """Teardown after a failed test: the demo's whole tree, by the PIDs it started."""
        for pid in [*self.descendants(), self.proc.pid]:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # a worker and its pool
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)


def alive(processes: dict[int, int]) -> list[int]:
    """The PIDs of ``processes`` still running (same start time: not a reused PID; not a zombie)."""
    out = []
    for pid, started in processes.items():
        stat = _stat(pid)
        if stat is not None and stat[2] == started and stat[1] != "Z":
            out.append(pid)
    return out


def get(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body = response.read().decode()
        return json.loads(body) if response.headers.get_content_type() == "application/json" else body


def post(url: str, body: Any = None, timeout: float = 10.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        assert response.status == 202, response.status
        return json.loads(response.read())


def status_code(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def server_sent_events(url: str, timeout: float = 30.0) -> Iterator[dict[str, Any]]:
    """The ``data:`` events of a server-sent events stream, as JSON."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.headers.get_content_type() == "text/event-stream"
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                yield json.loads(line[len("data: "):])


def wait_result(base: str, task_id: str, timeout: float = 60.0) -> dict[str, Any]:
    """The demo's ``/result/<task_id>`` once the task is finished."""
    deadline = time.monotonic() + timeout
    while True:
        body: dict[str, Any] = get(f"{base}/result/{task_id}")
        if body["state"] in ("SUCCESS", "FAILURE"):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"task {task_id} still {body} after {timeout}s")
        time.sleep(0.2)  # the next look
