"""The Redis protocol held to its declarations: the run record's fields, the reply codes, the
scripts' assembly, and the protocol version.

The record and the replies are read from the code itself (the assembled Lua of every script, and
the package's Python), so a field or a code used without its declaration fails here:

- a script touches a run record through ``r``, ``prev``, ``res`` or ``recs[...]`` (``r.fence``,
  ``r.waiting = '1'``, ``{token = ..., reserved = '1'}``) or as JSON text (``'"sup_by":'``);
- Python reads a record only through a :class:`~celery_singleflight.protocol.record.RunRecord`
  (or a feature's field group): ``record.fence``, never ``record["fence"]``;
- a script answers a code by its name (``return {HELD, holder, left}``), never a bare number, and
  Python compares a reply with the named constant, never with a number.
"""

from __future__ import annotations

import ast
import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import celery_singleflight
from celery_singleflight import Acquired, Holder, KeyLayout, LeaseStore, ProtocolMismatch
from celery_singleflight.protocol import fields as record_fields
from celery_singleflight.protocol import lua
from celery_singleflight.protocol.record import RunRecord
from celery_singleflight.protocol.store import SCRIPTS, USER_SCRIPTS
from celery_singleflight.testing import RedisServer

PACKAGE = Path(celery_singleflight.__file__).parent
FIELDS = {field.name: field for field in RunRecord.fields()}
#: how a script names a run record (the convention this test reads the scripts by)
_RECORD = r"(?<![\w.])(?:r|prev|res|recs\[[^\]]+\])"
_TOUCH = re.compile(_RECORD + r"\.(\w+)")
_ASSIGN = re.compile(r"^\s*((?:[\w.\[\]]+\s*,\s*)*[\w.\[\]]+)\s*=(?!=)", re.M)
_CONSTRUCTOR = re.compile(r"(?:res\s*=\s*|cjson\.encode\()\{([^{}]*)\}", re.S)
_JSON_NAME = re.compile(r'"(\w+)":')


def _code(script: lua.Script) -> str:
    """The script's Lua without comments; ACQUIRE's with the holder's fields it is sent (JSON
    members written into the record as they are)."""
    code = lua.strip_comments(script.source)
    if script.name == "ACQUIRE":
        code += f"\nlocal holder = '{Holder('id', 'worker', 'task').fields}'"
    return code


def _lua_use(code: str) -> tuple[set[str], set[str]]:
    """(every field the script touches, the fields it assigns)."""
    touched = set(_TOUCH.findall(code))
    assigned = {name for lhs in _ASSIGN.findall(code) for name in _TOUCH.findall(lhs)}
    for body in _CONSTRUCTOR.findall(code):
        keys = set(re.findall(r"(?<![\w.])(\w+)\s*=(?!=)", body))
        assigned |= keys
        touched |= keys
    for literal in re.findall(r"'((?:[^'\\]|\\.)*)'", code):  # JSON text in single-quoted Lua strings
        touched |= set(_JSON_NAME.findall(literal))
    return touched, assigned


def test_every_field_a_script_touches_is_declared_with_its_writers_and_readers() -> None:
    """Each field a script reads or writes is declared; each script that assigns a field is one of
    its declared writers; the scripts declared as its writers and readers are exactly those that
    touch it."""
    touched_by: dict[str, set[str]] = {}
    for script in SCRIPTS:
        touched, assigned = _lua_use(_code(script))
        undeclared = touched - set(FIELDS)
        assert not undeclared, f"{script.name} uses undeclared record fields {sorted(undeclared)}"
        for name in assigned:
            assert script.name in FIELDS[name].writers, f"{script.name} writes {name}, not a declared writer"
        for name in touched:
            touched_by.setdefault(name, set()).add(script.name)
    for field in FIELDS.values():
        declared = {who for who in (*field.writers, *field.readers) if who.isupper()}
        touching = touched_by.get(field.name, set())
        assert declared == touching, \
            f"{field.name}: declared {sorted(declared)}, touched by {sorted(touching)}"


def _record_names(tree: ast.AST, returning: set[str]) -> set[str]:
    """The names a module binds to a run record: parameters annotated with a record class, and
    variables assigned from a call that returns one (``x = store.record(...)``, ``x, _ = ...held(...)``)."""
    fields_classes = (cls.__name__ for cls in RunRecord.__mro__ if "Fields" in cls.__name__)
    record_types = {"RunRecord", "RecordBase", *fields_classes}
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None \
                and any(t in ast.unparse(node.annotation) for t in record_types):
            names.add(node.arg)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            called = ast.unparse(node.value.func).split(".")[-1]
            if called in returning or (called == "decode" and "Fields" in ast.unparse(node.value.func)) \
                    or ast.unparse(node.value.func).startswith("RunRecord"):
                target = node.targets[0]
                first = target.elts[0] if isinstance(target, ast.Tuple) else target
                if isinstance(first, ast.Name):
                    names.add(first.id)
    return names


def _python_readers() -> dict[str, set[str]]:
    """Per field, the modules of the package that read it (module paths like ``ops.keystatus``)."""
    returning = {"record", "holder_record", "held", "decode"}
    readers: dict[str, set[str]] = {}
    methods = {name for name in dir(RunRecord) if not name.startswith("_")} - set(FIELDS)
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if module.startswith("protocol.fields") or module == "protocol.record":
            continue
        tree = ast.parse(path.read_text())
        names = _record_names(tree, returning)
        for node in ast.walk(tree):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) \
                    and node.value.id in names:
                pytest.fail(f"{module} reads a record by string key: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id in names \
                    and node.func.attr == "get":
                pytest.fail(f"{module} reads a record by string key: {ast.unparse(node)}")
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in names:
                if node.attr in methods:
                    continue
                assert node.attr in FIELDS, f"{module} reads {node.attr}, which the record does not declare"
                readers.setdefault(node.attr, set()).add(module)
    return readers


def test_every_field_python_reads_is_declared_with_its_readers() -> None:
    """Python reads records through their typed fields only; each module that reads a field is
    among its declared readers, and each declared module reads it."""
    readers = _python_readers()
    for name, field in FIELDS.items():
        declared = {who for who in field.readers if not who.isupper()}
        assert readers.get(name, set()) == declared, f"{name}: read by {sorted(readers.get(name, set()))}"


def test_the_record_test_fails_for_an_undeclared_field() -> None:
    """The checks above see a field that is not declared (what a slip would look like)."""
    touched, assigned = _lua_use("local r = decode(raw)\nr.bogus, r.fence = '1', x\n")
    assert "bogus" in touched - set(FIELDS) and {"bogus", "fence"} <= assigned
    tree = ast.parse("def f(store):\n    record = store.record('k')\n    return record.bogus\n")
    assert "record" in _record_names(tree, {"record"})


# -- reply codes --------------------------------------------------------------------------------


def _code_scripts() -> Iterator[lua.Script]:
    yield from (*SCRIPTS, *USER_SCRIPTS)


def test_no_script_answers_a_bare_number_as_a_code() -> None:
    """A script returns a code by its declared name: ``return {HELD, ...}``, ``return RELEASED``."""
    for script in _code_scripts():
        code = _code(script)
        bare = re.findall(r"\breturn\s*\{?\s*-?\d+\b", code) + re.findall(r"\bout\[\w+\]\s*=\s*-?\d+\b", code)
        assert bare == [], f"{script.name} answers a bare number: {bare}"


def test_every_declared_code_is_answered_by_its_script() -> None:
    """Each code a script declares appears in its Lua under the same name (a code nobody
    answers any more is a stale declaration)."""
    for script in _code_scripts():
        code = _code(script)
        for replies in script.replies:
            for member in replies:
                assert re.search(rf"\b{member.name}\b", code), f"{script.name} never answers {member.name}"


def test_python_compares_replies_with_named_codes() -> None:
    """In the protocol package, no reply (``reply[0]``, ``code``, ``reply``) is compared with a
    number: the named constant says what is meant, in Lua and in Python alike."""
    found = []
    for path in sorted((PACKAGE / "protocol").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            numbers = [side for side in sides if isinstance(side, ast.Constant)
                       and isinstance(side.value, int) and not isinstance(side.value, bool)]
            reply = r"(int\()?(reply(\[\d+\])?|code)\)?"
            replies = [side for side in sides if re.fullmatch(reply, ast.unparse(side))]
            if numbers and replies:
                found.append(f"{path.name}: {ast.unparse(node)}")
    assert found == []


def test_an_undeclared_name_is_refused_when_a_script_is_assembled() -> None:
    with pytest.raises(ValueError, match="BOGUS"):
        lua.assemble("T", "return {BOGUS}", [], declared={"HELD": 0})
    assert lua.assemble("T", "return {HELD}", [], declared={"HELD": 0}).startswith("local HELD = 0\n")


def test_the_plain_path_cannot_call_a_helper() -> None:
    """The plain path runs before the helpers are made: a script whose plain path calls one is
    refused when it is assembled, not when that path first runs."""
    common = lua.read("shared/common.lua")
    with pytest.raises(ValueError, match="clock"):
        lua.assemble("T", "return 1", [common], plain="local now = clock()\n")
    with pytest.raises(ValueError, match="num"):  # after a minus sign on the same line
        lua.assemble("T", "return 1", [common], plain="local n = #KEYS - 3 local s = num(n)\n")
    lua.assemble("T", "return 1", [common], plain="-- clock() and num() come later\nreturn 2\n")


def test_every_script_defines_each_helper_it_calls_and_only_those() -> None:
    """Each script carries only the Lua helpers it uses (they come before its body); a helper
    left out would fail only on the (perhaps rare) path that calls it, as a call of nil."""
    libraries = sorted({path for script in SCRIPTS for path in script.libraries})
    names = [name for library in libraries for name, _ in lua.helpers(lua.read(library))]
    assert {"clock", "hand_off", "drop_own_copy", "keep_book", "superseded_outcome"} <= set(names)
    for script in SCRIPTS:
        source = lua.strip_comments(script.source)
        for name in names:
            used = re.search(rf"(?<![\w.]){name}\b(?!\s*=)", source.replace(f"local function {name}(", ""))
            if used is None:
                continue
            defined = re.search(rf"^local (?:function )?{name}\b", source, re.M)
            assert defined is not None, f"{name} is used but not defined in {script.name}"
    by_name = {script.name: script.source for script in SCRIPTS}
    assert "keep_book" not in by_name["RELEASE"] and "local function all_held" not in by_name["ACQUIRE"]
    # the plain path makes no helper: ACQUIRE's opens with its constants and the call's unpacking
    assert by_name["ACQUIRE"].index("local function") > by_name["ACQUIRE"].index("if rt then")


def test_the_plain_text_of_a_record_is_its_declared_layout() -> None:
    """The templates and patterns the plain path uses are made from the layouts, whose fields are
    declared (and ``v`` is the protocol version)."""
    assert set(record_fields.RUNNING_LAYOUT) | set(record_fields.RELEASED_LAYOUT) <= set(FIELDS)
    running = record_fields.TEMPLATES["PLAIN_RUNNING_RECORD"].expand(["t", "f", "s", "d"])
    assert running.startswith(f"'{record_fields.PLAIN}\"v\":\"{record_fields.PROTOCOL}\",\"token\":\"'")


# -- the protocol version ----------------------------------------------------------------------


@pytest.fixture
def store(redis_server: RedisServer) -> LeaseStore:
    client = redis_server.client(2)
    return LeaseStore(client, KeyLayout(f"proto-{uuid.uuid4().hex[:6]}"))


def test_a_record_of_another_version_is_refused_by_every_script_that_reads_others(store: LeaseStore) -> None:
    """Given a record written by a future protocol (version 3) on a key, acquiring it, resuming it
    and force-releasing it each raise ProtocolMismatch naming both versions; nothing is written."""
    raw = ('{"v":"3","token":"t","fence":"5","since":"1","deadline":"99999999999999","state":"running",'
           '"task_id":"x"}')
    store.client.set(store.layout.run("k"), raw)
    with pytest.raises(ProtocolMismatch, match=r"version 3.*version 2") as caught:
        store.acquire("k", uuid.uuid4().hex, 10, Holder("mine"))
    assert (caught.value.found, caught.value.ours) == ("3", "2")
    store.client.rpush(store.layout.queue("k"), "p|h")
    with pytest.raises(ProtocolMismatch):
        store.handoff.resume("k", 10)
    with pytest.raises(ProtocolMismatch):
        store.handoff.force_release("k", "operator")
    assert store.client.get(store.layout.run("k")) == raw.encode()


def test_a_record_of_protocol_1_is_read_as_its_own(store: LeaseStore) -> None:
    """A record written before versions (protocol 1: no ``v``, the same fields) is read: the next
    run takes the key with a larger fence and writes a version-2 record."""
    old = ('{ "rt":"aa","fence":"1795000000000000","outcome":"succeeded","task_id":"old","task_name":"t",'
           '"worker":"w","host":"h","pid":"1","since":"1","state":"succeeded","ended":"2","updated":"2"}')
    store.client.set(store.layout.run("k"), old, px=60_000)
    got = store.acquire("k", uuid.uuid4().hex, 10, Holder("new"))
    assert isinstance(got, Acquired) and got.fence > 1795000000000000
    record = store.record("k")
    assert record.v == "2" and record.prev_task_id == "old" and record.prev_outcome == "succeeded"
