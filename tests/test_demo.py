"""`python -m demo` (what `make demo` runs) tells its whole story and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_mesh_demo_runs_to_the_end() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "demo"], cwd=REPO, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "Both frontends list all three pools with fresh load and KV telemetry." in out
    assert "left the directory of both frontends" in out
    assert "The client's tokens are identical to an uninterrupted run's" in out
    assert "client.chat.completions.create(model='demo-model', stream=True" in out
    assert "completion tokens" in out  # the streamed chat's usage
    assert "All processes stopped." in out
