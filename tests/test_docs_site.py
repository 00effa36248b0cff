"""The docs site's reference: the configuration page is generated from the code and shows it as it
is, and every setting and task option is documented. (``make test`` also builds the whole site with
``mkdocs build --strict``.)"""

from __future__ import annotations

from pathlib import Path

from celery_singleflight import SingleFlightTask
from celery_singleflight.config.options import Options, declared
from celery_singleflight.config.page import configuration_page

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def test_every_option_is_documented_where_it_is_declared() -> None:
    """Each option says what it does and what it takes, in its one declaration."""
    undocumented = [option.name for option in declared() if not option.meaning or not option.values]
    assert undocumented == []
    assert {item.name for item in Options.declared()} >= {option.name for option in declared()}


def test_every_task_option_is_declared_and_an_attribute_of_the_task() -> None:
    """The options SingleFlightTask takes (its own public class attributes that are values, and
    its annotations) are exactly the declared task options, except those Celery itself reads
    (``retry_backoff`` ...), which it leaves alone, or Celery attributes it sets (``Strategy``):
    an option added to the class by hand would be missing from the configuration page."""
    from celery_singleflight.task import _CELERY_NAMES

    declared_options = {option.task for option in declared() if option.task} - _CELERY_NAMES
    own = {name for name, value in vars(SingleFlightTask).items()
           if not name.startswith("_") and not callable(value)
           and not isinstance(value, (property, classmethod, staticmethod))}
    own |= {name for name in SingleFlightTask.__annotations__ if not name.startswith("_")}
    # Celery's own attributes the class sets (``Strategy``: a fair task's main-process look)
    assert own - _CELERY_NAMES == declared_options


def test_the_configuration_page_is_generated_from_the_code() -> None:
    """docs/configuration.md is exactly what ``python -m celery_singleflight.config.page`` writes."""
    page = (DOCS / "configuration.md").read_text()
    assert page == configuration_page(), (
        "docs/configuration.md is out of date; write it again with"
        " python -m celery_singleflight.config.page > docs/configuration.md"
    )


#: modules the API page renders whole: every public name defined in them is on the page
_WHOLE_MODULES = {"errors", "signals", "states", "fencing", "testing", "compat", "singleton", "heimdall"}


def test_the_api_page_documents_exactly_the_stable_api() -> None:
    """Every name of ``celery_singleflight.__all__`` is on docs/api.md, and the page renders
    nothing else (a class's members are listed where it shows only the stable ones)."""
    import celery_singleflight

    targets = [line.split()[1] for line in (DOCS / "api.md").read_text().splitlines()
               if line.startswith("::: ")]
    shown = {target.rsplit(".", 1)[1] for target in targets}
    whole = {target.rsplit(".", 1)[1] for target in targets if target.rsplit(".", 1)[1] in _WHOLE_MODULES}
    stable = set(celery_singleflight.__all__) - {"__version__"}
    in_whole_modules = {
        name for name in stable
        if getattr(getattr(celery_singleflight, name), "__module__", "").rsplit(".", 1)[-1] in whole
    }
    assert stable - shown - in_whole_modules == set()
    assert shown - stable - _WHOLE_MODULES == set()


def test_the_docs_stay_short() -> None:
    """The README is a pitch (at most 1,500 words) and the user docs at most 25,000 words,
    counted as ``wc -w`` counts them: whitespace-separated tokens of the Markdown source, code and
    tables included, every page of docs/ plus the CHANGELOG the changelog page includes."""
    def words(path: Path) -> int:
        return len(path.read_text().split())

    assert words(ROOT / "README.md") <= 1500
    assert sum(words(page) for page in DOCS.glob("*.md")) + words(ROOT / "CHANGELOG.md") <= 25000
