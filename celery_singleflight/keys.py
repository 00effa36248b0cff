"""Lock key templates: ``"sync:<account_id>"`` rendered from a task's arguments.

Each ``<name>`` is bound through the task's own signature, so ``f(1)``, ``f(a=1)`` and a call
relying on the default give one key. Values are rendered as canonical JSON (sorted keys, no
spaces, tuples as lists: what the worker sees after JSON serialization), so ``1`` and ``"1"``
differ and a string value can never forge a separator (``"1:2"`` renders with its quotes).
``<name.field>`` reads a field of a dict or object argument, ``<@task>`` is the task's name.
Keys longer than :data:`MAX_KEY_LENGTH` are digested (stable and versioned).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import KeyTemplateError

__all__ = [
    "MAX_KEY_LENGTH",
    "KeyFunction",
    "KeyLayout",
    "canonical",
    "compile_key",
    "digest_key",
    "stored_key",
]

MAX_KEY_LENGTH = 256
_DIGEST_MARK = "~sha256v1~"
_DIGEST_KEEP = 150
_PLACEHOLDER = re.compile(r"<([^<>]*)>")
_NAME = re.compile(r"^(?:@task|[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)$")
# After a complete JSON number or literal, these characters could continue it; a separator
# between two placeholders must start with something else so every key parses one way only.
_CONTINUES_VALUE = re.compile(r"^[0-9A-Za-z.+]")

_RenderFn = Callable[[tuple[Any, ...], dict[str, Any]], str]


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
    return str(key)


def _normalize(value: Any) -> Any:
    """Reduce a value to plain JSON data, as a JSON round trip through the broker would."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {_dict_key(k): _normalize(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_normalize(v) for v in value), key=canonical)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(value).hex()}
    cls = type(value)
    return {f"${cls.__module__}.{cls.__qualname__}": str(value)}


def canonical(value: Any) -> str:
    """Deterministic, collision-free text for any argument value.

    A lone surrogate (possible after JSON decoding) becomes its ``\\udXXX`` escape, which no
    other string can render to (a real backslash is rendered doubled), so the key stays valid
    UTF-8 for Redis.
    """
    text = json.dumps(_normalize(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def digest_key(key: str) -> str:
    """Keep keys bounded: a readable head plus a versioned SHA-256 of the whole key.

    A short key that already carries the digest mark is digested too, so no key can pose as
    the digest of another.
    """
    if len(key) <= MAX_KEY_LENGTH and _DIGEST_MARK not in key:
        return key
    digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{key[:_DIGEST_KEEP]}{_DIGEST_MARK}{digest}"


_DIGEST_FORM = re.compile(rf"^.{{{_DIGEST_KEEP}}}{re.escape(_DIGEST_MARK)}[0-9a-f]{{64}}$", re.S)


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
    return parts


def _resolve(name: str, bound: Mapping[str, Any], template: str) -> Any:
    head, *fields = name.split(".")
    if head not in bound:
        raise KeyTemplateError(f"lock key template {template!r}: no argument <{head}> in this call")
    value = bound[head]
    for i, field in enumerate(fields):
        where = ".".join([head, *fields[: i + 1]])
        if isinstance(value, Mapping):
            if field not in value:
                raise KeyTemplateError(f"lock key template {template!r}: <{where}> is missing")
            value = value[field]
        elif hasattr(value, field):
            value = getattr(value, field)
        else:
            raise KeyTemplateError(f"lock key template {template!r}: <{where}> is missing")
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

    def render(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if signature is not None:
            ba = signature.bind(*args, **kwargs)
            ba.apply_defaults()
            bound: dict[str, Any] = dict(ba.arguments)
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
                out.append(canonical(_resolve(part.name, bound, spec)))
        return digest_key("".join(out))

    return KeyFunction(spec, render)


def _compile_callable(func: Callable[..., str]) -> _RenderFn:
    def render(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        key = func(*args, **kwargs)
        if not isinstance(key, str) or not key:
            raise KeyTemplateError(f"lock key callable {func!r} returned {key!r}, not a non-empty string")
        return digest_key(key)

    return render


def _escape(key: str) -> str:
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def _unescape(text: str) -> str:
    return text.replace("%7D", "}").replace("%7B", "{").replace("%25", "%")


@dataclass(frozen=True)
class KeyLayout:
    """Where the Redis keys of one lock live.

    ``<namespace>:{<key>}:<part>``: the braces make the user key the Redis Cluster hash tag, so
    every Redis key of one lock shares a slot. Braces and ``%`` inside the user key are
    percent-escaped so a key can neither break the tag nor collide with another key.
    """

    namespace: str

    def __post_init__(self) -> None:
        if not self.namespace or re.search(r"[\s{}]", self.namespace):
            raise KeyTemplateError(
                f"singleflight namespace {self.namespace!r} must be non-empty, without spaces or braces"
            )

    def redis_key(self, key: str, part: str) -> str:
        return f"{self.namespace}:{{{_escape(key)}}}:{part}"

    def user_key(self, redis_key: str) -> str | None:
        """The user key of a Redis key of this namespace, or None if it is not ours."""
        prefix = f"{self.namespace}:{{"
        if not redis_key.startswith(prefix):
            return None
        inner, sep, _ = redis_key[len(prefix) :].rpartition("}:")
        return _unescape(inner) if sep else None
