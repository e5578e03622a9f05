"""`python -m demo --secure` (what `make demo-secure` runs) tells the whole story over mutual TLS."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_the_demo_runs_to_the_end_over_mutual_tls() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "demo", "--secure"], cwd=REPO, capture_output=True, text=True, timeout=280
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "Over mutual TLS" in out
    assert "Both frontends list all three pools with fresh load and KV telemetry." in out
    assert "left the directory of both frontends" in out  # the operator's drain was authorized
    assert "The client's tokens are identical to an uninterrupted run's" in out
    assert "All processes stopped." in out
