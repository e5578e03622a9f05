"""`make demo`: runs the most complete local demo that exists (the whole mesh once it is built)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    try:
        from demo import mesh_demo as chosen
    except ModuleNotFoundError:
        from demo import discovery_demo as chosen  # type: ignore[no-redef]
    sys.exit(chosen.main())
