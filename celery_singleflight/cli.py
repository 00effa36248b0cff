"""``celery singleflight``: see and operate the keys of an app from the command line.

Installed as a Celery command plugin (entry point group ``celery.commands``), so it runs with
the app's own configuration::

    celery -A proj singleflight ls [--prefix P] [--json]       the held keys, one row per run
    celery -A proj singleflight show KEY [--json]              everything known about one key
    celery -A proj singleflight show --task NAME ARGS...        the same, by the task's arguments
    celery -A proj singleflight watch KEY [--slot N | --holder ID] [--json] [--timeout S]
                                                                follow a run live until it ends
    celery -A proj singleflight release KEY [--slot N | --holder ID] [--force] [--json]
                                                                free a key whoever holds it

KEY is the rendered key as ``ls`` prints it: ``job:a`` for ``lock_key="job:<name>"`` called with
``name="a"`` (a string that is not a plain name keeps its JSON quotes: ``'job:"a b"'``). With
``--task NAME``, ``show``, ``watch`` and ``release`` take the task's arguments instead, bound as
the task binds them: each word is read as JSON when it parses (``42``, ``'"42"'``, ``'[1,2]'``),
else as a string, and ``param=value`` passes ``param`` by name
(``celery -A proj singleflight show --task proj.sync_account 42``).

A key of a task with ``max_concurrency=N`` > 1 has one lease per slot (0 to N-1). ``ls`` lists
every held slot as its own row (with a SLOT column when a row's slot is not 0), ``show`` prints
every held slot of the key, and ``watch`` and ``release`` act on one run: the only one held, or
the one chosen with ``--slot N`` or ``--holder TASK_ID``. With several slots held and neither
option, they refuse (exit 6) and list the held slots rather than pick one. The slots read are
those the app's tasks can have (their largest ``max_concurrency``), in one round trip.

``watch`` draws a live progress bar when stdout is a terminal and ``rich`` is installed
(``pip install celery-singleflight[cli]``), and prints one line per event otherwise; with
``--json`` it prints one JSON object per event (JSON lines), the last one of kind ``end``.

Exit codes:

====  =====================================================================================
0     success: ``ls`` listed (even nothing), ``show`` found the key held, ``watch`` saw the
      run end with outcome ``succeeded``, ``release`` released the key
1     the key is not held: unknown, or its last run ended (``show`` still prints an ended
      run), ``watch`` of a key not held when it starts, ``release`` of a free key (or of a
      key that changed hands before the confirmation), or ``release`` declined ("aborted")
2     configuration error (e.g. no Redis URL), with the message; click's usage errors
      (a missing argument, an unknown option) exit 2 as well
3     Redis unreachable or answering with an error (one line on stderr, no traceback)
4     ``watch``: the run ended with another outcome than ``succeeded`` (failed, revoked,
      lost, force-released, expired, ...)
5     ``watch``: ``--timeout`` passed before the run ended
6     ``watch`` or ``release`` without ``--slot`` or ``--holder`` on a key with several held
      slots (a ``max_concurrency`` > 1 key): nothing is done, the held slots are listed
130   interrupted (Ctrl-C)
====  =====================================================================================
"""

from __future__ import annotations

import contextlib
import datetime as dt
import getpass
import inspect
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TypeVar, cast

import click
import redis
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from .acl import acl_rule
from .clients import redis_database
from .connection import redacted_url
from .errors import ConfigurationError, KeyTemplateError
from .registry import guarded_tasks, known_slots
from .settings import app_options, redis_url_for
from .status import KeyStatus, StatusReader, WatchEvent, reader
from .timestatus import TimeStatus, read_time_status

__all__ = [
    "EXIT_AMBIGUOUS",
    "EXIT_CONFIG",
    "EXIT_ENDED_OTHERWISE",
    "EXIT_NOT_HELD",
    "EXIT_OK",
    "EXIT_REDIS",
    "EXIT_TIMEOUT",
    "singleflight",
]

EXIT_OK = 0
EXIT_NOT_HELD = 1
EXIT_CONFIG = 2
EXIT_REDIS = 3
EXIT_ENDED_OTHERWISE = 4
EXIT_TIMEOUT = 5
EXIT_AMBIGUOUS = 6
EXIT_INTERRUPTED = 130

_F = TypeVar("_F", bound=Callable[..., Any])
_DIGEST_MARK = "~sha256v1~"
_GROUP = "Singleflight Options"


# -- formatting ---------------------------------------------------------------------------


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def progress_text(current: float | None, total: float | None, percent: float | None) -> str:
    """``3/10 30%``, ``3`` without a total, ``-`` without progress."""
    if current is None:
        return "-"
    text = _number(current)
    if total is not None:
        text += f"/{_number(total)}"
    if percent is not None:
        text += f" {percent:.0f}%"
    return text


def duration(seconds: float | None) -> str:
    """A short duration: ``4.2s``, ``3m05s``, ``2h07m``, ``3d04h``; ``-`` if unknown."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def when(ts: float | None, now: float | None = None) -> str:
    """An epoch time as local ISO 8601 plus how long ago (or from now) it is."""
    if ts is None:
        return "-"
    now = time.time() if now is None else now
    iso = dt.datetime.fromtimestamp(ts).astimezone().isoformat(timespec="milliseconds")
    delta = now - ts
    rel = f"{duration(delta)} ago" if delta >= 0 else f"in {duration(-delta)}"
    return f"{iso} ({rel})"


def _short(task_id: str | None) -> str:
    return task_id[:8] if task_id else "-"


def _json(value: Any, *, indent: int | None = 2) -> str:
    return json.dumps(value, indent=indent, default=str, ensure_ascii=False)


def status_table(rows: Iterable[KeyStatus]) -> list[str]:
    """The ``ls`` table: one aligned line per held key (per held slot), under a header.

    A SLOT column follows KEY when a row's slot is not 0 (a ``max_concurrency`` > 1 key).
    """
    rows = list(rows)
    slots = any(st.slot for st in rows)
    header: tuple[str, ...] = ("KEY", "TASK ID", "TASK", "STATE", "PROGRESS", "AGE", "TTL")
    if slots:
        header = ("KEY", "SLOT", *header[1:])
    lines = [header]
    for st in rows:
        slot = (str(st.slot),) if slots else ()
        lines.append((
            st.key, *slot, _short(st.task_id), st.task_name or "-", st.state,
            progress_text(st.current, st.total, st.percent), duration(st.age), duration(st.ttl_left),
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip() for line in lines]


def status_lines(st: KeyStatus, now: float | None = None, slot: bool | None = None) -> list[str]:
    """Every field of a :class:`KeyStatus`, one ``name: value`` line each.

    The ``slot`` line is shown when ``slot`` is true, or (by default) when the slot is not 0.
    """
    held = "yes" if st.held else f"no (the run ended: {st.outcome or st.state})"
    pid = "-" if st.pid is None else str(st.pid)
    rows: list[tuple[str, str]] = [("key", st.key)]
    if slot or (slot is None and st.slot):
        rows.append(("slot", str(st.slot)))
    rows += [
        ("held", held),
        ("state", st.state),
        ("outcome", st.outcome or "-"),
        ("task id", st.task_id or "-"),
        ("task name", st.task_name or "-"),
        ("worker", st.worker or "-"),
        ("host / pid", f"{st.host or '-'} / {pid}"),
        ("fence", "-" if st.fence is None else str(st.fence)),
        ("progress", progress_text(st.current, st.total, st.percent)),
        ("message", st.message if st.message is not None else "-"),
        ("fields", _json(st.fields, indent=None) if st.fields else "-"),
        ("started", when(st.started, now)),
        ("updated", when(st.updated, now)),
        ("ended", when(st.ended, now)),
        ("age", duration(st.age)),
        ("ttl left", duration(st.ttl_left)),
        ("queued", str(st.queued)),
        ("released by", st.released_by or "-"),
        ("args", "-" if st.args is None else _json(st.args, indent=None)),
        ("previous", "-" if st.previous_task_id is None
         else f"{st.previous_task_id} ({st.previous_outcome or '?'})"),
    ]
    if st.superseded_by:  # only for a superseded run (on_duplicate="supersede")
        rows.append(("superseded by", st.superseded_by))
    shown = {"key", "held", "state", "outcome", "task_id", "task_name", "worker", "host", "pid", "fence",
             "current", "total", "percent", "message", "fields", "started", "updated", "ended", "age",
             "ttl_left", "queued", "released_by", "args", "slot", "previous_task_id", "previous_outcome",
             "superseded_by"}
    for name, value in st.as_dict().items():  # fields added to KeyStatus later
        if name not in shown:
            rows.append((name.replace("_", " "), "-" if value is None else _json(value, indent=None)))
    width = max(len(name) for name, _ in rows) + 1
    return [f"{(name + ':').ljust(width)} {value}" for name, value in rows]


def time_lines(ts: TimeStatus, now: float | None = None) -> list[str]:
    """The ``show`` lines of a key's time policies: its open debounce burst and its rate state."""
    lines = []
    if ts.debounce is not None:
        burst = ts.debounce
        lines.append(f"debounce:    {burst.calls} call(s) folded since {when(burst.first, now)},"
                     f" run planned {when(burst.planned, now)} as {_short(burst.leader)}")
    if ts.rate is not None:
        rate = ts.rate
        lines.append(f"rate limit:  next free slot {when(rate.next_free, now)}, {rate.planned} run(s) planned"
                     f" ({rate.per_second:g}/s)")
    return lines


def event_line(event: WatchEvent) -> str:
    """One plain-text line for a watch event."""
    stamp = "--:--:--.---"
    if event.ts is not None:
        stamp = dt.datetime.fromtimestamp(event.ts).strftime("%H:%M:%S.%f")[:-3]
    if event.kind == "end":
        by = event.fields.get("by")
        return f"{stamp} end {event.state}" + (f" by {by}" if by else "")
    parts = [stamp, event.kind, event.state or "-", progress_text(event.current, event.total, event.percent)]
    if event.message:
        parts.append(event.message)
    return " ".join(parts)


def holder_text(st: KeyStatus) -> str:
    """Who holds a key, in one line."""
    where = " ".join(p for p in (st.worker, f"pid {st.pid}" if st.pid else None) if p)
    return (
        f"{_where(st.key, st.slot)} is held by task {st.task_id or '<unknown>'}"
        + f" ({st.task_name or 'unknown task'})"
        + (f" on {where}" if where else "")
        + f", {st.state} {progress_text(st.current, st.total, st.percent)}"
        + f", for {duration(st.age)}, lease left {duration(st.ttl_left)}"
    )


def _where(key: str, slot: int | None) -> str:
    """``key K``, or ``key K (slot N)`` for a slot other than 0."""
    return f"key {key}" + (f" (slot {slot})" if slot else "")


def released_by() -> str:
    """``user@host (celery singleflight release)``, recorded with a force-release."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (e.g. an arbitrary container uid)
        user = f"uid{os.getuid()}" if hasattr(os, "getuid") else "unknown"
    return f"{user}@{socket.gethostname()} (celery singleflight release)"


# -- plumbing -----------------------------------------------------------------------------


def _preload(func: _F) -> _F:
    """Celery's ``handle_preload_options``, typed (celery ships no types)."""
    return cast(_F, handle_preload_options(func))


def _exit(ctx: click.Context, code: int, message: str | None = None) -> NoReturn:
    if message:
        click.echo(message, err=True)
    ctx.exit(code)
    raise AssertionError("unreachable")  # ctx.exit always raises


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


@contextlib.contextmanager
def _handled(ctx: click.Context) -> Iterator[None]:
    """Turn configuration and Redis errors into one line on stderr and an exit code."""
    try:
        yield
    except ConfigurationError as exc:
        _exit(ctx, EXIT_CONFIG, f"Error: configuration: {exc}")
    except redis.RedisError as exc:
        what = "unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) else "error"
        url = ""
        with contextlib.suppress(Exception):
            url = f" at {redacted_url(redis_url_for(_app(ctx).conf))}"
        detail = " ".join(str(exc).split()) or type(exc).__name__
        _exit(ctx, EXIT_REDIS, f"Error: Redis {what}{url}: {detail}")
    except KeyboardInterrupt:
        _exit(ctx, EXIT_INTERRUPTED, "interrupted")


def _reader(ctx: click.Context) -> StatusReader:
    try:
        return reader(_app(ctx))
    except ValueError as exc:  # ConfigurationError, or a Redis URL redis-py cannot parse
        _exit(ctx, EXIT_CONFIG, f"Error: configuration: {exc}")


def _not_held(
    ctx: click.Context, key: str, st: KeyStatus | None, verb: str = "is not held", slot: int = 0
) -> NoReturn:
    where = _where(key, slot)
    if st is not None:
        ended = f"{duration(time.time() - st.ended)} ago" if st.ended is not None else "earlier"
        _exit(ctx, EXIT_NOT_HELD, f"{where} {verb}: its last run ended {st.outcome or st.state} {ended}")
    hint = ""
    if _DIGEST_MARK not in key:
        hint = (
            "\nhint: give the key as `celery singleflight ls` shows it (a plain name renders bare:"
            " job:a, not job:\"a\"), or name the task and its arguments: --task NAME ARGS..."
        )
    _exit(ctx, EXIT_NOT_HELD, f"{where} {verb}: nothing is known about it{hint}")


def _target(ctx: click.Context, words: tuple[str, ...], task_name: str | None) -> tuple[str, StatusReader]:
    """The key named on the command line (one word), or rendered from a task's arguments with
    ``--task``, and the reader of its namespace (a task may have its own ``lock_namespace``)."""
    if task_name is None:
        if len(words) != 1:
            _exit(ctx, EXIT_CONFIG, "Error: give one KEY (as `ls` prints it), or --task NAME and its"
                  " arguments")
        return words[0], _reader(ctx)
    app = _app(ctx)
    tasks = {task.name: task for task in guarded_tasks(app)}
    task = tasks.get(task_name)
    if task is None:
        known = ", ".join(tasks) or "none"
        _exit(ctx, EXIT_CONFIG,
              f"Error: no SingleFlightTask named {task_name!r} in this app (guarded tasks: {known})")
    args, kwargs = _call_of(words, task)
    try:
        key = str(task.render_key(*args, **kwargs))
    except (KeyTemplateError, TypeError) as exc:
        _exit(ctx, EXIT_CONFIG, f"Error: {task_name} {' '.join(words)}: {exc}")
    return key, StatusReader(task.store, app)


def _call_of(words: tuple[str, ...], task: Any) -> tuple[list[Any], dict[str, Any]]:
    """Positional and keyword arguments from command-line words: JSON where a word parses as
    JSON, else the word as a string; ``param=value`` for a parameter of the task."""
    def value(text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            return text

    try:
        params = inspect.signature(task.run).parameters
    except (TypeError, ValueError):
        params = {}  # type: ignore[assignment]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for word in words:
        name, sep, text = word.partition("=")
        if sep and name.isidentifier() and (name in params or takes_any):
            kwargs[name] = value(text)
        else:
            args.append(value(word))
    return args, kwargs


def _held_runs(ctx: click.Context, status_reader: StatusReader, key: str) -> list[KeyStatus]:
    """Every held slot of KEY, by slot, in one round trip: the slots the app's tasks can have are
    read directly (no SCAN, whose cost grows with the whole keyspace, and no +scan needed)."""
    return status_reader.read_all(key, slots=known_slots(_app(ctx)))


def _held_text(runs: Iterable[KeyStatus]) -> str:
    return ", ".join(f"slot {st.slot}: task {st.task_id or '<unknown>'}" for st in runs)


def _choose_run(
    ctx: click.Context, status_reader: StatusReader, key: str, slot: int | None, holder: str | None,
    failed: Callable[[list[KeyStatus]], None] = lambda runs: None,
) -> KeyStatus:
    """The held run of KEY that ``--slot`` and ``--holder`` choose, else the only one held.

    Exits 1 if it is not held (or nothing is), and 6 if several slots are held and neither
    option chose one; ``failed`` is called first (with the held runs), e.g. to print JSON.
    """
    if slot is not None:
        st = status_reader.read(key, slot)
        if st is None or not st.held:
            failed([])
            _not_held(ctx, key, st, slot=slot)
        if holder and st.task_id != holder:
            failed([st])
            _exit(ctx, EXIT_NOT_HELD, f"{_where(key, slot)} is held by task {st.task_id}, not by {holder}")
        return st
    runs = _held_runs(ctx, status_reader, key)
    if holder:
        chosen = [st for st in runs if st.task_id == holder]
        if not chosen:
            failed(runs)
            held = f"; held: {_held_text(runs)}" if runs else ""
            _exit(ctx, EXIT_NOT_HELD, f"no slot of key {key} is held by task {holder}{held}")
        return chosen[0]
    if not runs:
        failed([])
        _not_held(ctx, key, status_reader.read(key))
    if len(runs) > 1:
        failed(runs)
        _exit(
            ctx, EXIT_AMBIGUOUS,
            f"key {key} is held by {len(runs)} runs ({_held_text(runs)}):"
            " choose one with --slot N or --holder TASK_ID",
        )
    return runs[0]


def _option(*names: str, **kwargs: Any) -> Callable[[_F], _F]:
    return click.option(*names, cls=CeleryOption, help_group=_GROUP, **kwargs)


_json_option = _option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
_slot_option = _option(
    "--slot", type=click.IntRange(min=0), default=None, metavar="N",
    help="The run on slot N of a max_concurrency > 1 key (0 is the first; see `ls`).",
)
_holder_option = _option(
    "--holder", default=None, metavar="TASK_ID",
    help="The run of task TASK_ID, on whichever slot of the key it holds.",
)


# -- commands -----------------------------------------------------------------------------


@click.group(name="singleflight")
@click.pass_context
@_preload
def singleflight(ctx: click.Context, /, **kwargs: Any) -> None:
    """See and operate celery_singleflight keys: who holds them, their progress, force-release.

    KEY is the rendered key as `ls` shows it (job:a; a string that is not a plain name keeps its
    JSON quotes: 'job:"a b"'), or --task NAME followed by the task's arguments. Exit codes: 0 ok,
    1 not held / aborted, 2 configuration, 3 Redis unreachable, 4 watched run did not succeed,
    5 watch timed out, 6 several slots of the key are held: choose one with --slot or --holder.
    """
    if not logging.getLogger().handlers:
        # an operator's action (force-release) is logged with when and at which level
        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


@singleflight.command(cls=CeleryCommand)
@_option("--prefix", default="", metavar="PREFIX", help="Only keys that start with PREFIX (e.g. 'sync:').")
@_json_option
@click.pass_context
def ls(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """List the held keys: holder task, state, progress, age and lease time left.

    One row per running run: a max_concurrency > 1 key has a row per held slot (and a SLOT
    column is shown). Prints a line saying so (exit 0) when no key is held; --json prints a
    list of statuses (each with its "slot").
    """
    with _handled(ctx):
        rows = _reader(ctx).held(prefix)
    if as_json:
        click.echo(_json([st.as_dict() for st in rows]))
        return
    if not rows:
        where = f" starting with {prefix!r}" if prefix else ""
        click.echo(f"no keys{where} are held")
        return
    for line in status_table(rows):
        click.echo(line)


_task_option = _option(
    "--task", "task_name", default=None, metavar="NAME",
    help="Name a task: the arguments that follow are its arguments, and the key is rendered from them.",
)


@singleflight.command(cls=CeleryCommand)
@click.argument("words", nargs=-1, metavar="KEY | --task NAME ARGS...")
@_task_option
@_json_option
@click.pass_context
def show(ctx: click.Context, words: tuple[str, ...], task_name: str | None, as_json: bool) -> None:
    """Everything known about KEY: holder, state, progress, times (ISO and relative).

    Exits 0 when the key is held and 1 when it is not: for a run that ended (its status is kept
    for singleflight_status_retention seconds) it still prints the status with its outcome; for
    an unknown key it prints "not held" on stderr (and `null` with --json).

    A max_concurrency > 1 key with several slots held prints each held slot (a block each, with
    its slot); --json prints the first held slot's status with all of them under "slots".
    """
    with _handled(ctx):
        key, status_reader = _target(ctx, words, task_name)
        runs = _held_runs(ctx, status_reader, key)
        st = runs[0] if runs else status_reader.read(key)
        timing = read_time_status(status_reader.store, key)
    if as_json:
        shown = None if st is None else {**st.as_dict(), "slots": [r.as_dict() for r in runs]}
        if not timing.empty:
            shown = {**(shown or {"key": key}), "time": timing.as_dict()}
        click.echo(_json(shown))
    elif runs:
        several = len(runs) > 1
        for i, run in enumerate(runs):
            if i:
                click.echo("")
            for line in status_lines(run, slot=several or None):
                click.echo(line)
    elif st is not None:
        for line in status_lines(st):
            click.echo(line)
    if not as_json:
        for line in time_lines(timing):
            click.echo(line)
    if not runs:
        _not_held(ctx, key, st)


@singleflight.command(cls=CeleryCommand)
@click.argument("words", nargs=-1, metavar="KEY | --task NAME ARGS...")
@_task_option
@_slot_option
@_holder_option
@_json_option
@_option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
    help="Give up after SECONDS (exit 5) if the run has not ended by then.",
)
@click.pass_context
def watch(
    ctx: click.Context, words: tuple[str, ...], task_name: str | None, slot: int | None, holder: str | None,
    as_json: bool, timeout: float | None,
) -> None:
    """Follow the run holding KEY live (its history first) until it ends.

    A progress bar when stdout is a terminal and rich is installed, else one line per event;
    --json prints one JSON object per event. Exits 0 if the run succeeded, 4 if it ended
    otherwise (failed, revoked, lost, force-released, expired...), 1 if KEY is not held when
    the watch starts, 5 on --timeout. With several slots of KEY held (max_concurrency > 1),
    choose the run with --slot or --holder (else exit 6).
    """
    no_color = bool(getattr(ctx.obj, "no_color", False))
    with _handled(ctx):
        key, status_reader = _target(ctx, words, task_name)
        st = _choose_run(ctx, status_reader, key, slot, holder)
        events = status_reader.watch(key, timeout=timeout, slot=st.slot)
        if as_json:
            last = _follow_json(key, events, st.slot)
        elif _rich_wanted():
            last = _follow_rich(st, events, no_color)
        else:
            click.echo(f"watching {holder_text(st)}", err=True)
            last = _follow_plain(events)
    if last is None or not last.final:
        if timeout is not None:
            _exit(ctx, EXIT_TIMEOUT,
                  f"timed out after {duration(timeout)}: the run on {_where(key, st.slot)} goes on")
        _exit(ctx, EXIT_ENDED_OTHERWISE, f"the run on {_where(key, st.slot)} ended; its outcome is unknown")
    if last.state != "succeeded":
        ctx.exit(EXIT_ENDED_OTHERWISE)


def _rich_wanted() -> bool:
    if not sys.stdout.isatty():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


def _follow_json(key: str, events: Iterator[WatchEvent], slot: int = 0) -> WatchEvent | None:
    last = None
    where: dict[str, Any] = {"key": key, "slot": slot} if slot else {"key": key}
    for event in events:
        click.echo(_json({**where, **event.as_dict()}, indent=None))
        last = event
    return last


def _follow_plain(events: Iterator[WatchEvent]) -> WatchEvent | None:
    last = None
    for event in events:
        click.echo(event_line(event))
        last = event
    return last


def _follow_rich(st: KeyStatus, events: Iterator[WatchEvent], no_color: bool) -> WatchEvent | None:
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(no_color=no_color, highlight=False)
    console.print(
        f"watching [bold]{escape(st.key)}[/]" + (f" slot {st.slot}" if st.slot else "")
        + f" task {escape(st.task_id or '?')}"
        f" ({escape(st.task_name or 'unknown task')}); Ctrl-C stops watching, not the task"
    )
    last = None
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]{task.fields[state]}"),
        BarColumn(),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[message]}"),
        console=console,
    ) as bar:
        task = bar.add_task(st.key, total=None, state=escape(st.state), count="", message="")
        for event in events:
            last = event
            if not event.final and event.kind != "progress":  # e.g. a duplicate turned away
                bar.console.print(escape(event_line(event)))
                continue
            if event.final:
                if event.state == "succeeded":
                    total = bar.tasks[0].total
                    if total is not None:
                        bar.update(task, completed=total)
                bar.update(task, state=escape(event.state))
                break
            fields: dict[str, Any] = {
                "state": escape(event.state or "-"),
                "count": escape(progress_text(event.current, event.total, event.percent)),
                "message": escape(event.message or ""),
            }
            if event.total:
                fields["total"] = event.total
            if event.current is not None:
                fields["completed"] = event.current
            bar.update(task, **fields)
    if last is not None and last.final:
        by = last.fields.get("by")
        style = "green" if last.state == "succeeded" else "red"
        console.print(f"[{style}]{escape(last.state)}[/]" + (f" by {escape(str(by))}" if by else ""))
    return last


@singleflight.command(cls=CeleryCommand)
@click.argument("words", nargs=-1, metavar="KEY | --task NAME ARGS...")
@_task_option
@_slot_option
@_holder_option
@_option("-f", "--force", is_flag=True, help="Do not ask for confirmation.")
@_json_option
@click.pass_context
def release(
    ctx: click.Context, words: tuple[str, ...], task_name: str | None, slot: int | None, holder: str | None,
    force: bool, as_json: bool,
) -> None:
    """Force-release KEY, whoever holds it: the key is free at once.

    Shows the holder and asks first (default no) unless --force. Only the holder shown is
    released: if the key changed hands meanwhile, nothing is released (exit 1). The running task
    is not stopped; its heartbeat reports the lease lost. Recorded (status, history, a WARNING
    log and the lease_force_released signal) as released by user@host. Prints the released task
    id (exit 0); exit 1 if the key is not held or the confirmation is declined.

    A max_concurrency > 1 key: releases one slot, the only one held or the one chosen with
    --slot N or --holder TASK_ID; with several held and neither option, nothing is released
    and the held slots are listed (exit 6; --json lists them under "held").
    """
    by = released_by()
    with _handled(ctx):
        key, status_reader = _target(ctx, words, task_name)

    def failed(runs: list[KeyStatus]) -> None:
        if as_json:
            answer: dict[str, Any] = {"key": key, "released": False, "task_id": None, "by": by}
            if runs:
                answer["held"] = [{"slot": run.slot, "task_id": run.task_id} for run in runs]
            click.echo(_json(answer))

    with _handled(ctx):
        st = _choose_run(ctx, status_reader, key, slot, holder, failed)
        click.echo(holder_text(st), err=as_json)
        if not force:
            try:
                confirmed = click.confirm(
                    "Force-release it? The task keeps running without its lease", default=False,
                    err=as_json,
                )
            except click.Abort:  # end of input
                confirmed = False
            if not confirmed:
                _exit(ctx, EXIT_NOT_HELD, "aborted")
        app = _app(ctx)
        released = status_reader.force_release(key, by, expected_holder=st.task_id or "", slot=st.slot,
                                               slots=known_slots(app), ttl=app_options(app).ttl)
    if as_json:
        answer: dict[str, Any] = {"key": key, "released": released is not None, "task_id": released, "by": by}
        if st.slot:
            answer["slot"] = st.slot
        click.echo(_json(answer))
    where = _where(key, st.slot)
    if released is None:
        with _handled(ctx):
            now = status_reader.read(key, st.slot)
        if now is not None and now.held:
            _exit(ctx, EXIT_NOT_HELD, f"not released: {where} is now held by another task ({now.task_id})")
        _not_held(ctx, key, now, verb="was not released", slot=st.slot)
    if not as_json:
        click.echo(f"released {where}, held by task {released}")


@singleflight.command(cls=CeleryCommand)
@_option("--user", default="singleflight", metavar="USER", help="The ACL user name (default: singleflight).")
@_option("--password", default="PASSWORD", metavar="PASSWORD",
         help="The password to put in the rule (default: the placeholder PASSWORD).")
@click.pass_context
def acl(ctx: click.Context, user: str, password: str) -> None:
    """Print the least-privilege Redis ACL rule for the app's lease Redis.

    The user may touch only the keys of the app's namespace and run only the commands the library
    sends (docs: Operations). Adds SELECT when the lease database is not 0, the commands of
    redis-py's cluster client for a Cluster, and those of the time policies when a task uses one.
    Run the line printed on every node (a Cluster) or the master (Sentinel: replicas take ACLs
    from their own config, not by replication).
    """
    with _handled(ctx):
        app = _app(ctx)
        opts = app_options(app)
        target = opts.redis
        database = 0
        if target.scheme in ("redis", "rediss", "unix", "sentinel"):
            database = redis_database(target.url)
        timed = any(task._sf_rate is not None or task._sf_debounce is not None for task in guarded_tasks(app))
        rule = acl_rule(opts.namespace, password, database=database, cluster=target.cluster,
                        time_policies=timed)
    click.echo(f"ACL SETUSER {user} " + " ".join(rule))
