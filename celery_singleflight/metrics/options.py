"""The metrics settings (app-wide, ``singleflight_metrics*``): whether workers count, and
whether each worker serves what it counted."""

from __future__ import annotations

from typing import Any

from ..config.option import Option, OptionGroup, Resolving, count, flag
from ..errors import ConfigurationError

__all__ = ["MetricsOptions"]


def _directory(where: str, value: Any, ctx: Resolving) -> str | None:
    if value is None or (isinstance(value, str) and value):
        return value
    raise ConfigurationError(f"{where} must be a directory path, not {value!r}")


def _address(where: str, value: Any, ctx: Resolving) -> str:
    if isinstance(value, str) and value:
        return value
    raise ConfigurationError(f"{where} must be an IP address to listen on, not {value!r}")


class MetricsOptions(OptionGroup):
    """Prometheus metrics of the workers ([metrics](metrics.md))."""

    __slots__ = ()
    title = "Metrics"

    metrics = Option[bool](
        default=False, check=flag(),
        meaning="Workers count leases, duplicates, waits, hand-offs, losses and renewals as Prometheus series"
        " ([metrics](metrics.md)); needs `prometheus_client` (the `metrics` extra).",
        values="`True` or `False`.",
    )
    metrics_port = Option["int | None"](
        check=count(1, optional=True), default_text="none: the worker serves nothing",
        meaning="With `metrics`, each worker's main process serves its counts and the Redis gauges at"
        " `http://<metrics_address>:<port>/metrics`. Or run `celery singleflight metrics` beside the"
        " workers.",
        values="A TCP port; one per worker on a host.",
    )
    metrics_address = Option[str](
        default="127.0.0.1", check=_address,
        meaning="The address the worker's metrics server listens on.",
        values="An IP address; `\"0.0.0.0\"` to be scraped from other hosts.",
    )
    metrics_dir = Option["str | None"](
        check=_directory,
        default_text="`PROMETHEUS_MULTIPROC_DIR`, else a new temporary directory per worker",
        meaning="Where each process of a worker writes its counts (prometheus_client's multiprocess mode):"
        " a pool process's counts stay after it exits. Empty it before the workers start.",
        values="A directory path.",
    )
