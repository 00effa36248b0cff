"""The Celery app ``benchmarks/bench_fair.py`` runs in real workers (and dispatches from).

Every task has the same shape, ``(tenant, n, lock, sent, run)``, and the same body: note
``time.time()`` as its first statement (``started``), sleep ``SF_BENCH_SLEEP`` seconds (20 ms),
then RPUSH one line ``"tenant n sent started finished pid parked"`` to the recorder list of its
measurement (``record_key(run)``); ``parked`` is, for a fair task's run that waited at its gate,
when it was parked there (the library's ``HEADER_FAIR_WAITED`` header on the re-sent message), else
``-``. ``sent`` is ``time.time()`` in the benchmark's process just
before the message was sent, passed as an argument, so no result backend is needed (results are
ignored). One host, one clock.

- ``plain_job``: a plain Celery task (no lease; ``lock`` is ignored): the baseline;
- ``fair_unique``: ``SingleFlightTask``, ``lock_key="<lock>"`` (the benchmark gives each run its
  own key, ``job:<tenant>-<n>``), ``fair_key="<tenant>"``, ``fair_concurrency=SF_BENCH_FAIR_N``,
  default ``on_duplicate``;
- ``fair_spread``: the same with ``on_duplicate="queue"``, for tenant A's runs spread over 200 lock
  keys (``acct:<n % 200>``): a run whose key is busy parks in the key's FIFO instead of being
  dropped as a duplicate, so every run still runs once.

The fair-share options are new: when ``SingleFlightTask`` does not know them (they are not among
its option names, or defining the task raises), the two fair tasks are not defined and
``FAIR_PROBLEM`` says why; ``plain_job`` works either way.

Configuration comes from the environment (set by the benchmark before the workers start):
``SF_BENCH_BROKER`` (broker URL), ``SF_BENCH_LEASES`` (Redis URL of the leases),
``SF_BENCH_RECORDER`` (Redis URL of the recorder), ``SF_BENCH_PREFIX`` (every Redis key this app
writes starts with it: lease namespace, recorder keys, and a Redis broker's keys when
``SF_BENCH_BROKER_PREFIX=1``, via kombu's ``global_keyprefix``), ``SF_BENCH_QUEUE`` (the dedicated
queue), ``SF_BENCH_SLEEP`` (seconds each run sleeps), ``SF_BENCH_FAIR_N`` (``fair_concurrency``),
``SF_BENCH_PREFETCH`` (``worker_prefetch_multiplier``), ``SF_BENCH_SIDE`` (``plain``: the fair tasks
are not defined, so a plain side's worker is pure Celery, without the library's worker bootstep).
The benchmark's throwaway Redis has no append-only file, so ``singleflight_require_persistence``
is off (no start-up warning about parked runs a Redis restart would lose).
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_singleflight import SingleFlightTask

PREFIX = os.environ.get("SF_BENCH_PREFIX", "sfbench-fair")
BROKER = os.environ.get("SF_BENCH_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
LEASES = os.environ.get("SF_BENCH_LEASES", "redis://127.0.0.1:6379/2")
RECORDER = os.environ.get("SF_BENCH_RECORDER", "redis://127.0.0.1:6379/3")
QUEUE = os.environ.get("SF_BENCH_QUEUE", f"{PREFIX}-queue")
SLEEP = float(os.environ.get("SF_BENCH_SLEEP", "0.02"))
FAIR_N = int(os.environ.get("SF_BENCH_FAIR_N", "4"))
PREFETCH = int(os.environ.get("SF_BENCH_PREFETCH", "1"))
FAIR_OPTIONS = ("fair_key", "fair_concurrency")

transport_options: dict[str, Any] = {}
if os.environ.get("SF_BENCH_BROKER_PREFIX") == "1":
    transport_options["global_keyprefix"] = f"{PREFIX}:kombu:"

app = Celery("fairapp", broker=BROKER)
app.conf.update(
    singleflight_redis_url=LEASES,
    singleflight_namespace=PREFIX,
    task_default_queue=QUEUE,
    task_ignore_result=True,
    worker_prefetch_multiplier=PREFETCH,
    broker_transport_options=transport_options,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    # the benchmark's Redis is a throwaway one without an append-only file: no warning about it
    singleflight_require_persistence="off",
)

recorder = redis.Redis.from_url(RECORDER)


def record_key(run: str) -> str:
    """The recorder list of one measurement: one line per run of a task."""
    return f"{PREFIX}:rec:{run}"


def _body(tenant: str, n: int, sent: float, run: str, parked: float | None = None) -> None:
    started = time.time()
    time.sleep(SLEEP)
    finished = time.time()
    recorder.rpush(record_key(run), f"{tenant} {n} {sent!r} {started!r} {finished!r} {os.getpid()} "
                                    f"{'-' if parked is None else repr(parked)}")


def _parked_at(task: Any) -> float | None:
    """When the run was parked at its fair gate (the library's header on the re-sent message), if it was."""
    try:
        from celery_singleflight.run.messages import HEADER_FAIR_WAITED, header
    except ImportError:  # an internal of the library: the diagnostic is optional
        return None
    value = header(task.request, HEADER_FAIR_WAITED)
    try:
        return float(value) if value else None
    except (TypeError, ValueError):
        return None


@app.task(name="fairapp.plain_job")
def plain_job(tenant: str, n: int, lock: str, sent: float, run: str) -> None:
    _body(tenant, n, sent, run)


def _fair_problem() -> str | None:
    try:
        from celery_singleflight.config.options import task_option_names
    except ImportError as exc:  # pragma: no cover - the library moved it
        return f"cannot list SingleFlightTask's options: {exc}"
    missing = [name for name in FAIR_OPTIONS if name not in task_option_names()]
    if missing:
        return f"SingleFlightTask has no option {' or '.join(missing)} (Celery would ignore it)"
    return None


# the plain side's workers load no SingleFlightTask at all (no worker bootstep, no sweeper): pure Celery
PLAIN_ONLY = os.environ.get("SF_BENCH_SIDE") == "plain"
FAIR_PROBLEM = "not loaded (SF_BENCH_SIDE=plain)" if PLAIN_ONLY else _fair_problem()
fair_unique: Any = None
fair_spread: Any = None

if FAIR_PROBLEM is None:
    try:

        @app.task(bind=True, name="fairapp.fair_unique", base=SingleFlightTask, lock_key="<lock>",
                  fair_key="<tenant>", fair_concurrency=FAIR_N)
        def _fair_unique(self: Any, tenant: str, n: int, lock: str, sent: float, run: str) -> None:
            _body(tenant, n, sent, run, _parked_at(self))

        @app.task(bind=True, name="fairapp.fair_spread", base=SingleFlightTask, lock_key="<lock>",
                  fair_key="<tenant>", fair_concurrency=FAIR_N, on_duplicate="queue")
        def _fair_spread(self: Any, tenant: str, n: int, lock: str, sent: float, run: str) -> None:
            _body(tenant, n, sent, run, _parked_at(self))

        # @app.task is lazy: build the task classes now, so a rejected option shows here
        fair_unique = _fair_unique._get_current_object()
        fair_spread = _fair_spread._get_current_object()
    except Exception as exc:  # noqa: BLE001 - any refusal means "not available", said in the report
        FAIR_PROBLEM = f"SingleFlightTask refused the fair-share options: {type(exc).__name__}: {exc}"
        fair_unique = fair_spread = None
