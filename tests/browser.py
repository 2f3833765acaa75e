"""Debian's headless Chromium through Playwright, for the chat page's tests
(test_serve_page, test_serve_page_chat): a module that imports this is skipped
where either is missing."""

import os
from contextlib import contextmanager

import pytest

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(
        "no Chromium at /usr/bin/chromium (apt-get install chromium)",
        allow_module_level=True,
    )
sync_api = pytest.importorskip(
    "playwright.sync_api", reason="Playwright is not installed (pip install playwright)"
)

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
REPLY_MS = 180_000  # a reply on a busy 2-core CPU: an upper bound, not a wait


@contextmanager
def chromium():
    """One headless Chromium for a module's tests, closed at the end."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()
