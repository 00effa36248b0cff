"""The commands of ``celery singleflight`` (see :mod:`.` for what each does and its exit codes)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import click
import redis
from celery.bin.base import CeleryCommand
from redis.exceptions import RedisClusterException

from ...config.options import app_options
from ...connection.clients import redis_client
from ...connection.targets import is_cluster, redis_database
from ...protocol import server
from ...protocol.servers import ServerKind, server_kind
from ...worker.registry import guarded_tasks, known_slots, slots_of
from ..acl import acl_rule
from ..keystatus import KeyStatus, WatchEvent
from ..timestatus import read_time_status
from .format import (
    duration,
    event_line,
    holder_text,
    json_text,
    progress_text,
    released_by,
    status_lines,
    status_table,
    time_lines,
    waiting_lines,
    where_text,
)
from .plumbing import (
    EXIT_ENDED_OTHERWISE,
    EXIT_NOT_HELD,
    EXIT_TIMEOUT,
    app_of,
    choose_run,
    exit_with,
    handled,
    held_runs,
    key_and_reader,
    namespace_option,
    not_held,
    option,
    preload,
    reader_of,
)

__all__ = ["singleflight"]

_json_option = option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")
_slot_option = option(
    "--slot", type=click.IntRange(min=0), default=None, metavar="N",
    help="The run on slot N of a max_concurrency > 1 key (0 is the first; see `ls`).",
)
_holder_option = option(
    "--holder", default=None, metavar="TASK_ID",
    help="The run of task TASK_ID, on whichever slot of the key it holds.",
)

#: how many waiting runs ``show`` lists (the first ones, with their position and ETA)
_SHOWN_WAITING = 20


@click.group(name="singleflight")
@click.pass_context
@preload
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
@option("--prefix", default="", metavar="PREFIX", help="Only keys that start with PREFIX (e.g. 'sync:').")
@_json_option
@namespace_option
@click.pass_context
def ls(ctx: click.Context, prefix: str, as_json: bool) -> None:
    """List the held keys: holder task, state, progress, age and lease time left.

    One row per running run: a max_concurrency > 1 key has a row per held slot (and a SLOT
    column is shown). Prints a line saying so (exit 0) when no key is held; --json prints a
    list of statuses (each with its "slot").
    """
    with handled(ctx):
        rows = reader_of(ctx).held(prefix)
    if as_json:
        click.echo(json_text([st.as_dict() for st in rows]))
        return
    if not rows:
        starting = f" starting with {prefix!r}" if prefix else ""
        click.echo(f"no keys{starting} are held")
        return
    for line in status_table(rows):
        click.echo(line)


_task_option = option(
    "--task", "task_name", default=None, metavar="NAME",
    help="Name a task: the arguments that follow are its arguments, and the key is rendered from them.",
)


@singleflight.command(cls=CeleryCommand)
@click.argument("words", nargs=-1, metavar="KEY | --task NAME ARGS...")
@_task_option
@_json_option
@namespace_option
@click.pass_context
def show(ctx: click.Context, words: tuple[str, ...], task_name: str | None, as_json: bool) -> None:
    """Everything known about KEY: holder, state, progress, times (ISO and relative).

    Exits 0 when the key is held and 1 when it is not: for a run that ended (its status is kept
    for singleflight_status_retention seconds) it still prints the status with its outcome; for
    an unknown key it prints "not held" on stderr (and `null` with --json).

    A max_concurrency > 1 key with several slots held prints each held slot (a block each, with
    its slot); --json prints the first held slot's status with all of them under "slots".
    """
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, words, task_name)
        runs = held_runs(ctx, status_reader, key)
        st = runs[0] if runs else status_reader.read(key)
        timing = read_time_status(status_reader.store, key)
        waiting = status_reader.store.fair.waiters(key, slots_of(app_of(ctx), key), limit=_SHOWN_WAITING)
    if as_json:
        shown = None if st is None else {**st.as_dict(), "slots": [r.as_dict() for r in runs]}
        if not timing.empty:
            shown = {**(shown or {"key": key}), "time": timing.as_dict()}
        if waiting:
            shown = {**(shown or {"key": key}), "waiting": [w.as_dict() for w in waiting]}
        click.echo(json_text(shown))
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
        for line in (*time_lines(timing), *waiting_lines(waiting)):
            click.echo(line)
    if not runs:
        not_held(ctx, key, st)


@singleflight.command(cls=CeleryCommand)
@click.argument("words", nargs=-1, metavar="KEY | --task NAME ARGS...")
@_task_option
@_slot_option
@_holder_option
@_json_option
@option(
    "--timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
    help="Give up after SECONDS (exit 5) if the run has not ended by then.",
)
@namespace_option
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
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, words, task_name)
        st = choose_run(ctx, status_reader, key, slot, holder)
        events = status_reader.watch(key, timeout=timeout, slot=st.slot)
        if as_json:
            last = _followjson_text(key, events, st.slot)
        elif _rich_wanted():
            last = _follow_rich(st, events, no_color)
        else:
            click.echo(f"watching {holder_text(st)}", err=True)
            last = _follow_plain(events)
    if last is None or not last.final:
        if timeout is not None:
            exit_with(ctx, EXIT_TIMEOUT,
                      f"timed out after {duration(timeout)}: the run on {where_text(key, st.slot)} goes on")
        exit_with(ctx, EXIT_ENDED_OTHERWISE,
                  f"the run on {where_text(key, st.slot)} ended; its outcome is unknown")
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


def _followjson_text(key: str, events: Iterator[WatchEvent], slot: int = 0) -> WatchEvent | None:
    last = None
    place: dict[str, Any] = {"key": key, "slot": slot} if slot else {"key": key}
    for event in events:
        click.echo(json_text({**place, **event.as_dict()}, indent=None))
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
@option("-f", "--force", is_flag=True, help="Do not ask for confirmation.")
@_json_option
@namespace_option
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
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, words, task_name)

    def failed(runs: list[KeyStatus]) -> None:
        if as_json:
            answer: dict[str, Any] = {"key": key, "released": False, "task_id": None, "by": by}
            if runs:
                answer["held"] = [{"slot": run.slot, "task_id": run.task_id} for run in runs]
            click.echo(json_text(answer))

    with handled(ctx):
        st = choose_run(ctx, status_reader, key, slot, holder, failed)
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
                exit_with(ctx, EXIT_NOT_HELD, "aborted")
        app = app_of(ctx)
        released = status_reader.force_release(key, by, expected_holder=st.task_id or "", slot=st.slot,
                                               slots=known_slots(app), ttl=app_options(app).ttl)
    if as_json:
        answer: dict[str, Any] = {"key": key, "released": released is not None, "task_id": released, "by": by}
        if st.slot:
            answer["slot"] = st.slot
        click.echo(json_text(answer))
    where = where_text(key, st.slot)
    if released is None:
        with handled(ctx):
            now = status_reader.read(key, st.slot)
        if now is not None and now.held:
            exit_with(ctx, EXIT_NOT_HELD,
                      f"not released: {where} is now held by another task ({now.task_id})")
        not_held(ctx, key, now, verb="was not released", slot=st.slot)
    if not as_json:
        click.echo(f"released {where}, held by task {released}")


def _server_of(client: Any) -> ServerKind | None:
    """The family and version of the server ``client`` talks to, from HELLO (None: no answer)."""
    try:
        if is_cluster(client):  # any node: they run one server
            client = client.get_redis_connection(client.get_default_node())
        return server_kind({}, server.hello(client))
    except (redis.RedisError, RedisClusterException, OSError, ValueError):
        return None


@singleflight.command(cls=CeleryCommand)
@option("--user", default="singleflight", metavar="USER", help="The ACL user name (default: singleflight).")
@option("--password", default="PASSWORD", metavar="PASSWORD",
         help="The password to put in the rule (default: the placeholder PASSWORD).")
@click.pass_context
def acl(ctx: click.Context, user: str, password: str) -> None:
    """Print the least-privilege Redis ACL rule for the app's lease Redis.

    The user may touch only the keys of the app's namespace and run only the commands the library
    sends (docs: Operations). Adds SELECT when the lease database is not 0, the commands of
    redis-py's cluster client for a Cluster, and those of the time policies when a task uses one.
    Asks the server its version (HELLO, which needs no permission): what redis-py sends on each
    new connection is granted as that server names it.
    Run the line printed on every node of a Cluster or, with Sentinel, on the master and every
    replica (replicas take ACLs from their own config, not by replication).
    """
    with handled(ctx):
        app = app_of(ctx)
        opts = app_options(app)
        target = opts.redis
        database = 0
        if target.scheme in ("redis", "rediss", "unix", "sentinel"):
            database = redis_database(target.url)
        timed = any(stage.acl_commands for task in guarded_tasks(app) for stage in task.pipeline.stages)
        kind = _server_of(redis_client(target))
        rule = acl_rule(opts.namespace, password, database=database, cluster=target.cluster,
                        time_policies=timed, server=kind)
    if kind is None:
        click.echo("the lease Redis did not answer HELLO: this rule is for Redis 7.2 and later and Valkey;"
                   " on Redis 7.0 or 7.1 leave out +client|setinfo, on Redis 6.2 add"
                   " +client|maint_notifications", err=True)
    click.echo(f"ACL SETUSER {user} " + " ".join(rule))
