"""Shared pytest fixtures."""

from __future__ import annotations

import os

import pytest

from meshkit.clock import FakeClock
from meshlaunch import process_group
from tests.openai.cdp import Browser, chromium_path


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def procs(tmp_path):
    """A ProcessGroup whose processes are all stopped when the test ends."""
    with process_group(tmp_path) as group:
        yield group


@pytest.fixture
def browser(tmp_path):
    """Headless Chromium for the status-page tests (skipped without it, except in CI)."""
    binary = chromium_path()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing (make setup installs it: scripts/ensure_chromium.sh)")
        pytest.skip("chromium is not installed (make setup installs it)")
    b = Browser(binary, tmp_path / "profile")
    yield b
    b.close()
