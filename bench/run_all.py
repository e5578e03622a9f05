"""Runs every benchmark (bench/bench_*.py) and assembles BENCHMARKS.md: `python -m bench.run_all`.

Each benchmark prints its figures and writes a Markdown section to bench/results/<name>.md;
sections from benchmarks that fail keep their previous text, marked as not refreshed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

# Benchmarks with their own target and document, not part of BENCHMARKS.md (`make scale`: SCALE.md).
SEPARATE = {"bench_scale"}

HEADER = """# Benchmarks

Every figure here was printed by `make bench` (which runs `python -m bench.run_all`) on the
machine named in each section; each section says the command that produced it, so it can be
reproduced alone. Speeds are compared with a baseline measured in the same run and reported as
ratios where a comparison makes sense: the machine is shared and noisy, so absolute numbers move
between runs.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--only", action="append", default=[], help="run only benchmarks whose name contains this"
    )
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per benchmark")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    failed = []
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem
        if name in SEPARATE:
            continue
        if args.only and not any(o in name for o in args.only):
            continue
        print(f"== {name}", flush=True)
        started = time.monotonic()
        try:
            # As a module of the bench package, from the repository root: no sys.path edits needed.
            rc = subprocess.run(
                [sys.executable, "-m", f"bench.{name}"], cwd=ROOT, timeout=args.timeout
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
        print(f"== {name}: exit {rc} after {time.monotonic() - started:.0f}s", flush=True)
        if rc != 0:
            failed.append(name)
    sections = [HEADER]
    for md in sorted(RESULTS.glob("bench_*.md")):
        text = md.read_text()
        if md.stem in failed:
            text = f"> Not refreshed by the last run: `{md.stem}` failed.\n\n" + text
        sections.append(text)
    (ROOT / "BENCHMARKS.md").write_text("\n".join(sections))
    print(f"wrote BENCHMARKS.md ({len(sections) - 1} sections)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
