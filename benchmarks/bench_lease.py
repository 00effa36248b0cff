"""Lease cost of celery_singleflight next to redis-py's ``redis.lock.Lock``, on one Redis.

Every singleflight task run pays one acquire and one release, and every worker process pays
one renewal pass per heartbeat tick for all the leases it holds. This benchmark checks those
costs against their budgets, from ONE client over loopback, with redis-py's plain ``Lock``
measured side by side as the baseline (it is what people would use instead):

1. uncontended acquire + release pairs per second. Both sides do what one task run does: a
   fresh token (``uuid4`` for us as in ``task.py``, ``uuid1`` inside ``Lock.acquire``) and a
   fresh ``Holder``/``Lock`` object per pair, on the same key (it is released each time).
   The two run in alternating half-second slices, together with two bare PINGs per "pair":
   the ceiling any 2-round-trip design can reach with this client on this machine;
2. Redis round trips per pair, counted on the client (see :class:`RoundTrips`) and by the
   server: MONITOR lines sent by our connection (top-level commands; the ``redis.call``s a
   script makes show up as ``[lua]`` lines and are not round trips). Next to it,
   ``INFO stats total_commands_processed`` per pair, minus our own INFO calls: on Redis 7 that
   counter includes the commands run inside Lua scripts, so it is the server's work per pair,
   not its round trips;
3. one renewal pass over 1,000 leases held by one process (``Heartbeat.renew_once``) in round
   trips and wall time; redis-py has no batch renewal, so its column is 1,000 ``reacquire()``;
4. Redis memory per held lease: ``INFO memory used_memory`` before and after acquiring 10,000
   leases on distinct keys, divided by 10,000. For singleflight this includes each key's fence
   counter (a second Redis key that outlives the lease by design).

By default a private redis-server is started on a free loopback port and stopped afterwards.
With ``--redis-url`` that server is used instead: only keys under a unique namespace prefix
are written, and only those are deleted at the end (nothing is flushed). Counts from INFO and
memory are then disturbed by whatever else that server is doing.

The result is a report, not a test: the exit status is 0 whatever the verdicts.

    .venv/bin/python benchmarks/bench_lease.py [--seconds N] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis
from benchutil import CallgrindServer, bar_chart, delete_matching, machine, redis_for, write_section
from redis.client import Monitor
from redis.lock import Lock
from redis.utils import HIREDIS_AVAILABLE

from celery_singleflight import Lease, hold
from celery_singleflight.config.options import app_options
from celery_singleflight.protocol import lease as lease_protocol
from celery_singleflight.protocol import lua
from celery_singleflight.protocol.fields import PATTERNS, TEMPLATES
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.run.guard import options_store
from celery_singleflight.run.heartbeat import Heartbeat

TTL = 30.0  # seconds, the same for both contenders
WARMUP_PAIRS = 1_000  # loads the scripts (NOSCRIPT -> SCRIPT LOAD) and the connection
COUNTED_PAIRS = 1_000  # pairs whose round trips and commands are counted
RENEWED_LEASES = 1_000
MEMORY_LEASES = 10_000
BATCH = 100  # pairs between two looks at the clock
SLICE = 0.25  # seconds per turn when throughput measurements alternate

MIN_RATIO_TO_LOCK = 1.0  # the library's own lease path, pairs/s against redis-py's Lock in the same run
MIN_HOLD_RATIO_TO_LOCK = 0.9  # the public ``with hold(app, key)`` pair
MAX_COMMANDS_PER_PAIR = 8  # counted by the server, the commands inside the scripts included
MAX_TRIPS_PER_PAIR = 2
MAX_TRIPS_PER_RENEWAL = 1
MAX_BYTES_PER_LEASE = 500  # "a few hundred bytes"


class RoundTrips:
    """Client-side round trips of one ``redis.Redis`` client.

    Counted at ``Connection.send_packed_command``: redis-py calls it exactly once per request
    it writes, then blocks on the reply before writing anything else (a pipeline writes all
    its commands in one call), so calls == request/response round trips, hidden ones included:
    SCRIPT LOAD after a NOSCRIPT error, health-check PINGs, the handshake of a new connection.
    Counting ``read_response`` would count replies instead (N per pipeline, not 1).

    The pool's connection class is swapped for a counting subclass of whatever class the URL
    chose (TCP, TLS, unix socket), so this must run before the client's first command.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.count = 0
        pool = client.connection_pool
        base: type[Any] = pool.connection_class

        def send_packed_command(conn: Any, command: Any, check_health: bool = True) -> None:
            self.count += 1
            base.send_packed_command(conn, command, check_health)

        pool.connection_class = type(
            f"RoundTripCounting{base.__name__}", (base,), {"send_packed_command": send_packed_command}
        )


class Contender(Protocol):
    """One lock implementation, driven through the same three operations."""

    name: str
    client: redis.Redis
    trips: RoundTrips
    top_level: tuple[str, ...]

    def pair(self) -> None:
        """One uncontended acquire + release, as one task run does."""

    def hold(self, count: int) -> None:
        """Acquire ``count`` leases on distinct keys and keep them."""

    def renew(self, count: int) -> None:
        """Renew the first ``count`` held leases once."""


class Singleflight:
    name = "celery_singleflight"
    # what it sends; the commands inside a script are counted in its time
    top_level: tuple[str, ...] = ("evalsha",)

    def __init__(self, url: str, namespace: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.trips = RoundTrips(self.client)
        self.store = LeaseStore(self.client, KeyLayout(namespace))
        self.heartbeat = Heartbeat(self.store)  # renew_once() only: its thread never starts
        self.held: list[Lease] = []

    def pair(self) -> None:
        token = uuid.uuid4().hex
        got = self.store.acquire("pair", token, TTL, Holder(task_id=token))
        if not isinstance(got, Acquired) or not self.store.release("pair", token, fence=got.fence):
            raise RuntimeError(f"{self.name}: an uncontended acquire + release failed: {got}")

    def hold(self, count: int) -> None:
        for i in range(len(self.held), len(self.held) + count):
            key, token = f"held:{i:05d}", uuid.uuid4().hex
            got = self.store.acquire(key, token, TTL, Holder(task_id=token))
            if not isinstance(got, Acquired):
                raise RuntimeError(f"{self.name}: could not acquire free key {key!r}: {got}")
            self.held.append(
                Lease(key=key, token=token, fence=got.fence, ttl=TTL, interval=TTL / 3,
                      task_id=token, task_name="bench", store=self.store, since=got.since)
            )

    def renew(self, count: int) -> None:
        leases = self.held[:count]
        self.heartbeat.renew_once(leases)
        if any(lease.lost for lease in leases):
            raise RuntimeError(f"{self.name}: a renewal lost a lease")


class PublicHold:
    """The public door: ``with hold(app, key): pass``, options, heartbeat, signals and all."""

    name = "celery_singleflight hold()"

    def __init__(self, url: str, namespace: str) -> None:
        from celery import Celery

        self.app = Celery("bench-lease", broker="memory://", set_as_current=False)
        self.app.conf.update(singleflight_redis_url=url, singleflight_namespace=namespace,
                             singleflight_ttl=TTL)
        with hold(self.app, "hold-pair"):
            pass
        self.client = options_store(app_options(self.app, lock_ttl=None, progress_rate=None,
                                                max_concurrency=1)).client

    def pair(self) -> None:
        with hold(self.app, "hold-pair"):
            pass


class RedisPyLock:
    name = "redis-py Lock"
    top_level: tuple[str, ...] = ("set", "evalsha")  # SET NX PX to acquire, a script to release

    def __init__(self, url: str, namespace: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.trips = RoundTrips(self.client)
        self.layout = KeyLayout(namespace)  # lock names as long as singleflight's lease keys
        self.held: list[Lock] = []

    def pair(self) -> None:
        lock = self.client.lock(self.layout.redis_key("pair", "lock"), timeout=TTL)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"{self.name}: an uncontended acquire failed")
        lock.release()

    def hold(self, count: int) -> None:
        for i in range(len(self.held), len(self.held) + count):
            lock = self.client.lock(self.layout.redis_key(f"held:{i:05d}", "lock"), timeout=TTL)
            if not lock.acquire(blocking=False):
                raise RuntimeError(f"{self.name}: could not acquire free lock {lock.name!r}")
            self.held.append(lock)

    def renew(self, count: int) -> None:
        for lock in self.held[:count]:
            lock.reacquire()  # TTL back to the full timeout, as RENEW's PEXPIRE does


@dataclass(frozen=True)
class Results:
    pairs_per_second: float
    client_trips_per_pair: float
    server_trips_per_pair: float | None
    server_commands_per_pair: float | None
    client_trips_per_renewal: float
    server_trips_per_renewal: float | None
    seconds_per_renewal: float
    bytes_per_lease: float
    server_us_per_pair: float | None


T = TypeVar("T")


def _unless_refused(call: Callable[[], T]) -> T | None:
    """``call()``, or None if the server refuses the command (e.g. an ACL without MONITOR)."""
    try:
        return call()
    except redis.ResponseError:
        return None


class Server:
    """The Redis under test, seen through connections that are never counted."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.admin = redis.Redis.from_url(url, socket_timeout=60)
        self.admin.ping()  # connect now: a later handshake would show up in the INFO deltas
        first = self.commands_processed()
        self.info_cost = self.commands_processed() - first  # INFO counts itself: 1 on Redis 7

    def commands_processed(self) -> int:
        return int(self.admin.info("stats")["total_commands_processed"])

    def command_usec(self, names: Sequence[str]) -> int | None:
        """Microseconds Redis spent in ``names`` so far (INFO commandstats), None if refused."""
        stats = _unless_refused(lambda: self.admin.info("commandstats"))
        if stats is None:
            return None
        return sum(int(stats.get(f"cmdstat_{name}", {}).get("usec", 0)) for name in names)

    def used_memory(self) -> int:
        return int(self.admin.info("memory")["used_memory"])

    def version(self) -> str:
        return str(self.admin.info("server")["redis_version"])

    def count(self, contender: Contender, work: Callable[[], None]) -> tuple[int, int | None, int | None]:
        """Run ``work`` once; return its round trips (client, server) and server commands.

        Server round trips are the MONITOR lines of ``contender``'s connection (a script's own
        ``redis.call``s are ``[lua]`` lines and do not count). Server figures are None when
        MONITOR or INFO is refused (ACL) or for a unix socket, whose MONITOR lines name no peer.
        """
        by_peer = "path" not in contender.client.connection_pool.connection_kwargs
        trips_before = contender.trips.count
        with redis.Redis.from_url(self.url, socket_timeout=60) as watcher, ExitStack() as stack:
            monitor: Monitor | None = _unless_refused(lambda: stack.enter_context(watcher.monitor()))
            commands_before = _unless_refused(self.commands_processed)
            work()
            commands_after = _unless_refused(self.commands_processed)
            client_trips = contender.trips.count - trips_before
            addrs = _local_addresses(contender.client)
            server_trips = self._lines_from(monitor, addrs) if monitor is not None and by_peer else None
        if commands_before is None or commands_after is None:
            return client_trips, server_trips, None
        return client_trips, server_trips, commands_after - commands_before - self.info_cost

    def _lines_from(self, monitor: Monitor, addrs: set[str]) -> int:
        """MONITOR lines sent from ``addrs`` until now (an ECHO of ours marks the end)."""
        sentinel = f"bench-lease-end-{uuid.uuid4().hex}"
        self.admin.echo(sentinel)
        lines = 0
        while sentinel not in (entry := monitor.next_command())["command"]:  # type: ignore[no-untyped-call]
            if f"{entry['client_address']}:{entry['client_port']}" in addrs:
                lines += 1
        return lines

    def delete_namespace(self, namespace: str) -> int:
        """Delete the keys under ``namespace:`` (ours only) and return how many there were."""
        return delete_matching(self.admin, f"{namespace}:*")


def _local_addresses(client: redis.Redis) -> set[str]:
    """``host:port`` of every open connection of ``client``'s pool, as the server names its
    peers: the pooled ones and those a thread keeps for its lease scripts."""
    pool: Any = client.connection_pool
    conns = [*pool._available_connections, *pool._in_use_connections]
    out = set()
    for conn in conns:
        sock = getattr(conn, "_sock", None)
        if sock is not None:
            host, port = sock.getsockname()[:2]
            out.add(f"{host}:{port}")
    return out


def timed_pairs(pair: Callable[[], None], seconds: float) -> tuple[int, float]:
    """Run ``pair`` for about ``seconds``; return how many ran and how long they took."""
    done = 0
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(BATCH):
            pair()
        done += BATCH
        now = time.perf_counter()
        if now >= deadline:
            return done, now - start


def pairs_per_second(
    pairs: Sequence[Callable[[], None]], seconds: float,
) -> tuple[list[float], list[list[float]]]:
    """Rate of each of ``pairs`` over ``seconds`` each, run in alternating slices; and each
    one's rate in every slice (for paired ratios).

    Interleaving (A B C, C B A, A B C, ...) makes drift of a shared or throttled CPU hit
    every contender alike instead of whichever happened to run last.
    """
    slices = max(2, round(seconds / SLICE))
    done = [0] * len(pairs)
    spent = [0.0] * len(pairs)
    per_slice: list[list[float]] = [[] for _ in pairs]
    for i in range(slices):
        order = range(len(pairs)) if i % 2 == 0 else reversed(range(len(pairs)))
        for j in order:
            count, elapsed = timed_pairs(pairs[j], seconds / slices)
            done[j] += count
            spent[j] += elapsed
            per_slice[j].append(count / elapsed)
    return [count / elapsed for count, elapsed in zip(done, spent, strict=True)], per_slice


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> tuple[float, float, float]:
    """Median, lowest and highest of the per-slice ratios ``ours / theirs``: each ratio compares
    two slices run back to back, so a load change between slices moves both sides alike."""
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    return statistics.median(ratios), min(ratios), max(ratios)


def seconds_per_renewal(contender: Contender, seconds: float) -> float:
    """Median wall time of one renewal pass over RENEWED_LEASES, passes repeated for ``seconds``."""
    timings: list[float] = []
    deadline = time.perf_counter() + seconds
    while not timings or time.perf_counter() < deadline:
        start = time.perf_counter()
        contender.renew(RENEWED_LEASES)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def measure(contender: Contender, server: Server, seconds: float, rate: float) -> Results:
    """Everything but the throughput (``rate``, measured interleaved beforehand)."""

    def counted_pairs() -> None:
        for _ in range(COUNTED_PAIRS):
            contender.pair()

    pair_trips, pair_server_trips, pair_commands = server.count(contender, counted_pairs)
    usec_before = server.command_usec(contender.top_level)
    counted_pairs()
    usec_after = server.command_usec(contender.top_level)
    server_us = None
    if usec_before is not None and usec_after is not None:
        server_us = (usec_after - usec_before) / COUNTED_PAIRS

    memory_before = server.used_memory()
    contender.hold(MEMORY_LEASES)
    bytes_per_lease = (server.used_memory() - memory_before) / MEMORY_LEASES

    contender.renew(RENEWED_LEASES)  # warm-up: loads the renewal script
    renewal_trips, renewal_server_trips, _ = server.count(contender, lambda: contender.renew(RENEWED_LEASES))
    renewal_seconds = seconds_per_renewal(contender, seconds)

    return Results(
        pairs_per_second=rate,
        client_trips_per_pair=pair_trips / COUNTED_PAIRS,
        server_trips_per_pair=None if pair_server_trips is None else pair_server_trips / COUNTED_PAIRS,
        server_commands_per_pair=None if pair_commands is None else pair_commands / COUNTED_PAIRS,
        client_trips_per_renewal=renewal_trips,
        server_trips_per_renewal=renewal_server_trips,
        seconds_per_renewal=renewal_seconds,
        bytes_per_lease=bytes_per_lease,
        server_us_per_pair=server_us,
    )


def _num(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def _verdict(value: float | None, ok: Callable[[float], bool]) -> str:
    return "n/a" if value is None else ("PASS" if ok(value) else "MISS")


def table(ours: Results, theirs: Results, hold_rate: float, seconds: float,
          instructions: dict[str, int] | None, ratios: tuple[float, float, float],
          hold_ratios: tuple[float, float, float], server_instructions: dict[str, int] | None = None) -> str:
    ratio, hold_ratio = ratios[0], hold_ratios[0]

    def spread(found: tuple[float, float, float]) -> str:
        return f" (slices {found[1]:.2f} to {found[2]:.2f})"

    def per_pair(rate: float) -> str:
        return f"{rate:,.0f} ({1e6 / rate:.1f} µs/pair)"

    rows: list[tuple[str, str, str, str, str]] = [
        (
            f"acquire+release pairs/s, lease path ({seconds:g} s, 1 client)",
            per_pair(ours.pairs_per_second),
            per_pair(theirs.pairs_per_second),
            f"≥ {MIN_RATIO_TO_LOCK:.1f} x Lock",
            f"{ratio:.2f} x {_verdict(ratio, lambda v: v >= MIN_RATIO_TO_LOCK)}{spread(ratios)}",
        ),
        (
            "same, public `with hold(app, key): pass`",
            per_pair(hold_rate),
            per_pair(theirs.pairs_per_second),
            f"≥ {MIN_HOLD_RATIO_TO_LOCK:.1f} x Lock",
            f"{hold_ratio:.2f} x {_verdict(hold_ratio, lambda v: v >= MIN_HOLD_RATIO_TO_LOCK)}"
            f"{spread(hold_ratios)}",
        ),
    ]
    if instructions:
        rows.append((
            "client instructions per pair (callgrind, lease path / hold())",
            f"{instructions.get('store', 0):,} / {instructions.get('hold', 0):,}",
            f"{instructions.get('lock', 0):,}",
            "—",
            "info",
        ))
    if server_instructions:
        rows.append((
            "redis-server instructions per pair (callgrind, lease path / hold(); two PINGs: "
            f"{server_instructions.get('pings', 0):,})",
            f"{server_instructions.get('store', 0):,} / {server_instructions.get('hold', 0):,}",
            f"{server_instructions.get('lock', 0):,}",
            "—",
            "info",
        ))
    rows += [
        (
            "Redis server time per pair (INFO commandstats)",
            "n/a" if ours.server_us_per_pair is None else f"{ours.server_us_per_pair:.1f} µs",
            "n/a" if theirs.server_us_per_pair is None else f"{theirs.server_us_per_pair:.1f} µs",
            "—",
            "info",
        ),
        (
            "round trips per pair, client",
            _num(ours.client_trips_per_pair),
            _num(theirs.client_trips_per_pair),
            f"{MAX_TRIPS_PER_PAIR}",
            _verdict(ours.client_trips_per_pair, lambda v: v <= MAX_TRIPS_PER_PAIR),
        ),
        (
            "round trips per pair, server (MONITOR)",
            _num(ours.server_trips_per_pair),
            _num(theirs.server_trips_per_pair),
            f"{MAX_TRIPS_PER_PAIR}",
            _verdict(ours.server_trips_per_pair, lambda v: v <= MAX_TRIPS_PER_PAIR),
        ),
        (
            "Redis commands per pair (server, incl. Lua)",
            _num(ours.server_commands_per_pair),
            _num(theirs.server_commands_per_pair),
            f"≤ {MAX_COMMANDS_PER_PAIR}",
            _verdict(ours.server_commands_per_pair, lambda v: v <= MAX_COMMANDS_PER_PAIR),
        ),
        (
            f"round trips per {RENEWED_LEASES:,}-lease renewal pass, client",
            _num(ours.client_trips_per_renewal, 0),
            _num(theirs.client_trips_per_renewal, 0),
            f"{MAX_TRIPS_PER_RENEWAL}",
            _verdict(ours.client_trips_per_renewal, lambda v: v <= MAX_TRIPS_PER_RENEWAL),
        ),
        (
            f"round trips per {RENEWED_LEASES:,}-lease renewal pass, server (MONITOR)",
            _num(ours.server_trips_per_renewal, 0),
            _num(theirs.server_trips_per_renewal, 0),
            f"{MAX_TRIPS_PER_RENEWAL}",
            _verdict(ours.server_trips_per_renewal, lambda v: v <= MAX_TRIPS_PER_RENEWAL),
        ),
        (
            f"time per {RENEWED_LEASES:,}-lease renewal pass (median)",
            f"{ours.seconds_per_renewal * 1e3:.2f} ms",
            f"{theirs.seconds_per_renewal * 1e3:.2f} ms",
            "—",
            "info",
        ),
        (
            f"Redis used_memory per held lease ({MEMORY_LEASES:,} leases; ours: the run record)",
            f"{ours.bytes_per_lease:,.0f} B",
            f"{theirs.bytes_per_lease:,.0f} B",
            f"a few hundred bytes (≤ {MAX_BYTES_PER_LEASE} B)",
            _verdict(ours.bytes_per_lease, lambda v: v <= MAX_BYTES_PER_LEASE),
        ),
    ]
    lines = [
        "| measure | celery_singleflight | redis-py Lock | budget | verdict |",
        "|---|---:|---:|---|---|",
        *(f"| {' | '.join(row)} |" for row in rows),
    ]
    return "\n".join(lines)


def instructions_per_pair(url: str) -> dict[str, int]:
    """Client-side instructions per pair for each door, from ``valgrind --tool=callgrind`` (the
    same total for the same inputs whatever else the machine does): the difference between runs
    of 100 and 400 pairs, divided by 300, so start-up and warm-up cancel out. Empty without
    valgrind."""
    if shutil.which("valgrind") is None:
        print("valgrind not found: no instruction counts")
        return {}
    counts: dict[str, int] = {}
    for name in ("store", "hold", "lock"):
        totals = []
        for pairs in (100, 400):
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run(
                    ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable,
                     __file__, "--instructions-of", name, "--pairs", str(pairs), "--redis-url", url],
                    capture_output=True, text=True, check=True,
                    env={**os.environ, "PYTHONHASHSEED": "0"},  # the same dict layouts in every run
                )
            found = re.search(r"Collected : (\d+)", done.stderr)
            if found is None:
                raise RuntimeError(f"callgrind printed no total: {done.stderr[-500:]}")
            totals.append(int(found.group(1)))
        counts[name] = (totals[1] - totals[0]) // 300
    return counts


def two_pings(client: redis.Redis) -> Callable[[], None]:
    """The cheapest conceivable 2-round-trip "pair" with this client: two bare PINGs."""
    ping = client.ping

    def pair() -> None:
        ping()
        ping()

    return pair


def server_instructions_per_pair(pairs: int = 300) -> dict[str, int]:
    """redis-server instructions per pair for each door and for two PINGs, from a private
    server under callgrind (after a warm-up that loads the scripts): the server's side of the
    cost, which the client's rate shows only mixed with the round-trip time; and per call of each
    script part run alone (``part:<label>``). Empty without valgrind."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind not found: no server instruction counts")
        return {}
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = CallgrindServer(tmp).start(timeout=120)
        doors: list[Any] = []
        try:
            namespace = f"sfbench-cg-{os.getpid()}"
            doors = [Singleflight(server.url, namespace), PublicHold(server.url, namespace),
                     RedisPyLock(server.url, namespace)]
            pairs_of = [*(door.pair for door in doors), two_pings(doors[0].client)]
            for name, pair in zip(("store", "hold", "lock", "pings"), pairs_of, strict=True):
                for _ in range(50):
                    pair()
                counts[name] = server.instructions(lambda pair=pair: [pair() for _ in range(pairs)]) // pairs
            counts.update(_part_instructions(server, namespace))
        finally:
            for door in doors:
                door.client.close()
            server.close()
    return counts


def instructions_child(name: str, url: str, pairs: int) -> None:
    """The body ``instructions_per_pair`` runs under callgrind: warm up, then ``pairs`` pairs."""
    namespace = f"sfbench-cg-{os.getpid()}"
    door: Any = {"store": Singleflight, "hold": PublicHold, "lock": RedisPyLock}[name](url, namespace)
    for _ in range(WARMUP_PAIRS // 5):
        door.pair()
    for _ in range(pairs):
        door.pair()
    delete_matching(door.client, f"{namespace}:*")


def parser_description(client: redis.Redis) -> str:
    """The reply parser the client's connection really uses (redis-py 8 defaults to RESP3)."""
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        name = type(getattr(conn, "_parser", None)).__name__  # private, but the only ground truth
        protocol = getattr(conn, "protocol", "?")
    finally:
        pool.release(conn)
    hiredis = (f"hiredis {importlib.metadata.version('hiredis')} installed" if HIREDIS_AVAILABLE
               else "hiredis not installed")
    return f"{name}, RESP{protocol} ({hiredis})"


#: a plain run's record while it runs, and after its release (as the plain path writes them)
_TOKEN, _TASK_ID = "0" * 32, "1" * 32
_HOLDER = (f'"task_id":"{_TASK_ID}","task_name":"proj.tasks.sync","worker":"celery@host","host":"host",'
           '"pid":"1234"')
_RUNNING = ('{ "v":"2","token":"' + _TOKEN + '","fence":"1795446547423730","since":"1795446547423",'
            '"deadline":"1795446577423","state":"running",' + _HOLDER + "}")
_RELEASED = ('{ "v":"2","rt":"' + _TOKEN + '","fence":"1795446547423730","outcome":"succeeded",' + _HOLDER +
             ',"since":"1795446547423","state":"succeeded","ended":"1795446547424","updated":"1795446547424"}')
#: the Lua helpers ACQUIRE's general path makes (between its plain path and its general body)
_ACQUIRE_SOURCE = lease_protocol.ACQUIRE.source
_ACQUIRE_HELPERS = _ACQUIRE_SOURCE[_ACQUIRE_SOURCE.index("local function"):_ACQUIRE_SOURCE.index(
    lua.expand(lua.read(lease_protocol.ACQUIRE.body), TEMPLATES))]

#: parts of a lease script, each timed alone inside Redis (INFO commandstats, EVALSHA usec_per_call):
#: (label, script, its ARGV[2]); ARGV[1] is a packed call
_PARTS: list[tuple[str, str, str]] = [
    ("an empty script (Redis's own cost of one EVALSHA)", "return 1", _RUNNING),
    ("TIME (the server clock: deadlines, fences)", "local t = redis.call('TIME') return 1", _RUNNING),
    ("reading the packed call (the 5 fields of the plain path, one string.match)",
     "local a, b, c, d, e = string.match(ARGV[1], " + lua.lua_literal(lease_protocol.ACQUIRE_CALL.head) +
     ") return 1", _RUNNING),
    ("GET of a run record", "local raw = redis.call('GET', KEYS[1]) return 1", _RUNNING),
    ("plain path: reading a running record as text (RELEASE)",
     "local head = '{ \"v\":\"2\",\"token\":\"" + _TOKEN + "\",\"fence\":\"' "
     "if string.find(ARGV[2], head, 1, true) == 1 then "
     "local f, s, rest = string.match(ARGV[2], " + lua.lua_literal(PATTERNS["PLAIN_RUNNING"]) +
     ", #head + 1) end return 1",
     _RUNNING),
    ("plain path: reading a released record as text (ACQUIRE)",
     "local rt, f, o, id = string.match(ARGV[2], " + lua.lua_literal(PATTERNS["PLAIN_RELEASED"]) +
     ") return 1", _RELEASED),
    ("writing a run record: one concatenation and SET ... PX",
     "redis.call('SET', KEYS[1], '{ \"token\":\"' .. ARGV[2] .. '\",\"fence\":\"1\"}', 'PX', 60000) return 1",
     _HOLDER),
    ("general path: cjson.decode of a run record", "local r = cjson.decode(ARGV[2]) return 1", _RUNNING),
    ("general path: cjson.encode and SET of a run record",
     "local r = cjson.decode(ARGV[2]) redis.call('SET', KEYS[1], cjson.encode(r), 'PX', 60000) return 1",
     _RUNNING),
    ("general path: making the Lua helpers ACQUIRE uses (closures made on every call)",
     _ACQUIRE_HELPERS + "return 1", _RUNNING),
]


_PART_CALL = "\x1f".join(["tok" + "2" * 32, "30000", "330000", "", "", "300000", "task-1"])


def _part_instructions(server: CallgrindServer, namespace: str, calls: int = 300) -> dict[str, int]:
    """redis-server instructions per EVALSHA of each part of a lease script, run alone (keyed
    ``part:<label>``): the steady counterpart of :func:`server_breakdown`'s microseconds."""
    client = redis.Redis.from_url(server.url)
    key = f"{namespace}:{{breakdown}}:run"
    client.set(key, _RUNNING)
    counts: dict[str, int] = {}
    try:
        for label, source, arg in _PARTS:
            sha = client.script_load(source)
            for _ in range(50):
                client.evalsha(sha, 1, key, _PART_CALL, arg)
            counts[f"part:{label}"] = server.instructions(
                lambda sha=sha, arg=arg: [client.evalsha(sha, 1, key, _PART_CALL, arg) for _ in range(calls)]
            ) // calls
    finally:
        client.delete(key)
        client.close()
    return counts


def server_breakdown(server: Server, namespace: str, instructions: dict[str, int] | None = None) -> str:
    """Microseconds of server time per EVALSHA for each part of a lease script, timed alone, and
    the server's instructions for it when counted: where the scripts' time goes, on their plain
    path and on the general one."""
    admin = server.admin
    key = f"{namespace}:{{breakdown}}:run"
    admin.set(key, _RUNNING)
    rows = []
    for label, source, arg in _PARTS:
        sha = admin.script_load(source)
        for _ in range(200):
            admin.evalsha(sha, 1, key, _PART_CALL, arg)
        admin.config_resetstat()
        for _ in range(3000):
            admin.evalsha(sha, 1, key, _PART_CALL, arg)
        usec = float(admin.info("commandstats")["cmdstat_evalsha"]["usec_per_call"])
        counted = (instructions or {}).get(f"part:{label}")
        rows.append(f"| {label} | {usec:.2f} µs | {'—' if counted is None else f'{counted:,}'} |")
    admin.delete(key)
    return "\n".join(["| part of a lease script, run alone | server time per call | server instructions per "
                      "call (callgrind) |", "|---|---:|---:|", *rows])


def run(url: str, seconds: float, private: bool, callgrind: bool = False, write_docs: bool = False) -> None:
    namespace = f"sfbench-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    server = Server(url)
    contenders: list[Contender] = []
    try:
        print(f"redis-server {server.version()} at {url} "
              f"({'private, started by this benchmark' if private else 'given by --redis-url'}), "
              f"namespace {namespace!r}, {os.cpu_count()} CPUs, TTL {TTL:g} s")
        if not private:
            print("note: INFO counts and used_memory include whatever else this server is doing")
        ours = Singleflight(url, namespace)
        theirs = RedisPyLock(url, namespace)
        public = PublicHold(url, namespace)
        contenders += [ours, theirs]
        for pair in (ours.pair, theirs.pair, public.pair):
            for _ in range(WARMUP_PAIRS):  # connects, and loads the scripts (NOSCRIPT -> SCRIPT LOAD)
                pair()
        print(f"python {platform.python_version()}, redis-py {redis.__version__}, "
              f"parser {parser_description(ours.client)}")
        rates, per_slice = pairs_per_second([ours.pair, public.pair, theirs.pair, two_pings(ours.client)],
                                            seconds)
        ours_rate, hold_rate, theirs_rate, ceiling = rates
        ratios = paired_ratio(per_slice[0], per_slice[2])
        hold_ratios = paired_ratio(per_slice[1], per_slice[2])
        ours_results = measure(ours, server, seconds, ours_rate)
        theirs_results = measure(theirs, server, seconds, theirs_rate)
        instructions = instructions_per_pair(url) if callgrind else {}
        server_instructions = server_instructions_per_pair() if callgrind else {}
        report = table(ours_results, theirs_results, hold_rate, seconds, instructions, ratios, hold_ratios,
                       server_instructions)
        breakdown = server_breakdown(server, namespace, server_instructions)
        notes = (
            f"Measured in {max(2, round(seconds / SLICE))} alternating slices; a ratio is the median of "
            "paired per-slice ratios (range in brackets). redis-py's Lock has no batch renewal: its pass "
            f"is {RENEWED_LEASES:,} reacquire() calls. Two PINGs, the ceiling of any 2-round-trip pair: "
            f"{ceiling:,.0f}/s."
        )
        breakdown_note = (
            "Each row is one part of a lease script run alone as its own script (so each includes the "
            "empty script's cost). An uncontended pair takes the plain path of both scripts; the "
            "general path's rows are for runs with a queue, joined runs or progress."
        )
        print()
        print(report)
        print()
        print(notes)
        print()
        print(breakdown)
        print()
        print(breakdown_note)
        if write_docs:
            chart = bar_chart("lease", "uncontended acquire + release pairs/s, one client",
                              ["celery_singleflight lease path", "celery_singleflight hold()",
                               "redis-py Lock", "two PINGs (floor of any 2-round-trip pair)"],
                              [ours_rate, hold_rate, theirs_rate, ceiling], "pairs/s",
                              highlight="celery_singleflight lease path")
            write_section("lease", "\n\n".join(filter(None, [
                "## Lease cost (`benchmarks/bench_lease.py`)",
                "Alone: `.venv/bin/python benchmarks/bench_lease.py --callgrind` "
                f"(a private redis-server {server.version()}, parser {parser_description(ours.client)}).",
                f"Measured {machine()}.", report, notes, chart,
            ])))
    finally:
        deleted = server.delete_namespace(namespace)
        print(f"cleanup: deleted {deleted:,} keys under {namespace}:*")
        for contender in contenders:
            contender.client.close()
        server.admin.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=6.0, help="duration of each timed measurement")
    parser.add_argument("--redis-url", help="use this Redis (only keys under a unique prefix are touched)")
    parser.add_argument("--callgrind", action="store_true",
                        help="also count client and server instructions per pair under valgrind "
                             "(about two minutes)")
    parser.add_argument("--write-docs", action="store_true", help="write the figures into docs/benchmarks.md")
    parser.add_argument("--instructions-of", choices=["store", "hold", "lock"], help=argparse.SUPPRESS)
    parser.add_argument("--pairs", type=int, default=100, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions_of:
        instructions_child(args.instructions_of, args.redis_url, args.pairs)
        return 0
    with redis_for(args.redis_url) as (url, private):
        run(url, args.seconds, private=private, callgrind=args.callgrind, write_docs=args.write_docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
