"""Test-only paths; the process launcher lives in meshlaunch (re-exported here for older imports)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshlaunch import *  # noqa: F403 - re-exports for tests written against tests.support

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
