"""Every Prometheus series the library exports, declared once: its name, type, labels and
meaning. The recorder, the exporter and the metrics page of the docs all read this list.

Labels are the task name, the duplicate policy and a few stable codes, never a rendered key:
keys are unbounded (one per account or tenant) and would make a series each.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUCKETS", "PREFIX", "SERIES", "Series", "by_name", "markdown_table"]

PREFIX = "celery_singleflight_"

#: histogram buckets (seconds), 5 ms to 10 min: a key wait spans both
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(frozen=True)
class Series:
    """One series family. ``kind``: counter, histogram or gauge (gauges are read from Redis by
    the exporter, never summed over processes). ``name`` is without the prefix and ``_total``."""

    name: str
    kind: str
    labels: tuple[str, ...]
    help: str

    @property
    def exported(self) -> str:
        """The name as Prometheus shows it (a counter's with ``_total``)."""
        return PREFIX + self.name + ("_total" if self.kind == "counter" else "")


TASK, POLICY = "task", "policy"

SERIES: tuple[Series, ...] = (
    Series("leases_acquired", "counter", (TASK, POLICY), "Leases taken (a run started under its key)."),
    Series("duplicates", "counter", (TASK, POLICY, "outcome"),
           "Runs that found their key held, by what the policy did (`outcome`: skipped, raised, retry,"
           " queued, queue-full, joined, coalesced, superseding, redelivery, remembered)."),
    Series("wait_seconds", "histogram", (TASK, POLICY),
           "How long a run that waited (queued, retried, rate-limited, re-sent, fair share) took from its"
           " first attempt to its lease."),
    Series("hold_seconds", "histogram", (TASK, POLICY), "How long a lease was held, take to release."),
    Series("handoff_seconds", "histogram", (TASK, POLICY),
           "From a release handing the key on to the parked run's lease (the broker hop included)."),
    Series("leases_lost", "counter", (TASK, POLICY),
           "Leases found gone while the run went on (expired, taken over, force-released)."),
    Series("leases_taken_over", "counter", (TASK,), "Holders told that a newer run of their key took over."),
    Series("calls_folded", "counter", (TASK,),
           "Calls folded into a later call of their key, which runs for them (a quiet period)."),
    Series("rate_limited", "counter", (TASK,), "Runs delayed by `key_rate_limit`."),
    Series("rate_limit_delay_seconds", "histogram", (TASK,), "The delay `key_rate_limit` gave a run."),
    Series("queue_timeouts", "counter", (TASK,), "Runs that waited past `queue_timeout` and failed."),
    Series("redis_unavailable", "counter", (TASK, "mode"),
           "Runs that found the lease Redis unavailable: `mode` fail_open (ran unguarded) or fail_closed"
           " (re-sent)."),
    Series("renewals", "counter", (), "Leases renewed by the heartbeat."),
    Series("renewal_round_trips", "counter", (),
           "Heartbeat round trips (one renews every lease of a process)."),
    Series("keys_held", "gauge", (TASK,),
           "Keys held now (read from Redis at each scrape; fair gates not counted)."),
    Series("runs_waiting", "gauge", (TASK,),
           "Runs parked behind held keys and fair gates now (read from Redis at each scrape)."),
    Series("redis_up", "gauge", (), "1 if the exporter's last read of the lease Redis worked, else 0."),
)

_BY_NAME = {series.name: series for series in SERIES}


def by_name(name: str) -> Series:
    return _BY_NAME[name]


def markdown_table() -> str:
    """The metrics table of docs/metrics.md (generated: a test keeps the page equal to it)."""
    rows = ["| Series | Type | Labels | Meaning |", "|---|---|---|---|"]
    for series in SERIES:
        labels = ", ".join(f"`{label}`" for label in series.labels) or "none"
        rows.append(f"| `{series.exported}` | {series.kind} | {labels} | {series.help} |")
    return "\n".join(rows)
