"""``celery_singleflight.compat.singleton``: celery-singleton's tasks (tests/singletonapp.py, its
README's examples with only the import changed) on a real worker, and what its options and
settings map to. Written from celery-singleton's documented behaviour."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import ModuleType

import pytest
from celery import Celery, group

from celery_singleflight import ConfigurationError, KeyTemplateError, LockHeld, is_skipped
from celery_singleflight.compat.shared import NotSupported
from celery_singleflight.compat.singleton import (
    CelerySingletonException,
    DuplicateTaskError,
    Singleton,
    clear_locks,
)
from celery_singleflight.testing import RedisServer

from .conftest import running_app, wait_running

#: also run against the lowest and highest Celery and redis-py (make test)
pytestmark = pytest.mark.core


@pytest.fixture(scope="module")
def singletonapp() -> Iterator[ModuleType]:
    with running_app("singletonapp", "SF_SINGLETON_REDIS", concurrency=2) as module:
        yield module


@pytest.fixture
def app() -> Celery:
    return Celery("singleton_units", broker="redis://127.0.0.1:1/0", set_as_current=False)


# -- the options, mapped when the task is defined and bound -------------------------------------------


def test_unique_on_chooses_the_parameters_and_absent_means_every_argument(app: Celery) -> None:
    @app.task(base=Singleton, unique_on=["a"])
    def by_list(a, b):
        return a

    @app.task(base=Singleton, unique_on="a")
    def by_name(a, b):
        return a

    @app.task(base=Singleton)
    def by_all(*args, **kwargs):
        return args

    assert by_list.render_key(1, 2) == by_list.render_key(a=1, b=3) != by_list.render_key(2, 2)
    assert by_name.render_key(1, 2) == by_name.render_key(1, 9)
    assert by_all.render_key(1, 2, 3, a="b") == by_all.render_key(1, 2, 3, a="b")
    assert by_all.render_key(1, 2, 3, a="b") != by_all.render_key(1, 2, 3, a="c") != by_all.render_key(1, 2)
    with pytest.raises(KeyTemplateError, match="unique_on names <c>"):
        class Missing(Singleton):
            unique_on = ["c"]

            def run(self, a, b):
                return a


def test_options_and_settings_map_to_the_policy_and_the_marker(app: Celery) -> None:
    app.conf.update(singleton_raise_on_duplicate=True, singleton_lock_expiry=90,
                    singleton_backend_url="redis://127.0.0.1:1/3")

    @app.task(base=Singleton)
    def from_settings(x):
        return x

    @app.task(base=Singleton, raise_on_duplicate=False, lock_expiry=15)
    def own(x):
        return x

    assert (from_settings.options.on_duplicate, from_settings.options.dedup_ttl) == ("raise", 90.0)
    assert (own.options.on_duplicate, own.options.dedup_ttl) == ("skip", 15.0)
    assert own.options.dedup_enqueue is True
    assert from_settings.options.redis_url == "redis://127.0.0.1:1/3"
    assert from_settings.options.ttl == 30.0  # the running task's lease is renewed, whatever the expiry


@pytest.mark.parametrize(("setting", "value", "match"), [
    ("singleton_key_prefix", "LOCK_", "singleflight_namespace"),
    ("singleton_backend_class", "my.Backend", "Redis only"),
    ("singleton_backend_kwargs", {"ssl": True}, "transport_options"),
    ("singleton_json_encoder_class", "my.Encoder", "lock_key"),
])
def test_settings_without_an_equivalent_are_refused(
    app: Celery, setting: str, value: object, match: str
) -> None:
    app.conf[setting] = value

    @app.task(base=Singleton, name=f"refused_{setting}")
    def refused(x):
        return x

    with pytest.raises(ConfigurationError, match=match):
        app.finalize(auto=True)


@pytest.mark.parametrize("backend", ["celery_singleton.backends.redis.RedisBackend",
                                     "celery_singleton.backends.RedisBackend",
                                     "celery_singleton.backend.RedisBackend"])
def test_the_redis_backend_class_is_accepted_by_any_of_its_names(backend: str) -> None:
    app = Celery("singleton_backend", broker="redis://127.0.0.1:1/0", set_as_current=False)
    app.conf.singleton_backend_class = backend

    @app.task(base=Singleton, name=f"default_backend_{backend}", shared=False)
    def accepted(x):
        return x

    app.finalize(auto=True)
    assert accepted.options.dedup_enqueue is True


def test_an_on_duplicate_hook_is_refused_not_shadowed() -> None:
    with pytest.raises(ConfigurationError, match=r"on_duplicate\(self, existing_task_id\) hook"):
        class Hooked(Singleton):
            def on_duplicate(self, existing_task_id):
                return existing_task_id

            def run(self, x):
                return x


def test_old_lock_methods_say_what_to_use(app: Celery) -> None:
    @app.task(base=Singleton)
    def old_names(x):
        return x

    for name, use in [("release_lock", "clear_locks"), ("unlock", "force_release"),
                      ("generate_lock", "render_key"), ("get_existing_task_id", "status"),
                      ("singleton_backend", "force_release"), ("singleton_config", "app.conf")]:
        with pytest.raises(NotSupported, match=use):
            getattr(old_names, name)
    assert not hasattr(old_names, "no_such_name")


def test_celery_singleton_exception_is_the_base_of_duplicate_task_error() -> None:
    with pytest.raises(CelerySingletonException):
        raise DuplicateTaskError("Attempted to queue a duplicate of task ID abc", task_id="abc")


def test_duplicate_task_error_carries_the_task_id_and_pickles() -> None:
    exc = DuplicateTaskError("Attempted to queue a duplicate of task ID abc", task_id="abc")

    again = pickle.loads(pickle.dumps(exc))

    assert isinstance(again, LockHeld) and again.task_id == again.holder == "abc"
    assert str(again) == "Attempted to queue a duplicate of task ID abc"


def test_clear_locks_forgets_queued_markers(tmp_path: object) -> None:
    with RedisServer() as server:
        app = Celery("singleton_clear", broker=f"{server.url}/0", set_as_current=False)

        @app.task(base=Singleton)
        def queued_only(n):
            return n

        first = queued_only.delay(1)  # no worker: it stays queued
        assert queued_only.delay(1).id == first.id

        assert clear_locks(app) == 1
        assert queued_only.delay(1).id != first.id  # the marker is gone: sent again


def test_sends_with_their_own_task_id_are_checked_too() -> None:
    """celery-singleton does ``task_id = task_id or uuid()`` and then locks: a group, a chain
    and ``apply_async(task_id=...)`` are checked like ``delay()``."""
    with RedisServer() as server:
        app = Celery("singleton_own_id", broker=f"{server.url}/0", set_as_current=False)

        @app.task(base=Singleton, shared=False)
        def own_id(n):
            return n

        grouped = group(own_id.s(1), own_id.s(1), own_id.s(2)).apply_async()
        by_id = own_id.apply_async((1,), task_id="mine")
        chained = (own_id.s(2) | own_id.s()).apply_async()

        first = grouped.results[0].id
        assert by_id.id == first and chained.parent.id != first
        assert own_id.store.marks.enqueued(own_id.render_key(2))[0] == grouped.results[2].id
        assert server.client(0).llen("celery") == 2  # own_id(1) and own_id(2), once each


# -- on a real worker ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_a_duplicate_returns_the_queued_task(singletonapp: ModuleType) -> None:
    async_result = singletonapp.do_stuff.delay(1, 2, 3, a="b")
    async_result2 = singletonapp.do_stuff.delay(1, 2, 3, a="b")
    other = singletonapp.do_stuff.delay(1, 2, 3, a="c")

    assert async_result == async_result2 and other != async_result
    assert async_result.get(timeout=20) == "I just woke up" and other.get(timeout=20) == "I just woke up"
    assert singletonapp.do_stuff.delay(1, 2, 3, a="b") != async_result  # finished: a new one is sent


@pytest.mark.worker
def test_unique_on_ignores_the_other_arguments_and_the_running_task_counts(singletonapp: ModuleType) -> None:
    first = singletonapp.greet.delay("bob", "hi")
    wait_running(singletonapp.greet, "bob", "hi")

    assert singletonapp.greet.delay("bob", greeting="hello") == first
    assert singletonapp.greet.delay("alice", "hi") != first
    assert first.get(timeout=20) == "hi bob"


@pytest.mark.worker
def test_raise_on_duplicate_raises_with_the_existing_task_id(singletonapp: ModuleType) -> None:
    first = singletonapp.strict_greet.delay("bob", "hi")
    with pytest.raises(DuplicateTaskError) as duplicate:
        singletonapp.strict_greet.delay("bob", "hello")

    assert duplicate.value.task_id == first.id
    assert first.get(timeout=20) == "hi bob"


@pytest.mark.worker
def test_a_send_by_name_is_guarded_when_it_runs(singletonapp: ModuleType) -> None:
    first = singletonapp.greet.delay("carol", "hi")
    wait_running(singletonapp.greet, "carol", "hi")
    by_name = singletonapp.app.send_task(singletonapp.greet.name, args=("carol", "yo"))

    assert is_skipped(by_name.get(timeout=20))  # not a second run beside the first
    assert first.get(timeout=20) == "hi carol"


@pytest.mark.worker
def test_leases_live_where_singleton_backend_url_says(singletonapp: ModuleType) -> None:
    assert singletonapp.expiring.options.redis_url.endswith("/3")
    assert singletonapp.expiring.options.dedup_ttl == 10.0
    assert singletonapp.expiring.delay(4).get(timeout=20) == 4
