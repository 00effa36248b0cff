"""Lock key templates: binding, canonical rendering, validation, digests and the Redis layout."""

from __future__ import annotations

import inspect
import itertools
import json
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from celery_singleflight import ConfigurationError, KeyTemplateError, UnstableKeyError
from celery_singleflight.keys import MAX_KEY_LENGTH, canonical, compile_key, digest_key
from celery_singleflight.protocol.store import KeyLayout

DIGEST_MARK = "~sha256v1~"
PROPERTY = settings(max_examples=200, deadline=None, database=None)


# -- helpers ---------------------------------------------------------------------------------


def sync_account(account_id, region="eu"):
    """A task body: the signature templates are checked against."""


def two_args(a, b):
    """A task body with two required arguments."""


def one_arg(a):
    """A task body with one argument."""


def takes_kwargs(**options):
    """A task body that accepts any keyword."""


def key_for(template: str, func: Any = two_args, task_name: str = "t") -> Any:
    """Compile ``template`` against ``func``'s signature."""
    return compile_key(template, inspect.signature(func), task_name)


def render(template: str, func: Any, *args: Any, **kwargs: Any) -> str:
    """Compile and render in one step."""
    return key_for(template, func)(args, kwargs)


def hash_tag(redis_key: str) -> str | None:
    """The Redis Cluster hash tag: text between the first '{' and the first '}' after it, if non-empty."""
    start = redis_key.find("{")
    if start == -1:
        return None
    end = redis_key.find("}", start + 1)
    if end == -1 or end == start + 1:
        return None
    return redis_key[start + 1 : end]


# JSON-like values, including the characters that break naive key formats.
special_text = st.text(alphabet=st.sampled_from('*{}:\n"\\<>%~_-/ '), max_size=12)
json_text = st.text(max_size=12) | special_text
json_scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | json_text
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(json_text, children, max_size=4),
    max_leaves=12,
)


# -- binding through the signature -----------------------------------------------------------


def test_positional_keyword_and_default_calls_share_a_key():
    """Given a template over a defaulted parameter, every way of passing the same call gives one key."""
    key = key_for("sync:<account_id>:<region>", sync_account)

    keys = {
        key((1,), {}),
        key((), {"account_id": 1}),
        key((1, "eu"), {}),
        key((1,), {"region": "eu"}),
        key((), {"account_id": 1, "region": "eu"}),
    }

    assert keys == {"sync:1:eu"}


def test_a_non_default_value_changes_the_key():
    """Given the same account, a different region gives a different key."""
    key = key_for("sync:<account_id>:<region>", sync_account)

    assert key((1,), {}) != key((1, "us"), {})


@PROPERTY
@given(a=json_values, b=json_values)
def test_positional_and_keyword_agree_for_any_value(a, b):
    """Given any JSON-like arguments, positional and keyword calls render the same key."""
    key = key_for("k:<a>:<b>")

    assert key((a, b), {}) == key((), {"a": a, "b": b}) == key((a,), {"b": b})


# -- canonical values ------------------------------------------------------------------------


def test_tuple_and_list_give_the_same_key():
    """Given a tuple and the list the worker would receive after JSON, the keys match."""
    assert render("k:<a>", one_arg, (1, "x")) == render("k:<a>", one_arg, [1, "x"])


@pytest.mark.parametrize(("left", "right"), [(1, "1"), (1, True), (1, 1.5), (None, "null"), (0, False)])
def test_values_of_different_types_give_different_keys(left, right):
    """Given two values that print alike but differ in type, the keys differ."""
    assert render("k:<a>", one_arg, left) != render("k:<a>", one_arg, right)


@pytest.mark.parametrize("template", ["x:<a>_<b>", "x:<a>:<b>"])
def test_celery_once_style_collision_is_impossible(template):
    """Given values that forge the separator (the celery-once collision), the keys still differ."""
    first = render(template, two_args, a="1_b-2", b="3")
    second = render(template, two_args, a="1", b="2_b-3")

    assert first != second


def test_a_string_cannot_forge_a_separator():
    """Given a string containing the separator, it renders quoted and cannot match two values."""
    assert render("k:<a>:<b>", two_args, "1:2", "3") != render("k:<a>:<b>", two_args, "1", "2:3")


def test_dict_key_order_does_not_matter():
    """Given two dicts with the same items in a different order, the keys match."""
    assert render("k:<a>", one_arg, {"x": 1, "y": 2}) == render("k:<a>", one_arg, {"y": 2, "x": 1})


# -- fields and the task name ----------------------------------------------------------------


@pytest.mark.parametrize("user", [{"id": 7, "name": "ann"}, SimpleNamespace(id=7, name="ann")])
def test_field_placeholder_reads_a_dict_field_or_an_attribute(user):
    """Given <user.id>, a dict field and an object attribute both render the field's value."""

    def task(user):
        """A task taking a user."""

    assert render("u:<user.id>", task, user) == "u:7"


def test_nested_field_placeholder():
    """Given <a.b.c>, nested dicts and objects are followed."""
    value = {"b": SimpleNamespace(c="deep")}

    assert render("k:<a.b.c>", one_arg, value) == "k:deep"


@pytest.mark.parametrize("user", [{"name": "ann"}, SimpleNamespace(name="ann")])
def test_missing_field_raises_with_its_name(user):
    """Given a user without the field, rendering raises KeyTemplateError naming <user.id>."""

    def task(user):
        """A task taking a user."""

    key = key_for("u:<user.id>", task)

    with pytest.raises(KeyTemplateError, match=r"user\.id"):
        key((user,), {})


def test_task_placeholder_renders_the_task_name():
    """Given <@task>, the key contains the task's name."""
    key = compile_key("<@task>:<a>", inspect.signature(one_arg), "proj.tasks.sync")

    assert key((5,), {}) == "proj.tasks.sync:5"


def test_task_placeholder_alone_is_a_constant_key():
    """Given only <@task>, every call of the task shares one key."""
    key = compile_key("lock:<@task>", inspect.signature(one_arg), "proj.tasks.sync")

    assert key((1,), {}) == key((2,), {}) == "lock:proj.tasks.sync"


# -- validation at compile time --------------------------------------------------------------


def test_template_naming_a_missing_parameter_fails_at_compile_time():
    """Given a template naming a parameter the task lacks, compiling raises and names it."""
    with pytest.raises(KeyTemplateError, match=r"<acount_id>.*not a parameter") as info:
        key_for("sync:<acount_id>", sync_account)

    assert "account_id" in str(info.value)  # the real parameters are listed


def test_missing_head_of_a_field_placeholder_fails_at_compile_time():
    """Given <nope.field>, the missing parameter 'nope' is reported."""
    with pytest.raises(KeyTemplateError, match="nope"):
        key_for("k:<nope.field>", one_arg)


def test_task_with_var_keyword_accepts_any_name():
    """Given a task taking **kwargs, any placeholder name compiles and renders from the kwargs."""
    key = key_for("k:<anything>:<other.field>", takes_kwargs)

    assert key((), {"anything": 3, "other": {"field": "f"}}) == "k:3:f"


def test_var_keyword_task_without_the_argument_raises_at_render_time():
    """Given a **kwargs task called without the named argument, rendering raises naming it."""
    key = key_for("k:<anything>", takes_kwargs)

    with pytest.raises(KeyTemplateError, match="anything"):
        key((), {"else": 1})


@pytest.mark.parametrize("template", ["<a><b>", "k:<a><b>", "<a>x<b>", "<a>1<b>", "<a>.<b>", "<a>+<b>"])
def test_placeholders_without_a_separator_are_rejected(template):
    """Given two placeholders joined by nothing or by text that could continue a value, compiling fails."""
    with pytest.raises(KeyTemplateError, match=r"separator") as info:
        key_for(template)

    assert "<a>" in str(info.value)


@pytest.mark.parametrize("template", ["<a>:<b>", "<a>-<b>", "<a>/<b>", "<a>|<b>", "<a>_<b>", "k:<a>:<b>:v1"])
def test_placeholders_with_a_separator_are_accepted(template):
    """Given a proper separator, the template compiles and renders both values."""
    key = key_for(template)

    assert key((1, "x"), {}) != key(("x", 1), {})


@pytest.mark.parametrize("template", ["", "   "])
def test_empty_template_is_rejected(template):
    """Given an empty template, compiling raises KeyTemplateError."""
    with pytest.raises(KeyTemplateError, match="non-empty"):
        key_for(template)


@pytest.mark.parametrize("template", ["k:<a", "k:a>", "k:<a>>", "k:<a>:<b"])
def test_unbalanced_angle_bracket_is_rejected(template):
    """Given a stray '<' or '>', compiling raises KeyTemplateError."""
    with pytest.raises(KeyTemplateError, match="unbalanced"):
        key_for(template)


@pytest.mark.parametrize("template", ["k:<a:<b>", "k:<<a>", "k:>a<b>"])
def test_unbalanced_angle_bracket_before_a_placeholder_is_rejected(template):
    """Given a stray '<' or '>' before a later placeholder, compiling raises KeyTemplateError."""
    with pytest.raises(KeyTemplateError):
        key_for(template)


@pytest.mark.parametrize("template", ["k:<>", "k:<1a>", "k:<a-b>", "k:<a b>"])
def test_placeholder_that_is_not_a_name_is_rejected(template):
    """Given <> or a placeholder that is not an identifier, compiling raises KeyTemplateError."""
    with pytest.raises(KeyTemplateError, match="not a parameter name"):
        key_for(template)


# -- callable keys ---------------------------------------------------------------------------


def test_callable_key_is_called_with_the_task_arguments():
    """Given a callable lock_key, it receives the call's args and kwargs and its result is the key."""
    calls = []

    def make_key(*args, **kwargs):
        calls.append((args, kwargs))
        return f"acct:{args[0]}"

    key = compile_key(make_key, inspect.signature(sync_account), "t")

    assert key((1,), {"region": "us"}) == "acct:1"
    assert calls == [((1,), {"region": "us"})]


@pytest.mark.parametrize("result", ["", None, 5, b"bytes"])
def test_callable_key_must_return_a_non_empty_string(result):
    """Given a callable returning '' or a non-string, rendering raises KeyTemplateError."""
    key = compile_key(lambda *a, **k: result, inspect.signature(one_arg), "t")

    with pytest.raises(KeyTemplateError, match="non-empty string"):
        key((1,), {})


def test_long_callable_key_is_digested():
    """Given a callable returning a very long key, the result is bounded."""
    key = compile_key(lambda a: "x" * 1000, inspect.signature(one_arg), "t")

    assert len(key((1,), {})) <= MAX_KEY_LENGTH


# -- digests ---------------------------------------------------------------------------------


def test_key_of_exactly_the_limit_is_kept():
    """Given a key of MAX_KEY_LENGTH characters, it is returned unchanged."""
    key = "k" * MAX_KEY_LENGTH

    assert digest_key(key) == key


def test_long_key_is_digested_stably():
    """Given a key over the limit, it is shortened, marked and the same on every call."""
    long_value = "v" * 300

    first = render("k:<a>", one_arg, long_value)
    second = render("k:<a>", one_arg, long_value)

    assert MAX_KEY_LENGTH == 256
    assert len(first) <= 256
    assert DIGEST_MARK in first
    assert first == second


def test_different_long_keys_have_different_digests():
    """Given two long values that share their head and differ only at the end, the keys differ."""
    head = "h" * 400

    assert render("k:<a>", one_arg, head + "1") != render("k:<a>", one_arg, head + "2")


def test_one_megabyte_string_renders_to_a_bounded_key():
    """Given a 1 MB string argument, the key is digested to at most 256 characters."""
    key = render("k:<a>", one_arg, "x" * 1_000_000)

    assert len(key) <= MAX_KEY_LENGTH
    assert DIGEST_MARK in key


# -- properties over JSON-like values ---------------------------------------------------------


@PROPERTY
@given(a=json_values, b=json_values)
def test_rendering_is_deterministic_bounded_and_never_raises(a, b):
    """Given any JSON-like values, rendering succeeds, repeats exactly and stays within the limit."""
    key = key_for("k:<a>:<b>")

    first = key((a, b), {})

    assert first == key((a, b), {})
    assert isinstance(first, str)
    assert 0 < len(first) <= MAX_KEY_LENGTH


@PROPERTY
@given(a=json_values, b=json_values)
def test_caller_and_worker_see_the_same_key(a, b):
    """Given any JSON-like values, the key before and after a JSON round trip is the same."""
    key = key_for("k:<a>:<b>")
    a2, b2 = json.loads(json.dumps([a, b]))

    assert key((a, b), {}) == key((a2, b2), {})


@PROPERTY
@given(a1=json_values, b1=json_values, a2=json_values, b2=json_values)
def test_distinct_values_never_share_a_key(a1, b1, a2, b2):
    """Given two argument pairs that differ canonically, their keys differ."""
    assume((canonical(a1), canonical(b1)) != (canonical(a2), canonical(b2)))
    key = key_for("k:<a>:<b>")

    assert key((a1, b1), {}) != key((a2, b2), {})


@PROPERTY
@given(text=json_text, cut=st.integers(min_value=0, max_value=12))
def test_moving_the_boundary_between_two_strings_changes_the_key(text, cut):
    """Given one string split in two different places, the two keys differ."""
    cut = min(cut, len(text))
    assume(cut > 0)
    key = key_for("k:<a>:<b>")

    assert key((text[:cut], text[cut:]), {}) != key((text[: cut - 1], text[cut - 1 :]), {})


@pytest.mark.parametrize(
    ("value", "key"),
    [("acme", "k:acme"), ("cid_123", "k:cid_123"), ("eu-west.1", "k:eu-west.1"), ("_x", "k:_x"),
     ("42", 'k:"42"'), ("-1", 'k:"-1"'), ("true", 'k:"true"'), ("null", 'k:"null"'), ("NaN", 'k:"NaN"'),
     ("a:b", 'k:"a:b"'), ("a b", 'k:"a b"'), ("", 'k:""'), ("é", 'k:"é"'), ('"q"', 'k:"\\"q\\""'),
     (42, "k:42"), (None, "k:null"), (True, "k:true")],
)
def test_a_name_like_string_renders_bare(value, key):
    """Given a string that reads as a name, it renders as a person types it; anything that could
    read as another value (a number, a JSON literal) or hold a separator keeps its quotes."""
    assert render("k:<a>", one_arg, value) == key


def test_a_bare_string_never_holds_the_text_that_follows_its_placeholder():
    """Given ``<a>-<b>``, a value of ``a`` with a '-' keeps its quotes, so ('x-y', 'z') and
    ('x', 'y-z') stay two keys; the last placeholder, followed by nothing, may hold it."""
    first = render("k:<a>-<b>", two_args, "x-y", "z")
    second = render("k:<a>-<b>", two_args, "x", "y-z")

    assert (first, second) == ('k:"x-y"-z', "k:x-y-z")


#: every string up to 3 characters over the characters that could confuse a bare rendering with
#: its neighbours, and values of other types that print alike
_TRICKY = [
    "".join(chars) for size in range(4) for chars in itertools.product("a-_1", repeat=size)
] + ["e", "1e", "1e-05", 1e-05, 1, -1, True, None, "true", "a.b", ".", "a:b"]


@pytest.mark.parametrize("template", ["k:<a>:<b>", "k:<a>-<b>", "k:<a>_<b>", "<a>-<b>", "<a>_<b>_x", "<a>-x"])
def test_bare_strings_keep_every_template_collision_free(template):
    """Given a template with ':', '-' or '_' separators, every pair of values full of those
    characters (over 8,000 pairs) renders to its own key."""
    def run(a: Any, b: Any = None) -> None: ...

    key = compile_key(template, inspect.signature(run), "t")
    seen: dict[str, tuple[str, str]] = {}
    for a, b in itertools.product(_TRICKY, repeat=2):
        rendered, values = key((a, b), {}), (canonical(a), canonical(b) if "<b>" in template else "")
        assert seen.setdefault(rendered, values) == values, (template, rendered)


# -- the Redis key layout --------------------------------------------------------------------

user_keys = st.text(min_size=1, max_size=40) | st.text(
    alphabet=st.sampled_from("{}%7BDd25:ab"), min_size=1, max_size=20
)


@pytest.mark.parametrize(
    "key", ["k:1", "{", "}", "{}", "}{", "a{b}c", "%", "%7B", "%257D", '{"a":1}', "k:x}:lease"]
)
def test_lease_and_fence_share_a_hash_tag(key):
    """Given a key with braces or '%', the lease and fence Redis keys share one hash tag."""
    layout = KeyLayout("sf")

    lease, fence = layout.redis_key(key, "lease"), layout.redis_key(key, "fence")

    assert hash_tag(lease) is not None
    assert hash_tag(lease) == hash_tag(fence)
    assert layout.user_key(lease) == layout.user_key(fence) == key


@PROPERTY
@given(key=user_keys)
def test_hash_tag_and_round_trip_for_any_key(key):
    """Given any non-empty key, both Redis keys share a non-empty hash tag and map back to the key."""
    layout = KeyLayout("sf")

    lease, fence = layout.redis_key(key, "lease"), layout.redis_key(key, "fence")

    assert hash_tag(lease) is not None
    assert hash_tag(lease) == hash_tag(fence)
    assert layout.user_key(lease) == key
    assert layout.user_key(fence) == key


@PROPERTY
@given(a=json_values, b=json_values)
def test_rendered_keys_always_get_a_hash_tag(a, b):
    """Given any rendered key, its Redis keys carry a hash tag (rendered keys are never empty)."""
    layout = KeyLayout("sf")
    key = key_for("k:<a>:<b>")((a, b), {})

    assert hash_tag(layout.redis_key(key, "lease")) == hash_tag(layout.redis_key(key, "fence")) is not None


@PROPERTY
@given(first=user_keys, second=user_keys)
def test_different_keys_never_share_a_redis_key(first, second):
    """Given two different keys, their Redis keys differ."""
    assume(first != second)
    layout = KeyLayout("sf")

    assert layout.redis_key(first, "lease") != layout.redis_key(second, "lease")


def test_user_key_of_another_namespace_is_none():
    """Given a Redis key of another namespace, user_key returns None."""
    assert KeyLayout("sf").user_key(KeyLayout("other").redis_key("k", "lease")) is None


@pytest.mark.parametrize("namespace", ["", "a b", "a{b", "a}b", "{}", "\t", "sf\n"])
def test_bad_namespace_is_rejected(namespace):
    """Given a namespace that is empty or has spaces or braces, KeyLayout raises."""
    with pytest.raises(ConfigurationError, match="namespace"):
        KeyLayout(namespace)


def test_lone_surrogate_renders_to_valid_utf8_and_stays_distinct():
    """Given a string with a lone surrogate (possible after JSON decoding), the key encodes as
    UTF-8 for Redis and differs from the same text written with a literal backslash."""
    lone = key_for("k:<a>:<b>")(("\ud800", 1), {})
    literal = key_for("k:<a>:<b>")(("\\ud800", 1), {})
    lone.encode("utf-8")
    assert lone != literal


def test_short_key_cannot_pose_as_the_digest_of_a_long_one():
    """Given the digest D of a long key, a callable returning D itself gets a different key."""
    long_key = "x" * 1000
    digested = digest_key(long_key)
    assert digest_key(digested) != digested
    assert len(digest_key(digested)) <= 256


# -- keys that would drift: refused, naming the parameter, its type and the fix --------------------


class Thing:
    """Rendered with the default ``object.__repr__``: a memory address, different per process."""


class NamedThing:
    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __str__(self) -> str:
        return f"thing-{self.ident}"


def _sync(account: Any, region: str = "eu") -> None: ...


def test_a_value_rendered_with_a_memory_address_is_refused_naming_the_parameter_and_the_fix() -> None:
    render = compile_key("sync:<account>", inspect.signature(_sync), "proj.sync")
    with pytest.raises(UnstableKeyError) as info:
        render((Thing(),), {})
    message = str(info.value)
    assert "<account>" in message and "proj.sync" in message and "Thing" in message
    assert "memory address" in message and "__str__" in message and "callable" in message
    assert isinstance(info.value, KeyTemplateError)  # one base class: a bad key is a configuration error


@pytest.mark.parametrize("value", [
    [1, Thing()], {"nested": {"deep": Thing()}}, lambda: 1, (x for x in range(2)), {Thing(): 1},
])
def test_an_address_anywhere_in_the_value_is_refused(value: Any) -> None:
    render = compile_key("sync:<account>", inspect.signature(_sync), "proj.sync")
    with pytest.raises(UnstableKeyError, match="<account>"):
        render((value,), {})


def test_a_value_with_its_own_rendering_gives_one_key_in_every_process() -> None:
    render = compile_key("sync:<account>", inspect.signature(_sync), "proj.sync")
    assert render((NamedThing(7),), {}) == render((NamedThing(7),), {}) != render((NamedThing(8),), {})


def test_a_callable_key_that_returns_an_address_is_refused() -> None:
    render = compile_key(lambda account, region="eu": f"sync:{account}", inspect.signature(_sync), "p.sync")
    with pytest.raises(UnstableKeyError, match="memory address"):
        render((Thing(),), {})
    assert render((NamedThing(1),), {}) == "sync:thing-1"


def test_a_drifting_argument_is_refused_before_anything_is_sent() -> None:
    """Sending (``delay``/``apply_async``) renders the key first: the caller gets the error and no
    message is published; a run reaching a worker another way (by name) fails with it too."""
    from celery import Celery
    from celery import signals as celery_signals

    from celery_singleflight import SingleFlightTask

    app = Celery("drift", broker="memory://", set_as_current=False)
    app.conf.singleflight_redis_url = "redis://127.0.0.1:1/0"  # never reached

    @app.task(base=SingleFlightTask, name="drift.sync", shared=False, lock_key="sync:<account>",
              on_duplicate="skip")
    def sync(account: Any) -> None: ...

    published: list[Any] = []

    def receiver(sender: Any = None, **_: Any) -> None:
        published.append(sender)

    celery_signals.before_task_publish.connect(receiver, weak=False)
    try:
        with pytest.raises(UnstableKeyError, match="<account>"):
            sync.delay(Thing())
        with pytest.raises(UnstableKeyError):
            sync.apply_async(kwargs={"account": Thing()})
        assert published == []
        with pytest.raises(UnstableKeyError):
            sync.apply(args=(Thing(),)).get()
    finally:
        celery_signals.before_task_publish.disconnect(receiver)


def _plain(a: Any, b: Any = 2, *, c: Any = 3, d: Any) -> None: ...


@given(
    args=st.lists(st.integers(), max_size=4),
    kwargs=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), st.integers(), max_size=4),
)
def test_the_fast_binding_agrees_with_signature_bind_or_steps_aside(
    args: list[int], kwargs: dict[str, int]
) -> None:
    """Keys are rendered on every run through a fast binder; for any call it either binds exactly as
    ``Signature.bind`` + ``apply_defaults`` would, or steps aside (None) and lets bind decide."""
    from celery_singleflight.keys import _fast_binder

    signature = inspect.signature(_plain)
    fast = _fast_binder(signature)
    assert fast is not None
    got = fast(tuple(args), dict(kwargs))
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        assert got is None
        return
    bound.apply_defaults()
    assert got is None or got == dict(bound.arguments)
