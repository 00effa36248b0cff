"""MkDocs hook: show the docstrings' Sphinx roles (``:class:`~.guard.Guard```) as plain code.

mkdocstrings renders a role as its literal text followed by the code span
(``:class:<code>~.guard.Guard</code>``); this drops the role and, as Sphinx does, shortens a
``~``-prefixed target to its last name.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|data|mod|meth|attr|exc|obj):(<code>)(~?)\.?([^<]*)(</code>)")


def _plain(match: re.Match[str]) -> str:
    target = match.group(3)
    if match.group(2):
        target = target.rsplit(".", 1)[-1]
    return f"{match.group(1)}{target}{match.group(4)}"


def on_page_content(html: str, **_kwargs: Any) -> str:
    return _ROLE.sub(_plain, html)
