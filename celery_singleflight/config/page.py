"""The configuration reference page, written from the options' own declarations.

``docs/configuration.md`` is exactly :func:`configuration_page` (a test checks it), so the page's
defaults, option names and meanings come from the code. After changing an option, write the
page again::

    python -m celery_singleflight.config.page > docs/configuration.md
"""

from __future__ import annotations

import sys
from typing import Any

from .option import Option
from .options import GROUPS

__all__ = ["configuration_page"]

_STANDARD_PRECEDENCE = "task option > setting > default"


def _default_text(option: Option[Any]) -> str:
    value: Any = option.default
    if option.default_text is not None:
        return option.default_text
    if isinstance(value, float) and value.is_integer():
        return f"`{int(value)}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _heading(option: Option[Any]) -> str:
    return f"singleflight_{option.name}" if option.setting else str(option.task)


def _anchor(option: Option[Any]) -> str:
    return _heading(option)


def _entry(option: Option[Any]) -> list[str]:
    lines = [f"### `{_heading(option)}`", "", option.meaning, "", f"**Values:** {option.values}"]
    if option.precedence:
        lines += ["", f"**Precedence:** {option.precedence}"]
    return [*lines, ""]


def configuration_page() -> str:
    """The Markdown of ``docs/configuration.md``."""
    out = [
        "# Configuration reference",
        "",
        "<!-- generated from the options' declarations: edit an option where it is declared, then run",
        "     python -m celery_singleflight.config.page > docs/configuration.md -->",
        "",
        "Settings live in the Celery app's configuration as `singleflight_<name>`"
        " (`app.conf.singleflight_ttl = 10`; with Django's `namespace=\"CELERY\"`:"
        " `CELERY_SINGLEFLIGHT_<NAME>`, see [Django and Flask](django-flask.md)). A **task option** (a"
        " keyword of `@app.task(...)` or a class attribute) overrides the setting for one task:"
        f" **{_STANDARD_PRECEDENCE}** unless an entry says otherwise; `None` counts as not set. All is"
        " checked when a guarded task is bound (at worker start): a bad value or a misspelled name raises"
        " `ConfigurationError` naming the option. `hold()`, the status functions and the CLI read the"
        " settings, without a task's options.",
        "",
        "| setting | task option | default |",
        "| --- | --- | --- |",
    ]
    for group in GROUPS:
        for option in group.options():
            setting = f"[`singleflight_{option.name}`](#{_anchor(option)})" if option.setting else "—"
            task = (f"[`{option.task}`](#{_anchor(option)})" if not option.setting else f"`{option.task}`") \
                if option.task else "—"
            out.append(f"| {setting} | {task} | {_default_text(option)} |")
    for group in GROUPS:
        out += ["", f"## {group.title}", ""]
        for option in group.options():
            out += _entry(option)
    return "\n".join(out).rstrip("\n") + "\n"


if __name__ == "__main__":  # pragma: no cover - the docs' generator
    sys.stdout.write(configuration_page())
