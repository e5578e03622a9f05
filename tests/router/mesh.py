"""The local mesh lives in meshlaunch; re-exported here for tests written against tests.router.mesh."""

from meshlaunch import *  # noqa: F403
