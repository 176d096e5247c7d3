"""The browser tier: the dashboard in Debian's headless Chromium, driven by Playwright (both installed by
scripts/install-browser; `playwright install` is never used), against the session's shared real `pilldrops up`
(tests/up.py: its own node name so its cgroups and mounts are its own; leak-checked per test and at the
end). Every test fails on a script error or a console error it did not expect, and
leaves a full-page screenshot in test-artifacts/browser/."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.up import Up, no_leaks_of

CHROMIUM = Path(os.environ.get("PILLDROPS_CHROMIUM", "/usr/bin/chromium"))
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "browser"


def _why_no_browser() -> str | None:
    if not CHROMIUM.exists():
        return f"{CHROMIUM} is missing (scripts/install-browser installs Debian's chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (scripts/install-browser installs it into .venv)"
    return None


@pytest.fixture(scope="session")
def dash_server(shared_up: Up) -> Up:
    """The session's shared `pilldrops up` (tests/conftest.py)."""
    why = _why_no_browser()
    if why:
        pytest.skip(why)
    return shared_up


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    if "dash_server" not in request.fixturenames:
        yield
        return
    with no_leaks_of(request.getfixturevalue("dash_server")):
        yield


@pytest.fixture
def api(dash_server: Up) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dash_server.api_url, headers={"Authorization": f"Bearer {dash_server.api_key}"},
                      timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def browser(dash_server: Up) -> Iterator[Any]:
    """Per module, not per session: Playwright's sync API keeps an event loop running in this thread
    while it is started, and the asyncio tests that run after this tier need the thread's loop free."""
    from playwright.sync_api import sync_playwright
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                               args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        try:
            yield b
        finally:
            b.close()


@dataclass
class Console:
    """Script errors and console errors of a page; ``allow`` takes patterns a test expects."""

    errors: list[str] = field(default_factory=list)
    allowed: list[re.Pattern[str]] = field(default_factory=list)

    def allow(self, pattern: str) -> None:
        self.allowed.append(re.compile(pattern))

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self.allowed)]


@pytest.fixture
def page(browser: Any, dash_server: Up, request: pytest.FixtureRequest) -> Iterator[Any]:
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, base_url=dash_server.api_url)
    pg = ctx.new_page()
    pg.set_default_timeout(15_000)
    console = Console()
    pg.on("console", lambda m: console.errors.append(f"console.{m.type}: {m.text}") if m.type == "error" else None)
    pg.on("pageerror", lambda e: console.errors.append(f"script error: {e}"))
    pg.console_log = console       # type: ignore[attr-defined]
    try:
        yield pg
    finally:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        try:
            pg.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"), full_page=True)
        finally:
            ctx.close()
    assert not console.unexpected(), f"errors in the browser console: {console.unexpected()}"


def sign_in(page: Any, key: str) -> None:
    page.goto("/")
    page.fill("#api-key", key)
    page.click("#signin-form button[type=submit]")


