"""The Celery app the integration tests run in real worker subprocesses.

Redis comes from ``SF_TEST_REDIS`` (a private server started by the tests): broker db 0,
results db 1, leases db 2, and the independent run recorder db 3.
"""

from __future__ import annotations

import json
import os
import time

import redis
from celery import Celery
from celery.exceptions import Ignore, Reject

from celery_singleflight import SingleFlightTask
from tests.gates import hold, waiting_at

BASE = os.environ.get("SF_TEST_REDIS", "redis://127.0.0.1:6379")
BROKER = os.environ.get("SF_TEST_BROKER", f"{BASE}/0")

app = Celery("sfapp", broker=BROKER, backend=f"{BASE}/1")
app.conf.update(
    singleflight_redis_url=os.environ.get("SF_TEST_LEASE_REDIS", f"{BASE}/2"),
    # TLS files, a Sentinel's master_name (the Cluster, TLS and Sentinel tests)
    singleflight_redis_transport_options=json.loads(os.environ.get("SF_TEST_LEASE_OPTIONS", "null")),
    singleflight_redis_retry_delay=float(os.environ.get("SF_TEST_REDIS_RETRY", "5")),
    singleflight_ttl=float(os.environ.get("SF_TEST_TTL", "30")),
    task_acks_late=os.environ.get("SF_TEST_ACKS_LATE") == "1",
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=600,
    # the metrics tests: counting on, served from the worker (tests/test_metrics.py)
    singleflight_metrics=os.environ.get("SF_TEST_METRICS_PORT") is not None,
    singleflight_metrics_port=int(os.environ.get("SF_TEST_METRICS_PORT") or 0) or None,
    singleflight_metrics_dir=os.environ.get("SF_TEST_METRICS_DIR"),
)

recorder = redis.Redis.from_url(f"{BASE}/3")


def record_run(name: str, key: str, seconds: float) -> None:
    """The independent recorder: counts concurrent runs per key without the library."""
    task_id = app.current_task.request.id if app.current_task else "?"
    if recorder.incr(f"active:{key}") > 1:
        recorder.rpush("overlaps", f"{name}:{key}:{task_id}")
    recorder.rpush(f"runs:{key}", task_id)
    recorder.rpush("runs", f"{name}:{key}:{task_id}")
    try:
        hold(recorder, seconds, f"gate:{key}")  # a test that must outlast the run opens its gate when done
    finally:
        recorder.decr(f"active:{key}")


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_duplicate="raise")
def hold_raise(self, key, seconds=0.2):
    record_run("raise", key, seconds)
    return {"fence": self.lease.fence, "key": key}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_duplicate="skip")
def hold_skip(self, key, seconds=0.2):
    record_run("skip", key, seconds)
    return {"fence": self.lease.fence, "key": key}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_duplicate="retry", max_wait=120)
def hold_retry(self, key, seconds=0.2):
    record_run("retry", key, seconds)
    return {"fence": self.lease.fence, "key": key}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_duplicate="retry", max_wait=0.5)
def hold_retry_short(self, key, seconds=0.2):
    record_run("retry_short", key, seconds)
    return "ran"


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_duplicate="retry", max_wait=60,
          retry_backoff=0.6, retry_backoff_max=0.6, retry_jitter=False)
def hold_retry_tuned(self, key, seconds=0.2):
    record_run("retry_tuned", key, seconds)
    return {"fence": self.lease.fence, "key": key}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", max_retries=1)
def retry_once(self, key):
    recorder.rpush(f"attempts:{key}", self.request.retries)
    if self.request.retries == 0:
        raise self.retry(countdown=0)
    return self.request.retries


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>")
def fails(self, key):
    raise ValueError(f"boom {key}")


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>")
def ignores(self, key):
    raise Ignore()


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>")
def rejects(self, key):
    raise Reject("no thanks", requeue=False)


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", soft_time_limit=0.5)
def soft_limited(self, key):
    time.sleep(5)


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", time_limit=1)
def hard_limited(self, key):
    time.sleep(30)


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>")
def sleeper(self, key, seconds=30.0):
    recorder.set(f"pid:{key}", os.getpid())
    recorder.rpush(f"runs:{key}", self.request.id)
    hold(recorder, seconds, f"gate:{key}")
    return "slept"


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", lock_ttl=1.5)
def heartbeat_check(self, key, seconds=4.5):
    """Runs 3x its TTL; reports whether its lease stayed ours the whole time."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.1)
        if self.lease.lost:
            break
    return {"lost": self.lease.lost, "fence": self.lease.fence}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", lock_ttl=1.5)
def loses_lease(self, key):
    """Waits until its lease is deleted behind its back and then checks it."""
    recorder.set(f"started:{key}", 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not self.lease.lost:
        time.sleep(0.05)
    try:
        self.lease.check()
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        return {"lost": True, "error": type(exc).__name__, "message": str(exc)}
    return {"lost": False}


@app.task(bind=True, base=SingleFlightTask, lock_key="k:<key>", on_redis_error="fail_open")
def open_on_error(self, key):
    return "ran"


@app.task(base=SingleFlightTask, lock_key="plain:<x>")
def plain(x, y=1):
    """Not bound: the key is built from the function's own signature."""
    return [x, y]


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>", progress_rate=20)
def reporting(self, name, steps=5, pause=0.2, first=None, at=0):
    """Reports progress step by step; watched by the tests. ``first``: how long step ``at`` (step 0
    unless given) holds at most instead, until the gate ``gate:<name>:first`` opens (a test reads
    the run before it goes on); the other steps keep their pace (``gate:<name>`` would end them at
    once)."""
    for i in range(steps):
        self.progress("loading", current=i, total=steps, message=f"step {i}", name=name)
        if i == at and first is not None:
            hold(recorder, first, f"gate:{name}:first")
        else:
            hold(recorder, pause, f"gate:{name}")
    self.progress("finishing", current=steps, total=steps)
    return steps


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>", progress_rate=5)
def chatty(self, name, calls=1000):
    """Calls progress in a tight loop: the throttle keeps writes near the rate."""
    for i in range(calls):
        self.progress("working", current=i + 1, total=calls)
    return self.lease.reporter.writes


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>", status_include_args=True)
def with_args(self, name, secret="s3cr3t"):
    self.progress("working")
    return "ok"


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>")
def without_args(self, name, secret="s3cr3t"):
    self.progress("working")
    return "ok"


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>")
def fails_after_progress(self, name):
    self.progress("working", current=1, total=2)
    raise RuntimeError("halfway")


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>")
def bad_progress(self, name, case):
    """Calls progress() wrongly; returns the error it got."""
    try:
        if case == "negative":
            self.progress("x", current=-1)
        elif case == "inconsistent":
            self.progress("x", current=5, total=3)
        elif case == "not-json":
            self.progress("x", when=object())
        elif case == "too-big":
            self.progress("x", blob="y" * 100_000)
        elif case == "empty-state":
            self.progress("")
    except Exception as exc:  # noqa: BLE001 - reported back to the test
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"error": None}


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>", lock_ttl=1.5)
def progress_after_loss(self, name):
    """Keeps reporting until its lease is deleted behind its back, then reports the error."""
    recorder.set(f"started:{name}", 1)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            self.progress("working")
        except Exception as exc:  # noqa: BLE001 - reported back to the test
            return {"error": type(exc).__name__}
        time.sleep(0.1)
    return {"error": None}


@app.task(bind=True, base=SingleFlightTask, lock_key="job:<name>", on_duplicate="skip")
def reporting_skip(self, name, steps=5, pause=0.2):
    """Same key as `reporting`, skip policy: a duplicate of a reporting run."""
    return "ran"


@app.task(bind=True, base=SingleFlightTask, lock_key="q:<key>", on_duplicate="queue")
def queued(self, key, n, seconds=0.02):
    """Queue policy: records the order in which runs on a key happen."""
    recorder.rpush(f"started:{key}", time.time())
    record_run("queue", key, seconds)
    recorder.rpush(f"order:{key}", n)
    recorder.rpush(f"retries:{key}", self.request.retries)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="q:<key>", on_duplicate="queue", max_queued=2)
def queued_bounded(self, key, n, seconds=0.02):
    record_run("queue", key, seconds)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="q:<key>", on_duplicate="queue")
def queued_sleeper(self, key, seconds=30.0):
    """Queue policy holder the tests kill (it stays out of the overlap recorder: a killed run
    cannot record its own end)."""
    recorder.set(f"pid:{key}", os.getpid())
    time.sleep(seconds)
    return "slept"


@app.task(bind=True, base=SingleFlightTask, lock_key="j:<key>", on_duplicate="join")
def joined(self, key, value, seconds=1.0, fail=False):
    """Join policy: duplicates get this run's result (or its error)."""
    record_run("join", key, seconds)
    if fail:
        raise ValueError(f"holder failed on {key}")
    return {"value": value, "ran": self.request.id}


@app.task(bind=True, base=SingleFlightTask, lock_key="j:<key>", on_duplicate="join")
def joined_sleeper(self, key, seconds=30.0):
    recorder.set(f"pid:{key}", os.getpid())
    time.sleep(seconds)
    return "slept"


@app.task
def add_one(result):
    """A plain chain link after a joined run."""
    return {"after": result}


@app.task(bind=True, base=SingleFlightTask, lock_key="conv:<tenant>", on_duplicate="queue",
          idempotency_key="msg:<tenant>:<message_id>", idempotency_ttl=30)
def handle_message(self, tenant, message_id, seconds=0.3):
    """A chat bot's handler: one run per message id; messages of a conversation one at a time."""
    record_run("idem", f"{tenant}:{message_id}", seconds)
    return {"reply": f"handled {message_id}", "ran": self.request.id}


@app.task(bind=True, base=SingleFlightTask, lock_key="conv:<tenant>", on_duplicate="queue",
          idempotency_key="short:<tenant>:<message_id>", idempotency_ttl=1)
def handle_short_window(self, tenant, message_id):
    record_run("idem-short", f"{tenant}:{message_id}", 0.01)
    return {"ran": self.request.id}


@app.task(bind=True, base=SingleFlightTask, lock_key="acct:<account>", dedup_enqueue=True)
def deduped(self, account, seconds=0.2):
    """Enqueue-time dedup: a second delay() while this one is queued or running is not sent."""
    record_run("dedup", account, seconds)
    return self.request.id


def record_limited(key, limit, seconds):
    """Independent recorder for a per-key limit: counts runs at once without the library."""
    task_id = app.current_task.request.id if app.current_task else "?"
    now = recorder.incr(f"active:{key}")
    recorder.rpush(f"concurrent:{key}", now)
    if now > limit:
        recorder.rpush("overlaps", f"limit:{key}:{task_id}")
    recorder.rpush(f"runs:{key}", task_id)
    try:
        hold(recorder, seconds, f"gate:{key}")
    finally:
        recorder.decr(f"active:{key}")


@app.task(bind=True, base=SingleFlightTask, lock_key="lim:<key>", max_concurrency=3, on_duplicate="queue")
def limited(self, key, seconds=0.2):
    """At most 3 runs per key at once; the rest wait in the queue."""
    record_limited(key, 3, seconds)
    return self.lease.slot


@app.task(bind=True, base=SingleFlightTask, lock_key="lim:<key>", max_concurrency=2,
          on_duplicate="retry", max_wait=60)
def limited_two(self, key, seconds=0.2):
    recorder.set(f"pid:{key}:{self.request.id}", os.getpid())
    record_limited(key, 2, seconds)
    return self.lease.slot


# -- canvas (tests/test_canvas.py): plain links, chord bodies and errbacks that record what they got --


@app.task
def canvas_seen(value, tag="seen"):
    """A plain chain link: records the value it received (as JSON) under ``seen:<tag>``."""
    import json

    recorder.rpush(f"seen:{tag}", json.dumps(value))
    recorder.rpush("runs", f"seen:{tag}")
    return {"seen": value}


@app.task
def canvas_collect(results, tag="collect"):
    """A plain chord body: records the header's results (as JSON) under ``collected:<tag>``."""
    import json

    recorder.rpush(f"collected:{tag}", json.dumps(results))
    recorder.rpush("runs", f"collect:{tag}")
    return results


@app.task
def canvas_errback(request, exc, traceback):
    """A new-style errback (``link_error``): records which task failed and with what."""
    import json

    recorder.rpush("canvas:errors", json.dumps({"id": request.id, "error": type(exc).__name__}))


@app.task
def canvas_errback_old(task_id):
    """An old-style errback (one argument: the failed task's id)."""
    recorder.rpush("canvas:errors_old", task_id)


# -- the release-path matrix: one key, a deduplicated holder, a parked run and a joined run ---------


@app.task(bind=True, base=SingleFlightTask, lock_key="mx:<key>", on_duplicate="queue", dedup_enqueue=True,
          max_retries=1)
def mx_holder(self, key, mode="succeed", seconds=1.5):
    """Works ``seconds``, or less once the test opens its gate: ``gate:<key>``, and a retry's
    attempt ``gate:<key>:retry`` (the first attempt's open gate does not end it)."""
    recorder.set(f"pid:{key}", os.getpid())
    recorder.rpush(f"runs:{key}", f"holder:{self.request.id}")
    hold(recorder, seconds, f"gate:{key}:retry" if self.request.retries else f"gate:{key}")
    if mode == "retry" and self.request.retries == 0:
        raise self.retry(countdown=2.0)
    if mode == "fail":
        raise ValueError(f"mx {key} failed")
    return {"ran": self.request.id, "mode": mode}


@app.task(bind=True, base=SingleFlightTask, lock_key="mx:<key>", on_duplicate="queue", dedup_enqueue=True,
          time_limit=1.5)
def mx_time_limited(self, key):
    recorder.set(f"pid:{key}", os.getpid())
    recorder.rpush(f"runs:{key}", f"holder:{self.request.id}")
    time.sleep(30)


@app.task(bind=True, base=SingleFlightTask, lock_key="mx:<key>", on_duplicate="queue")
def mx_queued(self, key):
    recorder.rpush(f"runs:{key}", f"queued:{self.request.id}")
    time.sleep(0.3)
    return "queued-ran"


@app.task(bind=True, base=SingleFlightTask, lock_key="mx:<key>", on_duplicate="join")
def mx_joiner(self, key):
    recorder.rpush(f"runs:{key}", f"joiner:{self.request.id}")
    return "joiner-ran"


# -- coalesce (newest pending wins) ---------------------------------------------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="co:<key>", on_duplicate="coalesce")
def coalesced(self, key, payload, seconds=0.05):
    """Coalesce policy: records which payloads ran, in order."""
    record_run("coalesce", key, seconds)
    recorder.rpush(f"payloads:{key}", payload)
    return payload


@app.task(bind=True, base=SingleFlightTask, lock_key="co:<key>", on_duplicate="coalesce",
          coalesce_keep="first")
def coalesced_first(self, key, payload, seconds=0.05):
    record_run("coalesce", key, seconds)
    recorder.rpush(f"payloads:{key}", payload)
    return payload


# -- supersede (newest wins) ----------------------------------------------------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="sup:<key>", on_duplicate="supersede", lock_ttl=3,
          supersede_grace=2.0)
def superseding(self, key, n, seconds=0.05, checks=True):
    """Supersede policy: runs ``seconds`` (less once the test opens the gate ``gate:<key>``),
    checking its lease every 50 ms if ``checks``; records when it started, when it first saw
    ``self.lease.superseded``, and whether it completed. Its last act is a fenced write of ``n``
    (refused once a newer holder wrote)."""
    from celery_singleflight import fencing

    recorder.rpush(f"started:{key}", n)
    recorder.set(f"pid:{key}:{n}", os.getpid())
    recorder.set(f"fence:{key}:{n}", self.lease.fence)
    deadline = time.time() + seconds
    seen = False
    mark = ""
    while time.time() < deadline and not recorder.exists(f"gate:{key}"):
        mark = waiting_at(recorder, f"gate:{key}")
        if self.lease.superseded and not seen:
            seen = True
            recorder.set(f"seen:{key}:{n}", time.time())
        if checks:
            self.lease.check()
        time.sleep(0.05)
    if mark:
        recorder.delete(mark)
    written = fencing.fenced_set(recorder, f"fenced:{key}", str(n), self.lease.fence)
    recorder.rpush(f"done:{key}", n)
    return {"n": n, "fence": self.lease.fence, "written": written}


@app.task(bind=True, base=SingleFlightTask, lock_key="told:<key>", on_duplicate="supersede",
          supersede_grace=30.0)
def told_at_once(self, key, n, seconds=0.05):
    """Supersede with the default lease TTL (30 s: a renewal every 10 s): checks its lease every
    10 ms and records when ``check()`` first raised (``raised:<key>:<n>``) and why, or that it
    completed. Only a push tells it within a second."""
    recorder.rpush(f"started:{key}", n)
    recorder.set(f"began:{key}:{n}", time.time())
    deadline = time.time() + seconds
    try:
        while time.time() < deadline:
            self.lease.check()
            time.sleep(0.01)
    except Exception as exc:
        recorder.set(f"raised:{key}:{n}", time.time())
        recorder.set(f"why:{key}:{n}", type(exc).__name__)
        raise
    recorder.rpush(f"done:{key}", n)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="told:<key>", on_duplicate="supersede",
          supersede_grace=0)
def revoked_at_once(self, key, n, seconds=0.05):
    """Supersede with no grace: a holder that never checks is revoked as soon as it is superseded."""
    recorder.rpush(f"started:{key}", n)
    time.sleep(seconds)
    recorder.rpush(f"done:{key}", n)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="told:<key>", on_duplicate="supersede",
          supersede_grace=30.0)
def waits_superseded(self, key, n, seconds=0.05):
    """A body that blocks: ``wait_superseded`` instead of a loop of checks."""
    recorder.rpush(f"started:{key}", n)
    if self.lease.wait_superseded(seconds):
        recorder.set(f"raised:{key}:{n}", time.time())
        self.lease.check()
    recorder.rpush(f"done:{key}", n)
    return n


# -- ordered queue (strict send order) ------------------------------------------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="ord:<key>", on_duplicate="queue", ordered=True,
          order_timeout=60.0)
def ordered_run(self, key, n, seconds=0.002):
    """Ordered queue policy: records the order in which runs on a key start."""
    recorder.rpush(f"order:{key}", n)
    record_run("ordered", key, seconds)
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="ordgap:<key>", on_duplicate="queue", ordered=True,
          order_timeout=2.0)
def ordered_gap(self, key, n, seconds=0.002):
    """As ordered_run, with a short order_timeout (each key keeps its own)."""
    recorder.rpush(f"order:{key}", n)
    record_run("ordered", key, seconds)
    return n


# -- the release-path matrix of the coalesce, supersede and ordered policies -----------------


def _pm_run(key, n, seconds):
    recorder.set(f"pid:{key}", os.getpid())
    recorder.rpush(f"pm:{key}", n)
    hold(recorder, seconds, f"gate:{key}")  # a holder the test must outlast holds until it opens the gate
    return n


@app.task(bind=True, base=SingleFlightTask, lock_key="pm:<key>", on_duplicate="coalesce")
def pm_coalesce(self, key, n, seconds=0.05):
    return _pm_run(key, n, seconds)


@app.task(bind=True, base=SingleFlightTask, lock_key="pm:<key>", on_duplicate="supersede",
          supersede_grace=30.0)
def pm_supersede(self, key, n, seconds=0.05):
    return _pm_run(key, n, seconds)


@app.task(bind=True, base=SingleFlightTask, lock_key="pm:<key>", on_duplicate="queue", ordered=True,
          order_timeout=30.0)
def pm_ordered(self, key, n, seconds=0.05):
    return _pm_run(key, n, seconds)


@app.task(bind=True, base=SingleFlightTask, lock_key="ordidem:<key>", on_duplicate="queue", ordered=True,
          order_timeout=60.0, idempotency_key="ordidem:<key>:<msg>")
def ordered_idem(self, key, msg, n):
    """Ordered, with an idempotency key: a repeated message returns the remembered result."""
    recorder.rpush(f"order:{key}", n)
    return n


def record_fair(tenant: str, n: int, seconds: float, until: str | None = None) -> None:
    """Fair share: records each start (tenant, n, time) and the most runs at once, without the library.
    ``until``: a recorder key that ends the run early once set (a test's own pace, not a guess)."""
    running = recorder.incr("fair:running")
    recorder.rpush("fair:max", running)
    recorder.rpush("fair:started", f"{tenant}:{n}:{time.time()}")
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (until and recorder.get(until)):
            time.sleep(min(0.05, seconds))
    finally:
        recorder.decr("fair:running")


@app.task(bind=True, base=SingleFlightTask, lock_key="fj:<tenant>:<n>", fair_key="<tenant>",
          fair_concurrency=2, fair_weights={"double": 2.0})
def fair_job(self, tenant, n, seconds=0.05, until=None):
    """Fair share across tenants: at most 2 at once, freed slots handed round robin by tenant."""
    record_fair(tenant, n, seconds, until)
    return f"{tenant}:{n}"


@app.task(bind=True, base=SingleFlightTask, lock_key="ft:<tenant>:<n>", fair_key="<tenant>",
          fair_concurrency=1, queue_timeout=1.0)
def fair_timed(self, tenant, n, seconds=0.5):
    """Fair share with a queue_timeout: runs that wait over 1 s end FAILURE (QueueTimeout)."""
    record_fair(tenant, n, seconds)
    return f"{tenant}:{n}"


# -- the metrics tests' queue timeout (tests/test_metrics.py); not shared, so that another app
# finalized later (the Django site's) does not build it under its own defaults --------------------


@app.task(bind=True, base=SingleFlightTask, lock_key="mft:<key>:<n>", fair_key="<key>", fair_concurrency=1,
          queue_timeout=0.5, shared=False)
def fair_metered(self, key, n, seconds=0.05):
    hold(recorder, seconds, f"gate:{key}")  # a holder the test must outlast holds until it opens the gate
    return n
