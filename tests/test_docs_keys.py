"""Every key the docs show for a call is the key ``render_key`` gives for that call.

The docs state a call's key in one of two forms, which this test finds on every page and in the
README:

- in code, ``task.render_key(ARGS)  # "KEY"`` (or ``# -> KEY``);
- in prose, ```task(ARGS)``` followed in the same sentence by "holds", "renders", "is" or
  "gives" and ```KEY``` (several calls may share one key: "```f(1)``` and ```f(a=1)``` both hold
  ```k:1```").

The task is the one defined (``@app.task(..., lock_key="...")`` and ``def task(...)``) in a
code block of the page or an example file it includes (else of another page); the test defines a
task with the same template, name (``name=``, else ``proj.<function>``) and signature on a
throwaway app and renders the call. A claim about a task defined
nowhere fails, so a renamed task cannot leave a stale key behind.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_singleflight import SingleFlightTask

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [*sorted((ROOT / "docs" / "examples").glob("*.py")),
            *sorted((ROOT / "example_project").rglob("*.py"))]

_CODE_CLAIM = re.compile(
    r"\b(?P<task>[A-Za-z_]\w*)\.render_key\((?P<args>[^()\n]*(?:\([^()\n]*\)[^()\n]*)*)\)"
    r"\s*#\s*(?:->\s*|→\s*)?(?P<q>[\"'`]?)(?P<key>[^\s\"'`]+)(?P=q)"
)
_CALL = r"`(?P<task>[a-z_]\w*)\((?P<args>[^`]*)\)`"  # a task is a function: lower case
_PROSE_CLAIM = re.compile(
    rf"(?P<calls>{_CALL}(?:(?:,\s*|\s+(?:and|or)\s+)`[a-z_]\w*\([^`]*\)`)*)"
    r"\s+(?:both\s+|all\s+|each\s+)?(?:holds?|renders?|is|gives?)\s+(?:the\s+key\s+)?`(?P<key>[^`\s]+)`"
)
_ONE_CALL = re.compile(r"`(?P<task>[A-Za-z_]\w*)\((?P<args>[^`]*)\)`")


def _sources(page: Path) -> list[str]:
    """The Python a page shows: its code blocks and the example files it includes."""
    text = page.read_text()
    sources = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    for included in re.findall(r'--8<-- "([^"]+\.py)(?::[\w-]+)?"', text):
        path = ROOT / included
        if path.exists():
            sources.append(path.read_text())
    return sources


def _defined_in(sources: list[str]) -> dict[str, tuple[Any, str, str]]:
    """Task function name -> (lock_key template, task name, ``def`` line) of the tasks in ``sources``."""
    found: dict[str, tuple[Any, str, str]] = {}
    for source in sources:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for deco in node.decorator_list:
                if not isinstance(deco, ast.Call):
                    continue
                options = {kw.arg: kw.value for kw in deco.keywords}
                template = options.get("lock_key")
                if isinstance(template, ast.Constant):
                    bind = getattr(options.get("bind"), "value", False) is True
                    named = options.get("name")
                    name = named.value if isinstance(named, ast.Constant) else f"proj.{node.name}"
                    found[node.name] = (template.value, name, _signature(node, bind))
    return found


@functools.cache
def _definitions(page: str) -> dict[str, tuple[Any, str, str]]:
    """The tasks a page can mean: those it defines or includes first, then any other page's."""
    everywhere: dict[str, tuple[Any, str, str]] = _defined_in([p.read_text() for p in EXAMPLES])
    for other in PAGES:
        everywhere.update(_defined_in(_sources(other)))
    own = next(p for p in PAGES if p.name == page)
    return {**everywhere, **_defined_in(_sources(own))}


def _signature(node: ast.FunctionDef, bind: bool) -> str:
    """``def name(params): ...`` with defaults kept as text and annotations dropped."""
    args = ast.unparse(node.args)
    if bind and not args.startswith("self"):
        args = "self, " + args
    return f"def {node.name}({re.sub(r':[^,=)]+', '', args) if ':' in args else args}): return None"


def _claims() -> list[tuple[str, str, str, str]]:
    """(page, task, argument text, key) for every key the docs show for a call."""
    claims = []
    for page in PAGES:
        text = page.read_text()
        for match in _CODE_CLAIM.finditer(text):
            claims.append((page.name, match["task"], match["args"], match["key"]))
        for match in _PROSE_CLAIM.finditer(re.sub(r"\s+", " ", text)):
            for call in _ONE_CALL.finditer(match["calls"]):
                claims.append((page.name, call["task"], call["args"], match["key"]))
    return claims


def _render(template: Any, name: str, signature: str, args: str) -> str:
    app = Celery("docs-keys", broker="redis://127.0.0.1:1/0", set_as_current=False)  # never connected
    namespace: dict[str, Any] = {}
    exec(signature, namespace)  # a signature from our own docs, body `return None`
    func = namespace[signature.split()[1].split("(")[0]]
    bind = signature.split("(", 1)[1].startswith("self")
    task = app.task(base=SingleFlightTask, lock_key=template, bind=bind, name=name, shared=False)(func)
    call_args, call_kwargs = eval(f"(lambda *a, **k: (a, k))({args})", {})  # the call as the docs write it
    return str(task.render_key(*call_args, **call_kwargs))


CLAIMS = _claims()


def test_the_docs_show_keys_for_calls() -> None:
    """The convention is in use: a change that stopped the docs from stating keys this way
    would leave the other test checking nothing."""
    assert len(CLAIMS) >= 5, CLAIMS


@pytest.mark.parametrize(("page", "task", "args", "key"), CLAIMS,
                         ids=[f"{c[0]}:{c[1]}({c[2]})" for c in CLAIMS])
def test_a_key_shown_for_a_call_is_what_render_key_gives(page: str, task: str, args: str, key: str) -> None:
    definitions = _definitions(page)
    assert task in definitions, f"{page} shows the key of {task}(...), a task no docs code block defines"
    template, name, signature = definitions[task]
    assert _render(template, name, signature, args) == key, f"{page}: {task}({args})"


#: a key part in JSON quotes right after a separator, as a page or a sample output shows it
_QUOTED_PART = re.compile(r'[\w.-][:/|-]\\?"(?P<value>[^"\\\s]+)\\?"')


def test_no_page_shows_a_name_in_quotes_inside_a_key() -> None:
    """A string that reads as a name renders bare (``report:acme``), so a key shown with such a
    string in JSON quotes (``report:"acme"``) is one the code never writes: a reader who types it
    is told "not held"."""
    from celery_singleflight.keys import render_value

    wrong = []
    for page in PAGES:
        for match in _QUOTED_PART.finditer(page.read_text()):
            value = match["value"]
            if any(stop in value for stop in ":/|-"):
                continue  # quoted when it holds the separator after its placeholder: not decidable here
            if render_value(value) == value:
                wrong.append(f"{page.name}: {match[0]}")
    assert wrong == []
