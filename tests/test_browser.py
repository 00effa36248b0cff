"""The demo's live progress page in a real browser: headless Chromium from Debian's ``chromium``
package, driven by Selenium through Debian's ``chromium-driver`` (never a downloaded browser).

Skips locally when either is missing; fails when ``CI=true`` (``.ci/run`` installs both).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .conftest import IN_CI, wait_for
from .demoproc import Demo, alive

pytestmark = pytest.mark.worker
CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")


@pytest.fixture
def browser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    if not (CHROMIUM and CHROMEDRIVER):
        message = "chromium and chromedriver are needed (apt-get install chromium chromium-driver)"
        if IN_CI:
            pytest.fail(f"{message} and CI=true")
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    # the driver's path is given, so Selenium Manager is never run; offline in case it were
    monkeypatch.setenv("SE_OFFLINE", "true")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the page's console, checked
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1400",
                     f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


# about 20 s: the demo and a real chromium, a run's bar sampled while it advances
def test_progress_page_shows_a_running_task(browser: Any, tmp_path: Path) -> None:
    """Given the demo and its page open, a double click on "sync (queue)" shows a bar that
    advances while the first run works, its queued duplicate, and then the final outcome."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    demo = Demo("--port", "0", "--concurrency", "3")
    try:
        base = demo.wait_url()
        browser.get(base + "/")
        bar = browser.find_element(By.CSS_SELECTOR, '.bar[data-key="sync-queue:2"]')
        button = browser.find_element(By.CSS_SELECTOR, 'button.sync[data-policy="queue"][data-account="2"]')
        ActionChains(browser).double_click(button).perform()

        def both_clicks_done() -> bool:
            clicks = browser.find_elements(By.CSS_SELECTOR, "#clicks li")
            return len(clicks) == 2 and all(li.get_attribute("data-state") == "SUCCESS" for li in clicks)

        seen: dict[str, list[float]] = {}  # percent by holder
        details: list[str] = []
        deadline = time.monotonic() + 40
        while not (both_clicks_done() and bar.get_attribute("data-outcome") == "succeeded"):
            assert time.monotonic() < deadline, (seen, details)
            # one read of the bar's state: read attribute by attribute, the key could change hands
            # between two reads and pair one run's task id with the next run's percent
            held, task, percent, detail = browser.execute_script(
                "const b = arguments[0]; return [b.dataset.held, b.dataset.task, b.dataset.percent,"
                " b.querySelector('.detail').textContent];", bar)
            if held == "true":
                seen.setdefault(task, []).append(float(percent or 0))
                details.append(detail)
                if len(details) == 10:
                    browser.save_screenshot(str(tmp_path / "running.png"))
            time.sleep(0.1)  # the next sample of the bar
        # the bar's width transition ended: the fill is drawn full, with no animation running
        wait_for(lambda: browser.execute_script(
            "const f = arguments[0].querySelector('.fill'), t = arguments[0].querySelector('.track');"
            " return f.getAnimations().length === 0"
            " && f.getBoundingClientRect().width >= t.getBoundingClientRect().width - 0.5;", bar), timeout=10)
        browser.save_screenshot(str(tmp_path / "finished.png"))

        # two runs, one after the other; each bar advanced, never backwards, up to 100
        assert len(seen) == 2, seen
        for percents in seen.values():
            assert len({p for p in percents if 0 < p < 100}) >= 3 and percents == sorted(percents), seen
        assert any("queued 1" in text for text in details), details  # the double click waited
        assert any(text.startswith("holder ") and "/8" in text for text in details), details
        assert bar.find_element(By.CLASS_NAME, "state").text == "succeeded"
        assert float(bar.get_attribute("data-percent")) == 100
        assert "outcome succeeded" in bar.find_element(By.CLASS_NAME, "detail").text
        errors = [entry for entry in browser.get_log("browser") if entry["level"] == "SEVERE"]
        assert errors == []
        for name in ("running.png", "finished.png"):
            assert (tmp_path / name).stat().st_size > 10_000
        tree = demo.descendants()
        assert demo.interrupt() == 0, demo.output
        assert not alive(tree)
    finally:
        if demo.proc.poll() is None:
            demo.kill()
