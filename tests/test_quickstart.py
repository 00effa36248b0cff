"""The quickstart page runs as written: its commands, its files, and the output it shows.

The commands are read from ``docs/quickstart.md`` itself (its ```` ```sh ```` blocks), so an edit
that breaks them fails here. In a fresh directory: a new virtualenv with ``pip install`` of this
repository (linked as ``celery-singleflight``, as the page names the clone), the files the page
shows (``proj.py``, ``quickstart_client.py``), a private Redis (``REDIS_URL``, as the page says), a
real worker started with the page's command line, then every other command in page order. Where
the page shows output (a ```` ```text ```` block after a command), the command's output must match
it, volatile parts (ids, times, numbers, the host) aside; ``...`` stands for any number of lines.
The worker's block must appear in its log.

Needs the network (or a configured package index) for ``pip install``: without one it skips
locally and fails with ``CI=true``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_singleflight.testing import RedisServer

from .conftest import IN_CI, wait_for

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "quickstart.md"
CLONE = "celery-singleflight"  # what the page calls the clone of this repository
WORKER = re.compile(r"^celery -A \S+ worker\b")
OFFLINE = ("No matching distribution", "Could not find a version", "NewConnectionError",
           "Temporary failure in name resolution", "Network is unreachable")

pytestmark = pytest.mark.worker

_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.M | re.S)
_FILE = re.compile(r'^`([\w.-]+\.py)`:\s*\n+```python\n--8<-- "([^"]+)"\n```', re.M)

#: volatile parts of shown output, in the order they are replaced (text shown -> pattern)
_VOLATILE = [
    (re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"), r"[0-9a-f-]{36}"),
    (re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+[+-]\d\d:\d\d"), r"\S+"),  # an ISO time in any time zone
    (re.compile(r"redis://[^/\s]+"), r"redis://[^/\s]+"),  # the Redis URL's host and port
    (re.compile(r"\blaptop\b"), r"[\w.-]+"),  # the host name
    (re.compile(r"\b[0-9a-f]{8}\b"), r"[0-9a-f]{8}"),  # a short task id (ls)
    (re.compile(r"(?<![\w:])[+-]\d+\.\d+"), r"[+-]\d+\.\d+"),  # a signed figure (clock skew)
    (re.compile(r"(?<![A-Za-z]:)\d+(?:\.\d+)?"), r"\d+(?:\.\d+)?"),  # numbers, not a key's (sync:7)
]


def blocks(page: str) -> list[tuple[str, str]]:
    """The page's fenced blocks, in order: (language, text)."""
    return [(lang, text) for lang, text in _BLOCK.findall(page)]


def pattern(shown: str) -> re.Pattern[str]:
    """A regex for one line of shown output: volatile parts become patterns, spaces are any."""
    marks: list[str] = []

    def hide(regex: str) -> str:  # a mark no later pattern matches: a private-use character
        marks.append(regex)
        return f"\0{chr(0xE000 + len(marks) - 1)}\0"

    text = shown.strip()
    for volatile, regex in _VOLATILE:
        text = volatile.sub(lambda _m, r=regex: hide(r), text)
    parts = re.split("\0(.)\0", text)
    out = "".join(marks[ord(p) - 0xE000] if i % 2 else re.escape(p) for i, p in enumerate(parts))
    return re.compile(re.sub(r"(\\ )+", r"\\s+", out))


def matches(shown: str, output: str) -> bool:
    """``output`` has the lines of ``shown``, in order; a shown ``...`` line skips any lines."""
    want = [line for line in shown.splitlines() if line.strip()]
    got = [line.strip() for line in output.splitlines() if line.strip()]

    def walk(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i].strip() in ("...", "…"):
            return any(walk(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and bool(pattern(want[i]).fullmatch(got[j])) and walk(i + 1, j + 1)

    return walk(0, 0)


def missing(message: str) -> None:
    if IN_CI:
        pytest.fail(f"{message} and CI=true")
    pytest.skip(message)


@pytest.fixture
def redis_url() -> Iterator[str]:
    try:
        server = RedisServer().start()
    except RuntimeError as exc:  # no redis-server binary
        missing(str(exc))
    try:
        yield server.url
    finally:
        server.close()


@pytest.mark.timeout(300)  # a fresh virtualenv and pip install: about 40 s, more on a loaded machine
def test_the_quickstart_runs_as_written(tmp_path: Path, redis_url: str) -> None:
    page = PAGE.read_text(encoding="utf-8")
    shown = blocks(page)
    files = _FILE.findall(page)
    assert {name for name, _ in files} >= {"proj.py", "quickstart_client.py"}, files
    for name, source in files:  # the files the page shows, under the names it gives them
        (tmp_path / name).write_text((ROOT / source).read_text(encoding="utf-8"), encoding="utf-8")
    (tmp_path / CLONE).symlink_to(ROOT, target_is_directory=True)

    steps = [(text, shown[i + 1][1] if i + 1 < len(shown) and shown[i + 1][0] == "text" else None)
             for i, (lang, text) in enumerate(shown) if lang == "sh"]
    install, output = steps[0]
    assert "pip install ./" + CLONE in install and output is None
    run = subprocess.run(["bash", "-ec", install], cwd=tmp_path, capture_output=True, text=True,
                         timeout=600)
    if run.returncode != 0:
        log = run.stdout + run.stderr
        if any(sign in log for sign in OFFLINE):
            missing(f"pip install could not reach a package index:\n{log[-2000:]}")
        pytest.fail(f"the install block failed:\n{log[-4000:]}")

    venv = tmp_path / ".venv"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "REDIS_URL")}
    env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               REDIS_URL=redis_url, PYTHONUNBUFFERED="1")
    commands: list[tuple[str, str | None]] = []  # each line of a block; the output shown after it: the last
    for text, output in steps[1:]:
        lines = [line for line in text.splitlines() if line.strip()]
        commands += [(line, output if i == len(lines) - 1 else None) for i, line in enumerate(lines)]
    assert any(WORKER.match(line) for line, _ in commands), "the page starts no worker"

    worker: subprocess.Popen[bytes] | None = None
    log_path = tmp_path / "worker.log"
    try:
        for line, output in commands:
            if WORKER.match(line):
                worker = start_worker(line, tmp_path, env, log_path)
                if output is not None:
                    log = [ln.split("] ", 1)[-1] for ln in log_path.read_text().splitlines()]
                    assert any(matches(output, ln) for ln in log), (output, "\n".join(log))
                continue
            assert worker is not None, f"{line!r} comes before the worker is started"
            if " singleflight ls" in line:  # the sync sent just before has started and reported
                wait_for_progress(redis_url, shown_key(commands))
            done = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, f"{line!r} exited {done.returncode}:\n{done.stdout}{done.stderr}"
            if output is not None:
                # the page says so: when the skipped call is noted after the watch began (a busy
                # machine), the watch shows it too, as one `duplicate skipped` line
                lines = done.stdout.splitlines()
                printed = "\n".join(ln for ln in lines if ln.strip() != "duplicate skipped")
                assert matches(output, printed), (
                    f"{line!r} printed:\n{done.stdout}\nthe page shows:\n{output}")
    finally:
        if worker is not None:
            stop(worker)


def shown_key(commands: list[tuple[str, str | None]]) -> str:
    """The key the page's ``show`` command looks at."""
    keys = [line.split(" singleflight show ", 1)[1].split()[0] for line, _ in commands
            if " singleflight show " in line]
    assert keys, "the page has no `celery -A proj singleflight show KEY` line"
    return keys[0]


def start_worker(line: str, cwd: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """The page's worker command line, in a process group of its own; wait until it is ready."""
    with log_path.open("wb") as log:
        worker = subprocess.Popen(["bash", "-c", f"exec {line}"], cwd=cwd, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while " ready." not in log_path.read_text():
        if worker.poll() is not None or time.monotonic() > deadline:
            stop(worker)
            pytest.fail(f"the worker did not start:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.1)  # the next look at the log
    return worker


def stop(worker: subprocess.Popen[bytes]) -> None:
    """Warm shutdown of the worker this test started (its process group), then SIGKILL."""
    if worker.poll() is None:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)


def wait_for_progress(redis_url: str, key: str) -> None:
    """Until a run holds ``key`` and has reported progress (read with the library under test)."""
    from celery import Celery

    import celery_singleflight as sf

    app = Celery("quickstart-probe", set_as_current=False)
    app.conf.singleflight_redis_url = f"{redis_url}/2"
    wait_for(lambda: (st := sf.status(app, key)) is not None and st.held and st.current, timeout=30)


def test_the_readme_quickstart_is_the_tested_one() -> None:
    """The README's short quickstart shows ``proj.py`` as the page has it, and only commands that
    the page runs (and so the test above)."""
    readme = blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    page_commands = {line.split("#")[0].strip() for lang, text in blocks(PAGE.read_text(encoding="utf-8"))
                     if lang == "sh" for line in text.splitlines()}
    proj = (ROOT / "docs" / "examples" / "proj.py").read_text(encoding="utf-8")
    body = proj.split('"""', 2)[2].strip()  # without the module docstring
    assert [text.strip() for lang, text in readme if lang == "python"] == [body]
    shown = [line.split("#")[0].strip() for lang, text in readme if lang == "sh"
             for line in text.splitlines() if line.strip() and not line.startswith(("make ", " "))]
    assert shown and set(shown) <= page_commands, set(shown) - page_commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q", "-p", "no:cacheprovider"]))
