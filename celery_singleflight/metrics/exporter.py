"""Serving the metrics: a worker's own server (``singleflight_metrics_port``) and the
standalone ``celery singleflight metrics``, which serve the same thing: the counts every process
wrote to the metrics directory, summed, and the gauges read from Redis at each scrape.
"""

from __future__ import annotations

import logging
import os
import tempfile
from typing import Any

from ..config.options import app_options
from ..errors import ConfigurationError
from ..worker.registry import guarded_tasks
from . import hooks, record
from .gauges import RedisGauges

__all__ = ["DIR_VARIABLE", "registry_for", "serve", "start_worker_metrics"]

log = logging.getLogger("celery_singleflight.metrics")

#: prometheus_client's variable for the multiprocess directory
DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"



def registry_for(app: Any, directory: str | None) -> Any:
    """A registry of the counts in ``directory`` (summed over its processes' files) and the
    gauges of ``app``'s lease Redis."""
    record.client()
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    if directory:
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
    registry.register(RedisGauges(app))
    return registry


def serve(app: Any, port: int, address: str, directory: str | None) -> Any:
    """Serve ``/metrics`` on ``address:port`` from a daemon thread; returns the server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, address, registry=registry_for(app, directory))
    log.info("serving metrics on http://%s:%s/metrics", address, server.server_port)
    return server


def start_worker_metrics(app: Any) -> str | None:
    """In a worker's main process, before the pool forks: count from now on (here and in every
    pool process), make each task's series at 0, and serve them if a port is set. Returns the
    metrics directory, or None when metrics are off."""
    opts = app_options(app)
    if not opts.metrics:
        return None
    directory = (opts.metrics_dir or os.environ.get(DIR_VARIABLE)
                 or tempfile.mkdtemp(prefix="singleflight-metrics-"))
    record.start_recording(directory)
    hooks.connect()
    # a series that appears only at its first count hides that count from increase() and rate()
    for task in guarded_tasks(app):
        policy = hooks.policy_of(task.name)
        record.count("leases_acquired", task.name, policy, amount=0)
        pipeline = getattr(task, "_sf_pipeline", None)
        for stage in pipeline.stages if pipeline is not None else ():
            for outcome in stage.outcomes.get(policy, ()):
                record.count("duplicates", task.name, policy, outcome, amount=0)
    # written now, not by a timer thread that a fork of the pool could catch inside the
    # client's lock (the pool process would wait on it for ever)
    record.flush()
    if opts.metrics_port:
        try:
            serve(app, opts.metrics_port, opts.metrics_address, directory)
        except OSError as exc:  # the port is taken (another worker on this host?) or the address wrong
            raise ConfigurationError(
                f"singleflight_metrics_port: cannot serve metrics on {opts.metrics_address}:"
                f"{opts.metrics_port} ({exc}); give each worker on a host its own port, or leave it"
                " unset and run `celery singleflight metrics` beside the workers") from exc
    return directory
