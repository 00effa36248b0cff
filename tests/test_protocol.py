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
from celery_singleflight import ProtocolMismatch
from celery_singleflight.protocol import fields as record_fields
from celery_singleflight.protocol import lua
from celery_singleflight.protocol.record import RunRecord
from celery_singleflight.protocol.replies import Acquired, Holder
from celery_singleflight.protocol.store import SCRIPTS, USER_SCRIPTS, KeyLayout, LeaseStore
from celery_singleflight.testing import RedisServer

PACKAGE = Path(celery_singleflight.__file__).parent
FIELDS = {field.name: field for field in RunRecord.fields()}
#: how a script names a run record: by convention ``r``, ``prev`` (a helper's parameter), ``res``
#: (a record being built) and ``recs[i]``; and any name bound from those or from the helpers
#: that decode records (``local cur = r``, ``local held = decode(raw)``, ``local rs = records(...)``)
_RECORD_NAMES = ("r", "prev", "res")
_LIST_NAMES = ("recs",)
_BINDING = re.compile(r"(?:local\s+)?(\w+)(?:\s*,\s*\w+)*\s*=\s*([\w.]+)(\s*[\[(])?")
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


def _lua_record_names(code: str) -> tuple[set[str], set[str]]:
    """(names of records, names of lists of records) in ``code`` (see :data:`_RECORD_NAMES`)."""
    records, lists = set(_RECORD_NAMES), set(_LIST_NAMES)
    before = -1
    while len(records) + len(lists) != before:
        before = len(records) + len(lists)
        for name, source, opening in _BINDING.findall(code):
            opening = opening.strip()
            if (source == "decode" and opening == "(") or (source in lists and opening == "[") \
                    or (source in records and not opening):
                records.add(name)
            elif (source in ("records", "all_held") and opening == "(") or (source in lists and not opening):
                lists.add(name)
        for name, source in re.findall(r"\bfor\s+\w+\s*,\s*(\w+)\s+in\s+i?pairs\((\w+)\)", code):
            if source in lists:
                records.add(name)
    return records, lists


def _lua_use(code: str) -> tuple[set[str], set[str]]:
    """(every field the script touches, the fields it assigns)."""
    records, lists = _lua_record_names(code)
    named = "|".join(sorted(records)) + "|" + "|".join(rf"{name}\[[^\]]+\]" for name in sorted(lists))
    touch = re.compile(rf"(?<![\w.])(?:{named})\.(\w+)")
    touched = set(touch.findall(code))
    assigned = {name for lhs in _ASSIGN.findall(code) for name in touch.findall(lhs)}
    for body in _CONSTRUCTOR.findall(code):
        keys = set(re.findall(r"(?<![\w.])(\w+)\s*=(?!=)", body))
        assigned |= keys
        touched |= keys
    for literal in re.findall(r"'((?:[^'\\]|\\.)*)'", code):  # JSON text in single-quoted Lua strings
        touched |= set(_JSON_NAME.findall(literal))
    return touched, assigned


def _text_written(script: lua.Script) -> set[str]:
    """The fields ``script`` writes as text: those of each record template its own Lua calls
    (``DEADLINE_FIELD(deadline)``; not one it searches for), and ACQUIRE's holder fields (sent by
    its caller as JSON text)."""
    texts = [lua.read(script.body), lua.read(script.plain) if script.plain else ""]
    source = script.source
    for library in script.libraries:  # the helpers the script carries
        texts += [text for name, text in lua.helpers(lua.read(library))
                  if re.search(rf"^local (?:function )?{name}\b", source, re.M)]
    code = lua.strip_comments("\n".join(texts))
    written: set[str] = set()
    for name, template in script.templates.items():
        for line in code.splitlines():
            at = line.find(f"{name}(")
            if at >= 0 and "string.find(" not in line[:at]:  # a search reads the text it makes
                written |= set(_JSON_NAME.findall("".join(template.pieces)))
    if script.name == "ACQUIRE":
        written |= set(_JSON_NAME.findall(Holder("id", "worker", "task").fields))
    return written


def test_every_field_a_script_touches_is_declared_with_its_writers_and_readers() -> None:
    """Each field a script reads or writes is declared; the scripts declared as its writers are
    exactly those that assign it (or write it as text); its writers and readers together are
    exactly the scripts that touch it."""
    touched_by: dict[str, set[str]] = {}
    written_by: dict[str, set[str]] = {}
    for script in SCRIPTS:
        touched, assigned = _lua_use(_code(script))
        undeclared = touched - set(FIELDS)
        assert not undeclared, f"{script.name} uses undeclared record fields {sorted(undeclared)}"
        for name in assigned | _text_written(script):
            written_by.setdefault(name, set()).add(script.name)
        for name in touched:
            touched_by.setdefault(name, set()).add(script.name)
    for field in FIELDS.values():
        writers = written_by.get(field.name, set())
        assert set(field.writers) == writers, \
            f"{field.name}: declared written by {sorted(field.writers)}, written by {sorted(writers)}"
        declared = {who for who in (*field.writers, *field.readers) if who.isupper()}
        touching = touched_by.get(field.name, set())
        assert declared == touching, \
            f"{field.name}: declared {sorted(declared)}, touched by {sorted(touching)}"


_RECORD_TYPES = ("RunRecord", "RecordBase", "Snapshot",
                 *(cls.__name__ for cls in RunRecord.__mro__ if "Fields" in cls.__name__))


def _returning_records() -> set[str]:
    """The functions of the package whose return annotation holds a run record (``record``,
    ``held``, ``snapshots``, ...): a name bound from a call of one holds a record."""
    found = {"decode"}  # RecordBase.decode returns the class it is called on
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.returns is not None \
                    and any(t in ast.unparse(node.returns) for t in _RECORD_TYPES):
                found.add(node.name)
    return found


def _names_in(target: ast.AST) -> set[str]:
    return {node.id for node in ast.walk(target) if isinstance(node, ast.Name)}


def _reads_records(call: ast.Call, returning: set[str]) -> bool:
    """A call of the store (``store.record``, ``self.store.reads.held``) that returns records,
    or a record class's ``decode``."""
    if not isinstance(call.func, ast.Attribute) or call.func.attr not in returning:
        return False
    receiver = ast.unparse(call.func.value)
    return "store" in receiver or "reads" in receiver or receiver.endswith(_RECORD_TYPES)


def _record_names(tree: ast.AST, returning: set[str]) -> set[str]:
    """The names a module binds to a run record, or to records (a tuple or list of them):
    parameters annotated with a record class; names assigned from a call that returns one, or
    from a name already known (``x = store.record(...)``, ``x, left = ...held(...)``); loop and
    comprehension variables over such a value (``for (key, slot), (record, n, now) in zip(runs,
    snapshots)`` binds the second element's names only)."""
    names: set[str] = set()

    def bearing(value: ast.AST) -> bool:
        """``value`` is records: such a call, a known name, or an item of either (not a field
        of a record: ``record.progress`` is the field's value)."""
        if isinstance(value, ast.Subscript):
            return bearing(value.value)
        return (isinstance(value, ast.Call) and _reads_records(value, returning)) \
            or (isinstance(value, ast.Name) and value.id in names)

    def bind(target: ast.AST, value: ast.AST) -> None:
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "zip" \
                and isinstance(target, ast.Tuple) and len(target.elts) == len(value.args):
            for element, arg in zip(target.elts, value.args, strict=True):
                bind(element, arg)
        elif bearing(value):
            names.update(_names_in(target))

    before = -1
    while len(names) != before:  # until no new name is bound (a name may come from another)
        before = len(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.arg) and node.annotation is not None \
                    and any(t in ast.unparse(node.annotation) for t in _RECORD_TYPES):
                names.add(node.arg)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, node.value)
            elif isinstance(node, (ast.For, ast.comprehension)):
                bind(node.target, node.iter)
    return names


def _module_readers(module: str, tree: ast.AST, returning: set[str], readers: dict[str, set[str]]) -> None:
    """Add the fields ``module`` reads to ``readers``; fail on a field read by string key or one
    the record does not declare."""
    methods = {name for name in dir(RunRecord) if not name.startswith("_")} - set(FIELDS)
    names = _record_names(tree, returning)

    def record(expr: ast.AST) -> bool:  # a record: a name bound to one, or a call returning one
        return (isinstance(expr, ast.Name) and expr.id in names) \
            or (isinstance(expr, ast.Call) and _reads_records(expr, returning))

    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and record(node.value) \
                and not (isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int)):
            pytest.fail(f"{module} reads a record by string key: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and record(node.func.value) and node.func.attr == "get":
            pytest.fail(f"{module} reads a record by string key: {ast.unparse(node)}")
        if isinstance(node, ast.Attribute) and record(node.value):
            if node.attr in methods:
                continue
            assert node.attr in FIELDS, f"{module} reads {node.attr}, which the record does not declare"
            readers.setdefault(node.attr, set()).add(module)


def _python_readers() -> dict[str, set[str]]:
    """Per field, the modules of the package that read it (module paths like ``ops.keystatus``)."""
    returning = _returning_records()
    readers: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        if module.startswith("protocol.fields") or module == "protocol.record":
            continue
        _module_readers(module, ast.parse(path.read_text()), returning, readers)
    return readers


def test_every_field_python_reads_is_declared_with_its_readers() -> None:
    """Python reads records through their typed fields only; each module that reads a field is
    among its declared readers, and each declared module reads it."""
    readers = _python_readers()
    for name, field in FIELDS.items():
        declared = {who for who in field.readers if not who.isupper()}
        assert readers.get(name, set()) == declared, f"{name}: read by {sorted(readers.get(name, set()))}"


def test_the_record_test_fails_for_an_undeclared_field() -> None:
    """The checks above see a field that is not declared, however the record is named (what a
    slip would look like)."""
    touched, assigned = _lua_use("local r = decode(raw)\nr.bogus, r.fence = '1', x\n")
    assert "bogus" in touched - set(FIELDS) and {"bogus", "fence"} <= assigned
    aliased = ("local cur = r\ncur.lost = '1'\nlocal rs = records(n)\n"
               "for _, one in ipairs(rs) do x = one.pseq end\n")
    touched, assigned = _lua_use(aliased + "local held = rs[2]\nreturn held.entry\n")
    assert touched == {"lost", "pseq", "entry"} and assigned == {"lost"}
    returning = _returning_records()
    slips = [
        "def f(store):\n    record = store.record('k')\n    return record.bogus\n",
        "def f(store):\n    record = store.record('k')\n    return record['fence']\n",
        "def f(store):\n    return store.record('k').get('fence')\n",
        "def f(self):\n    rec = self.store.reads.held('k')[0]\n    return rec['lost']\n",
        "def f(self, runs):\n    snaps = self.store.reads.snapshots(runs)\n"
        "    return [r.bogus for (k, s), (r, q, n) in zip(runs, snaps)]\n",
    ]
    for source in slips:
        with pytest.raises((AssertionError, pytest.fail.Exception)):
            _module_readers("m", ast.parse(source), returning, {})
    readers: dict[str, set[str]] = {}
    _module_readers("m", ast.parse(slips[-1].replace("bogus", "fence")), returning, readers)
    assert readers == {"fence": {"m"}}


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
    for script in (*SCRIPTS, *USER_SCRIPTS):
        source = lua.strip_comments(script.source)
        for name in names:
            used = re.search(rf"(?<![\w.]){name}\b(?!\s*=)", source.replace(f"local function {name}(", ""))
            defined = re.search(rf"^local (?:function )?{name}\b", source, re.M)
            assert (used is None) == (defined is None), \
                f"{script.name}: {name} is {'used but not defined' if used else 'defined but not used'}"
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
    # a running record of protocol 1 (a run an old worker took) released by this one is ours after
    running = ('{ "token":"t1","fence":"1795000000000001","since":"1","deadline":"99999999999999",'
               '"state":"running","task_id":"old","task_name":"t","worker":"w","host":"h","pid":"1"}')
    store.client.set(store.layout.run("j"), running, px=60_000)
    assert store.release("j", "t1", fence=1795000000000001).ours
    released = store.record("j")
    assert (released.v, released.outcome, released.token) == ("2", "succeeded", "")
