"""The public test helpers (``celery_singleflight.testing``) leave nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from celery_singleflight.testing import RedisServer

from .conftest import TESTS, wait_for, worker_env


def _gone(pid: int) -> bool:
    """True once ``pid`` has exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux-only")
@pytest.mark.worker
def test_processes_started_by_a_killed_test_run_stop_with_it(redis_server: RedisServer) -> None:
    """Given a test process that started a private redis-server and a real worker, when it is
    SIGKILLed (no teardown runs), then both stop by themselves instead of living on."""
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(TESTS)!r})
        from celery_singleflight.testing import RedisServer, WorkerProcess
        server = RedisServer().start()
        worker = WorkerProcess("sfapp", concurrency=1, cwd={str(TESTS)!r}).start()
        print(server.proc.pid, worker.proc.pid, flush=True)
        time.sleep(120)
    """)
    env = worker_env(redis_server)
    runner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              env={**os.environ, **env}, cwd=str(TESTS))
    try:
        assert runner.stdout is not None
        line = runner.stdout.readline().decode()
        server_pid, worker_pid = (int(x) for x in line.split())
        assert not _gone(server_pid) and not _gone(worker_pid)
        runner.send_signal(signal.SIGKILL)
        runner.wait(timeout=10)
        wait_for(lambda: _gone(server_pid), timeout=10)
        wait_for(lambda: _gone(worker_pid), timeout=30)  # a warm shutdown of an idle worker
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait(timeout=10)
        if runner.stdout is not None:
            runner.stdout.close()
        for pid in locals().get("server_pid"), locals().get("worker_pid"):
            if isinstance(pid, int) and not _gone(pid):
                os.kill(pid, signal.SIGKILL)  # only the processes this test started


def test_a_server_whose_picked_port_was_taken_meanwhile_starts_on_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A port is free when it is picked and may be taken (by another test's process) before the
    server binds it: the server's first start then picks another. A port given is kept."""
    import socket

    from celery_singleflight.testing import free_port

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        picks = iter([busy, free_port()])
        monkeypatch.setattr(RedisServer, "fresh_port", classmethod(lambda cls: next(picks)))
        server = RedisServer()
        assert server.port == busy
        try:
            server.start()
            assert server.port != busy and server.client().ping()
        finally:
            server.close()
        with pytest.raises(RuntimeError, match=f"did not start on port {busy}"):
            RedisServer(port=busy).start()
