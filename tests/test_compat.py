"""``celery_singleflight.compat.QueueOnce``: celery-once's tasks (tests/onceapp.py, its README's
examples with only the import changed) on a real worker, and what its ``once`` options and its
``ONCE`` setting map to. Written from celery-once's documented behaviour."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import MaxRetriesExceededError

from celery_singleflight import ConfigurationError, KeyTemplateError, LockHeld, SingleFlightError, is_skipped
from celery_singleflight.compat import AlreadyQueued, QueueOnce
from celery_singleflight.compat.shared import NotSupported
from celery_singleflight.testing import RedisServer

from .conftest import running_app, wait_for, wait_running

#: also run against the lowest and highest Celery and redis-py (make test)
pytestmark = pytest.mark.core



@pytest.fixture(scope="module")
def onceapp() -> Iterator[ModuleType]:
    with running_app("onceapp", "SF_ONCE_REDIS") as module:
        yield module


# -- the once options, mapped when the task is defined ----------------------------------------------


@pytest.fixture
def app() -> Celery:
    return Celery("compat", broker="redis://127.0.0.1:1/0", set_as_current=False)


def test_keys_choose_the_parameters_bound_by_the_signature(app: Celery) -> None:
    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def slow_add(a, b):
        return a + b

    @app.task(base=QueueOnce, once={"keys": []})
    def any_args(a, b):
        return a + b

    @app.task(base=QueueOnce)
    def every_arg(a, b=2):
        return a + b

    assert repr(slow_add.lock_key) == "<@task>:<a>"
    assert slow_add.render_key(1, 2) == slow_add.render_key(a=1, b=5) == f"{slow_add.name}:1"
    assert any_args.render_key(1, 2) == any_args.render_key(3, 4) == any_args.name
    assert every_arg.render_key(1) == every_arg.render_key(a=1, b=2) == f"{every_arg.name}:1:2"
    assert every_arg.render_key(1, 3) != every_arg.render_key(1)
    assert slow_add.get_key([1, 2]) == slow_add.get_key(None, {"a": 1, "b": 9}) == slow_add.render_key(1, 2)


def test_without_keys_every_argument_counts_varargs_included(app: Celery) -> None:
    """celery-once keys on every argument when ``keys`` is absent, ``*args`` and ``**kwargs`` too."""

    @app.task(base=QueueOnce, once={"graceful": True})
    def notify(*user_ids):
        return user_ids

    @app.task(base=QueueOnce)
    def sync(pk, **options):
        return pk

    @app.task(base=QueueOnce, once={"keys": ["pk", "options"]})
    def sync_named(pk, *rest, **options):
        return pk

    assert notify.render_key(1) != notify.render_key(2)
    assert notify.render_key(1, 2) != notify.render_key(2, 1) != notify.render_key(12)
    assert notify.render_key(1, 2) == notify.render_key(*(1, 2))
    assert notify.render_key() == notify.render_key() != notify.render_key(None)
    assert sync.render_key(1, full=True) != sync.render_key(1, full=False)
    assert sync.render_key(1, full=True, x=2) == sync.render_key(pk=1, x=2, full=True)
    assert sync.render_key(1) != sync.render_key(1, pk2=1)
    assert sync_named.render_key(1, 5, full=True) == sync_named.render_key(1, 6, full=True)
    assert sync_named.render_key(1, full=True) != sync_named.render_key(1, full=False)


def test_graceful_and_timeout_map_to_skip_and_the_marker_ttl(app: Celery) -> None:
    @app.task(base=QueueOnce, once={"graceful": True, "timeout": 600})
    def gentle(x):
        return x

    @app.task(base=QueueOnce)
    def strict(x):
        return x

    assert (gentle.options.on_duplicate, gentle.options.dedup_ttl, gentle.options.dedup_enqueue) == (
        "skip", 600.0, True)
    assert (strict.options.on_duplicate, strict.options.dedup_ttl) == ("raise", 3600.0)
    assert strict.options.ttl == 30.0  # the lease is renewed while it runs; the timeout is not its TTL


def test_the_once_setting_is_read(app: Celery) -> None:
    app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                     "settings": {"url": "redis://127.0.0.1:1/5", "default_timeout": 120}}

    @app.task(base=QueueOnce)
    def once_plain(x):
        return x

    @app.task(base=QueueOnce, once={"timeout": 30})
    def once_own(x):
        return x

    assert once_plain.options.redis_url == once_own.options.redis_url == "redis://127.0.0.1:1/5"
    assert (once_plain.options.dedup_ttl, once_own.options.dedup_ttl) == (120.0, 30.0)


def test_the_once_setting_does_not_override_singleflight_redis_url(app: Celery) -> None:
    app.conf.update(singleflight_redis_url="redis://127.0.0.1:1/7",
                    ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": "redis://127.0.0.1:1/5"}})

    @app.task(base=QueueOnce)
    def url_plain(x):
        return x

    assert url_plain.options.redis_url == "redis://127.0.0.1:1/7"


@pytest.mark.parametrize(("once", "match"), [
    ({"backend": "celery_once.backends.File", "settings": {"location": "/x"}}, "File' is not supported"),
    ({"backend": "celery_once.backends.Redis", "settings": {"url": "redis://h/0", "blocking": True}},
     "'blocking': True is not supported"),
    ({"backend": "celery_once.backends.Redis", "settings": {"urll": "redis://h/0"}}, "'urll'"),
])
def test_what_the_once_setting_cannot_say_here_is_refused(
    app: Celery, once: dict[str, Any], match: str
) -> None:
    app.conf.ONCE = once

    @app.task(base=QueueOnce, name=f"refused_{sorted(once['settings'])[0]}")
    def refused(x):
        return x

    with pytest.raises(ConfigurationError, match=match):
        app.finalize(auto=True)


def test_unknown_or_unsupported_once_options_fail_at_definition() -> None:
    with pytest.raises(ConfigurationError, match="'unlock_before_run': True"):
        class Early(QueueOnce):
            once = {"unlock_before_run": True}

            def run(self, x):
                return x

    with pytest.raises(ConfigurationError, match=r"'grace'.*QueueOnce knows keys, graceful"):
        class Typo(QueueOnce):
            once = {"grace": True}

            def run(self, x):
                return x

    with pytest.raises(KeyTemplateError, match="names <c>"):
        class Missing(QueueOnce):
            once = {"keys": ["c"]}

            def run(self, a, b):
                return a + b


def test_already_queued_is_a_lock_held_with_celery_once_fields_that_pickles() -> None:
    exc = AlreadyQueued("k:1", "abc", 12.5)
    queued = AlreadyQueued("k:2", "def", None, 3599.2)

    again = pickle.loads(pickle.dumps(exc))
    again_queued = pickle.loads(pickle.dumps(queued))

    assert isinstance(again, LockHeld) and isinstance(again, SingleFlightError)
    assert (again.key, again.holder, again.countdown) == ("k:1", "abc", 12.5)
    assert (again_queued.holder, again_queued.ttl_left, again_queued.countdown) == ("def", None, 3599.2)
    assert "3599.2" in again_queued.message and again_queued.message == str(again_queued)
    assert AlreadyQueued("k:3").countdown == 0.0


def test_already_queued_takes_celery_once_constructor() -> None:
    """celery-once's ``AlreadyQueued(countdown)``, as users' tests and mocks build it."""
    exc = AlreadyQueued(60)

    again = pickle.loads(pickle.dumps(exc))

    assert exc.countdown == again.countdown == 60 and again.key == ""
    assert exc.message == again.message == "Expires in 60 seconds"
    assert AlreadyQueued(2.5).countdown == 2.5


def test_the_module_example_does_what_it_says() -> None:
    """The example's ``except AlreadyQueued`` branch must not re-send the same call: that send
    finds the same key queued and raises again."""
    from celery_singleflight.compat import once

    assert "countdown=exc.countdown" not in (once.__doc__ or "")
    assert "AsyncResult(exc.holder)" in (once.__doc__ or "")


def test_celery_once_ssl_url_becomes_rediss(app: Celery) -> None:
    app.conf.ONCE = {"backend": "celery_once.backends.Redis",
                     "settings": {"url": "redis://127.0.0.1:1/1?ssl=true&socket_timeout=2"}}

    @app.task(base=QueueOnce)
    def over_tls(x):
        return x

    assert over_tls.options.redis_url == "rediss://127.0.0.1:1/1?socket_timeout=2"

    other = Celery("once_ssl_refused", broker="redis://127.0.0.1:1/0", set_as_current=False)
    other.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": "redis://h:1/1?ssl=no"}}

    @other.task(base=QueueOnce, name="ssl_refused")
    def refused(x):
        return x

    with pytest.raises(ConfigurationError, match="rediss://"):
        other.finalize(auto=True)


def test_once_default_timeout_setting_is_read(app: Celery) -> None:
    """The README's ``ONCE_DEFAULT_TIMEOUT``: the marker's lifetime of tasks without ``timeout``."""
    app.conf.ONCE_DEFAULT_TIMEOUT = 90

    @app.task(base=QueueOnce)
    def by_setting(x):
        return x

    @app.task(base=QueueOnce, once={"timeout": 30})
    def by_task(x):
        return x

    assert (by_setting.options.dedup_ttl, by_task.options.dedup_ttl) == (90.0, 30.0)
    assert by_setting.default_timeout == 90.0


def test_per_call_keys_are_refused(app: Celery) -> None:
    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def per_call(a, b):
        return a

    with pytest.raises(ConfigurationError, match="once=\\{'keys'"):
        per_call.apply_async((1, 2), once={"keys": ["b"]})


def test_old_queue_once_names_answer(app: Celery) -> None:
    app.conf.ONCE = {"backend": "celery_once.backends.Redis", "settings": {"url": "redis://127.0.0.1:1/5"}}

    @app.task(base=QueueOnce)
    def named(x):
        return x

    assert named.config is app.conf and named.once_config == app.conf.ONCE
    assert named.default_timeout == 3600.0 and named.unlock_before_run() is False


def test_once_backend_refuses_what_it_does_not_offer(app: Celery) -> None:
    @app.task(base=QueueOnce)
    def backend_plain(x):
        return x

    with pytest.raises(NotSupported, match="clear_lock"):
        backend_plain.once_backend.raise_or_lock("k", timeout=1)


# -- with a private Redis, no worker ------------------------------------------------------------------


@pytest.fixture
def lone_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


def test_an_eager_send_checks_the_key_like_any_send(lone_redis: RedisServer) -> None:
    """celery-once checks in ``apply_async``, eager or not: a key marked by a queued task refuses
    an eager ``delay()`` of it too."""
    app = Celery("eager", broker=f"{lone_redis.url}/0", set_as_current=False)

    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def eager_add(a, b):
        return a + b

    queued = eager_add.delay(1, 1)  # no worker: it stays queued, its key marked
    app.conf.task_always_eager = True

    with pytest.raises(AlreadyQueued) as refused:
        eager_add.delay(1, 2)
    inline = eager_add.delay(2, 2)
    again = eager_add.delay(2, 3)  # the inline run has ended: its key is free again

    assert refused.value.holder == queued.id
    assert 3500 < refused.value.countdown <= 3600  # the marker's time left, a number
    assert inline.get() == 4 and again.get() == 5


def test_clear_lock_frees_a_queued_key(lone_redis: RedisServer) -> None:
    app = Celery("clear", broker=f"{lone_redis.url}/0", set_as_current=False)

    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def clear_add(a, b):
        return a + b

    clear_add.delay(1, 1)
    with pytest.raises(AlreadyQueued):
        clear_add.delay(1, 2)

    assert clear_add.once_backend.clear_lock(clear_add.get_key([1, 2])) is True
    assert clear_add.delay(1, 3).id  # sent
    assert clear_add.once_backend.clear_lock(clear_add.get_key([7, 0])) is False


def test_a_send_with_its_own_task_id_is_checked_too(lone_redis: RedisServer) -> None:
    """celery-once skips the check only for retries: ``apply_async(task_id=...)`` and canvas sends
    (which carry their ids) are checked, under the caller's id."""
    app = Celery("own_id", broker=f"{lone_redis.url}/0", set_as_current=False)

    @app.task(base=QueueOnce, once={"keys": ["a"]})
    def own_id(a, b):
        return a + b

    first = own_id.apply_async((1, 1), task_id="first-id")
    with pytest.raises(AlreadyQueued) as by_id:
        own_id.apply_async((1, 2), task_id="second-id")
    with pytest.raises(AlreadyQueued):
        own_id.s(1, 3).set(task_id="third-id").apply_async()  # as a chain or group sends it
    with pytest.raises(AlreadyQueued):
        own_id.apply_async((1, 1), task_id="first-id")  # the same send again: not sent twice
    retried = own_id.apply_async((1, 4), task_id="first-id", retries=1)  # a retry is not checked

    assert first.id == "first-id" and by_id.value.holder == "first-id" and retried.id == "first-id"
    assert own_id.store.marks.enqueued(own_id.render_key(1, 1))[0] == "first-id"
    assert lone_redis.client(0).llen("celery") == 2  # the first send and the retry


# -- on a real worker ---------------------------------------------------------------------------------


@pytest.mark.worker
def test_leases_live_where_the_once_setting_says(onceapp: ModuleType) -> None:
    assert onceapp.slow_task.options.redis_url.endswith("/2")
    first = onceapp.slow_task.delay()
    wait_running(onceapp.slow_task)

    assert onceapp.slow_task.status().task_id == first.id  # read in db 2, where the worker wrote it
    assert first.get(timeout=20) == "Done!"


@pytest.mark.worker
def test_a_queued_duplicate_raises_already_queued_and_the_key_frees_after(onceapp: ModuleType) -> None:
    first = onceapp.slow_add.delay(1, 1)
    with pytest.raises(AlreadyQueued) as queued:
        onceapp.slow_add.delay(1, 2)  # same a: refused in the caller, nothing is sent
    other = onceapp.slow_add.delay(2, 2)  # another a: sent

    assert queued.value.holder == first.id
    assert 0 < queued.value.countdown <= 3600
    retry_in = queued.value.countdown + 1  # as celery-once users write it: always a number
    assert first.get(timeout=20) == 2 and other.get(timeout=20) == 4
    assert onceapp.slow_add.delay(1, 5).get(timeout=20) == 6  # the key is free once the run ended
    assert retry_in > 1


@pytest.mark.worker
def test_a_running_duplicate_reports_the_lease_time_left(onceapp: ModuleType) -> None:
    first = onceapp.slow_any.delay(1, 1)
    wait_running(onceapp.slow_any, 1, 1)

    with pytest.raises(AlreadyQueued) as running:
        onceapp.slow_any.delay(5, 5)  # keys=[]: one run of the task at a time, whatever the arguments

    assert running.value.holder == first.id
    assert 0 < running.value.countdown <= 30 and running.value.ttl_left == pytest.approx(
        running.value.countdown, abs=1)
    assert first.get(timeout=20) == 2


@pytest.mark.worker
def test_calls_with_other_varargs_are_sent_and_run(onceapp: ModuleType) -> None:
    first = onceapp.notify.delay(1)
    second = onceapp.notify.delay(2)  # another user: its own key, sent
    same = onceapp.notify.delay(1)  # graceful: the queued one
    full = onceapp.sync.delay(1, full=True)
    partial = onceapp.sync.delay(1, full=False)

    assert second.id != first.id and same.id == first.id and partial.id != full.id
    assert first.get(timeout=20) == [1] and second.get(timeout=20) == [2]
    assert full.get(timeout=20) == [1, {"full": True}] and partial.get(timeout=20) == [1, {"full": False}]


@pytest.mark.worker
def test_graceful_returns_the_queued_task_instead_of_raising(onceapp: ModuleType) -> None:
    first = onceapp.graceful_task.delay(1)
    again = onceapp.graceful_task.delay(1)
    per_call = onceapp.slow_task.apply_async()
    per_call_again = onceapp.slow_task.apply_async(once={"graceful": True})  # as celery-once allows

    assert again.id == first.id
    assert per_call_again.id == per_call.id
    assert first.get(timeout=20) == "graceful done" and per_call.get(timeout=20) == "Done!"


@pytest.mark.worker
def test_a_send_by_name_is_guarded_when_it_runs(onceapp: ModuleType) -> None:
    first = onceapp.slow_task.delay()
    wait_running(onceapp.slow_task)
    by_name = onceapp.app.send_task(onceapp.slow_task.name)  # bypasses apply_async, like beat
    gentle = onceapp.graceful_task.delay(1)
    wait_running(onceapp.graceful_task, 1)
    gentle_by_name = onceapp.app.send_task(onceapp.graceful_task.name, args=(1,))

    with pytest.raises(LockHeld):
        by_name.get(timeout=20)  # graceful=False: raise
    assert is_skipped(gentle_by_name.get(timeout=20))  # graceful=True: skip
    assert first.get(timeout=20) == "Done!" and gentle.get(timeout=20) == "graceful done"


@pytest.mark.worker
def test_self_retry_is_not_its_own_duplicate(onceapp: ModuleType) -> None:
    assert onceapp.flaky.delay(3).get(timeout=20) == 2


@pytest.mark.worker
def test_long_timeout_task_runs(onceapp: ModuleType) -> None:
    assert onceapp.long_running_task.delay().get(timeout=20) == "long done"
    assert onceapp.long_running_task.options.dedup_ttl == 36000.0


@pytest.mark.worker
def test_a_run_revoked_or_expired_in_the_queue_frees_its_key(onceapp: ModuleType) -> None:
    expired = onceapp.slow_add.apply_async((7, 0), countdown=3, expires=1)
    revoked = onceapp.slow_add.apply_async((8, 0), countdown=2)
    revoked.revoke()

    def both_free() -> bool:
        return all(onceapp.slow_add.store.marks.enqueued(onceapp.slow_add.render_key(a, 0))[0] is None
                   for a in (7, 8))

    wait_for(both_free, timeout=15)
    later, later_revoked = onceapp.slow_add.delay(7, 1), onceapp.slow_add.delay(8, 1)  # sent, not refused

    assert later.id != expired.id and later_revoked.id != revoked.id
    assert later.get(timeout=20) == 8 and later_revoked.get(timeout=20) == 9


@pytest.mark.worker
def test_a_run_waiting_to_retry_keeps_its_key_until_its_last_retry_fails(onceapp: ModuleType) -> None:
    first = onceapp.always_retry.delay(1)
    wait_for(lambda: first.state == "RETRY", timeout=10)

    with pytest.raises(AlreadyQueued) as during:
        onceapp.always_retry.delay(1)  # its retry is queued: one queued or running, not two
    with pytest.raises(MaxRetriesExceededError):
        first.get(timeout=20)
    # Celery stores the failure just before the run's release ends its lease
    wait_for(lambda: (st := onceapp.always_retry.status(1)) is not None and not st.held, timeout=10)
    ended = onceapp.always_retry.status(1)  # recorded as what happened: no retry was sent
    assert ended is not None and (ended.task_id, ended.outcome) == (first.id, "failed")
    after = onceapp.always_retry.delay(1)  # the final retry failed: the key is free

    after.revoke()
    assert during.value.holder == first.id and after.id != first.id
