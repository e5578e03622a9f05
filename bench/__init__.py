"""Benchmarks: `python -m bench.run_all` (what `make bench` runs) writes BENCHMARKS.md."""
