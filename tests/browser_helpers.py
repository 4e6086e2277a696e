"""Headless Debian chromium through Selenium, for the browser tests (review page, walkthrough).

Selenium drives the system ``chromedriver`` (Debian's ``chromium-driver``), never a download
by selenium-manager (there is no internet where the tests run)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
NEEDS_BROWSER = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromedriver on PATH (apt install chromium chromium-driver); "
           "selenium-manager downloads are not used",
)


@contextmanager
def chrome() -> Iterator[Any]:
    """A headless chromium session, quit afterwards."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                "--disable-gpu", "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=opts)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def press(driver: Any, key: str) -> None:
    """Type ``key`` on the page (not into a field), as a reviewer's keyboard does."""
    from selenium.webdriver.common.by import By

    driver.find_element(By.TAG_NAME, "body").send_keys(key)


def wait_away(driver: Any, url: str, timeout: float = 10) -> None:
    """Wait until the browser has left ``url`` and the new page has loaded."""
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: d.current_url != url and d.execute_script("return document.readyState") == "complete")
