"""``celery_singleflight.compat.heimdall``: celery-heimdall's tasks (tests/heimdallapp.py, its
README's examples with only the import changed) on a real worker, and what its ``heimdall``
options and settings map to. Written from celery-heimdall's documented behaviour."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_singleflight import ConfigurationError, LockHeld, is_skipped
from celery_singleflight.compat.heimdall import AlreadyQueuedError, HeimdallTask, RateLimit
from celery_singleflight.compat.shared import NotSupported

from .conftest import running_app, wait_running

#: also run against the lowest and highest Celery and redis-py (make test)
pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def heimdallapp() -> Iterator[ModuleType]:
    with running_app("heimdallapp", "SF_HEIMDALL_REDIS", concurrency=2) as module:
        yield module


@pytest.fixture
def app() -> Celery:
    return Celery("heimdall_units", broker="redis://127.0.0.1:1/0", set_as_current=False)


# -- the options, mapped when the task is defined and bound -------------------------------------------


def test_unique_maps_to_enqueue_dedup_and_skip_and_the_timeout_to_the_marker(app: Celery) -> None:
    @app.task(base=HeimdallTask, heimdall={"unique": True, "unique_timeout": 120})
    def report(customer_id):
        return customer_id

    opts = report.options
    assert (opts.dedup_enqueue, opts.on_duplicate, opts.dedup_ttl) == (True, "skip", 120.0)
    assert opts.max_concurrency == 1
    assert opts.key_rate_limit is None
    assert report.render_key(1) == report.render_key(customer_id=1) != report.render_key(2)


def test_times_and_per_map_to_key_rate_limit(app: Celery) -> None:
    @app.task(base=HeimdallTask, heimdall={"times": 2, "per": 60})
    def by_pair(customer_id):
        return customer_id

    @app.task(base=HeimdallTask, heimdall={"rate_limit": RateLimit((5, 10)), "unique": True})
    def by_rate_limit(customer_id):
        return customer_id

    assert (by_pair.options.key_rate_limit, by_pair.options.key_rate_burst) == (2 / 60, 2)
    assert (by_pair.options.max_concurrency, by_pair.options.dedup_enqueue) == (2, False)
    assert (by_rate_limit.options.key_rate_limit, by_rate_limit.options.key_rate_burst) == (0.5, 5)
    assert by_rate_limit.options.max_concurrency == 1


def test_key_is_a_string_or_a_function_of_args_and_kwargs(app: Celery) -> None:
    @app.task(base=HeimdallTask, heimdall={"unique": True, "key": "generate_report"})
    def static(customer_id):
        return customer_id

    @app.task(base=HeimdallTask, heimdall={"unique": True, "key": lambda args, kwargs: f"customer_{args[0]}"})
    def computed(customer_id):
        return customer_id

    assert static.render_key(1) == static.render_key(2) == "generate_report"
    assert computed.render_key(10) == "customer_10"


@pytest.mark.parametrize(("heimdall", "match"), [
    ({"unique": True, "unique_wait_for_expiry": True}, "idempotency_key"),
    ({"unique": True, "unique_lock_blocking": True}, "never waits"),
    ({"unique": True, "lock_prefix": "x:"}, "singleflight_namespace"),
    ({"unique": True, "uniq": True}, "'uniq'"),
    ({"rate_limit": RateLimit(lambda args: (1, 30))}, "computed per call"),
    ({"times": 0, "per": 60}, "whole number"),
    ({}, "needs 'unique' or a rate"),
])
def test_options_without_an_equivalent_are_refused(heimdall: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):  # as @app.task builds the class
        type("Refused", (HeimdallTask,), {"heimdall": heimdall, "run": staticmethod(lambda x: x)})


@pytest.mark.parametrize("heimdall", [
    {"unique": True, "unique_wait_for_expiry": False},
    {"unique": True, "unique_lock_blocking": False},
    {"unique": True, "unique_lock_blocking": False, "unique_lock_timeout": 5},
    {"unique": True, "lock_prefix": "h-lock:", "rate_limit_prefix": "h-rate:"},
    {"rate_limit": RateLimit([2, 60])},
])
def test_values_that_match_what_the_shim_does_are_accepted(heimdall: dict[str, Any]) -> None:
    task = type("Accepted", (HeimdallTask,), {"heimdall": heimdall, "run": staticmethod(lambda x: x)})
    assert task._sf_render is not None


def test_unique_false_is_refused_not_read_as_false() -> None:
    """celery-heimdall tested ``"unique" in heimdall``: ``False`` made the task unique there."""
    with pytest.raises(ConfigurationError, match="whatever its value"):
        type("NotUnique", (HeimdallTask,), {"heimdall": {"unique": False, "times": 1, "per": 1},
                                            "run": staticmethod(lambda x: x)})


def test_settings_at_the_shim_behaviour_are_accepted_and_others_refused() -> None:
    accepting = Celery("heimdall_defaults", broker="redis://127.0.0.1:1/0", set_as_current=False)
    accepting.conf.update(heimdall_lock_prefix="h-lock:", heimdall_rate_limit_prefix="h-rate:",
                          heimdall_unique_lock_blocking=False, heimdall_unique_wait_for_expiry=False,
                          heimdall_unique_lock_timeout=1)

    @accepting.task(base=HeimdallTask, heimdall={"unique": True}, name="defaults_ok")
    def accepted(x):
        return x

    accepting.finalize(auto=True)
    assert accepted.options.dedup_enqueue is True

    refusing = Celery("heimdall_blocking", broker="redis://127.0.0.1:1/0", set_as_current=False)
    refusing.conf.heimdall_unique_lock_timeout = 3  # the default blocking=True waited this long

    @refusing.task(base=HeimdallTask, heimdall={"unique": True}, name="waits")
    def waits(x):
        return x

    with pytest.raises(ConfigurationError, match="heimdall_unique_lock_timeout"):
        refusing.finalize(auto=True)


def test_settings_are_read_or_refused(app: Celery) -> None:
    app.conf.update(heimdall_unique_raises=True, heimdall_unique_timeout=45)

    @app.task(base=HeimdallTask, heimdall={"unique": True})
    def from_settings(x):
        return x

    assert from_settings.options.dedup_ttl == 45.0 and from_settings._sf_raises is True

    other = Celery("heimdall_refused", broker="redis://127.0.0.1:1/0", set_as_current=False)
    other.conf.heimdall_lock_prefix = "h:"

    @other.task(base=HeimdallTask, heimdall={"unique": True}, name="refused_prefix")
    def refused(x):
        return x

    with pytest.raises(ConfigurationError, match="heimdall_lock_prefix"):
        other.finalize(auto=True)


def test_setup_redis_and_only_after_are_refused_loudly(app: Celery) -> None:
    with pytest.raises(ConfigurationError, match="singleflight_redis_url"):
        class OwnRedis(HeimdallTask):
            def setup_redis(self):
                return None

    @app.task(base=HeimdallTask, heimdall={"unique": True}, bind=True)
    def uses_only_after(self, x):
        return x

    with pytest.raises(NotSupported, match="only_after"):
        uses_only_after.only_after("k", 60)


def test_already_queued_error_has_heimdall_fields_and_pickles() -> None:
    exc = AlreadyQueuedError(expires_in=30, likely_culprit="abc")

    again = pickle.loads(pickle.dumps(exc))

    assert isinstance(again, LockHeld)
    assert (again.expires_in, again.likely_culprit, again.holder) == (30, "abc", "abc")


# -- on a real worker ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_a_unique_duplicate_returns_the_existing_task(heimdallapp: ModuleType) -> None:
    first = heimdallapp.generate_report.delay(7)
    wait_running(heimdallapp.generate_report, 7)

    assert heimdallapp.generate_report.delay(7).id == first.id
    assert heimdallapp.generate_report.delay(8).id != first.id
    assert first.get(timeout=20) == "report 7"


@pytest.mark.worker
def test_unique_raises_gives_the_culprit_and_the_time_left(heimdallapp: ModuleType) -> None:
    first = heimdallapp.strict_report.delay(1)
    with pytest.raises(AlreadyQueuedError) as queued:
        heimdallapp.strict_report.delay(1)

    assert queued.value.likely_culprit == first.id
    assert isinstance(queued.value.expires_in, int) and 0 < queued.value.expires_in <= 3600
    assert first.get(timeout=20) == "report 1"


@pytest.mark.worker
def test_a_custom_key_makes_one_run_for_every_customer(heimdallapp: ModuleType) -> None:
    first = heimdallapp.one_report.delay(1)

    assert heimdallapp.one_report.delay(2).id == first.id
    assert first.get(timeout=20) == "report 1"


@pytest.mark.worker
def test_a_duplicate_that_reaches_the_worker_is_skipped(heimdallapp: ModuleType) -> None:
    first = heimdallapp.generate_report.delay(3)
    wait_running(heimdallapp.generate_report, 3)
    by_name = heimdallapp.app.send_task(heimdallapp.generate_report.name, args=(3,))  # like beat

    assert is_skipped(by_name.get(timeout=20))
    assert first.get(timeout=20) == "report 3"


@pytest.mark.worker
def test_times_per_spreads_the_starts_of_a_key(heimdallapp: ModuleType) -> None:
    results = [heimdallapp.download.delay(1) for _ in range(4)]  # 2 per 3 s: 2 now, then one per 1.5 s
    other = heimdallapp.download.delay(2)  # another key has its own budget

    starts = sorted(result.get(timeout=30) for result in results)
    assert starts[1] - starts[0] < 1.0
    assert starts[2] - starts[0] >= 1.3 and starts[3] - starts[0] >= 2.8
    assert other.get(timeout=30) - starts[0] < 1.0
