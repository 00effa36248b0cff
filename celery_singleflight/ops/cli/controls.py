"""The commands of ``celery singleflight`` that change a key at run time: ``pause``, ``resume``
and ``limit`` (see :mod:`..controls`)."""

from __future__ import annotations

import time
from typing import Any

import click
from celery.bin.base import CeleryCommand

from ...errors import ConfigurationError
from ...protocol.controls import Limits
from ...protocol.fair import gate_key
from ..controls import clear_limits, pause, resume, set_limits
from ..fairstatus import set_fair_weight
from .format import duration, json_text
from .plumbing import app_of, exit_with, handled, key_and_reader, namespace_option, option

__all__ = ["limit_command", "pause_command", "resume_command"]

_json_option = option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")


def _limits_text(limits: Limits | None) -> str:
    if limits is None:
        return "the task's own limits"
    parts = []
    if limits.concurrency is not None:
        parts.append(f"concurrency {limits.concurrency}")
    if limits.rate is not None:
        parts.append(f"rate {limits.rate}")
    return ", ".join(parts) or "the task's own limits"


def _limits_json(limits: Limits | None) -> dict[str, Any] | None:
    if limits is None:
        return None
    return {"concurrency": limits.concurrency, "rate": limits.rate}


@click.command(name="pause", cls=CeleryCommand)
@click.argument("key")
@option("--for", "seconds", type=click.FloatRange(min=0, min_open=True), default=None, metavar="S",
        help="Pause for S seconds (default: until `resume`).")
@_json_option
@namespace_option
@click.pass_context
def pause_command(ctx: click.Context, key: str, seconds: float | None, as_json: bool) -> None:
    """Pause KEY: no run takes it until the pause ends (after --for S, or at `resume`).

    Runs of the key that come meanwhile wait parked in its queue, whatever their on_duplicate,
    and run in order when the pause ends; a running run is not stopped."""
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, (key,), None)
        until = pause(app_of(ctx), key, seconds, namespace=status_reader.store.layout.namespace)
        parked = status_reader.store.handoff.queued(key)
    if as_json:
        click.echo(json_text({"key": key, "paused": True, "until": until, "parked": parked}))
        return
    ends = "until resumed" if until is None else f"for {duration(max(0.0, until - time.time()))}"
    click.echo(f"paused {key} {ends} ({parked} parked)")


@click.command(name="resume", cls=CeleryCommand)
@click.argument("key")
@_json_option
@namespace_option
@click.pass_context
def resume_command(ctx: click.Context, key: str, as_json: bool) -> None:
    """End the pause of KEY now: its first parked run gets it within about a second, the others
    follow in order. Exit 1 if it was not paused."""
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, (key,), None)
        was = resume(app_of(ctx), key, namespace=status_reader.store.layout.namespace)
        parked = status_reader.store.handoff.queued(key)
    if as_json:
        click.echo(json_text({"key": key, "resumed": was, "parked": parked}))
    elif was:
        click.echo(f"resumed {key} ({parked} parked)")
    if not was:
        exit_with(ctx, 1, None if as_json else f"{key} was not paused")


@click.command(name="limit", cls=CeleryCommand)
@click.argument("key")
@option("--concurrency", type=click.IntRange(min=1), default=None, metavar="N",
        help="At most N runs of KEY at once (its max_concurrency), until cleared.")
@option("--rate", default=None, metavar="RATE",
        help="KEY's key_rate_limit (e.g. 10/m), until cleared (tasks that have a key_rate_limit).")
@option("--burst", type=click.IntRange(min=1), default=None, metavar="N",
        help="With --rate: its key_rate_burst.")
@option("--weight", type=click.FloatRange(min=0, min_open=True), default=None, metavar="W",
        help="With --task: KEY is a fair key of that task, and W its share at the task's gate.")
@option("--task", "task_name", default=None, metavar="NAME",
        help="The fair-share task whose gate --weight (or --clear) is for.")
@option("--clear", is_flag=True, help="Back to the tasks' own limits (with --task: its fair_weights).")
@_json_option
@namespace_option
@click.pass_context
def limit_command(ctx: click.Context, key: str, concurrency: int | None, rate: str | None, burst: int | None,
                  weight: float | None, task_name: str | None, clear: bool, as_json: bool) -> None:
    """Override KEY's max_concurrency and key_rate_limit at run time, until --clear; or, with
    --task, the weight of fair key KEY at that task's gate.

    Read by the next acquire and rate check of the key on every worker; runs already holding
    the key go on. A weight places the fair key's next parked runs."""
    if task_name is not None or weight is not None:
        _weigh(ctx, key, task_name, weight, clear, as_json, concurrency is not None or rate is not None)
        return
    if clear == (concurrency is not None or rate is not None):
        exit_with(ctx, 2, "Error: give --concurrency and/or --rate, or --clear")
    with handled(ctx):
        key, status_reader = key_and_reader(ctx, (key,), None)
        namespace = status_reader.store.layout.namespace
        try:
            if clear:
                before = clear_limits(app_of(ctx), key, namespace=namespace)
                now = None
            else:
                before = None
                now = set_limits(app_of(ctx), key, concurrency=concurrency, rate=rate, burst=burst,
                                 namespace=namespace)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from exc
    if as_json:
        click.echo(json_text({"key": key, "limits": _limits_json(now), "cleared": _limits_json(before)}))
    elif clear:
        click.echo(f"cleared the limits of {key} ({_limits_text(before)}): the task's own limits apply")
    else:
        click.echo(f"limits of {key}: {_limits_text(now)}")


def _weigh(ctx: click.Context, fair_key: str, task_name: str | None, weight: float | None, clear: bool,
           as_json: bool, limits_too: bool) -> None:
    """``limit FAIR_KEY --task NAME --weight W`` (or ``--clear``): the fair key's weight at the gate."""
    if task_name is None or limits_too or clear == (weight is not None):
        exit_with(ctx, 2, "Error: give --task NAME with --weight W or --clear (not --concurrency or --rate)")
    with handled(ctx):
        task = app_of(ctx).tasks.get(task_name)
        if task is None:
            raise ConfigurationError(f"no task named {task_name!r} in this app")
        set_fair_weight(task, fair_key, None if clear else weight)
        weights = task.store.fair.weights(gate_key(task.name))
    if as_json:
        click.echo(json_text({"task": task_name, "fair_key": fair_key, "weight": weights.get(fair_key)}))
    elif clear:
        click.echo(f"cleared the weight of {fair_key} at {task_name}: its fair_weights apply")
    else:
        click.echo(f"weight of {fair_key} at {task_name}: {weights.get(fair_key):g}")
