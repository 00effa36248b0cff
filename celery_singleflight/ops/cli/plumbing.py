"""What the CLI's commands share: exit codes, errors turned into one line, the key named on the
command line (or rendered from a task's arguments), and the run a command acts on."""

from __future__ import annotations

import contextlib
import inspect
import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn, TypeVar, cast

import click
import redis
from celery.bin.base import CeleryOption, handle_preload_options

from ...config.settings import redis_url_for
from ...connection.clients import redacted_url
from ...errors import ConfigurationError, KeyTemplateError
from ...keys import DIGEST_MARK
from ...worker.registry import guarded_tasks, known_slots
from ..keystatus import KeyStatus
from ..status import StatusReader, reader
from .format import duration, where_text

__all__ = ["EXIT_AMBIGUOUS", "EXIT_CONFIG", "EXIT_ENDED_OTHERWISE", "EXIT_INTERRUPTED", "EXIT_NOT_HELD",
           "EXIT_OK", "EXIT_REDIS", "EXIT_TIMEOUT", "app_of", "choose_run", "exit_with", "handled",
           "held_runs", "key_and_reader", "namespace_option", "not_held", "option", "preload",
           "reader_of"]

EXIT_OK = 0
EXIT_NOT_HELD = 1
EXIT_CONFIG = 2
EXIT_REDIS = 3
EXIT_ENDED_OTHERWISE = 4
EXIT_TIMEOUT = 5
EXIT_AMBIGUOUS = 6
EXIT_INTERRUPTED = 130

_F = TypeVar("_F", bound=Callable[..., Any])
_GROUP = "Singleflight Options"


def preload(func: _F) -> _F:
    """Celery's ``handle_preload_options``, typed (celery ships no types)."""
    return cast(_F, handle_preload_options(func))


def exit_with(ctx: click.Context, code: int, message: str | None = None) -> NoReturn:
    if message:
        click.echo(message, err=True)
    ctx.exit(code)
    raise AssertionError("unreachable")  # ctx.exit always raises


def app_of(ctx: click.Context) -> Any:
    return ctx.obj.app


@contextlib.contextmanager
def handled(ctx: click.Context) -> Iterator[None]:
    """Turn configuration and Redis errors into one line on stderr and an exit code."""
    try:
        yield
    except ConfigurationError as exc:
        exit_with(ctx, EXIT_CONFIG, f"Error: configuration: {exc}")
    except redis.RedisError as exc:
        what = "unreachable" if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)) else "error"
        url = ""
        with contextlib.suppress(Exception):
            url = f" at {redacted_url(redis_url_for(app_of(ctx).conf))}"
        detail = " ".join(str(exc).split()) or type(exc).__name__
        exit_with(ctx, EXIT_REDIS, f"Error: Redis {what}{url}: {detail}")
    except KeyboardInterrupt:
        exit_with(ctx, EXIT_INTERRUPTED, "interrupted")


#: where ``--namespace`` leaves its value for the command's readers
_NAMESPACE = "celery_singleflight.namespace"


def _remember_namespace(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        ctx.meta[_NAMESPACE] = value
    return value


#: ``--namespace NS``: the keys of tasks that have their own ``lock_namespace``
namespace_option = click.option(
    "--namespace", default=None, metavar="NS", expose_value=False, callback=_remember_namespace,
    cls=CeleryOption, help_group=_GROUP,
    help="The lock_namespace of tasks that have their own (default: singleflight_namespace).",
)


def reader_of(ctx: click.Context) -> StatusReader:
    try:
        return reader(app_of(ctx), ctx.meta.get(_NAMESPACE))
    except ValueError as exc:  # ConfigurationError, or a Redis URL redis-py cannot parse
        exit_with(ctx, EXIT_CONFIG, f"Error: configuration: {exc}")


def not_held(
    ctx: click.Context, key: str, st: KeyStatus | None, verb: str = "is not held", slot: int = 0
) -> NoReturn:
    where = where_text(key, slot)
    if st is not None:
        ended = f"{duration(time.time() - st.ended)} ago" if st.ended is not None else "earlier"
        exit_with(ctx, EXIT_NOT_HELD, f"{where} {verb}: its last run ended {st.outcome or st.state} {ended}")
    hint = ""
    if DIGEST_MARK not in key:
        hint = (
            "\nhint: give the key as `celery singleflight ls` shows it (a plain name renders bare:"
            " job:a, not job:\"a\"), or name the task and its arguments: --task NAME ARGS..."
        )
    exit_with(ctx, EXIT_NOT_HELD, f"{where} {verb}: nothing is known about it{hint}")


def key_and_reader(
    ctx: click.Context, words: tuple[str, ...], task_name: str | None
) -> tuple[str, StatusReader]:
    """The key named on the command line (one word), or rendered from a task's arguments with
    ``--task``, and the reader of its namespace (a task may have its own ``lock_namespace``)."""
    if task_name is None:
        if len(words) != 1:
            exit_with(ctx, EXIT_CONFIG, "Error: give one KEY (as `ls` prints it), or --task NAME and its"
                  " arguments")
        return words[0], reader_of(ctx)
    app = app_of(ctx)
    tasks = {task.name: task for task in guarded_tasks(app)}
    task = tasks.get(task_name)
    if task is None:
        known = ", ".join(tasks) or "none"
        exit_with(ctx, EXIT_CONFIG,
              f"Error: no SingleFlightTask named {task_name!r} in this app (guarded tasks: {known})")
    args, kwargs = _call_of(words, task)
    try:
        key = str(task.render_key(*args, **kwargs))
    except (KeyTemplateError, TypeError) as exc:
        exit_with(ctx, EXIT_CONFIG, f"Error: {task_name} {' '.join(words)}: {exc}")
    asked = ctx.meta.get(_NAMESPACE)
    if asked is not None and asked != task.options.namespace:
        exit_with(ctx, EXIT_CONFIG, f"Error: --namespace {asked} is not the namespace of {task_name}"
                  f" ({task.options.namespace}); leave --namespace out with --task")
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


def held_runs(ctx: click.Context, status_reader: StatusReader, key: str) -> list[KeyStatus]:
    """Every held slot of KEY, by slot, in one round trip: the slots the app's tasks can have are
    read directly (no SCAN, whose cost grows with the whole keyspace, and no +scan needed)."""
    return status_reader.read_all(key, slots=known_slots(app_of(ctx)))


def _held_text(runs: Iterable[KeyStatus]) -> str:
    return ", ".join(f"slot {st.slot}: task {st.task_id or '<unknown>'}" for st in runs)


def choose_run(
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
            not_held(ctx, key, st, slot=slot)
        if holder and st.task_id != holder:
            failed([st])
            exit_with(ctx, EXIT_NOT_HELD,
                      f"{where_text(key, slot)} is held by task {st.task_id}, not by {holder}")
        return st
    runs = held_runs(ctx, status_reader, key)
    if holder:
        chosen = [st for st in runs if st.task_id == holder]
        if not chosen:
            failed(runs)
            held = f"; held: {_held_text(runs)}" if runs else ""
            exit_with(ctx, EXIT_NOT_HELD, f"no slot of key {key} is held by task {holder}{held}")
        return chosen[0]
    if not runs:
        failed([])
        not_held(ctx, key, status_reader.read(key))
    if len(runs) > 1:
        failed(runs)
        exit_with(
            ctx, EXIT_AMBIGUOUS,
            f"key {key} is held by {len(runs)} runs ({_held_text(runs)}):"
            " choose one with --slot N or --holder TASK_ID",
        )
    return runs[0]


def option(*names: str, **kwargs: Any) -> Callable[[_F], _F]:
    return click.option(*names, cls=CeleryOption, help_group=_GROUP, **kwargs)

