"""The docs site's reference: the configuration page is generated from the code and shows it as it
is, and every setting and task option is documented. (``make test`` also builds the whole site with
``mkdocs build --strict``.)"""

from __future__ import annotations

from pathlib import Path

from celery_singleflight import SingleFlightTask
from celery_singleflight.settings import DEFAULTS
from celery_singleflight.settings_doc import SETTINGS, TASK_ONLY, configuration_page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_every_setting_is_documented() -> None:
    assert sorted(set(DEFAULTS) - set(SETTINGS)) == [], "document it in celery_singleflight/settings_doc.py"
    assert sorted(set(SETTINGS) - set(DEFAULTS)) == [], "a documented setting no longer exists"


def test_every_task_option_is_documented() -> None:
    """Each option of SingleFlightTask (a class attribute it declares, not private) is a setting's
    task option or documented in ``TASK_ONLY``."""
    declared = {
        name for name in SingleFlightTask.__annotations__
        if not name.startswith("_") and name not in ("throws",)
    }
    documented = {attr for attr, _default in DEFAULTS.values() if attr} | set(TASK_ONLY)
    assert sorted(declared - documented) == []


def test_the_configuration_page_is_generated_from_the_code() -> None:
    """docs/configuration.md is exactly what ``python -m celery_singleflight.settings_doc`` writes."""
    page = (DOCS / "configuration.md").read_text()
    assert page == configuration_page(), (
        "docs/configuration.md is out of date; write it again with"
        " python -m celery_singleflight.settings_doc > docs/configuration.md"
    )
