"""``celery singleflight metrics``: a standalone Prometheus exporter, as celery-exporter is one,
for operators who do not let each worker serve its own (:mod:`...metrics`)."""

from __future__ import annotations

import os
import threading

import click
from celery.bin.base import CeleryCommand

from ...metrics.exporter import DIR_VARIABLE, serve
from .plumbing import app_of, handled, option

__all__ = ["metrics_command"]


@click.command(name="metrics", cls=CeleryCommand)
@option("--port", type=click.IntRange(0, 65535), default=9808, show_default=True,
        help="The port to serve /metrics on (0: any free port, printed).")
@option("--address", default="127.0.0.1", show_default=True, help="The address to listen on.")
@option("--dir", "directory", default=None, metavar="DIR",
        help=f"The workers' metrics directory (default: ${DIR_VARIABLE}); without one, only the gauges"
        " read from Redis are served.")
@click.pass_context
def metrics_command(ctx: click.Context, port: int, address: str, directory: str | None) -> None:
    """Serve the app's metrics for Prometheus until stopped (Ctrl-C).

    The gauges (keys held, runs waiting) are read from the lease Redis at each scrape. The
    counters and histograms are the ones the workers of this host write to DIR: start them with
    singleflight_metrics = True and the same PROMETHEUS_MULTIPROC_DIR."""
    directory = directory or os.environ.get(DIR_VARIABLE) or None
    with handled(ctx):
        server = serve(app_of(ctx), port, address, directory)
    counts = f"counts from {directory}" if directory else "no counts (no --dir): gauges only"
    click.echo(f"serving http://{address}:{server.server_port}/metrics ({counts})", err=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
