"""``celery -A sfapp singleflight ...`` run as a user runs it: a subprocess against a real worker.

Exit codes under test (see celery_singleflight.cli): 0 ok, 1 not held / aborted,
2 configuration error, 3 Redis unreachable, 4 watched run did not succeed, 5 watch timed out.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import pty
import re
import subprocess
import sys
import threading
from types import ModuleType
from typing import Any

import pytest

import celery_singleflight as sf
from celery_singleflight.connection.clients import redacted_url as redacted
from celery_singleflight.ops.cli import duration, progress_text, when
from celery_singleflight.testing import RedisServer, WorkerProcess, free_port

from .conftest import TESTS, open_gate, wait_for, worker_env

pytestmark = pytest.mark.worker


def cli_args(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "sfapp", "singleflight", *args]


def cli_env(redis_server: RedisServer, **extra: str) -> dict[str, str]:
    return {**os.environ, **worker_env(redis_server, **extra)}


def run_cli(
    redis_server: RedisServer, *args: str, input: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cli_args(*args), cwd=TESTS, env={**cli_env(redis_server), **(env or {})},
        capture_output=True, text=True, timeout=60, input=input,
    )


def start_cli(redis_server: RedisServer, *args: str) -> subprocess.Popen[str]:
    """The CLI in the background (for commands that follow a run)."""
    return subprocess.Popen(
        cli_args(*args), cwd=TESTS, env=cli_env(redis_server), stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def finish(proc: subprocess.Popen[str], timeout: float = 30) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def running(sfapp: ModuleType, key: str) -> sf.KeyStatus:
    """Wait until ``key`` is held and has reported progress."""
    return wait_for(  # type: ignore[no-any-return]
        lambda: (st := sf.status(sfapp.app, key)) is not None and st.held and st.current is not None and st,
        timeout=15,
    )


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


# -- formatting (no subprocess) --------------------------------------------------------------


def test_formatting_helpers() -> None:
    assert progress_text(3, 10, 30.0) == "3/10 30%"
    assert progress_text(2.5, None, None) == "2.5"
    assert progress_text(None, 10, None) == "-"
    assert [duration(s) for s in (None, 4.24, 185, 7620, 273600)] == ["-", "4.2s", "3m05s", "2h07m", "3d04h"]
    assert when(None) == "-"
    assert when(1000.0, now=1012.5).endswith("(12.5s ago)")
    assert redacted("redis://:secret@h:1/2") == "redis://:***@h:1/2"
    assert redacted("rediss://u:p@h/0?ssl_cert_reqs=none") == "rediss://u:***@h/0?ssl_cert_reqs=none"
    assert redacted("unix:///run/r.sock?db=2&password=zz") == "unix:///run/r.sock?db=2&password=***"
    assert redacted("redis://h:6379/2") == "redis://h:6379/2"
    assert redacted("redis://u:p%40ss@h:1/0") == "redis://u:***@h:1/0"
    assert redacted("redis://user@h:6379/0") == "redis://user@h:6379/0"
    assert redacted("rediss://:pw@h/0?PASSWORD=x") == "rediss://:***@h/0?PASSWORD=***"
    assert re.match(r"^19\d\d-\d\d-\d\dT\d\d:\d\d:\d\d\.000[+-]\d\d:\d\d \(in 2\.0s\)$", when(0.0, now=-2.0))


@pytest.mark.core
def test_help_lists_every_command_and_option(redis_server: RedisServer, sfapp: ModuleType) -> None:
    """The plugin is found through the celery.commands entry point, with help texts."""
    top = run_cli(redis_server, "--help")
    assert top.returncode == 0, top.stderr
    for command in ("ls", "show", "watch", "release"):
        assert re.search(rf"^\s+{command}\s+\S", top.stdout, re.MULTILINE), top.stdout
    watch = run_cli(redis_server, "watch", "--help")
    assert watch.returncode == 0
    assert "--timeout SECONDS" in watch.stdout and "--json" in watch.stdout and "exit 5" in watch.stdout


def following(redis_server: RedisServer, count: int) -> None:
    """Until ``count`` watchers follow a run live (each blocked in XREAD on its history)."""
    def blocked() -> bool:
        with contextlib.closing(redis_server.client()) as admin:
            clients = admin.client_list()
        return sum(c.get("cmd") == "xread" and "b" in c.get("flags", "") for c in clients) >= count
    wait_for(blocked, timeout=60, interval=0.05)


# -- ls ------------------------------------------------------------------------------------


def test_ls_lists_a_held_key(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    result = sfapp.sleeper.delay("cli-ls", 300)  # held until the gate opens, however slow the CLI
    wait_for(lambda: sfapp.recorder.get("pid:cli-ls"), timeout=15)
    key = "k:cli-ls"

    table = run_cli(redis_server, "ls")
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["KEY", "TASK", "ID", "TASK", "STATE", "PROGRESS", "AGE", "TTL"]
    row = next(r for r in rows if r.startswith(key + " "))
    assert result.id[:8] in row and "sfapp.sleeper" in row and "running" in row
    assert re.search(r"\s-\s+\d+\.\ds\s+\d+\.\ds$", row), row  # no progress; age; lease left

    listed = run_cli(redis_server, "ls", "--json")
    assert listed.returncode == 0, listed.stderr
    found = {item["key"]: item for item in json.loads(listed.stdout)}
    assert found[key]["task_id"] == result.id and found[key]["held"] is True
    assert 0 < found[key]["ttl_left"] <= 30

    kept = run_cli(redis_server, "ls", "--prefix", "k:cli-")
    assert kept.returncode == 0 and key in kept.stdout and result.id[:8] in kept.stdout
    dropped = run_cli(redis_server, "ls", "--prefix", "job:")
    assert dropped.returncode == 0
    assert key not in dropped.stdout and "no keys starting with 'job:' are held" in dropped.stdout
    dropped_json = run_cli(redis_server, "ls", "--prefix", "job:", "--json")
    assert dropped_json.returncode == 0 and json.loads(dropped_json.stdout) == []
    open_gate(redis_server, "gate:cli-ls")
    assert result.get(timeout=30) == "slept"


# -- show ----------------------------------------------------------------------------------


@pytest.mark.core
def test_show_a_running_then_ended_key_and_an_unknown_one(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    result = sfapp.reporting.delay("cli-show", 20, 5.0)  # each step until the gate opens
    key = sfapp.reporting.render_key("cli-show")
    assert key == "job:cli-show"
    running(sfapp, key)

    shown = run_cli(redis_server, "show", key)
    assert shown.returncode == 0, shown.stderr
    fields = dict(re.findall(r"^([a-z /]+):\s+(.*)$", shown.stdout, re.MULTILINE))
    assert fields["key"] == key and fields["held"] == "yes" and fields["state"] == "loading"
    assert fields["task id"] == result.id and fields["task name"] == "sfapp.reporting"
    assert re.fullmatch(r"\d+/20 \d+%", fields["progress"]), fields["progress"]
    assert re.fullmatch(r"step \d+", fields["message"])
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"
    assert re.fullmatch(iso + r" \(\d+\.\ds ago\)", fields["started"]), fields["started"]
    assert fields["ttl left"].endswith("s") and fields["ended"] == "-"

    as_json = run_cli(redis_server, "show", key, "--json")
    assert as_json.returncode == 0
    data = json.loads(as_json.stdout)
    assert data["held"] is True and data["task_id"] == result.id and data["total"] == 20

    unknown = run_cli(redis_server, "show", "job:nobody")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert "not held" in unknown.stderr and "Traceback" not in unknown.stderr

    open_gate(redis_server, "gate:cli-show")
    assert result.get(timeout=30) == 20
    ended = run_cli(redis_server, "show", key)
    assert ended.returncode == 1  # not held any more, but its outcome is still shown
    assert "held:        no (the run ended: succeeded)" in ended.stdout and "20/20 100%" in ended.stdout
    assert "not held" in ended.stderr and "succeeded" in ended.stderr


# -- watch ---------------------------------------------------------------------------------


def test_watch_json_and_plain_follow_a_run_to_its_end(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    # each step waits for the gate, which opens once both CLIs follow (however slow their starts)
    sfapp.reporting.delay("cli-watch", 24, 5.0)
    sfapp.reporting.delay("cli-plain", 24, 5.0)
    running(sfapp, "job:cli-watch")
    running(sfapp, "job:cli-plain")
    as_json = start_cli(redis_server, "watch", "job:cli-watch", "--json")
    plain = start_cli(redis_server, "watch", "job:cli-plain", "--timeout", "60")
    following(redis_server, 2)
    open_gate(redis_server, "gate:cli-watch")
    open_gate(redis_server, "gate:cli-plain")

    code, out, err = finish(as_json)
    assert code == 0, err
    events = json_lines(out)
    assert len(events) >= 3
    assert all(e["key"] == "job:cli-watch" for e in events)
    assert events[-1]["kind"] == "end" and events[-1]["state"] == "succeeded"
    progress = events[:-1]
    assert all(e["kind"] == "progress" for e in progress)
    currents = [e["current"] for e in progress]
    assert currents == sorted(set(currents)) and currents[-1] == 24  # strictly increasing, to the end
    assert progress[-1]["state"] == "finishing" and progress[0]["total"] == 24

    code, out, err = finish(plain)
    assert code == 0, err
    lines = out.splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3} progress loading \d+/24 \d+% step \d+", lines[0]), lines[0]
    assert lines[-2].endswith("progress finishing 24/24 100%")
    assert lines[-1].endswith(" end succeeded")
    assert "watching key job:cli-plain" in err


def test_watch_draws_a_progress_bar_on_a_terminal(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    sfapp.reporting.delay("cli-tty", 16, 5.0)  # each step until the gate opens, once the CLI follows
    running(sfapp, "job:cli-tty")
    master, replica = pty.openpty()
    env = {**cli_env(redis_server), "COLUMNS": "120", "TERM": "xterm"}
    proc = subprocess.Popen(
        cli_args("watch", "job:cli-tty"), cwd=TESTS, env=env, stdin=subprocess.DEVNULL,
        stdout=replica, stderr=subprocess.PIPE, text=True,
    )
    os.close(replica)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO once the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    following(redis_server, 1)
    open_gate(redis_server, "gate:cli-tty")
    try:
        code = proc.wait(timeout=30)
        reader.join(timeout=5)
    finally:
        os.close(master)
        assert proc.stderr is not None
        err = proc.stderr.read()
        proc.stderr.close()
    screen = b"".join(chunks).decode(errors="replace")
    assert code == 0, err
    assert "━" in screen and "16/16 100%" in screen  # rich's bar, filled at the end
    assert "succeeded" in screen


# -- release -------------------------------------------------------------------------------


def test_release_asks_then_forces_and_the_holder_loses_its_lease(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    # runs until the test opens its gate, however long the CLI starts take on a busy machine
    result = sfapp.sleeper.delay("cli-rel", 300)
    wait_for(lambda: sfapp.recorder.get("pid:cli-rel"), timeout=15)
    key = "k:cli-rel"
    record_key = sfapp.sleeper.render_key("cli-rel")
    assert record_key == key

    timed_out = run_cli(redis_server, "watch", key, "--timeout", "0.5")
    assert timed_out.returncode == 5 and "timed out" in timed_out.stderr
    watcher = start_cli(redis_server, "watch", key, "--json")

    declined = run_cli(redis_server, "release", key, input="n\n")
    assert declined.returncode == 1
    assert result.id in declined.stdout and "[y/N]" in declined.stdout and "aborted" in declined.stderr
    assert sfapp.sleeper.store.holder_record(key)["task_id"] == result.id  # still held

    no_input = run_cli(redis_server, "release", key, input="")  # end of input declines too
    assert no_input.returncode == 1 and "aborted" in no_input.stderr
    assert sfapp.sleeper.store.holder_record(key)["task_id"] == result.id

    forced = run_cli(redis_server, "release", key, "--force")
    assert forced.returncode == 0, forced.stderr
    assert result.id in forced.stdout and "[y/N]" not in forced.stdout
    assert sfapp.sleeper.store.holder_record(key) == {}
    st = sf.status(sfapp.app, key)
    assert st is not None and st.state == "force-released" and not st.held
    assert st.released_by is not None and st.released_by.endswith("(celery singleflight release)")

    # the watcher sees the end: not a success
    code, out, err = finish(watcher)
    assert code == 4, err
    end = json_lines(out)[-1]
    assert end["kind"] == "end" and end["state"] == "force-released"
    assert end["fields"]["by"] == st.released_by

    again = run_cli(redis_server, "release", key, "--force")
    assert again.returncode == 1 and "not held" in again.stderr and again.stdout == ""
    unknown = run_cli(redis_server, "release", "k:nobody", "--force", "--json")
    assert unknown.returncode == 1 and json.loads(unknown.stdout)["released"] is False

    # the running task finds out (heartbeat or its own release at the end) and says so
    wait_for(lambda: f"lease lost: key='{key}'" in shared_worker.log(), timeout=25, interval=0.2)
    open_gate(redis_server, "gate:cli-rel")
    assert result.get(timeout=25) == "slept"


def test_release_json_keeps_stdout_machine_readable(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    result = sfapp.sleeper.delay("cli-relj", 300)  # held until the gate opens
    wait_for(lambda: sfapp.recorder.get("pid:cli-relj"), timeout=15)
    released = run_cli(redis_server, "release", "k:cli-relj", "--json", input="y\n")
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout) == {
        "key": "k:cli-relj", "released": True, "task_id": result.id,
        "by": json.loads(released.stdout)["by"],
    }
    assert "[y/N]" in released.stderr and result.id in released.stderr
    open_gate(redis_server, "gate:cli-relj")
    assert result.get(timeout=30) == "slept"


# -- errors --------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("ls",), ("watch", "k:x"), ("release", "--force", "k:x")])
def test_redis_unreachable_is_one_line_and_exit_3(
    sfapp: ModuleType, redis_server: RedisServer, command: tuple[str, ...]
) -> None:
    nowhere = f"redis://127.0.0.1:{free_port()}/2"
    out = run_cli(redis_server, *command, env={"SF_TEST_LEASE_REDIS": nowhere})
    assert out.returncode == 3, out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Redis unreachable" in lines[0] and nowhere in lines[0]


def test_configuration_error_is_exit_2(sfapp: ModuleType, redis_server: RedisServer) -> None:
    out = run_cli(redis_server, "ls", env={"SF_TEST_LEASE_REDIS": "http://127.0.0.1/2"})
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "is not a Redis URL" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


# -- max_concurrency > 1: slots ------------------------------------------------------------


def test_watch_and_release_help_name_the_slot_options(redis_server: RedisServer, sfapp: ModuleType) -> None:
    top = run_cli(redis_server, "--help")
    assert top.returncode == 0 and re.search(r"6\s+several\s+slots", top.stdout), top.stdout
    for command in ("watch", "release"):
        shown = run_cli(redis_server, command, "--help")
        assert shown.returncode == 0, shown.stderr
        assert "--slot N" in shown.stdout and "--holder TASK_ID" in shown.stdout
        assert re.search(r"exit\s+6", shown.stdout), shown.stdout


def test_a_key_held_only_on_slot_1_is_shown_held(sfapp: ModuleType, redis_server: RedisServer) -> None:
    """Slot 0 of a max_concurrency=2 key is free (its run ended) while slot 1 is held: show, ls,
    watch and release see the slot-1 run instead of reporting the key free."""
    from celery_singleflight.protocol.replies import Holder

    store = sfapp.limited_two.store
    key = "lim:cli-slot1"
    first, second = "a" * 32, "b" * 32
    # leases of 300 s: four CLI starts on a loaded machine can outlast 30
    store.acquire(key, first, 300, Holder("run-first", "w@h", "sfapp.limited_two"), slots=2)
    got = store.acquire(key, second, 300, Holder("run-second", "w@h", "sfapp.limited_two"), slots=2)
    assert got.slot == 1  # type: ignore[union-attr]
    assert store.release(key, first)

    shown = run_cli(redis_server, "show", key)
    assert shown.returncode == 0, shown.stderr
    fields = dict(re.findall(r"^([a-z /]+):\s+(.*)$", shown.stdout, re.MULTILINE))
    assert fields["slot"] == "1" and fields["held"] == "yes" and fields["task id"] == "run-second"
    listed = run_cli(redis_server, "ls", "--json")
    rows = [(i["key"], i["slot"], i["task_id"]) for i in json.loads(listed.stdout)]
    assert rows == [(key, 1, "run-second")]
    timed_out = run_cli(redis_server, "watch", key, "--timeout", "0.5")
    assert timed_out.returncode == 5 and "(slot 1)" in timed_out.stderr
    released = run_cli(redis_server, "release", key, "--force", "--json")
    assert released.returncode == 0, released.stderr
    answer = json.loads(released.stdout)
    assert (answer["released"], answer["task_id"], answer["slot"]) == (True, "run-second", 1)
    assert store.holder_record(key, 1) == {}


# -- by the task's arguments ---------------------------------------------------------------


# about 15 s: nine runs of the CLI as a user runs it, each a process that imports Celery and the app
def test_show_watch_and_release_by_the_tasks_arguments(
    sfapp: ModuleType, shared_worker: WorkerProcess, redis_server: RedisServer
) -> None:
    """Given a running task, ``--task NAME ARGS...`` names its key by the arguments the task
    binds (positional or ``param=value``), as ``task.status(...)`` does in Python; a task that is
    not guarded, or arguments the task cannot bind, are configuration errors (exit 2)."""
    # runs until the test opens its gate, however long the CLI starts take on a busy machine
    result = sfapp.reporting.delay("cli-args", 48, 5.0)
    st = running(sfapp, "job:cli-args")
    by_args, by_name = sfapp.reporting.status("cli-args"), sfapp.reporting.status(name="cli-args")
    assert by_args is not None and by_name is not None
    assert by_args.key == by_name.key == "job:cli-args"
    assert by_args.task_id == by_name.task_id == st.task_id == result.id
    assert sfapp.reporting.status("cli-nobody") is None
    assert [s.task_id for s in sfapp.reporting.status_all("cli-args")] == [result.id]

    for words in (("cli-args",), ("name=cli-args",), ('"cli-args"',)):
        shown = run_cli(redis_server, "show", "--task", "sfapp.reporting", *words, "--json")
        assert shown.returncode == 0, (words, shown.stderr)
        assert json.loads(shown.stdout)["task_id"] == result.id

    watched = start_cli(redis_server, "watch", "--task", "sfapp.reporting", "cli-args", "--json")
    following(redis_server, 1)  # it follows the run live: let the run end
    open_gate(redis_server, "gate:cli-args")
    events = list(sfapp.reporting.watch("cli-args"))
    assert events[-1].kind == "end" and events[-1].state == "succeeded"
    code, out, err = finish(watched)
    assert code == 0, err
    assert json_lines(out)[-1]["state"] == "succeeded"

    unknown = run_cli(redis_server, "show", "--task", "sfapp.nothing_here", "x")
    assert unknown.returncode == 2 and "no SingleFlightTask named 'sfapp.nothing_here'" in unknown.stderr
    assert "sfapp.reporting" in unknown.stderr  # the guarded tasks are listed
    too_many = ["a"] * (len(inspect.signature(sfapp.reporting.run).parameters) + 1)  # more than it takes
    unbound = run_cli(redis_server, "show", "--task", "sfapp.reporting", *too_many)
    assert unbound.returncode == 2 and "Traceback" not in unbound.stderr
    neither = run_cli(redis_server, "show")
    assert neither.returncode == 2 and "--task NAME" in neither.stderr

    held = sfapp.reporting.delay("cli-args-rel", 40, 5.0)
    running(sfapp, "job:cli-args-rel")
    released = run_cli(redis_server, "release", "--task", "sfapp.reporting", "cli-args-rel", "--force",
                       "--json")
    assert released.returncode == 0, released.stderr
    assert json.loads(released.stdout)["task_id"] == held.id
    held.revoke(terminate=True)
