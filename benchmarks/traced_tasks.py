"""Instructions per task, counted by callgrind: a task run the way a prefork pool child runs it
(Celery's tracer, ``fast_trace_task``), and the redis-server's work for it.

Wall-clock rates and CPU seconds on a shared machine move by several per cent between runs;
instruction counts do not. ``bench_throughput.py --callgrind`` calls :func:`instructions_per_task`
for the variants that lock in the worker (plain, two PINGs, redis-py ``Lock``, SingleFlightTask,
and SingleFlightTask with metrics on):

- the pool child: this file run as a script under ``valgrind --tool=callgrind``, once with 100 and
  once with 400 tasks; the difference divided by 300 is one task's cost (start-up, imports and the
  warm-up cancel out);
- the redis-server: a private server under callgrind, its counters zeroed before and dumped after
  each of those two runs, the same difference.

The worker's main process (which receives the messages and hands them to the pool) is not in
these counts: it does the same for every variant.

    .venv/bin/python benchmarks/traced_tasks.py VARIANT TASKS REDIS_URL   # the counted child
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import redis
from benchutil import CallgrindServer, import_app
from celery.app.trace import build_tracer, fast_trace_task, setup_worker_optimizations

from celery_singleflight.metrics.exporter import start_worker_metrics
from celery_singleflight.protocol.store import SCRIPTS

HERE = Path(__file__).resolve().parent
TRACED = ("plain", "two_pings", "redis_lock", "singleflight", "singleflight_metrics")
WARMUP = 30  # tasks run before the counted ones, in every child
FEW, MANY = 100, 400


def run_traced(variant: str, tasks: int, url: str) -> None:
    """Run ``WARMUP + tasks`` tasks of ``variant`` through Celery's tracer, as a pool child does."""
    metrics_dir = tempfile.mkdtemp(prefix="sftr-metrics-") if variant == "singleflight_metrics" else ""
    ta, _ = import_app("throughputapp", {
        "SF_TP_BROKER": f"{url}/0", "SF_TP_LOCKS": f"{url}/1", "SF_TP_RECORDER": f"{url}/2",
        "SF_TP_PREFIX": f"sftr-{uuid.uuid4().hex[:8]}", "SF_TP_METRICS_DIR": metrics_dir,
    })
    app = ta.app
    if metrics_dir:  # as a worker's main process does before its pool forks
        start_worker_metrics(app)
    setup_worker_optimizations(app, "celery@bench")
    task = ta.TASKS[variant]
    task.__trace__ = build_tracer(task.name, task, app.loader, "celery@bench", app=app)
    round_id = uuid.uuid4().hex[:8]
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    for i in range(WARMUP + tasks):
        task_id = str(uuid.uuid4())
        body = json.dumps([[i, round_id, 10**9], {}, embed])  # the target is never reached
        request = {
            "lang": "py", "task": task.name, "id": task_id, "root_id": task_id, "parent_id": None,
            "group": None, "retries": 0, "eta": None, "expires": None, "timelimit": [None, None],
            "ignore_result": True, "origin": "bench@host", "reply_to": "", "correlation_id": task_id,
            "delivery_info": {"exchange": "", "routing_key": "bench", "priority": 0, "redelivered": False},
        }
        failed, _, _ = fast_trace_task(task.name, task_id, request, body, "application/json", "utf-8")
        if failed:
            raise RuntimeError(f"{variant} task {i} failed")
    if metrics_dir:
        shutil.rmtree(metrics_dir, ignore_errors=True)


def child_instructions(variant: str, tasks: int, url: str, out_dir: Path) -> int:
    """Instructions of one run of this file as a script (``run_traced``) under callgrind."""
    done = subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_dir}/out.%p", sys.executable, __file__,
         variant, str(tasks), url],
        capture_output=True, text=True, check=True, cwd=HERE,
        env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts in every run
    )
    found = re.search(r"Collected : (\d+)", done.stderr)
    if found is None:
        raise RuntimeError(f"callgrind printed no total: {done.stderr[-500:]}")
    return int(found.group(1))


def instructions_per_task() -> dict[str, tuple[int, int]]:
    """``variant -> (pool child, redis-server)`` instructions per task; empty without valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind not found: no instruction counts")
        return {}
    counts: dict[str, tuple[int, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server_dir, child_dir = Path(tmp, "server"), Path(tmp, "child")
        server_dir.mkdir()
        child_dir.mkdir()
        server = CallgrindServer(str(server_dir)).start(timeout=120)
        try:
            client = redis.Redis.from_url(f"{server.url}/1")
            for source in (script.source for script in SCRIPTS):  # loaded once, so no child run pays for it
                client.script_load(source)
            lock = client.lock("sftr-preload", timeout=5)  # redis-py registers its release script
            lock.acquire()
            lock.release()
            client.close()
            for variant in TRACED:
                child: list[int] = []
                served: list[int] = []
                for tasks in (FEW, MANY):
                    server.zero()
                    child.append(child_instructions(variant, tasks, server.url, child_dir))
                    served.append(server.counted())
                span = MANY - FEW
                counts[variant] = ((child[1] - child[0]) // span, (served[1] - served[0]) // span)
                print(f"  {variant}: {counts[variant][0]:,} instructions per task in the pool child, "
                      f"{counts[variant][1]:,} in the redis-server", flush=True)
        finally:
            server.close()
    return counts


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    run_traced(sys.argv[1], int(sys.argv[2]), sys.argv[3])
