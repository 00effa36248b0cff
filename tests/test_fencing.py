"""Fenced writes (``celery_singleflight.fencing``) against a real Redis, PostgreSQL and SQLite.

Redis data lives in db 8 under a prefix unique to each test. PostgreSQL is the machine's
(127.0.0.1:5432, database ``test``, user ``postgres``): each test creates its own table and drops
it afterwards; without a server the PostgreSQL cases skip locally and fail in CI.
"""

from __future__ import annotations

import pickle
import random
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_singleflight import SingleFlightError
from celery_singleflight.fencing import (
    FencedValue,
    StaleFence,
    detect_paramstyle,
    fenced_get,
    fenced_set,
    fenced_update,
    fenced_upsert,
    insert_once,
)
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

from .conftest import IN_CI, wait_for

PG_DSN = "host=127.0.0.1 port=5432 dbname=test user=postgres"
DATA_DB = 8


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------


@pytest.fixture
def prefix(redis_server: RedisServer) -> Iterator[str]:
    """A key prefix of this test in db 8; its keys (data and leases) are deleted afterwards."""
    name = f"fencing-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis_server.client(DATA_DB)
    keys = list(client.scan_iter(match=f"{name}*"))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def data(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis_server.client(DATA_DB)
    yield client
    client.close()


def _acquire(store: LeaseStore, key: str, ttl: float) -> Acquired:
    got = store.acquire(key, uuid.uuid4().hex, ttl, Holder(f"task-{uuid.uuid4().hex[:6]}"))
    assert isinstance(got, Acquired)
    return got


def test_increasing_fences_write_and_the_last_one_is_read_back(data: redis.Redis, prefix: str) -> None:
    """Given an empty key, when writes come with fences 1, 2, 10, then each is stored and the
    value read back is the last one, with its fence."""
    key = f"{prefix}:report"
    assert fenced_get(data, key) is None
    for fence in (1, 2, 10):
        assert fenced_set(data, key, f"v{fence}", fence) is True
    assert fenced_get(data, key) == FencedValue(b"v10", 10)
    assert data.ttl(key) == -1  # no ttl: the value never expires


def test_an_older_fence_is_refused_and_the_value_is_unchanged(data: redis.Redis, prefix: str) -> None:
    """Given a value written with fence 7, when a writer with fence 6 writes, then it is refused
    (False, or StaleFence naming both fences with check=True) and fence 7's value stays."""
    key = f"{prefix}:report"
    assert fenced_set(data, key, "new", 7)
    assert fenced_set(data, key, "old", 6) is False
    with pytest.raises(StaleFence) as info:
        fenced_set(data, key, "old", 6, check=True)
    error = info.value
    assert (error.key, error.fence, error.stored) == (key, 6, 7)
    assert isinstance(error, SingleFlightError)
    assert "fence 6" in str(error) and "fence 7" in str(error)
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.key, copy.fence, copy.stored) == (key, 6, 7)
    assert fenced_get(data, key) == FencedValue(b"new", 7)


def test_an_equal_fence_writes_again(data: redis.Redis, prefix: str) -> None:
    """Given a value written with fence 5, when the same holder (fence 5) writes again, then the
    second write is stored: one holder may write any number of times."""
    key = f"{prefix}:report"
    assert fenced_set(data, key, "first", 5)
    assert fenced_set(data, key, "second", 5, check=True) is True
    assert fenced_get(data, key) == FencedValue(b"second", 5)


def test_fences_past_two_to_the_53_compare_exactly(data: redis.Redis, prefix: str) -> None:
    """Given fences Lua's doubles cannot tell apart (2**60 and 2**60 + 1), when the smaller one
    writes after the larger, then it is refused: the script compares decimal strings."""
    key = f"{prefix}:big"
    big = 2**60
    assert float(big) == float(big + 1)
    assert fenced_set(data, key, "newer", big + 1)
    assert fenced_set(data, key, "older", big) is False
    assert fenced_get(data, key) == FencedValue(b"newer", big + 1)
    assert fenced_set(data, key, "much newer", 10**20)  # longer than the stored fence: newer
    assert fenced_get(data, key) == FencedValue(b"much newer", 10**20)


def test_ttl_behaves_like_set(data: redis.Redis, prefix: str) -> None:
    """Given a write with a TTL, then the hash expires then; when a later write gives none, then
    the TTL is removed (as SET does)."""
    key = f"{prefix}:ttl"
    assert fenced_set(data, key, "a", 1, ttl=30)
    assert 29_000 < data.pttl(key) <= 30_000
    assert fenced_set(data, key, "b", 2)
    assert data.pttl(key) == -1


def test_bad_arguments_are_refused_before_redis(data: redis.Redis, prefix: str) -> None:
    """Given a negative, bool or float fence, a non-positive TTL or a pipeline, then the call
    raises at once and nothing is written."""
    key = f"{prefix}:bad"
    with pytest.raises(ValueError):
        fenced_set(data, key, "v", -1)
    with pytest.raises(TypeError):
        fenced_set(data, key, "v", True)
    with pytest.raises(TypeError):
        fenced_set(data, key, "v", 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        fenced_set(data, key, "v", 1, ttl=0)
    with pytest.raises(TypeError):
        fenced_set(data.pipeline(), key, "v", 1)
    assert data.exists(key) == 0


def test_a_stale_holder_is_refused_after_its_lease_expired(redis_server: RedisServer, prefix: str) -> None:
    """Given a holder whose 50 ms lease expired while it was paused, and a second holder that
    acquired the key (a larger fence) and wrote, when the first holder wakes up and writes, then
    its fenced write is refused and the second holder's value stays."""
    client = redis_server.client(DATA_DB)
    store = LeaseStore(client, KeyLayout(f"{prefix}-ns"))
    target = f"{prefix}:balance"
    first = _acquire(store, "account:1", ttl=0.05)
    # the pause: the first holder's lease runs out (by the server's clock)
    wait_for(lambda: store.time_left("account:1") is None)
    second = _acquire(store, "account:1", ttl=10)
    assert second.fence > first.fence
    assert fenced_set(client, target, "second's result", second.fence, check=True)

    assert fenced_set(client, target, "first's late result", first.fence) is False
    with pytest.raises(StaleFence):
        fenced_set(client, target, "first's late result", first.fence, check=True)
    assert fenced_get(client, target) == FencedValue(b"second's result", second.fence)
    client.close()


def test_fences_keep_growing_across_a_redis_restart(redis_server: RedisServer, prefix: str) -> None:
    """Given a holder that wrote with its fence (data kept in another Redis), when the lock Redis
    is killed and restarted without persistence, then a new lease's fence (never below Redis TIME
    in microseconds) is larger than any earlier fence, so the new holder's writes succeed and the
    old holder's are refused."""
    data = redis_server.client(DATA_DB)
    target = f"{prefix}:report"
    key = "report:1"
    with RedisServer() as lock_redis:
        store = LeaseStore(lock_redis.client(), KeyLayout("sf"))
        old = _acquire(store, key, ttl=30)
        assert old.fence <= time.time_ns() // 1000 + 1_000_000  # about the clock, in microseconds
        assert fenced_set(data, target, "old", old.fence)
        before_restart_us = time.time_ns() // 1000

        lock_redis.kill()
        lock_redis.start()
        store = LeaseStore(lock_redis.client(), KeyLayout("sf"))
        assert store.holder_record(key) == {}  # everything was lost
        new = _acquire(store, key, ttl=30)

    assert new.fence > before_restart_us > old.fence
    assert fenced_set(data, target, "new", new.fence, check=True)
    assert fenced_set(data, target, "old, late", old.fence) is False
    assert fenced_get(data, target) == FencedValue(b"new", new.fence)
    data.close()


# --------------------------------------------------------------------------------------------
# SQL: PostgreSQL and SQLite
# --------------------------------------------------------------------------------------------


def pg_connect() -> Any:
    """A connection to the machine's PostgreSQL; skip without one (fail in CI)."""
    try:
        import psycopg
    except ImportError as exc:  # the test extra was not installed
        _unavailable(f"psycopg is not installed: {exc}")
    try:
        return psycopg.connect(PG_DSN, connect_timeout=3)
    except psycopg.OperationalError as exc:
        _unavailable(f"PostgreSQL at 127.0.0.1:5432 is not reachable: {exc}")


def _unavailable(reason: str) -> Any:
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


@dataclass
class Database:
    """One backend: a table of this test and a way to open more connections to it."""

    kind: str
    connect: Callable[[], Any]
    conn: Any
    table: str

    def rows(self) -> list[tuple[Any, ...]]:
        cur = self.conn.cursor()
        cur.execute(f"SELECT k, v, fence FROM {self.table} ORDER BY k")
        rows = [tuple(row) for row in cur.fetchall()]
        cur.close()
        self.conn.commit()
        return rows

    def run(self, sql: str) -> None:
        cur = self.conn.cursor()
        cur.execute(sql)
        cur.close()
        self.conn.commit()


SCHEMA = "CREATE TABLE {table} (k TEXT PRIMARY KEY, v TEXT, fence BIGINT NOT NULL DEFAULT 0)"
PAYMENTS = "CREATE TABLE {table} (idem_key TEXT NOT NULL UNIQUE, account TEXT NOT NULL, amount INTEGER)"



def _with_table(database: Database) -> Iterator[Database]:
    """``database`` with its table created, then dropped and the connection closed."""
    database.run(SCHEMA.format(table=database.table))
    try:
        yield database
    finally:
        database.conn.rollback()
        database.run(f"DROP TABLE IF EXISTS {database.table}")
        database.conn.close()

@pytest.fixture(params=["postgres", "sqlite"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh table (``k`` primary key, ``v``, ``fence BIGINT NOT NULL DEFAULT 0``), dropped after."""
    table = f"fencing_{uuid.uuid4().hex[:12]}"
    connect: Callable[[], Any]
    if request.param == "postgres":
        connect = pg_connect
    else:
        path = tmp_path / "fencing.sqlite3"

        def connect() -> Any:
            return sqlite3.connect(path, timeout=10)

    yield from _with_table(Database(request.param, connect, connect(), table))


def test_paramstyle_is_read_from_the_driver(db: Database) -> None:
    """Given a psycopg or sqlite3 connection, then its driver's paramstyle is found; given an
    object no driver made, then a ValueError asks for paramstyle=."""
    assert detect_paramstyle(db.conn) == {"postgres": "pyformat", "sqlite": "qmark"}[db.kind]
    with pytest.raises(ValueError, match="paramstyle="):
        detect_paramstyle(object())


def test_fenced_update_takes_newer_and_equal_fences_and_refuses_older(db: Database) -> None:
    """Given a row at fence 0 (the migration default), when fences 5, 5, 3, 9 update it, then
    5 writes, 5 again writes (same holder), 3 is refused and leaves the row, 9 writes."""
    db.run(f"INSERT INTO {db.table} (k, v) VALUES ('a', 'initial')")
    assert db.rows() == [("a", "initial", 0)]

    assert fenced_update(db.conn, db.table, {"v": "five"}, {"k": "a"}, 5) is True
    assert fenced_update(db.conn, db.table, {"v": "five again"}, {"k": "a"}, 5) is True
    db.conn.commit()
    assert db.rows() == [("a", "five again", 5)]

    assert fenced_update(db.conn, db.table, {"v": "three"}, {"k": "a"}, 3) is False
    db.conn.commit()
    assert db.rows() == [("a", "five again", 5)]

    assert fenced_update(db.conn, db.table, {"v": "nine"}, {"k": "a"}, 9) is True
    assert fenced_update(db.conn, db.table, {"v": "ghost"}, {"k": "missing"}, 99) is False
    db.conn.commit()
    assert db.rows() == [("a", "nine", 9)]


def test_fenced_update_with_an_explicit_paramstyle(db: Database) -> None:
    """Given an explicit paramstyle the driver also accepts (sqlite3: named, psycopg: format),
    when a fenced update runs, then it binds its values that way."""
    style = {"postgres": "format", "sqlite": "named"}[db.kind]
    db.run(f"INSERT INTO {db.table} (k, v) VALUES ('a', 'initial')")
    assert fenced_update(db.conn, db.table, {"v": "x"}, {"k": "a"}, 2, paramstyle=style)
    assert not fenced_update(db.conn, db.table, {"v": "y"}, {"k": "a"}, 1, paramstyle=style)
    db.conn.commit()
    assert db.rows() == [("a", "x", 2)]


def test_fenced_upsert_creates_then_only_newer_or_equal_fences_update(db: Database) -> None:
    """Given no row, when fenced upserts come with fences 7, 6, 7, 8, then 7 inserts, 6 is
    refused, 7 updates and 8 updates; schema-qualified table names work too."""
    assert fenced_upsert(db.conn, db.table, {"k": "b", "v": "seven"}, "k", 7) is True
    assert fenced_upsert(db.conn, db.table, {"k": "b", "v": "six"}, "k", 6) is False
    assert fenced_upsert(db.conn, db.table, {"k": "b", "v": "seven again"}, "k", 7) is True
    db.conn.commit()
    assert db.rows() == [("b", "seven again", 7)]
    schema = {"postgres": "public", "sqlite": "main"}[db.kind]
    assert fenced_upsert(db.conn, f"{schema}.{db.table}", {"k": "b", "v": "eight"}, "k", 8) is True
    db.conn.commit()
    assert db.rows() == [("b", "eight", 8)]


def test_insert_once_inserts_one_row_per_idempotency_key(db: Database) -> None:
    """Given a unique idempotency key column, when the same payment is inserted twice, then the
    first call returns True, the second False, and one row exists (the first one's)."""
    payments = f"{db.table}_pay"
    db.run(PAYMENTS.format(table=payments))
    try:
        first = {"idem_key": "pay-42", "account": "a", "amount": 10}
        assert insert_once(db.conn, payments, first, "idem_key") is True
        db.conn.commit()
        assert insert_once(db.conn, payments, {**first, "amount": 99}, "idem_key") is False
        db.conn.commit()
        cur = db.conn.cursor()
        cur.execute(f"SELECT idem_key, account, amount FROM {payments}")
        assert [tuple(r) for r in cur.fetchall()] == [("pay-42", "a", 10)]
        cur.close()
        db.conn.commit()
    finally:
        db.run(f"DROP TABLE IF EXISTS {payments}")


@pytest.mark.parametrize(
    "call",
    [
        lambda c: fenced_update(c, "t; DROP TABLE x", {"v": 1}, {"k": 1}, 1),
        lambda c: fenced_update(c, "t", {'v" = 1 --': 1}, {"k": 1}, 1),
        lambda c: fenced_update(c, "t", {"v": 1}, {"k k": 1}, 1),
        lambda c: fenced_update(c, "t", {"v": 1}, {"k": 1}, 1, fence_column="fence;"),
        lambda c: fenced_update(c, "t", {"fence": 1}, {"k": 1}, 1),  # the fence comes from fence=
        lambda c: fenced_update(c, "t", {"v": 1}, {}, 1),  # no WHERE: would update every row
        lambda c: fenced_update(c, "t", {"v": 1}, {"k": None}, 1),  # '= NULL' matches nothing
        lambda c: fenced_update(c, "t", {"v": 1}, {"k": 1}, 1, paramstyle="percent"),
        lambda c: insert_once(c, "t", {"v": 1}, "k"),  # the key column is not in values
        lambda c: insert_once(c, "1t", {"k": 1}, "k"),
        lambda c: fenced_upsert(c, "t", {"k": 1}, "k", -1),
    ],
)
def test_unsafe_identifiers_and_bad_arguments_raise_value_error(call: Callable[[Any], Any]) -> None:
    """Given an identifier that is not plain ([A-Za-z_][A-Za-z0-9_]*) or a call that cannot do
    what it says, then ValueError is raised before any SQL runs."""
    conn = sqlite3.connect(":memory:")
    try:
        with pytest.raises(ValueError):
            call(conn)
    finally:
        conn.close()


# --------------------------------------------------------------------------------------------
# Concurrency (PostgreSQL: SQLite serializes writers anyway)
# --------------------------------------------------------------------------------------------


@pytest.fixture
def pg() -> Iterator[Database]:
    """A fresh PostgreSQL table for the concurrency cases, dropped after."""
    table = f"fencing_{uuid.uuid4().hex[:12]}"
    yield from _with_table(Database("postgres", pg_connect, pg_connect(), table))


def _in_threads(count: int, work: Callable[[int, Any], None], connect: Callable[[], Any]) -> None:
    """Run ``work(i, conn)`` in ``count`` threads, each with its own connection, released
    together by a barrier; re-raise the first error."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        conn = connect()
        try:
            barrier.wait(timeout=10)
            work(i, conn)
        except BaseException as exc:  # noqa: BLE001  (re-raised in the main thread below)
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    if errors:
        raise errors[0]


def test_concurrent_fenced_updates_leave_the_largest_fence_and_its_value(pg: Database) -> None:
    """Given 8 writers with their own connections, each updating one row 15 times with random
    fences, when they race, then the row ends with the largest fence any of them used and that
    writer's value: no older write ever overwrote a newer one."""
    pg.run(f"INSERT INTO {pg.table} (k, v) VALUES ('hot', 'initial')")
    rng = random.Random(1234)
    fences = [[rng.randrange(1, 10**15) for _ in range(15)] for _ in range(8)]

    def work(i: int, conn: Any) -> None:
        for fence in fences[i]:
            fenced_update(conn, pg.table, {"v": f"v{fence}"}, {"k": "hot"}, fence)
            conn.commit()

    _in_threads(8, work, pg.connect)
    top = max(f for mine in fences for f in mine)
    assert pg.rows() == [("hot", f"v{top}", top)]


def test_concurrent_insert_once_lets_exactly_one_writer_in(pg: Database) -> None:
    """Given 8 writers racing to insert the same idempotency key, then exactly one insert
    returns True and one row exists."""
    payments = f"{pg.table}_pay"
    pg.run(PAYMENTS.format(table=payments))
    won: list[int] = []

    def work(i: int, conn: Any) -> None:
        if insert_once(conn, payments, {"idem_key": "pay-1", "account": f"w{i}", "amount": i}, "idem_key"):
            won.append(i)
        conn.commit()

    try:
        _in_threads(8, work, pg.connect)
        cur = pg.conn.cursor()
        cur.execute(f"SELECT account FROM {payments}")
        assert [r[0] for r in cur.fetchall()] == [f"w{won[0]}"]
        cur.close()
        pg.conn.commit()
        assert len(won) == 1
    finally:
        pg.run(f"DROP TABLE IF EXISTS {payments}")
