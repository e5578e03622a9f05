"""`python -m demo` (what `make demo` runs): the whole-mesh demo."""

import sys

from demo.mesh_demo import main

sys.exit(main())
