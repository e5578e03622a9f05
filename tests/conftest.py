"""Shared pytest fixtures."""

from __future__ import annotations

import pytest

from meshkit.clock import FakeClock
from meshlaunch import process_group


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def procs(tmp_path):
    """A ProcessGroup whose processes are all stopped when the test ends."""
    with process_group(tmp_path) as group:
        yield group
