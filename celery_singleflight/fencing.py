"""Fenced writes: storage that refuses a write from an older lease holder.

A lease cannot by itself guarantee that only one process acts on a key: a holder that pauses
(GC, a stalled HTTP call, SIGSTOP, a VM migration) can outlive its lease, wake up and write,
while a newer holder already owns the key. Every acquire returns ``lease.fence``, a number that
only grows per key; these helpers make the *storage* compare it with the fence of the last write
and refuse an older one, so a stale holder's write is rejected where it lands (see
``docs/fencing.md``)::

    from celery_singleflight import fencing

    # Redis: the value and its fence in one hash
    fencing.fenced_set(client, "report:42", payload, lease.fence)        # False if stale
    fencing.fenced_set(client, "report:42", payload, lease.fence, check=True)  # StaleFence

    # SQL (any DB-API 2.0 connection: psycopg, sqlite3, ...; the caller commits)
    fencing.fenced_update(conn, "accounts", {"balance": 10}, {"id": 42}, lease.fence)
    fencing.insert_once(conn, "payments", {"idem_key": "pay-42", "amount": 10}, "idem_key")

Fences of one lock key are only comparable with each other: guard a record with one lock key.
No database driver is imported here; the placeholder style is read from the connection's driver.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import redis

from .errors import SingleFlightError
from .protocol import fences

__all__ = [
    # errors
    "StaleFence",
    # Redis
    "FENCED_SET",
    "FencedValue",
    "fenced_get",
    "fenced_set",
    # SQL
    "DBAPIConnection",
    "detect_paramstyle",
    "fenced_update",
    "fenced_upsert",
    "insert_once",
]


class StaleFence(SingleFlightError):
    """A write carried a fence older than the one already stored: a newer lease holder wrote
    since, so this writer's lease is gone and its result must not land.

    Lives here rather than in :mod:`celery_singleflight.errors` because only the fencing helpers
    raise it; it is still a :class:`SingleFlightError`, and pickles (all arguments are passed on).
    """

    def __init__(self, key: str, fence: int, stored: int) -> None:
        super().__init__(key, fence, stored)
        self.key = key
        self.fence = fence
        self.stored = stored

    def __str__(self) -> str:
        return (
            f"stale fence for {self.key!r}: this write has fence {self.fence}, but fence"
            f" {self.stored} was already stored (a newer lease holder wrote)"
        )


def _check_fence(fence: Any) -> int:
    """A fence is a non-negative int; a bool or a float would compare in surprising ways."""
    if isinstance(fence, bool) or not isinstance(fence, int):
        raise TypeError(f"fence must be an int (lease.fence), not {type(fence).__name__}")
    if fence < 0:
        raise ValueError(f"fence must be zero or more, not {fence}")
    return fence


# --------------------------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------------------------

#: the script of :func:`fenced_set` (Lua source)
FENCED_SET = fences.FENCED_SET.source


class FencedValue(NamedTuple):
    """A value written by :func:`fenced_set` and the fence it was written with.

    ``value`` is bytes, or str when the client decodes responses.
    """

    value: bytes | str
    fence: int


def fenced_set(
    client: redis.Redis, key: str, value: bytes | str | int | float, fence: int,
    ttl: float | None = None, *, check: bool = False,
) -> bool:
    """Store ``value`` at ``key`` only if ``fence`` is not older than the fence stored with it.

    One script call, atomic: the value and its fence live in one hash (``value``, ``fence``), so
    they share a TTL, a cluster slot and an eviction, and can never drift apart. An equal fence
    writes (the same holder writing twice, e.g. a retry); an older one is refused and nothing is
    written. Returns True if written, False if refused; with ``check=True`` a refusal raises
    :class:`StaleFence` instead, for code that must stop rather than carry on.

    ``ttl`` (seconds) behaves like SET's: given, the hash expires then; None, it never expires
    (an earlier TTL is removed). Once the hash expires its fence is forgotten and any fence
    writes again, so a TTL must outlast every holder that could still write (lease TTL plus the
    longest pause you guard against). Read it back with :func:`fenced_get`.
    """
    _check_fence(fence)
    if isinstance(client, redis.client.Pipeline):
        raise TypeError("fenced_set needs the reply at once: pass a client, not a pipeline")
    if ttl is not None and not ttl > 0:
        raise ValueError(f"ttl must be more than zero seconds (or None for no expiry), not {ttl!r}")
    ttl_ms = None if ttl is None else max(1, int(ttl * 1000))
    written, stored = fences.fenced_set(client, key, value, fence, ttl_ms)
    if written:
        return True
    if check:
        raise StaleFence(key, fence, stored)
    return False


def fenced_get(client: redis.Redis, key: str) -> FencedValue | None:
    """The value at ``key`` and the fence it was written with; None if nothing is stored."""
    found = fences.fenced_get(client, key)
    return None if found is None else FencedValue(*found)


# --------------------------------------------------------------------------------------------
# SQL (DB-API 2.0)
# --------------------------------------------------------------------------------------------

class DBAPIConnection(Protocol):
    """What the SQL helpers use of a DB-API 2.0 connection (PEP 249): ``cursor()``."""

    def cursor(self) -> Any: ...


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PARAMSTYLES = ("qmark", "numeric", "named", "format", "pyformat")


def _ident(name: str, what: str = "column") -> str:
    """A quoted identifier. Identifiers cannot be bound as parameters, so they are checked
    against a strict pattern (never interpolated as given) and then double-quoted, which also
    lets a column be called ``user`` or ``order``. Quoted names are exact: PostgreSQL folds
    unquoted names to lower case, so a table created as ``CREATE TABLE Accounts`` is ``accounts``.
    """
    if not isinstance(name, str) or not _IDENTIFIER.match(name):
        raise ValueError(f"{what} name {name!r} is not a plain identifier ([A-Za-z_][A-Za-z0-9_]*)")
    return f'"{name}"'


def _table(name: str) -> str:
    """A table name, optionally schema-qualified (``schema.table``), each part checked."""
    if not isinstance(name, str):
        raise ValueError(f"table name {name!r} is not a plain identifier")
    return ".".join(_ident(part, "table") for part in name.split("."))


def detect_paramstyle(conn: Any) -> str:
    """The PEP 249 ``paramstyle`` of the driver that made ``conn`` (psycopg: ``pyformat``,
    sqlite3: ``qmark``), read from the module that defines the connection's class or a parent
    package of it. Raises ValueError if none says; pass ``paramstyle=`` then."""
    module = type(conn).__module__
    while module:
        style = getattr(sys.modules.get(module), "paramstyle", None)
        if isinstance(style, str):
            return style
        module = module.rpartition(".")[0]
    raise ValueError(
        f"cannot tell the paramstyle of {type(conn).__module__}.{type(conn).__qualname__};"
        f" pass paramstyle= (one of {', '.join(_PARAMSTYLES)})"
    )


class _Statement:
    """Collects bound values and renders each placeholder in the driver's paramstyle."""

    def __init__(self, paramstyle: str) -> None:
        if paramstyle not in _PARAMSTYLES:
            raise ValueError(f"unknown paramstyle {paramstyle!r} (one of {', '.join(_PARAMSTYLES)})")
        self.style = paramstyle
        self.values: list[Any] = []

    def bind(self, value: Any) -> str:
        self.values.append(value)
        n = len(self.values)
        return {
            "qmark": "?", "format": "%s", "numeric": f":{n}", "named": f":p{n}", "pyformat": f"%(p{n})s",
        }[self.style]

    @property
    def params(self) -> Sequence[Any] | Mapping[str, Any]:
        if self.style in ("named", "pyformat"):
            return {f"p{i}": v for i, v in enumerate(self.values, 1)}
        return tuple(self.values)


def _execute(conn: DBAPIConnection, sql: str, params: Sequence[Any] | Mapping[str, Any]) -> int:
    """Run one statement on a fresh cursor; its ``rowcount``. Never commits: the write belongs
    to the caller's transaction, so it can commit it together with its other writes."""
    cursor = conn.cursor()
    try:
        cursor.execute(sql, params)
        return int(cursor.rowcount)
    finally:
        cursor.close()


def _columns(values: Mapping[str, Any], what: str) -> None:
    if not values:
        raise ValueError(f"{what} must name at least one column")


def fenced_update(
    conn: DBAPIConnection, table: str, set_values: Mapping[str, Any], where: Mapping[str, Any],
    fence: int, fence_column: str = "fence", *, paramstyle: str | None = None,
) -> bool:
    """``UPDATE table SET <set_values>, fence = :fence WHERE <where> AND fence <= :fence``.

    The fence check and the write are one statement, so the database decides under its row lock:
    a concurrent writer with a newer fence that commits first makes this one match nothing
    (PostgreSQL re-checks the WHERE against the committed row in READ COMMITTED; stricter
    isolation levels raise a serialization error to retry instead). Rows with an older fence
    are overwritten; an equal fence is the same holder writing again (a retry, a second step)
    and is allowed, as in :func:`fenced_set`.

    The table needs the fence column: ``ALTER TABLE t ADD COLUMN fence BIGINT NOT NULL DEFAULT 0``
    (0 is older than every lease's fence, so existing rows take the first fenced write; NOT NULL
    because ``NULL <= x`` is never true and such a row could never be written).

    ``where`` is ANDed column equalities (None is refused: ``= NULL`` never matches). Returns
    True if a row was updated; False if none matched: the row is missing or a newer holder wrote
    it (use :func:`fenced_upsert` to create a missing row). Does not commit.
    ``paramstyle`` defaults to the connection's driver's (see :func:`detect_paramstyle`).
    """
    _check_fence(fence)
    _columns(set_values, "set_values")
    _columns(where, "where")
    fence_col = _ident(fence_column, "fence column")
    if fence_column in set_values:
        raise ValueError(f"set_values must not set the fence column {fence_column!r}; pass fence=")
    stmt = _Statement(paramstyle or detect_paramstyle(conn))
    assignments = [f"{_ident(col)} = {stmt.bind(value)}" for col, value in set_values.items()]
    assignments.append(f"{fence_col} = {stmt.bind(fence)}")
    conditions = []
    for col, value in where.items():
        if value is None:
            raise ValueError(f"where[{col!r}] is None: '= NULL' matches no row")
        conditions.append(f"{_ident(col)} = {stmt.bind(value)}")
    conditions.append(f"{fence_col} <= {stmt.bind(fence)}")
    sql = f"UPDATE {_table(table)} SET {', '.join(assignments)} WHERE {' AND '.join(conditions)}"
    return _execute(conn, sql, stmt.params) > 0


def fenced_upsert(
    conn: DBAPIConnection, table: str, values: Mapping[str, Any], key_column: str, fence: int,
    fence_column: str = "fence", *, paramstyle: str | None = None,
) -> bool:
    """Insert the row, or update it if its stored fence is not newer: one statement,
    ``INSERT ... ON CONFLICT (key_column) DO UPDATE SET ... WHERE table.fence <= excluded.fence``.

    :func:`fenced_update` alone cannot create a row; inserting first and updating on conflict
    in two statements would let a stale holder slip in between. ``key_column`` (in ``values``)
    needs a unique constraint. Returns True if the row was inserted or updated, False if a newer
    holder's fence is stored. Does not commit. PostgreSQL >= 9.5, SQLite >= 3.24.
    """
    _check_fence(fence)
    _columns(values, "values")
    if key_column not in values:
        raise ValueError(f"values must contain the key column {key_column!r}")
    if fence_column in values:
        raise ValueError(f"values must not set the fence column {fence_column!r}; pass fence=")
    fence_col, key_col = _ident(fence_column, "fence column"), _ident(key_column, "key column")
    target = _table(table)
    name = target.rpartition(".")[2]  # the ON CONFLICT clause names the row by the bare table name
    stmt = _Statement(paramstyle or detect_paramstyle(conn))
    columns = [_ident(col) for col in values]
    placeholders = [stmt.bind(value) for value in values.values()]
    updates = [f"{col} = excluded.{col}" for col in columns if col != key_col]
    updates.append(f"{fence_col} = excluded.{fence_col}")
    sql = (
        f"INSERT INTO {target} ({', '.join([*columns, fence_col])})"
        f" VALUES ({', '.join([*placeholders, stmt.bind(fence)])})"
        f" ON CONFLICT ({key_col}) DO UPDATE SET {', '.join(updates)}"
        f" WHERE {name}.{fence_col} <= excluded.{fence_col}"
    )
    return _execute(conn, sql, stmt.params) > 0


def insert_once(
    conn: DBAPIConnection, table: str, values: Mapping[str, Any], key_column: str,
    *, paramstyle: str | None = None,
) -> bool:
    """``INSERT ... ON CONFLICT (key_column) DO NOTHING``: the idempotency-key pattern.

    The unique constraint on ``key_column`` (in ``values``) is what makes a side effect happen
    once, whatever the locks did: a duplicate run, a retry after a lost reply, a stale holder
    all insert the same key and all but the first are ignored. Returns True if this call
    inserted the row, False if the key was already there. Does not commit.
    PostgreSQL >= 9.5, SQLite >= 3.24.
    """
    _columns(values, "values")
    if key_column not in values:
        raise ValueError(f"values must contain the key column {key_column!r}")
    stmt = _Statement(paramstyle or detect_paramstyle(conn))
    columns = [_ident(col) for col in values]
    placeholders = [stmt.bind(value) for value in values.values()]
    sql = (
        f"INSERT INTO {_table(table)} ({', '.join(columns)}) VALUES ({', '.join(placeholders)})"
        f" ON CONFLICT ({_ident(key_column, 'key column')}) DO NOTHING"
    )
    return _execute(conn, sql, stmt.params) > 0
