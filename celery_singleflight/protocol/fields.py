"""How a run record's fields are declared and read, its protocol version, and its text layout.

A run record is one JSON object per slot of a key (``<ns>:{<key>}:run``). Each field is declared
once, as a :class:`Field` on a record class (the core ones in :mod:`.record`, a feature's own in
its protocol module), with its type, the scripts that write it, who reads it and what it means;
:class:`~.record.RunRecord` gathers them. Python reads a record only through those fields
(``record.fence`` is an int, ``record.reserved`` a bool), never by string key.

**The version.** Every record carries ``v``, the :data:`PROTOCOL` that wrote it (a record
without one is protocol 1, the layout before versions, which this protocol reads as its own).
A script that meets a record of another version answers ``FOREIGN`` with it, and the caller
refuses loudly instead of running unguarded.

**The text layout.** A plain run's record is written and read as text by the lease scripts'
plain path, at fixed places: it opens with :data:`PLAIN` and its first fields come in the order
of :data:`RUNNING_LAYOUT` (while it runs) or :data:`RELEASED_LAYOUT` (once released). The
templates and patterns the scripts use for that are generated here from those layouts
(:data:`TEMPLATES`, :data:`PATTERNS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from ..errors import ProtocolMismatch
from .lua import Replies, Template

__all__ = [
    "FLAG", "JSON", "MS", "NUMBER", "PATTERNS", "PLAIN", "PROTOCOL", "READS", "RELEASED_LAYOUT",
    "RUNNING_LAYOUT", "TEMPLATES", "TEXT", "Field", "Kind", "RecordBase", "VersionReply", "json_member",
    "member", "refuse_foreign",
]

T = TypeVar("T")

#: the version of the run record and of the keys' layout this library writes
PROTOCOL = 2
#: the versions it reads (records without ``v`` are protocol 1: the same fields and keys)
READS = (1, 2)
#: the opening of a plain run's record: valid JSON that ``cjson`` never writes, so only the lease
#: scripts' text writes have it, and a script that re-encodes the record drops it
PLAIN = "{ "
#: the fields a plain record opens with while it runs, in order
RUNNING_LAYOUT = ("v", "token", "fence", "since", "deadline", "state")
#: the fields a plain record opens with once released, in order (what the next ACQUIRE reads)
RELEASED_LAYOUT = ("v", "rt", "fence", "outcome", "task_id")


class VersionReply(Replies):
    """What a script that reads other runs' records answers for one it cannot read."""

    FOREIGN = 9, "{FOREIGN, version}: a record of the key was written by another protocol version"


def refuse_foreign(key: str, reply: Any) -> None:
    """Raise :class:`ProtocolMismatch` if ``reply`` is ``{FOREIGN, version}``."""
    if isinstance(reply, list) and reply and int(reply[0]) == VersionReply.FOREIGN:
        found = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        raise ProtocolMismatch(key, found, str(PROTOCOL))


@dataclass(frozen=True)
class Kind(Generic[T]):
    """How a field's stored string reads in Python."""

    name: str  #: for the docs
    decode_raw: Any  #: stored value (never None) -> T
    missing: Any = None  #: what an absent field reads as

    def read(self, raw: Any) -> T:
        if raw is None or raw == "":
            return self.missing  # type: ignore[no-any-return]
        return self.decode_raw(raw)  # type: ignore[no-any-return]


def _int(raw: Any) -> int:
    return int(raw)


def _json(raw: Any) -> Any:
    return json.loads(raw) if isinstance(raw, str) else raw


#: a string ("" when absent)
TEXT: Kind[str] = Kind("text", str, "")
#: a whole number stored as a string (numbers are strings: ``cjson`` prints 16 digits as 1.7e+15)
NUMBER: Kind[int | None] = Kind("number", _int)
#: server time in milliseconds, stored as a string
MS: Kind[int | None] = Kind("ms", _int)
#: ``"1"`` when set; absent otherwise
FLAG: Kind[bool] = Kind("flag", lambda raw: raw == "1", False)
#: a JSON document stored as a string
JSON: Kind[Any] = Kind("JSON", _json)


class Field(Generic[T]):
    """One field of the run record: its kind, who writes and reads it, and what it means.

    ``writers`` are the scripts that set or change it; ``readers`` the scripts and modules that
    read it (modules as their path in the package, ``ops.status``). A test holds both to the code.
    """

    name: str

    def __init__(
        self, kind: Kind[T], meaning: str, *, writers: tuple[str, ...], readers: tuple[str, ...]
    ) -> None:
        self.kind = kind
        self.meaning = meaning
        self.writers = writers
        self.readers = readers

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, record: None, owner: type) -> Field[T]: ...

    @overload
    def __get__(self, record: RecordBase, owner: type) -> T: ...

    def __get__(self, record: RecordBase | None, owner: type) -> Field[T] | T:
        if record is None:
            return self
        return self.kind.read(record._raw.get(self.name))

    def __repr__(self) -> str:
        return f"<Field {self.name}: {self.kind.name}>"


class RecordBase(Mapping[str, Any]):
    """A decoded run record: typed fields (declared on subclasses) over the stored JSON. The
    mapping view gives the stored strings as they are (for dumps and ``== {}``)."""

    __slots__ = ("_raw",)

    def __init__(self, raw: Mapping[str, Any] | None = None) -> None:
        self._raw: dict[str, Any] = dict(raw or {})

    @classmethod
    def decode(cls: type[R], raw: bytes | str | None) -> R:
        """The record stored as ``raw`` (empty for nothing, or for a value that is not one)."""
        if not raw:
            return cls()
        try:
            found = json.loads(raw)
        except ValueError:
            return cls()
        return cls(found if isinstance(found, dict) else None)

    @classmethod
    def fields(cls) -> list[Field[Any]]:
        """Every field of the record, in declaration order (core fields first)."""
        seen: dict[str, Field[Any]] = {}
        for klass in cls.__mro__:
            for value in vars(klass).values():
                if isinstance(value, Field):
                    seen.setdefault(value.name, value)
        return list(seen.values())

    def __getitem__(self, name: str) -> Any:
        return self._raw[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._raw!r})"


R = TypeVar("R", bound=RecordBase)


def member(name: str) -> str:
    """How a field with a text value opens in a record's JSON: ``"name":"``."""
    return f'"{name}":"'


def json_member(name: str) -> str:
    """How a field with any JSON value opens: ``"name":``."""
    return f'"{name}":'


def _text(names: tuple[str, ...], *, opening: str | None, after: str, running: bool = False) -> Template:
    """The text of the fields ``names`` as the scripts write them: ``"name":"<value>"`` joined
    by commas, each value a template argument (``v`` is written out: :data:`PROTOCOL`; with
    ``running``, ``state`` reads ``running``), after ``opening`` (None: the opening is the first
    argument) and before ``after``."""
    fixed = {"v": str(PROTOCOL), **({"state": "running"} if running else {})}
    pieces = [] if opening is not None else [""]
    current = opening or ""
    for i, name in enumerate(names):
        current += ("," if i else "") + member(name)
        if name in fixed:
            current += fixed[name] + '"'
        else:
            pieces.append(current)
            current = '"'
    pieces.append(current + after)
    return Template(tuple(pieces))


#: how each field of a layout is matched when the scripts read a plain record's text
_MATCHED = {"v": str(PROTOCOL), "token": '[^"]*', "rt": '([^"]*)', "fence": "(%d+)", "since": "(%d+)",
            "deadline": "%d+", "state": "running", "outcome": '([^"]*)'}


def _pattern(names: tuple[str, ...]) -> str:
    """A Lua pattern of the fields ``names`` as :func:`_text` writes them (the captures in
    order; ``task_id`` is captured as its JSON string literal, quotes included)."""
    parts = []
    for name in names:
        if name == "task_id":
            parts.append(f'"{name}":("[^"\\]*")')
        else:
            parts.append(member(name) + _MATCHED[name] + '"')
    return ",".join(parts)


#: the templates the lease scripts write a record's text with (expanded in place: see .lua)
TEMPLATES: dict[str, Template] = {
    # RUNNING_RECORD(open, token, fence, since, deadline): a running record's lease fields,
    # after ``open`` ('{' or PLAIN); the rest (rt, lost, the holder) follows
    "RUNNING_RECORD": _text(RUNNING_LAYOUT, opening=None, after=",", running=True),
    # PLAIN_RUNNING_RECORD(token, fence, since, deadline): the same, opened with PLAIN
    "PLAIN_RUNNING_RECORD": _text(RUNNING_LAYOUT, opening=PLAIN, after=",", running=True),
    # RUNNING_HEAD(token): how a plain running record of ``token`` opens, up to its fence's value
    "RUNNING_HEAD": _text(RUNNING_LAYOUT[:2], opening=PLAIN, after="," + member(RUNNING_LAYOUT[2])),
    # RELEASED_HEAD(token, fence, outcome): a released plain record's first fields; the text
    # kept from the running record (task id first) follows
    "RELEASED_HEAD": _text(RELEASED_LAYOUT[:-1], opening=PLAIN, after=","),
    # RELEASED_TAIL(since, state, ended, updated): the fields a release adds at the end
    "RELEASED_TAIL": _text(("since", "state", "ended", "updated"), opening=",", after="}"),
    # RT_FIELD(token), LOST_FIELD(fences): the releasing token, the lost fences, as members
    "RT_FIELD": _text(("rt",), opening="", after=","),
    "LOST_FIELD": _text(("lost",), opening="", after=","),
    # PREVIOUS_FIELDS(task id as a JSON string literal, outcome): who ran before, how it ended
    "PREVIOUS_FIELDS": Template(("," + json_member("prev_task_id"), "," + member("prev_outcome"), '"')),
    # TOKEN_FIELD(token), DEADLINE_FIELD(ms): one member, as RENEW finds and rewrites it in any record
    "TOKEN_FIELD": _text(("token",), opening="", after=""),
    "DEADLINE_FIELD": _text(("deadline",), opening="", after=""),
    # TRACE_FIELD(traceparent): the holder's trace context, after its fields (a traced run only)
    "TRACE_FIELD": _text(("trace",), opening=",", after=""),
}

#: the constants the lease scripts read a record's text with
PATTERNS: dict[str, int | str] = {
    "PROTOCOL": str(PROTOCOL),
    "PLAIN": PLAIN,
    # after RUNNING_HEAD: the fence, since, and where the rest starts (``rt`` if the previous run
    # left one, ``lost`` if runs were lost, the holder, the previous run)
    "PLAIN_RUNNING": "^" + _pattern(RUNNING_LAYOUT[2:])[len(member(RUNNING_LAYOUT[2])):] + ",()",
    # a released plain record: the releasing token, the fence, the outcome and the task id (a
    # JSON string literal without escapes, copied as it is); a record with ``lost`` between them
    # takes the general path (a lease ran out unreleased: rare)
    "PLAIN_RELEASED": "^" + PLAIN + _pattern(RELEASED_LAYOUT),
    "RT_OPEN": member("rt"),
    "RT_OPEN_LEN": len(member("rt")),
    "JOINED_FLAG": "," + member("joined") + '1"',
    "WAITING_FLAG": "," + member("waiting") + '1"',
    # RENEW: the deadline of any record, and the flag of a run that has a history stream
    "DEADLINE_MATCH": member("deadline") + '%d+"',
    "HISTORY_FLAG": member("history") + '1"',
}
