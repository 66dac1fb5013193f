"""Debian's headless Chromium driven by selenium through Debian's chromedriver (`make browser`
installs both): the viewer's browser test and benchmarks/viewer.py. No browser is downloaded
(selenium's own manager is bypassed by naming both binaries).

``chromium()`` yields a WebDriver; ``wait_for(driver, js)`` polls a JavaScript expression until
it is truthy, with a generous timeout (a loaded machine is slow, never wrong).
"""

from __future__ import annotations

import contextlib
import shutil
import time

CHROMIUM = ("/usr/bin/chromium", "chromium")
CHROMEDRIVER = ("/usr/bin/chromedriver", "chromedriver")


def _find(names) -> str:
    for n in names:
        found = shutil.which(n)
        if found:
            return found
    raise RuntimeError(f"{names[-1]} not found: `make browser` installs Debian's chromium and "
                       "chromium-driver (apt-get install chromium chromium-driver)")


@contextlib.contextmanager
def chromium(width: int = 1400, height: int = 1000):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = _find(CHROMIUM)
    driver = webdriver.Chrome(options=options, service=Service(_find(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(driver, js: str, timeout_s: float = 120.0):
    """The value of ``return (js)`` once truthy; TimeoutError naming ``js`` otherwise."""
    end = time.monotonic() + timeout_s
    while True:
        value = driver.execute_script(f"return ({js});")
        if value:
            return value
        if time.monotonic() > end:
            raise TimeoutError(f"the page never satisfied {js} in {timeout_s:.0f} s")
        time.sleep(0.1)
