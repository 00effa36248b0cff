"""An option, declared once: its setting and task option, its default, its check, its doc.

Each feature declares its options as :class:`Option` attributes of a group class
(:class:`~.core.CoreOptions` here, the duplicate policies' in :mod:`..policies.duplicates`, ...);
:class:`~.options.Options` inherits every group, so ``task.options.ttl`` is a typed attribute,
and the settings reader, the task's class attributes, the misspelling check and the
configuration page all come from the same declarations.

Precedence, in one line: per-task attribute > ``app.conf.singleflight_<name>`` > default. A
value left at ``None`` counts as not set. Each value is checked when it is resolved (the task's
binding to its app), so a bad value fails when the worker starts, with a sentence naming the
task, the option and what to change.
"""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

from ..errors import ConfigurationError
from .settings import conf_get

__all__ = [
    "Derived", "Option", "OptionGroup", "Resolving", "anything", "choice", "count", "flag", "seconds",
    "signal_name",
]

T = TypeVar("T")


@dataclass
class Resolving:
    """What a check may look at while one task's (or an app's) options resolve: the task (a
    class, an instance, or a stand-in with only some attributes), its name, the app's settings,
    and the values resolved so far (and as given, in ``raw``)."""

    task: Any
    name: str
    conf: Any
    values: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)

    def setting(self, name: str) -> Any:
        """``singleflight_<name>`` (also ``SINGLEFLIGHT_<NAME>``) from the settings, or None."""
        return conf_get(self.conf, name)


#: a check: (where, the value, what resolved so far) -> the value to keep, or ConfigurationError
Check = Callable[[str, Any, Resolving], T]


class Option(Generic[T]):
    """One option (see the module docstring). ``setting``: it is also the app setting
    ``singleflight_<name>``; ``task``: the task option's name (None: app-wide only)."""

    name: str

    def __init__(
        self, *, check: Check[T], meaning: str, values: str, default: Any = None, setting: bool = True,
        task: str | None = None, default_text: str | None = None, precedence: str | None = None,
        read: Callable[[Option[Any], Resolving], Any] | None = None,
    ) -> None:
        self.check = check
        self.meaning = meaning
        self.values = values
        self.default = default
        self.setting = setting
        self.task = task
        self.default_text = default_text
        self.precedence = precedence
        self.read = read

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        if self.task is None and not self.setting:
            raise TypeError(f"option {name} is neither a setting nor a task option")

    @overload
    def __get__(self, options: None, owner: type) -> Option[T]: ...

    @overload
    def __get__(self, options: OptionGroup, owner: type) -> T: ...

    def __get__(self, options: OptionGroup | None, owner: type) -> Option[T] | T:
        if options is None:
            return self
        value: T = options._values[self.name]
        return value

    def where(self, ctx: Resolving) -> str:
        """How an error names the option: ``task t: lock_ttl (or singleflight_ttl)``."""
        if self.task and self.setting:
            return f"task {ctx.name}: {self.task} (or singleflight_{self.name})"
        if self.task:
            return f"task {ctx.name}: {self.task}"
        return f"singleflight_{self.name}"

    def given(self, ctx: Resolving) -> Any:
        """The value as given: per-task attribute > setting > default (None counts as not set)."""
        if self.read is not None:
            return self.read(self, ctx)
        value = getattr(ctx.task, self.task, None) if self.task else None
        if value is None and self.setting:
            value = ctx.setting(self.name)
        return self.default if value is None else value

    def resolve(self, ctx: Resolving) -> T:
        value = self.given(ctx)
        ctx.raw[self.name] = value
        return self.check(self.where(ctx), value, ctx)


class Derived(Generic[T]):
    """A value computed from options resolved before it (the Redis target of three settings)."""

    name: str

    def __init__(self, compute: Callable[[Resolving], T]) -> None:
        self.compute = compute

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, options: None, owner: type) -> Derived[T]: ...

    @overload
    def __get__(self, options: OptionGroup, owner: type) -> T: ...

    def __get__(self, options: OptionGroup | None, owner: type) -> Derived[T] | T:
        if options is None:
            return self
        value: T = options._values[self.name]
        return value

    def resolve(self, ctx: Resolving) -> T:
        return self.compute(ctx)


_G = TypeVar("_G", bound="OptionGroup")


class OptionGroup:
    """A feature's options (class attributes :class:`Option`). ``validate`` checks options
    against each other once all are resolved."""

    __slots__ = ("_values",)
    #: the heading of the group's options on the configuration page
    title = ""

    def __init__(self, values: dict[str, Any]) -> None:
        self._values = values

    def replace(self: _G, **values: Any) -> _G:
        """These options with ``values`` changed (already resolved and checked by the caller)."""
        return type(self)({**self._values, **values})

    @classmethod
    def declared(cls) -> Iterator[Option[Any] | Derived[Any]]:
        """Every option and derived value of the class, groups in reverse MRO order, each in
        declaration order."""
        seen: set[str] = set()
        for klass in reversed(cls.__mro__):
            for value in vars(klass).values():
                if isinstance(value, (Option, Derived)) and value.name not in seen:
                    seen.add(value.name)
                    yield value

    @classmethod
    def options(cls) -> list[Option[Any]]:
        return [item for item in cls.declared() if isinstance(item, Option)]

    @classmethod
    def validate(cls, ctx: Resolving) -> None:
        """Raise :class:`ConfigurationError` for a bad combination of this group's options."""


# -- checks ----------------------------------------------------------------------------------


def seconds(*, allow_zero: bool = False, optional: bool = False, unit: str = "seconds") -> Check[Any]:
    """A number of seconds (more than zero, or zero or more); None when ``optional``. ``unit``
    names what the number counts in messages (``"writes a second"`` for a rate)."""

    def check(where: str, value: Any, ctx: Resolving) -> float | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigurationError(f"{where} must be a number of {unit} (int or float), not {value!r}")
        number = float(value)
        if not math.isfinite(number) or number < 0 or (number == 0 and not allow_zero):
            bound = "zero or more" if allow_zero else "more than zero"
            raise ConfigurationError(f"{where} must be {bound} {unit}, not {value!r}")
        return number

    return check


def rate() -> Check[Any]:
    """A number of writes a second, more than zero."""
    return seconds(unit="writes a second")


def count(minimum: int, *, optional: bool = False) -> Check[Any]:
    """A whole number of at least ``minimum``; None when ``optional``."""

    def check(where: str, value: Any, ctx: Resolving) -> int | None:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigurationError(f"{where} must be a whole number of at least {minimum}, not {value!r}")
        return value

    return check


def flag(*, optional: bool = False) -> Check[Any]:
    """True or False; None when ``optional``."""

    def check(where: str, value: Any, ctx: Resolving) -> bool | None:
        if value is None and optional:
            return None
        if not isinstance(value, bool):
            raise ConfigurationError(f"{where} must be True or False, not {value!r}")
        return value

    return check


def choice(choices: tuple[str, ...]) -> Check[str]:
    """One of ``choices``."""

    def check(where: str, value: Any, ctx: Resolving) -> str:
        if value not in choices:
            raise ConfigurationError(f"{where} is {value!r}; choose one of {', '.join(choices)}")
        return str(value)

    return check


def signal_name(where: str, value: Any, ctx: Resolving) -> str:
    """A signal name as ``revoke(signal=...)`` takes it (``"SIGTERM"``, ``"SIGKILL"``, ...)."""
    name = value.upper() if isinstance(value, str) else ""
    name = name if name.startswith("SIG") else f"SIG{name}"
    if not isinstance(value, str) or not hasattr(signal.Signals, name):
        raise ConfigurationError(
            f"{where} must be a signal name such as 'SIGTERM' or 'SIGKILL', not {value!r}")
    return name


def anything(where: str, value: Any, ctx: Resolving) -> Any:
    """Any value: checked later, by whoever uses it (a template when the task is defined)."""
    return value
