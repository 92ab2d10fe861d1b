"""Headless Chromium for the web page tests: Debian's `chromium` (scripts/setup.sh --test
installs it) driven by Playwright for Python, which never downloads a browser of its own.

A missing browser fails the tests that need it, loudly; only `SHOAL_SKIP_BROWSER_TESTS=1` skips
them (a developer machine without the browser). Screenshots go to `SHOAL_TEST_ARTIFACTS`
(default `test-artifacts/` in the checkout)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_CANDIDATES = ("chromium", "chromium-browser")


def chromium_path() -> str:
    """The system browser (`SHOAL_TEST_CHROMIUM` names another), or a failure saying how to
    get one."""
    configured = os.environ.get("SHOAL_TEST_CHROMIUM")
    found = configured or next(filter(None, map(shutil.which, CHROMIUM_CANDIDATES)), None)
    if os.environ.get("SHOAL_SKIP_BROWSER_TESTS") == "1":
        pytest.skip("SHOAL_SKIP_BROWSER_TESTS=1")
    if not found or not Path(found).exists():
        pytest.fail(
            "no Chromium for the browser tests: run `bash scripts/setup.sh --test` (it installs "
            "Debian's chromium) or `apt-get install chromium`; SHOAL_SKIP_BROWSER_TESTS=1 skips them"
        )
    return found


def artifacts_dir() -> Path:
    directory = Path(os.environ.get("SHOAL_TEST_ARTIFACTS", REPO / "test-artifacts"))
    directory.mkdir(parents=True, exist_ok=True)
    return directory


@contextmanager
def chromium() -> Iterator:
    """A headless Chromium (Playwright's Browser), closed afterwards."""
    from playwright.sync_api import sync_playwright

    executable = chromium_path()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable)
        try:
            yield browser
        finally:
            browser.close()


class PageErrors:
    """Uncaught exceptions in a page's scripts, which a test asserts there were none of."""

    def __init__(self, page) -> None:
        self.errors: list[str] = []
        page.on("pageerror", lambda error: self.errors.append(str(error)))

    def assert_none(self) -> None:
        assert not self.errors, f"uncaught errors in the page: {self.errors}"
