"""Lock key templates: ``"sync:<account_id>"`` rendered from a task's arguments.

Each ``<name>`` is bound through the task's own signature, so ``f(1)``, ``f(a=1)`` and a call
relying on the default give one key. A string that reads as a name (``acme``, ``cid_123``,
``eu-west.1``: ASCII letters, digits, ``_``, ``.`` and ``-``, starting with a letter or ``_``)
renders bare, as a person would type it: ``sync:acme``. Every other value renders as canonical
JSON (sorted keys, no spaces, tuples as lists: what the worker sees after JSON serialization):
``sync:42``, ``sync:"42"``, ``sync:"a:b"``, ``sync:[1,2]``. Keys stay collision-free: a bare
string never looks like a number or a JSON literal (``"true"``, ``"null"``, ``"NaN"`` keep their
quotes), and never holds the character that starts the text after its placeholder (with
``"<a>-<b>"``, ``a="x-y"`` keeps its quotes), so every key parses back one way only.
``<name.field>`` reads a field of a dict or object argument, ``<@task>`` is the task's name.
Keys longer than :data:`MAX_KEY_LENGTH` are digested (stable and versioned).

A value that is not plain data is rendered by its ``str()``. When that text holds a memory
address (the default ``object.__repr__``: ``<app.Thing object at 0x7f...>``), the key would
differ between the caller, the worker and a redelivery, and equal objects would never exclude
each other: such a value is refused (:class:`UnstableKeyError`) naming the parameter and the fix.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import KeyTemplateError, UnstableKeyError

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyFunction",
    "canonical",
    "compile_key",
    "digest_key",
    "render_value",
    "stored_key",
]

MAX_KEY_LENGTH = 256
"""A rendered key longer than this many characters is stored as its digest (see :func:`digest_key`)."""
DIGEST_MARK = "~sha256v1~"
_DIGEST_KEEP = 150
_PLACEHOLDER = re.compile(r"<([^<>]*)>")
_NAME = re.compile(r"^(?:@task|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)$")
# After a complete JSON number or literal, these characters could continue it; a separator
# between two placeholders must start with something else so every key parses one way only.
_CONTINUES_VALUE = re.compile(r"^[0-9A-Za-z.+]")

#: a string rendered bare: it cannot start a number (digit, ``-``), a quoted string or a JSON
#: list or object, and holds no separator but the two a template may also use (``_``, ``-``)
_BARE = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
#: bare-looking texts that are the rendering of another value (``True``, ``None``, floats)
_NOT_BARE = frozenset({"true", "false", "null", "NaN", "Infinity"})

_RenderFn = Callable[[tuple[Any, ...], dict[str, Any]], str]
#: how a memory address shows in a default repr (``<Thing object at 0x7f6f2356e2d0>``, functions,
#: generators, bound methods)
_ADDRESS = re.compile(r"\bat 0x[0-9a-fA-F]{4,}")


class _Unstable(Exception):
    """Raised inside rendering; turned into an :class:`UnstableKeyError` naming the parameter."""

    def __init__(self, value: Any, text: str) -> None:
        super().__init__(value, text)
        self.type_name = f"{type(value).__module__}.{type(value).__qualname__}"
        self.text = text


@dataclass(frozen=True)
class KeyFunction:
    """A compiled lock key: ``key(args, kwargs)`` renders it for one call."""

    source: str
    render: _RenderFn

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self.render(args, kwargs)


def _dict_key(key: Any) -> str:
    """Mirror how JSON turns a mapping key into a string."""
    if isinstance(key, str):
        return key
    if key is None or isinstance(key, (bool, int, float)):
        return json.dumps(key)
    text = str(key)
    if _ADDRESS.search(text):
        raise _Unstable(key, text)
    return text


def _normalize(value: Any) -> Any:
    """Reduce a value to plain JSON data, as a JSON round trip through the broker would."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {_dict_key(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_normalize(v) for v in value), key=_canonical)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(value).hex()}
    cls = type(value)
    text = str(value)
    if _ADDRESS.search(text):
        raise _Unstable(value, text)
    return {f"${cls.__module__}.{cls.__qualname__}": text}


def canonical(value: Any) -> str:
    """Deterministic, collision-free text for any argument value.

    A lone surrogate (possible after JSON decoding) becomes its ``\\udXXX`` escape, which no
    other string can render to (a real backslash is rendered doubled), so the key stays valid
    UTF-8 for Redis. Raises :class:`UnstableKeyError` for a value rendered with a memory address.
    """
    try:
        return _canonical(value)
    except _Unstable as exc:
        raise UnstableKeyError(_unstable_message(exc, "the value")) from None


_encode_str = json.encoder.encode_basestring  # what json.dumps(str, ensure_ascii=False) gives


def _canonical(value: Any) -> str:
    kind = type(value)
    if kind is int:  # the common values, without json.dumps (same text)
        return str(value)
    if kind is str and value.isascii():
        return _encode_str(value)
    text = json.dumps(_normalize(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def render_value(value: Any, stop: str = "") -> str:
    """One argument as it appears in a key: bare for a name-like string that holds no ``stop``
    character (the first character of the template text after the placeholder), else
    :func:`canonical`."""
    if (type(value) is str and _BARE.fullmatch(value) and value not in _NOT_BARE
            and not (stop and stop in value)):
        return value
    return _canonical(value)


def digest_key(key: str) -> str:
    """Keep keys bounded: a readable head plus a versioned SHA-256 of the whole key.

    A short key that already carries the digest mark is digested too, so no key can pose as
    the digest of another.
    """
    if len(key) <= MAX_KEY_LENGTH and DIGEST_MARK not in key:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{key[:_DIGEST_KEEP]}{DIGEST_MARK}{digest}"


_DIGEST_FORM = re.compile(rf"^.{{{_DIGEST_KEEP}}}{re.escape(DIGEST_MARK)}[0-9a-f]{{64}}$", re.S)


def stored_key(key: str) -> str:
    """The key as stored, for a key typed by a person or listed by ``held()``.

    A key already in digest form (as ``held()`` lists a long key) is used as it is; any other key
    is digested like a rendered one. Rendering never trusts the digest form (see
    :func:`digest_key`), so this only serves look-ups of keys that exist.
    """
    return key if _DIGEST_FORM.match(key) else digest_key(key)


@dataclass(frozen=True)
class _Part:
    literal: str
    name: str | None  # None: literal only; "@task": the task name; else "param[.field...]"
    stop: str = ""  # the first character of the text after this placeholder, when a bare string may hold it


def _parse(template: str) -> list[_Part]:
    parts: list[_Part] = []
    pos = 0
    for match in _PLACEHOLDER.finditer(template):
        literal = template[pos : match.start()]
        if "<" in literal or ">" in literal:
            raise KeyTemplateError(f"lock key template {template!r} has an unbalanced '<' or '>'")
        name = match.group(1).strip()
        if not _NAME.match(name):
            raise KeyTemplateError(
                f"lock key template {template!r}: <{match.group(1)}> is not a parameter name"
                " (use <param>, <param.field> or <@task>)"
            )
        if parts and parts[-1].name not in (None, "@task") and not literal:
            raise KeyTemplateError(
                f"lock key template {template!r}: put a separator such as ':' between"
                f" <{parts[-1].name}> and <{name}>"
            )
        if parts and parts[-1].name not in (None, "@task") and _CONTINUES_VALUE.match(literal):
            raise KeyTemplateError(
                f"lock key template {template!r}: the text after <{parts[-1].name}> must start"
                " with a separator such as ':', '/', '|', '-' or '_' (not a letter, digit, '.' or '+')"
            )
        parts.append(_Part(literal, name))
        pos = match.end()
    tail = template[pos:]
    if "<" in tail or ">" in tail:
        raise KeyTemplateError(f"lock key template {template!r} has an unbalanced '<' or '>'")
    if tail:
        parts.append(_Part(tail, None))
    # a bare string must not hold the character that starts the text after its placeholder
    return [
        _Part(part.literal, part.name, following.literal[:1])
        if part.name not in (None, "@task") and following.literal[:1] in ("_", "-") else part
        for part, following in zip(parts, [*parts[1:], _Part("", None)], strict=True)
    ]


def _resolve(name: str, bound: Mapping[str, Any], template: str, task_name: str) -> Any:
    head, *fields = name.split(".")
    if head not in bound:
        raise KeyTemplateError(
            f"task {task_name}: lock key {template!r}: this call has no argument <{head}>"
        )
    value = bound[head]
    for i, field in enumerate(fields):
        if isinstance(value, Mapping) and field in value:
            value = value[field]
        elif not isinstance(value, Mapping) and hasattr(value, field):
            value = getattr(value, field)
        else:
            parent = ".".join([head, *fields[:i]])
            lacks = ("is a mapping without the key" if isinstance(value, Mapping)
                     else f"({type(value).__name__}) has no field")
            raise KeyTemplateError(
                f"task {task_name}: lock key {template!r}: <{parent}.{field}> is missing: the"
                f" argument {parent} {lacks} {field!r}"
            )
    return value


def compile_key(
    spec: str | Callable[..., str],
    signature: inspect.Signature | None,
    task_name: str,
) -> KeyFunction:
    """Check ``spec`` against the task's signature now and return ``render(args, kwargs)``.

    Raises :class:`KeyTemplateError` at definition time for a name the task does not have.
    """
    if callable(spec):
        return KeyFunction(repr(spec), _compile_callable(spec))
    if not isinstance(spec, str) or not spec.strip():
        raise KeyTemplateError(f"task {task_name}: lock_key must be a non-empty string or a callable")
    parts = _parse(spec)
    params = dict(signature.parameters) if signature is not None else {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for part in parts:
        if part.name in (None, "@task"):
            continue
        head = part.name.split(".")[0]
        if signature is not None and head not in params and not takes_any:
            names = ", ".join(params) or "none"
            raise KeyTemplateError(
                f"task {task_name}: lock key {spec!r} names <{head}>, which is not a parameter"
                f" of the task (its parameters: {names})"
            )
    if not any(p.name not in (None, "@task") for p in parts):
        constant = digest_key("".join(p.literal + (task_name if p.name else "") for p in parts))
        return KeyFunction(spec, lambda args, kwargs: constant)
    fast_bind = None if signature is None else _fast_binder(signature)

    def render(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        bound: dict[str, Any] | None = None if fast_bind is None else fast_bind(args, kwargs)
        if bound is not None:
            pass
        elif signature is not None:
            ba = signature.bind(*args, **kwargs)
            ba.apply_defaults()
            bound = dict(ba.arguments)
            for p in signature.parameters.values():
                if p.kind is inspect.Parameter.VAR_KEYWORD:
                    bound.update(bound.pop(p.name, {}))
        else:
            bound = dict(kwargs)
        out: list[str] = []
        for part in parts:
            out.append(part.literal)
            if part.name == "@task":
                out.append(task_name)
            elif part.name is not None:
                try:
                    out.append(render_value(_resolve(part.name, bound, spec, task_name), part.stop))
                except _Unstable as exc:
                    where = f"task {task_name}: lock key {spec!r}: <{part.name}>"
                    raise UnstableKeyError(_unstable_message(exc, where)) from None
        return digest_key("".join(out))

    return KeyFunction(spec, render)


def _fast_binder(
    signature: inspect.Signature,
) -> Callable[[tuple[Any, ...], dict[str, Any]], dict[str, Any] | None] | None:
    """Bind a call to a signature of plain parameters (no ``*args``, ``**kwargs`` or positional-only)
    the way ``Signature.bind`` + ``apply_defaults`` would, at a fraction of the cost: every run
    renders its key. A call it cannot vouch for (too many arguments, an unknown or repeated name,
    a missing one) gives None, and ``bind`` then decides, with its own error."""
    kinds = inspect.Parameter
    params = list(signature.parameters.values())
    if any(p.kind in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD, kinds.POSITIONAL_ONLY) for p in params):
        return None
    positional = [p.name for p in params if p.kind is kinds.POSITIONAL_OR_KEYWORD]
    names = frozenset(p.name for p in params)
    defaults = [(p.name, p.default) for p in params if p.default is not inspect.Parameter.empty]
    count = len(names)

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        if len(args) > len(positional):
            return None
        bound = dict(zip(positional, args, strict=False))  # fewer args than parameters: the rest by name
        for name, value in kwargs.items():
            if name not in names or name in bound:
                return None
            bound[name] = value
        for name, default in defaults:
            bound.setdefault(name, default)
        return bound if len(bound) == count else None

    return bind


def _compile_callable(func: Callable[..., str]) -> _RenderFn:
    def render(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        key = func(*args, **kwargs)
        if not isinstance(key, str) or not key:
            raise KeyTemplateError(f"lock key callable {func!r} returned {key!r}, not a non-empty string")
        if _ADDRESS.search(key):
            raise UnstableKeyError(
                f"lock key callable {getattr(func, '__qualname__', func)!r} returned {key!r}, which holds a"
                " memory address: it differs per process, so runs of equal arguments would not exclude each"
                " other. Build the key from ids or values, not from an object's default repr"
            )
        return digest_key(key)

    return render


def _unstable_message(exc: _Unstable, where: str) -> str:
    return (
        f"{where} is a {exc.type_name} rendered as {exc.text!r}, which holds a memory address: it differs"
        " per process (caller, worker, redelivery), so runs of equal arguments would not exclude each"
        f" other. Give {exc.type_name.rpartition('.')[2]} a __str__ that names the value (an id), pass the"
        " id instead of the object, or give lock_key a callable that builds the key"
    )
