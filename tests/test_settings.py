"""Settings: defaults, precedence, validation messages, and resolution inside a real Celery app."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_singleflight import ConfigurationError, KeyTemplateError, SingleFlightTask
from celery_singleflight.config.options import resolve_options

REDIS = "redis://127.0.0.1:1/0"  # never connected to: resolving options does no I/O


class FakeTask:
    """A task-like object: the per-task attributes resolve_options reads, all unset."""

    name = "proj.tasks.sync"
    lock_ttl: Any = None
    heartbeat_interval: Any = None
    on_duplicate: Any = None
    max_wait: Any = None
    on_redis_error: Any = None
    lock_namespace: Any = None


def task_with(**attrs: Any) -> type[FakeTask]:
    """A FakeTask subclass with some per-task attributes set."""
    return type("Task", (FakeTask,), attrs)


def conf_with(**settings: Any) -> dict[str, Any]:
    """A plain-dict app configuration with a Redis broker."""
    return {"broker_url": REDIS, **settings}


def config_error(task: Any, conf: dict[str, Any]) -> str:
    """Resolve, expecting a ConfigurationError; return its message."""
    with pytest.raises(ConfigurationError) as info:
        resolve_options(task, conf)
    message = str(info.value)
    assert "\n" not in message, "the message should be one sentence"
    return message


def make_app(name: str = "t") -> Celery:
    """A Celery app that is never the current app and never connects anywhere."""
    return Celery(name, broker=REDIS, set_as_current=False)


# -- defaults and precedence -----------------------------------------------------------------


def test_defaults():
    """Given nothing configured, the defaults are ttl 30, interval 10, raise, fail_closed."""
    options = resolve_options(FakeTask, conf_with())

    assert options.ttl == 30
    assert options.heartbeat_interval == pytest.approx(10)
    assert options.on_duplicate == "raise"
    assert options.on_redis_error == "fail_closed"
    assert options.namespace == "sf"
    assert options.max_wait == 60
    assert options.redis_url == REDIS


def test_heartbeat_defaults_to_a_third_of_the_ttl():
    """Given only a TTL, the heartbeat interval is TTL / 3."""
    assert resolve_options(task_with(lock_ttl=9), conf_with()).heartbeat_interval == pytest.approx(3)


def test_app_setting_beats_the_default():
    """Given singleflight_* settings, they replace the defaults."""
    conf = conf_with(
        singleflight_ttl=12,
        singleflight_heartbeat_interval=2,
        singleflight_on_duplicate="skip",
        singleflight_on_redis_error="fail_open",
        singleflight_max_wait=5,
        singleflight_namespace="locks",
    )

    options = resolve_options(FakeTask, conf)

    assert (options.ttl, options.heartbeat_interval) == (12, 2)
    assert (options.on_duplicate, options.on_redis_error) == ("skip", "fail_open")
    assert (options.max_wait, options.namespace) == (5, "locks")


def test_per_task_value_beats_the_app_setting():
    """Given both a per-task value and an app setting, the task's value wins."""
    task = task_with(
        lock_ttl=60, heartbeat_interval=7, on_duplicate="retry", on_redis_error="fail_closed",
        max_wait=1, lock_namespace="mine",
    )
    conf = conf_with(
        singleflight_ttl=12, singleflight_heartbeat_interval=2, singleflight_on_duplicate="skip",
        singleflight_on_redis_error="fail_open", singleflight_max_wait=5, singleflight_namespace="locks",
    )

    options = resolve_options(task, conf)

    assert (options.ttl, options.heartbeat_interval) == (60, 7)
    assert (options.on_duplicate, options.on_redis_error) == ("retry", "fail_closed")
    assert (options.max_wait, options.namespace) == (1, "mine")


def test_per_task_ttl_with_app_heartbeat():
    """Given a task TTL and an app heartbeat, each comes from its own level."""
    options = resolve_options(task_with(lock_ttl=20), conf_with(singleflight_heartbeat_interval=4))

    assert (options.ttl, options.heartbeat_interval) == (20, 4)


# -- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("ttl", [0, -1, -0.5, float("nan"), float("inf"), "thirty"])
def test_bad_ttl_is_rejected(ttl):
    """Given a non-positive, NaN, infinite or non-numeric TTL, resolving raises naming lock_ttl."""
    message = config_error(task_with(lock_ttl=ttl), conf_with())

    assert "lock_ttl" in message
    assert "singleflight_ttl" in message
    assert repr(ttl) in message


def test_bad_app_ttl_is_rejected():
    """Given a bad singleflight_ttl, resolving raises naming the setting."""
    assert "singleflight_ttl" in config_error(FakeTask, conf_with(singleflight_ttl=-3))


@pytest.mark.parametrize("ttl", ["30", True])
def test_ttl_must_be_a_real_number(ttl):
    """Given a TTL that is a string of digits or a bool, resolving raises."""
    config_error(task_with(lock_ttl=ttl), conf_with())


@pytest.mark.parametrize("interval", [30, 31, 100])
def test_heartbeat_not_shorter_than_ttl_is_rejected(interval):
    """Given a heartbeat interval >= the TTL, resolving raises naming heartbeat_interval."""
    message = config_error(task_with(lock_ttl=30, heartbeat_interval=interval), conf_with())

    assert "heartbeat_interval" in message
    assert "TTL" in message


@pytest.mark.parametrize("interval", [0, -1, float("nan")])
def test_non_positive_heartbeat_is_rejected(interval):
    """Given a zero, negative or NaN heartbeat interval, resolving raises naming it."""
    assert "heartbeat_interval" in config_error(task_with(heartbeat_interval=interval), conf_with())


@pytest.mark.parametrize("policy", ["wait", "RAISE", ""])
def test_unknown_duplicate_policy_is_rejected(policy):
    """Given an unknown on_duplicate policy, resolving raises naming the setting and the choices."""
    message = config_error(task_with(on_duplicate=policy), conf_with())

    assert "on_duplicate" in message
    assert "raise, skip, retry" in message


def test_unknown_duplicate_policy_in_app_settings_is_rejected():
    """Given an unknown singleflight_on_duplicate, resolving raises naming it."""
    assert "singleflight_on_duplicate" in config_error(FakeTask, conf_with(singleflight_on_duplicate="drop"))


@pytest.mark.parametrize("mode", ["ignore", "fail-open", "FAIL_CLOSED"])
def test_unknown_redis_error_mode_is_rejected(mode):
    """Given an unknown on_redis_error, resolving raises naming the setting and the choices."""
    message = config_error(task_with(on_redis_error=mode), conf_with())

    assert "on_redis_error" in message
    assert "fail_closed, fail_open" in message


@pytest.mark.parametrize("namespace", ["a b", "a{b}", "x}"])
def test_bad_namespace_is_rejected(namespace):
    """Given a namespace with spaces or braces, resolving raises naming the namespace."""
    assert "namespace" in config_error(task_with(lock_namespace=namespace), conf_with())


@pytest.mark.parametrize("url", ["amqp://guest@localhost//", "sqs://", "http://localhost:6379/0"])
def test_non_redis_singleflight_url_is_rejected(url):
    """Given a singleflight_redis_url that is not Redis, resolving raises even with a Redis broker."""
    message = config_error(FakeTask, conf_with(singleflight_redis_url=url))

    assert "singleflight_redis_url" in message
    assert url in message


# -- where Redis comes from ------------------------------------------------------------------


@pytest.mark.parametrize("url", ["redis://h:6379/3", "rediss://h:6380/0", "unix:///tmp/redis.sock"])
def test_singleflight_redis_url_is_used(url):
    """Given singleflight_redis_url, it is used rather than the broker."""
    assert resolve_options(FakeTask, conf_with(singleflight_redis_url=url)).redis_url == url


def test_falls_back_to_a_redis_broker():
    """Given no singleflight_redis_url and a redis:// broker, the broker URL is used."""
    conf = {"broker_url": "redis://broker:6379/0", "result_backend": "redis://results:6379/1"}

    assert resolve_options(FakeTask, conf).redis_url == "redis://broker:6379/0"


def test_falls_back_to_a_redis_result_backend():
    """Given an AMQP broker and a Redis result backend, the result backend URL is used."""
    conf = {"broker_url": "amqp://guest@localhost//", "result_backend": "redis://results:6379/1"}

    assert resolve_options(FakeTask, conf).redis_url == "redis://results:6379/1"


@pytest.mark.parametrize("backend", [None, "rpc://", "db+sqlite:///results.db"])
def test_amqp_broker_without_redis_is_rejected(backend):
    """Given an AMQP broker, no singleflight_redis_url and no Redis backend, resolving raises."""
    message = config_error(FakeTask, {"broker_url": "amqp://guest@localhost//", "result_backend": backend})

    assert "singleflight_redis_url" in message


# -- inside a real Celery app ----------------------------------------------------------------


class DjangoSettings:
    """What a Django settings module looks like to config_from_object(namespace="CELERY")."""

    CELERY_SINGLEFLIGHT_TTL = 5
    CELERY_SINGLEFLIGHT_REDIS_URL = "redis://127.0.0.1:1/2"


def test_django_style_namespaced_settings_are_read():
    """Given CELERY_SINGLEFLIGHT_* settings loaded with namespace="CELERY", the task uses them."""
    app = make_app()
    app.config_from_object(DjangoSettings, namespace="CELERY")

    @app.task(base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def guarded(x):
        return x

    app.finalize()

    assert guarded.options.ttl == 5
    assert guarded.options.redis_url == "redis://127.0.0.1:1/2"
    assert guarded.render_key(x=1) == guarded.render_key(1) == "k:1"


def test_app_conf_settings_are_read():
    """Given singleflight_* in app.conf, a bound task resolves them; a per-task option beats them."""
    app = make_app()
    app.conf.update(singleflight_ttl=8, singleflight_on_duplicate="skip")

    @app.task(base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def from_app(x):
        return x

    @app.task(base=SingleFlightTask, lock_key="k:<x>", lock_ttl=3, shared=False)
    def from_task(x):
        return x

    app.finalize()

    assert (from_app.options.ttl, from_app.options.on_duplicate) == (8, "skip")
    assert (from_task.options.ttl, from_task.options.on_duplicate) == (3, "skip")


def test_bound_task_signature_excludes_self():
    """Given a bind=True task, the template is checked against the arguments after self."""
    app = make_app()

    @app.task(bind=True, base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def bound(self, x):
        return x

    app.finalize()

    assert bound.render_key(4) == "k:4"


def test_template_naming_a_missing_parameter_fails_when_the_task_is_created():
    """Given a template naming a parameter the task lacks, finalizing the app raises KeyTemplateError."""
    app = make_app()

    @app.task(base=SingleFlightTask, lock_key="k:<missing>", shared=False)
    def broken(x):
        return x

    with pytest.raises(KeyTemplateError, match="missing"):
        app.finalize()


def test_task_without_lock_key_fails_when_the_task_is_created():
    """Given lock_key=None, finalizing the app raises KeyTemplateError asking for a lock_key."""
    app = make_app()

    @app.task(base=SingleFlightTask, lock_key=None, shared=False)
    def unkeyed(x):
        return x

    with pytest.raises(KeyTemplateError, match="lock_key"):
        app.finalize()


def test_bad_option_fails_when_the_app_is_finalized():
    """Given a bad per-task option, the error surfaces at finalize, not at the first run."""
    app = make_app()

    @app.task(base=SingleFlightTask, lock_key="k:<x>", lock_ttl=-1, shared=False)
    def bad(x):
        return x

    with pytest.raises(ConfigurationError, match="lock_ttl"):
        app.finalize()


# -- fuzzing: any value of any setting gives Options or one clear ConfigurationError -----------

from hypothesis import given, settings  # noqa: E402 - grouped with the fuzz tests
from hypothesis import strategies as st  # noqa: E402

from celery_singleflight.config.options import declared  # noqa: E402

#: setting name -> its task option ('' if app-wide only)
DEFAULTS = {option.name: (option.task or "",) for option in declared() if option.setting}

_any_value = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-10**12, max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=8),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=300, deadline=None, database=None)
@given(setting=st.sampled_from(sorted(DEFAULTS)), value=_any_value, per_task=st.booleans())
def test_any_value_of_any_setting_is_accepted_or_refused_clearly(setting: str, value: object,
                                                                  per_task: bool) -> None:
    """Given any value for any setting (per task or in app.conf), resolving either succeeds with
    valid options or raises ConfigurationError naming the setting: never another exception."""
    from celery_singleflight import ConfigurationError
    from celery_singleflight.config.options import resolve_options

    attr = DEFAULTS[setting][0]
    task = type("T", (), {"name": "t"})
    conf: dict[str, object] = {"broker_url": "redis://h/0"}
    if per_task and attr:
        setattr(task, attr, value)
    else:
        conf[f"singleflight_{setting}"] = value
    try:
        opts = resolve_options(task, conf)
    except ConfigurationError as exc:
        assert setting in str(exc) or (attr and attr in str(exc)) or "Redis" in str(exc), str(exc)
        return
    assert opts.ttl > 0 and 0 < opts.heartbeat_interval < opts.ttl
    assert opts.max_concurrency >= 1 and (opts.max_queued is None or opts.max_queued >= 0)


# -- misspelled names -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "named"),
    [("lease_ttl", "lock_ttl"), ("lock_tll", "lock_ttl"), ("on_duplicates", "on_duplicate"),
     ("max_concurency", "max_concurrency"), ("lock_expiry", "lock_ttl"), ("unique_on", "lock_key"),
     ("once", "QueueOnce"), ("raise_on_duplicate", "on_duplicate='raise'"), ("Lock_TTL", "lock_ttl"),
     ("retry_backof", "retry_backoff")],
)
def test_a_misspelled_task_option_is_refused_naming_the_right_one(option: str, named: str) -> None:
    """Given ``@app.task(lease_ttl=3)`` (for ``lock_ttl``) or another library's option, the task
    is refused when it is defined, with the name to use: Celery would ignore it silently."""
    app = Celery("typos", broker=REDIS, set_as_current=False)

    with pytest.raises(ConfigurationError) as info:
        @app.task(bind=True, base=SingleFlightTask, lock_key="k:<a>", name=f"typo_{option}", shared=False,
                  **{option: 3})
        def task(self: Any, a: int) -> None: ...

        task.name  # noqa: B018 - a task is created when first used (the app is lazy)

    assert repr(option) in str(info.value) and named in str(info.value)


def test_names_far_from_ours_and_celerys_own_options_are_left_alone() -> None:
    """Given Celery's own options (autoretry, rate_limit, time_limit) and a name of the user's far
    from ours, the task is defined; an attribute starting with '_' is never checked."""
    app = Celery("far", broker=REDIS, set_as_current=False)

    @app.task(bind=True, base=SingleFlightTask, lock_key="k:<a>", autoretry_for=(ValueError,), shared=False,
              retry_backoff=True, rate_limit="1/m", time_limit=30, max_retries=3, my_cache_ttl=5, _lock_tll=1)
    def task(self: Any, a: int) -> None: ...

    assert task.options.retry_backoff == 1.0 and task.my_cache_ttl == 5


def test_an_unknown_singleflight_setting_is_refused_naming_the_closest() -> None:
    """Every ``singleflight_*`` setting is ours: a misspelled one (or a task option's name used as
    a setting) is an error naming the right setting; in Django's form too."""
    assert "did you mean singleflight_ttl?" in config_error(FakeTask, conf_with(singleflight_tll=3))
    assert "did you mean singleflight_ttl?" in config_error(FakeTask, conf_with(singleflight_lock_ttl=3))
    message = config_error(FakeTask, conf_with(SINGLEFLIGHT_NAMESPAC="x"))
    assert "did you mean SINGLEFLIGHT_NAMESPACE?" in message
    assert "the settings are:" in config_error(FakeTask, conf_with(singleflight_colour="blue"))


class DjangoSettingsMisspelled:
    """A Django settings module with a typo, as config_from_object(namespace=...) loads it."""

    CELERY_BROKER_URL = REDIS
    CELERY_SINGLEFLIGHT_TLL = 5
    CACHE_SINGLEFLIGHT_TIMEOUT = 3  # someone else's setting: not ours, left alone


@pytest.mark.parametrize("namespace", ["CELERY", "MYPROJ"])
def test_a_misspelled_django_setting_is_refused_in_the_form_it_was_written(namespace: str) -> None:
    """``app.config_from_object(settings, namespace="CELERY")`` keeps ``CELERY_SINGLEFLIGHT_TLL``
    under that name: it is refused when the task is created, naming ``CELERY_SINGLEFLIGHT_TTL``;
    so under another namespace. A setting of another prefix that merely contains ours is not."""
    settings = type("S", (), {k.replace("CELERY_", f"{namespace}_"): v
                              for k, v in vars(DjangoSettingsMisspelled).items() if k.isupper()})
    app = make_app()
    app.config_from_object(settings, namespace=namespace)

    @app.task(base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def guarded(x):
        return x

    with pytest.raises(ConfigurationError, match=f"{namespace}_SINGLEFLIGHT_TLL.*did you mean"
                                                 f" {namespace}_SINGLEFLIGHT_TTL"):
        app.finalize()


def test_check_app_refuses_typos_at_import_not_at_first_use() -> None:
    """Celery creates a task on first use; ``check_app(app)`` at the end of the app's module
    creates and checks every guarded task there, and a task defined after it is checked where it
    is defined."""
    from celery_singleflight import check_app

    app = make_app()

    @app.task(base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def fine(x):
        return x

    assert check_app(app) == [fine.name]
    with pytest.raises(ConfigurationError, match=r"lease_ttl.*did you mean lock_ttl"):
        @app.task(base=SingleFlightTask, lock_key="k:<x>", lease_ttl=3, shared=False)
        def typo(x):
            return x

    late = make_app()
    late.conf.update(singleflight_tll=3)

    @late.task(base=SingleFlightTask, lock_key="k:<x>", shared=False)
    def guarded(x):
        return x

    with pytest.raises(ConfigurationError, match="singleflight_tll"):
        check_app(late)


def test_error_messages_name_the_task_the_option_and_the_unit() -> None:
    """A bad value names the task and the option, in the option's own unit; a bad combination
    says what the task has; a missing field of a dict argument names the task."""
    app = make_app()

    def define(name: str, **opts: Any) -> Any:
        @app.task(base=SingleFlightTask, lock_key="k:<a.b>", name=name, shared=False, **opts)
        def task(a):
            return a
        return task

    with pytest.raises(ConfigurationError, match=r"task rate: progress_rate .* zero writes a second, not 0"):
        define("rate", progress_rate=0).options  # noqa: B018
    with pytest.raises(ConfigurationError, match=r"task ns: lock_namespace .* not 'a b'"):
        define("ns", lock_namespace="a b").options  # noqa: B018
    with pytest.raises(ConfigurationError, match="this task has on_duplicate='raise' and max_concurrency=1"):
        define("ordered", ordered=True).options  # noqa: B018
    with pytest.raises(KeyTemplateError, match=r"task fields: .*<a\.b> is missing.*without the key 'b'"):
        define("fields").render_key({"c": 1})


@pytest.mark.parametrize(("broker", "advice"), [
    ("sentinel://127.0.0.1:26379", "master_name"),
    ("redis+cluster://127.0.0.1:7000", "redis+cluster://"),
    ("amqp://guest@localhost//", "the broker is amqp://"),
])
def test_a_broker_the_leases_cannot_use_says_what_to_set(broker: str, advice: str) -> None:
    """A Sentinel or Cluster broker is Redis, but not usable as it is: the message says what to
    set, not that the broker is not Redis."""
    message = config_error(FakeTask, {"broker_url": broker})
    assert advice in message and "singleflight_redis_url" in message


def test_retry_backoff_options_resolve_and_are_validated() -> None:
    """``retry_backoff`` (seconds, True for 1 s, False for no growth), ``retry_backoff_max`` and
    ``retry_jitter`` resolve from the task or the settings; bad values name the option."""
    default = resolve_options(FakeTask, conf_with())
    assert (default.retry_backoff, default.retry_backoff_grows) == (0.1, True)
    assert (default.retry_backoff_max, default.retry_jitter) == (None, True)
    tuned = resolve_options(task_with(retry_backoff=2, retry_backoff_max=10, retry_jitter=False), conf_with())
    assert (tuned.retry_backoff, tuned.retry_backoff_max, tuned.retry_jitter) == (2.0, 10.0, False)
    flat = resolve_options(FakeTask, conf_with(singleflight_retry_backoff=False))
    assert (flat.retry_backoff, flat.retry_backoff_grows) == (0.1, False)
    assert resolve_options(task_with(retry_backoff=True), conf_with()).retry_backoff == 1.0
    assert "retry_backoff" in config_error(task_with(retry_backoff=-1), conf_with())
    assert "retry_backoff_max" in config_error(task_with(retry_backoff_max="soon"), conf_with())
    assert "retry_jitter" in config_error(task_with(retry_jitter="yes"), conf_with())
