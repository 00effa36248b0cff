"""The protocol's Lua, read from ``protocol/lua/<feature>/*.lua`` and assembled into scripts.

A script is one body file, after the helpers it uses from its feature's libraries and the
shared ones (``local function name`` or ``local NAME =`` at the margin, each with the comment
lines above it). Lua makes a closure of every ``local function`` each time a script runs, so a
script carries only the helpers it calls, and its *plain path* (a file that answers the
commonest call and returns early) comes before them all: a call it answers makes none.

Names in capitals are the protocol's declared constants: reply codes (:class:`Replies`), the
numbers of :mod:`..constants` and the record's patterns. The assembler puts ``local NAME = value``
at the top of a script for each one it uses, and refuses a script that uses one nobody declared.
A *template* (``RUNNING_RECORD(open, token, fence, since, deadline)``) looks like a call but is
expanded in place into the concatenation it stands for (no call at run time): it is how the run
record's field table writes the plain path's text (:mod:`.record`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from importlib.resources import files

__all__ = ["Replies", "Script", "Template", "assemble", "expand", "helpers", "lua_literal", "read",
           "strip_comments"]

#: globals of Redis's Lua that are written in capitals
_LUA_GLOBALS = frozenset({"KEYS", "ARGV"})
_CAPITALS = re.compile(r"(?<![\w.'\"])([A-Z][A-Z0-9_]*[A-Z0-9])\b")


class Replies(enum.IntEnum):
    """Base of a script's reply codes: each member is ``NAME = value, "meaning"``. The same
    names are Lua constants in the scripts that return them (``return {HELD, holder, left}``)."""

    meaning: str

    def __new__(cls, value: int, meaning: str = "") -> Replies:
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member


def read(path: str) -> str:
    """The text of ``lua/<path>`` in this package."""
    return files(__package__).joinpath("lua", path).read_text()


def strip_comments(source: str) -> str:
    """``source`` without its ``--`` comments (the scripts have no ``--`` inside strings)."""
    return re.sub(r"--[^\n]*", "", source)


def helpers(library: str) -> list[tuple[str, str]]:
    """A helper library split into its definitions, ``(name, text)`` in order."""
    found: list[tuple[str, str]] = []
    comments: list[str] = []
    for line in library.strip("\n").split("\n"):
        named = re.match(r"local (?:function )?(\w+)", line)
        if named:
            found.append((named.group(1), "".join(c + "\n" for c in comments) + line + "\n"))
            comments = []
        elif line.startswith("--") or not found:
            comments.append(line)
        else:
            name, text = found[-1]
            found[-1] = (name, text + line + "\n")
    return found


def lua_literal(value: int | str) -> str:
    """``value`` as a Lua literal: a number, or a single-quoted string (control characters as
    decimal escapes)."""
    if isinstance(value, int):
        return f"{value:d}"
    out = []
    for char in value:
        if char in "\\'":
            out.append("\\" + char)
        elif ord(char) < 32:
            out.append(f"\\{ord(char)}")
        else:
            out.append(char)
    return "'" + "".join(out) + "'"


@dataclass(frozen=True)
class Template:
    """Text the run record is written as, expanded in place: ``NAME(a, b)`` becomes the
    concatenation ``piece .. a .. piece .. b .. piece`` (each argument a Lua variable)."""

    pieces: tuple[str, ...]  #: the literal text around the arguments (one more than them)

    def expand(self, args: list[str]) -> str:
        if len(args) != len(self.pieces) - 1:
            raise ValueError(f"a template of {len(self.pieces) - 1} values got {len(args)}: {args}")
        parts = [lua_literal(self.pieces[0])] if self.pieces[0] else []
        for arg, piece in zip(args, self.pieces[1:], strict=True):
            parts.append(arg)
            if piece:
                parts.append(lua_literal(piece))
        return " .. ".join(parts)


Constant = int | str


@dataclass(frozen=True)
class Script:
    """One script of the protocol: its ``body`` file after the helpers it uses from
    ``libraries`` (files, in order), and its ``plain`` path file first. ``constants``,
    ``templates`` and ``replies``: what its capitalised names may stand for."""

    name: str
    body: str
    libraries: tuple[str, ...] = ()
    plain: str = ""
    replies: tuple[type[Replies], ...] = ()
    constants: Mapping[str, Constant] = field(default_factory=dict)
    templates: Mapping[str, Template] = field(default_factory=dict)

    @cached_property
    def declared(self) -> dict[str, Constant]:
        """Every constant the script may use, by name (reply codes included)."""
        out: dict[str, Constant] = dict(self.constants)
        for codes in self.replies:
            for member in codes:
                known = out.get(member.name)
                if known is not None and known != int(member):
                    raise ValueError(f"{self.name}: {member.name} is {known} and {int(member)}")
                out[member.name] = int(member)
        return out

    @cached_property
    def source(self) -> str:
        """The assembled script, as Redis runs it."""
        return assemble(self.name, read(self.body), [read(library) for library in self.libraries],
                        read(self.plain) if self.plain else "", self.declared, self.templates)

    def uses(self) -> set[str]:
        """The declared names the assembled script uses (for tests and docs)."""
        return set(_CAPITALS.findall(strip_comments(self.source))) & set(self.declared)


def expand(text: str, templates: Mapping[str, Template]) -> str:
    """``text`` with every template call (``NAME(a, b)``) expanded in place."""
    if not templates:
        return text
    names = "|".join(map(re.escape, templates))
    return re.sub(rf"\b({names})\(([^()]*)\)",
                  lambda m: templates[m.group(1)].expand([a.strip() for a in m.group(2).split(",")]), text)


def _locals(names: list[str], declared: Mapping[str, Constant]) -> str:
    return "".join(f"local {name} = {lua_literal(declared[name])}\n" for name in names)


def assemble(
    name: str, body: str, libraries: list[str], plain: str = "",
    declared: Mapping[str, Constant] | None = None, templates: Mapping[str, Template] | None = None,
) -> str:
    """A script from its texts (see :class:`Script`): the constants its plain path uses, the plain
    path, the other constants, the helpers the body calls (and those they call), the body."""
    declared = declared or {}
    templates = templates or {}
    plain, body = expand(plain, templates), expand(body, templates)
    defined = [item for library in libraries for item in helpers(expand(library, templates))]
    used: set[str] = set()
    seen = strip_comments(body)
    code = strip_comments(plain)
    for helper, text in reversed(defined):  # a helper only calls helpers defined before it
        called = re.compile(rf"(?<![\w.]){helper}\b")  # not ``cjson.decode`` for ``decode``
        if called.search(seen):
            used.add(helper)
            seen += strip_comments(text)
        if called.search(code):
            raise ValueError(f"{name}: the plain path runs before the helpers, so it cannot use {helper}")
    helper_text = "".join(text for helper, text in defined if helper in used)
    names = sorted(set(_CAPITALS.findall(strip_comments(plain + helper_text + body))) - _LUA_GLOBALS - used)
    unknown = [constant for constant in names if constant not in declared]
    if unknown:
        raise ValueError(f"script {name} uses {', '.join(unknown)}, which nothing declares")
    # the constants the plain path uses come first; the others after it, so that a call the
    # plain path answers does not even load them
    early = [constant for constant in names if re.search(rf"\b{constant}\b", strip_comments(plain))]
    late = [constant for constant in names if constant not in early]
    return _locals(early, declared) + plain + _locals(late, declared) + helper_text + body
