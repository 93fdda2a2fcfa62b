"""Headless Chromium for the console's browser tests: Debian's chromium and chromedriver
(``make browser`` installs them), driven by Selenium without downloading anything.
Screenshots go to test-artifacts/console/ (gitignored)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "console"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1000"]


def chrome():
    """A Selenium driver of Debian's headless Chromium with a fresh profile (skips the test
    when chromium, chromedriver or selenium is missing: `make browser`)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (make browser)")
    profile = tempfile.mkdtemp(prefix="expstore-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.profile_dir = profile
    return driver


def quit(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


def wait_for(driver, css: str, timeout: float = 30.0):
    """The first element matching ``css``, once there and displayed."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    return wait_until(driver, ec.visibility_of_element_located((By.CSS_SELECTOR, css)), timeout)


def wait_until(driver, condition, timeout: float = 30.0):
    """``condition(driver)`` once truthy. Counts as not yet: an element the page
    re-rendered while the condition read it (stale), one not there yet, and a lookup
    that a navigation cut short (the page reloading, as after a login)."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    def holds(d):
        try:
            return condition(d)
        except WebDriverException as e:
            if "aborted by navigation" not in (e.msg or ""):
                raise
            return False

    return WebDriverWait(driver, timeout, ignored_exceptions=(StaleElementReferenceException,)).until(holds)


def screenshot(driver, name: str) -> Path:
    """A PNG of the whole page (the window grown to the page's height)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, max(800, min(int(height) + 40, 6000)))
    time.sleep(0.3)  # plotly relayouts on resize
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    driver.set_window_size(1400, 1000)
    return path


def errors(driver) -> list[str]:
    """The page's console errors since the last call (a refused request is logged too)."""
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
