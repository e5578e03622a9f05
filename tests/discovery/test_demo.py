"""The interim discovery demo runs to the end, shows the lapsed pool leave, and exits 0."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support import REPO


@pytest.mark.timeout(60)
def test_discovery_demo_runs():
    code = "import sys; from demo import discovery_demo; sys.exit(discovery_demo.main())"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "pool-west REMOVED (REMOVAL_REASON_LEASE_EXPIRED)" in done.stdout
    assert "exited with code 0" in done.stdout
