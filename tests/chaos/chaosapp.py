"""The Celery app the chaos scenarios run in real worker subprocesses.

Two private Redis servers, so that the lease Redis can be killed without taking the broker down:

- ``CHAOS_REDIS``: broker (db 0), results (db 1) and the independent run recorder (db 3);
- ``CHAOS_LEASE_URL``: where the leases live (a second server, or a TCP proxy in front of it).

Worker-side knobs come from the environment, so each scenario starts workers with its own:
``CHAOS_TTL`` (lease TTL), ``CHAOS_ACKS_LATE``, ``CHAOS_VISIBILITY`` (the Redis broker's
visibility timeout), ``CHAOS_RETRY_DELAY`` (``fail_closed`` re-send delay).

The recorder does not use the library. A run registers itself in ``active:<key>`` (a set) with
its PID and that process's start time; a run that finds another registered run whose process is
still alive (a stopped process is alive) pushes an entry to ``overlaps``. A run whose process was
SIGKILLed never unregisters, so a dead (or zombie) process's entry is dropped instead of counted:
killing a holder is not an overlap, two live bodies on one key are.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery import signals as celery_signals

from celery_singleflight import LeaseLost, SingleFlightTask
from celery_singleflight.policies.ratelimit import PLANNED_ATTR
from tests.gates import hold

BASE = os.environ.get("CHAOS_REDIS", "redis://127.0.0.1:6379")
LEASE_URL = os.environ.get("CHAOS_LEASE_URL", f"{BASE}/2")


def _transport_options() -> dict[str, Any]:
    visibility = os.environ.get("CHAOS_VISIBILITY")
    if not visibility:
        return {}
    # kombu sweeps unacknowledged messages every 10 s and scans on every 10th sweep only; a short
    # visibility timeout is only useful with a sweep that runs every second. Each sweep holds a
    # mutex in the broker that outlives a worker killed while holding it for
    # unacked_mutex_expire (5 min by default): no other worker restores anything meanwhile
    return {"visibility_timeout": float(visibility), "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1, "unacked_mutex_expire": 5}


app = Celery("chaosapp", broker=f"{BASE}/0", backend=f"{BASE}/1")
app.conf.update(
    singleflight_redis_url=LEASE_URL,
    singleflight_ttl=float(os.environ.get("CHAOS_TTL", "3")),
    singleflight_redis_retry_delay=float(os.environ.get("CHAOS_RETRY_DELAY", "0.5")),
    task_acks_late=os.environ.get("CHAOS_ACKS_LATE") == "1",
    broker_transport_options=_transport_options(),
    worker_hijack_root_logger=False,
    broker_connection_retry_on_startup=True,
    result_expires=900,
)

recorder = redis.Redis.from_url(f"{BASE}/3")
HOST = socket.gethostname()


# -- the independent recorder ------------------------------------------------------------------


def proc_start(pid: int) -> str:
    """The start time of process ``pid`` (field 22 of /proc/<pid>/stat), '' if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]


def proc_alive(pid: int, started: str) -> bool:
    """True if ``pid`` is the same process as when it registered and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0] not in ("Z", "X") and fields[19] == started


def _text(raw: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in raw.items()}


class Run:
    """One execution of a task body, registered in the recorder (use as a context manager)."""

    def __init__(self, key: str, name: str, fence: int | None = None) -> None:
        request = app.current_task.request if app.current_task else None
        self.key = key
        self.task_id = getattr(request, "id", None) or "?"
        self.token = f"{self.task_id}:{uuid.uuid4().hex[:8]}"
        self.pid = os.getpid()
        self.info = {
            "key": key, "task_id": self.task_id, "name": name, "pid": self.pid,
            "pstart": proc_start(self.pid), "host": HOST, "start": repr(time.time()),
            "fence": "" if fence is None else str(fence),
        }

    def __enter__(self) -> Run:
        pipe = recorder.pipeline(transaction=True)
        pipe.sadd(f"active:{self.key}", self.token)
        pipe.hset(f"run:{self.token}", mapping=self.info)
        pipe.smembers(f"active:{self.key}")
        pipe.hset("busy", str(self.pid), self.token)  # lets the soak aim its kills at running bodies
        members = pipe.execute()[-2]
        recorder.rpush(f"runs:{self.key}", self.token)
        recorder.rpush("runs", self.token)
        for raw in members:
            other = raw.decode()
            if other == self.token:
                continue
            info = _text(recorder.hgetall(f"run:{other}"))
            if info and proc_alive(int(info["pid"]), info["pstart"]):
                recorder.rpush("overlaps", json.dumps({"key": self.key, "run": self.info, "other": info}))
            else:
                recorder.srem(f"active:{self.key}", other)  # its process died mid-run (SIGKILL)
        return self

    def __exit__(self, *exc: object) -> None:
        pipe = recorder.pipeline(transaction=True)
        pipe.srem(f"active:{self.key}", self.token)
        pipe.hset(f"run:{self.token}", "end", repr(time.time()))
        pipe.hdel("busy", str(self.pid))
        pipe.execute()


_stack_file: Any = None


@celery_signals.worker_process_init.connect
def _stacks_on_sigusr2(**_: Any) -> None:
    """In each pool process: SIGUSR2 writes every thread's stack to CHAOS_STACKS_DIR/<pid>.txt
    (the soak uses it on a body that is stuck, to see where)."""
    global _stack_file
    where = os.environ.get("CHAOS_STACKS_DIR")
    if where:
        _stack_file = open(Path(where) / f"{os.getpid()}.txt", "w")  # noqa: SIM115 - kept open
        faulthandler.register(signal.SIGUSR2, file=_stack_file, all_threads=True)


@celery_signals.task_prerun.connect
def _count_delivery(task_id: str | None = None, **_: Any) -> None:
    """Every delivery that reaches a pool process, including the ones the library turns away."""
    if task_id:
        recorder.rpush(f"deliveries:{task_id}", repr(time.time()))


# -- a fenced resource, written by the tasks themselves ----------------------------------------
#
# ``celery_singleflight.fencing.fenced_set`` when the library has it; else the same compare-and-set
# inline (a hash holding the value and the fence of the last accepted write; an older fence is
# refused, an equal one accepted).

try:
    from celery_singleflight import fencing as _fencing
except ImportError:  # pragma: no cover - older library without the fencing helpers
    _fencing = None

FENCED_WRITE = recorder.register_script("""
-- KEYS[1] - the resource (hash: fence, value)
-- ARGV[1] - the writer's fencing token, ARGV[2] - the value
-- return 1 if written, 0 if refused (a larger fence already wrote)
local stored = redis.call('HGET', KEYS[1], 'fence')
if not stored or #ARGV[1] > #stored or (#ARGV[1] == #stored and ARGV[1] >= stored) then
  redis.call('HSET', KEYS[1], 'fence', ARGV[1], 'value', ARGV[2])
  return 1
end
return 0
""")
FENCED_WRITE_VIA = "celery_singleflight.fencing.fenced_set" if _fencing is not None else "inline Lua"


def fenced_write(resource: str, fence: int, value: str) -> bool:
    """Write ``value`` only if no writer with a larger fence has written (compare-and-set)."""
    if _fencing is not None:
        return bool(_fencing.fenced_set(recorder, f"resource:{resource}", value, fence))
    return int(FENCED_WRITE(keys=[f"resource:{resource}"], args=[str(fence), value])) == 1


# -- scenario tasks ----------------------------------------------------------------------------


@app.task(bind=True, base=SingleFlightTask, name="chaos.queued", lock_key="c:<key>", on_duplicate="queue")
def queued(self, key, n, seconds=0.05, first_seconds=None, until=None):
    """Queue policy. ``first_seconds``: how long the first delivery of this task id sleeps (the
    holder the scenario kills); a redelivery sleeps ``seconds``. ``until``: a gate (tests/gates.py)."""
    deliveries = recorder.incr(f"bodies:{self.request.id}")
    if first_seconds is not None:
        recorder.hset(f"holder:{key}", mapping={"task_id": self.request.id, "pid": os.getpid(),
                                                "hostname": self.request.hostname or ""})
    with Run(key, "queued", self.lease.fence):
        hold(recorder, first_seconds if first_seconds is not None and deliveries == 1 else seconds, until)
    return n


@app.task(bind=True, base=SingleFlightTask, name="chaos.fenced", lock_key="fw:<key>", on_duplicate="raise")
def fenced(self, key, tag, hold=3.0, spin=False, until=None):
    """Writes the resource with its fence at start and at the end, checking its lease between
    (for ``hold`` seconds, or until the recorder key ``until`` exists).

    After a pause of the process (a loop step that took more than a second), it records what the
    lease told it, in this order: ``check()``, ``progress()``, then its fenced write.

    ``spin``: a CPU-bound body (a busy loop, as a task that computes), instead of one that sleeps
    between checks. A frozen CPU-bound body continues exactly where it stopped, holding the GIL, so
    what it learns first after the pause does not depend on which thread the OS wakes first.
    """
    fence = self.lease.fence
    seen: dict[str, Any] = {"tag": tag, "fence": fence, "pid": os.getpid()}
    recorder.hset(f"fw:{key}:{tag}", mapping={"pid": os.getpid(), "fence": fence})
    seen["first_write"] = fenced_write(key, fence, f"{tag}:first")
    deadline = time.monotonic() + hold
    last = time.monotonic()
    # from here on a pause is seen: a scenario that stops the process waits for this mark
    recorder.hset(f"fw:{key}:{tag}", "looping", 1)
    while last < deadline and not (until and recorder.exists(until)):
        if not spin:
            time.sleep(0.01)
        now = time.monotonic()
        if now - last > 1.0:  # the process was stopped: report what it learns first
            seen["paused_for"] = round(now - last, 3)
            seen["time_left_after_pause"] = self.lease.time_left
            seen["lost_flag_after_pause"] = self.lease.lost
            try:
                self.lease.check()
                seen["check"] = "ok"
            except LeaseLost:
                seen["check"] = "LeaseLost"
            try:
                self.progress("resumed")
                seen["progress"] = "ok"
            except LeaseLost:
                seen["progress"] = "LeaseLost"
            seen["write_after_pause"] = fenced_write(key, fence, f"{tag}:after-pause")
            seen["resumed_at"] = time.time()
            break
        last = now
    else:
        seen["last_write"] = fenced_write(key, fence, f"{tag}:last")
    recorder.hset(f"fw:{key}:{tag}", "seen", json.dumps(seen))
    return seen


@app.task(bind=True, base=SingleFlightTask, name="chaos.watcher", lock_key="r:<key>", on_duplicate="raise")
def watcher(self, key, seconds=10.0):
    """Holds its key for ``seconds``, polling ``self.lease`` every 20 ms; stops as soon as the
    lease is reported lost (the cooperative contract: check, and stop when told)."""
    started = time.time()
    saw_zero_left_at = None
    recorder.hset(f"watcher:{key}", mapping={"pid": os.getpid(), "started": repr(started)})
    with Run(key, "watcher", self.lease.fence):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.lease.time_left == 0 and saw_zero_left_at is None and not self.lease.lost:
                saw_zero_left_at = time.time()
            try:
                self.lease.check()
            except LeaseLost as exc:
                return {"lost": True, "reason": exc.reason, "lost_at": time.time(), "started": started,
                        "fence": self.lease.fence, "zero_left_unflagged_at": saw_zero_left_at}
            time.sleep(0.02)
    return {"lost": False, "lost_at": None, "started": started, "fence": self.lease.fence,
            "zero_left_unflagged_at": saw_zero_left_at}


@app.task(bind=True, base=SingleFlightTask, name="chaos.probe", lock_key="r:<key>", on_duplicate="skip")
def probe(self, key, seconds=0.05):
    """Tries the key (skip policy): runs only if nobody holds it."""
    with Run(key, "probe", self.lease.fence):
        time.sleep(seconds)
    return {"ran": True, "fence": self.lease.fence, "at": time.time()}


@app.task(bind=True, base=SingleFlightTask, name="chaos.quick", lock_key="r:<key>", on_duplicate="retry",
          max_wait=120)
def quick(self, key, seconds=0.05):
    """Retry policy, short body: what the outage scenario dispatches while Redis is away."""
    with Run(key, "quick", self.lease.fence):
        time.sleep(seconds)
    return {"fence": self.lease.fence, "retries": self.request.retries}


@app.task(bind=True, base=SingleFlightTask, name="chaos.long", lock_key="d:<key>", on_duplicate="raise")
def long_run(self, key, seconds=6.0, until=None):
    """Runs longer than the broker's visibility timeout (redelivery scenario): ``seconds``, or
    until the scenario sets the recorder key ``until`` (see :func:`work`)."""
    with Run(key, "long", self.lease.fence):
        hold(recorder, seconds, until)
    return {"task_id": self.request.id, "pid": os.getpid()}


# -- soak tasks: three policies on one key space ----------------------------------------------


def _soak(task: Any, key: str, seconds: float, policy: str) -> dict[str, Any]:
    with Run(key, policy, task.lease.fence):
        time.sleep(seconds)
    return {"ran": True}


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_skip", lock_key="s:<key>", on_duplicate="skip")
def soak_skip(self, key, seconds):
    return _soak(self, key, seconds, "skip")


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_queue", lock_key="s:<key>",
          on_duplicate="queue")
def soak_queue(self, key, seconds):
    return _soak(self, key, seconds, "queue")


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_retry", lock_key="s:<key>",
          on_duplicate="retry", max_wait=90)
def soak_retry(self, key, seconds):
    return _soak(self, key, seconds, "retry")


# -- the other policies on the same key space (the many-workers scenario on a Redis Cluster) -----


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_raise", lock_key="s:<key>", on_duplicate="raise")
def soak_raise(self, key, seconds):
    return _soak(self, key, seconds, "raise")


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_join", lock_key="s:<key>", on_duplicate="join")
def soak_join(self, key, seconds):
    return _soak(self, key, seconds, "join")


@app.task(bind=True, base=SingleFlightTask, name="chaos.soak_limited", lock_key="m:<key>", max_concurrency=3,
          on_duplicate="queue")
def soak_limited(self, key, seconds):
    """Up to 3 at once per key: each slot is its own key for the recorder."""
    with Run(f"{key}#slot{self.lease.slot}", "limited", self.lease.fence):
        time.sleep(seconds)
    return {"ran": True}


# -- nothing waiting is lost: one task per policy (tests/chaos/test_nothing_lost.py) ----------------


def _nl_body(task: Any, n: int, seconds: float, *, per_slot: bool = False, planned: Any = None,
             until: str | None = None) -> int:
    """Record a run under its lock key (with its argument ``n``) and hold it ``seconds``; stop
    (``LeaseLost``) as soon as the lease counts as lost, as a careful task does. A superseded run
    goes on until it is revoked. ``per_slot``: each slot of a ``max_concurrency`` key is a key of
    the recorder. ``planned``: a rate-limited run's cell (its planned start, epoch seconds).
    ``until``: a recorder key; the run ends as soon as it exists (``seconds`` is then the most it
    waits), so a scenario decides when a holder ends instead of guessing a duration."""
    lease = task.lease
    run = Run(f"{lease.key}#slot{lease.slot}" if per_slot else lease.key, task.name, lease.fence)
    run.info["n"] = str(n)
    if planned is not None:
        run.info["planned"] = repr(planned)
    with run:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if lease.lost:
                lease.check()
            if until is not None and recorder.exists(until):
                break
            time.sleep(0.02)
    return n


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_queue", lock_key="nl:q:<key>",
          on_duplicate="queue")
def nl_queue(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_ordered", lock_key="nl:o:<key>",
          on_duplicate="queue", ordered=True, order_timeout=2)
def nl_ordered(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_limited", lock_key="nl:m:<key>",
          on_duplicate="queue", max_concurrency=2)
def nl_limited(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, per_slot=True, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_coalesce", lock_key="nl:c:<key>",
          on_duplicate="coalesce")
def nl_coalesce(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_supersede", lock_key="nl:s:<key>",
          on_duplicate="supersede", supersede_grace=2)
def nl_supersede(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_debounce", lock_key="nl:d:<key>",
          on_duplicate="queue", debounce=1, debounce_max_wait=3)
def nl_debounce(self, key, n, seconds=0.1, until=None):
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_rate", lock_key="nl:r:<key>", on_duplicate="queue",
          key_rate_limit="4/s", max_concurrency=8)
def nl_rate(self, key, n, seconds=0.05, until=None):
    """Rate limited; 8 slots, so a long run does not hold the others back (only the rate does)."""
    return _nl_body(self, n, seconds, per_slot=True, planned=getattr(self.request, PLANNED_ATTR, None),
                    until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.dc_rate", lock_key="dc:r:<key>", on_duplicate="queue",
          key_rate_limit="2/s", max_concurrency=8)
def dc_rate(self, key, n, seconds=0.05):
    """As ``nl_rate`` at half the rate: a burst of 8 waits up to 3.5 s, time for a worker to note
    every copy it holds before it is killed (tests/chaos/test_delayed_copies.py)."""
    return _nl_body(self, n, seconds, per_slot=True, planned=getattr(self.request, PLANNED_ATTR, None))


@app.task(bind=True, base=SingleFlightTask, name="chaos.nl_fair", lock_key="nl:f:<key>:<n>",
          fair_key="<tenant>", fair_concurrency=2)
def nl_fair(self, key, n, seconds=0.1, tenant="t0", until=None):
    """Fair share: at most 2 runs of the task at once (its gate ``fair:chaos.nl_fair``), slots
    handed round robin across tenants. Each run has a lock key of its own (``n``), so only the gate
    limits them; the recorder sees each run under that key."""
    return _nl_body(self, n, seconds, until=until)


# -- a worker killed inside a window of the waiting machinery (tests/chaos/test_waiting_windows.py) --


@app.task(bind=True, base=SingleFlightTask, name="chaos.win_rate", lock_key="w:rate:<key>",
          on_duplicate="queue", key_rate_limit="12/m")
def win_rate(self, key, n, seconds=0.1):
    """Rate limited, one cell every 5 s: a run sent just after another's start is delayed for sure
    (its countdown message waits in the worker that received it)."""
    return _nl_body(self, n, seconds, planned=getattr(self.request, PLANNED_ATTR, None))


@app.task(bind=True, base=SingleFlightTask, name="chaos.win_retry", lock_key="w:retry:<key>",
          on_duplicate="retry", max_wait=120)
def win_retry(self, key, n, seconds=0.1, until=None):
    """Retry policy: a duplicate is re-sent with a countdown (a delayed run with its copy in Redis)."""
    return _nl_body(self, n, seconds, until=until)


@app.task(bind=True, base=SingleFlightTask, name="chaos.win_queue", lock_key="w:queue:<key>",
          on_duplicate="queue")
def win_queue(self, key, n, seconds=0.1, until=None):
    """Queue policy: a duplicate parks (``QUEUED``) until the holder releases and hands it the key."""
    return _nl_body(self, n, seconds, until=until)


# -- the lease Redis loses its data (tests/chaos/test_redis_data_loss.py) -------------------------

if os.environ.get("CHAOS_JOURNAL_DIR"):
    app.conf.singleflight_journal_dir = os.environ["CHAOS_JOURNAL_DIR"]


@app.task(bind=True, base=SingleFlightTask, name="chaos.queued_in_order", lock_key="co:<key>",
          on_duplicate="queue", ordered=True)
def queued_in_order(self, key, n, seconds=0.05, first_seconds=None, until=None):
    """``queued`` with ``ordered=True``: runs start in send order."""
    recorder.incr(f"bodies:{self.request.id}")
    with Run(key, "queued_in_order", self.lease.fence):
        hold(recorder, first_seconds if first_seconds is not None else seconds, until)
    return n
