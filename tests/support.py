"""Test-only paths; the process launcher lives in meshlaunch (re-exported here for older imports)."""

from __future__ import annotations

import sys
from pathlib import Path

from meshlaunch import *  # noqa: F403 - re-exports for tests written against tests.support

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def start_simulated_pools(mesh, router_address: str, nodes: Path, stats: Path, *args: str):
    """`python -m bench.scale_sim pools` against a local mesh's discovery and one frontend (with
    `args` for its sizes and traffic), writing its counters to `stats`; returns the process and a
    function reading those counters ({} until written; raises if the simulator died)."""
    import json
    import os

    proc = mesh.group.start(
        "sim",
        [
            *(sys.executable, "-m", "bench.scale_sim", "pools", "--frontend", f"http://{router_address}"),
            *("--discovery", mesh.discovery, "--nodes", str(nodes), "--stats", str(stats), *args),
        ],
        env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])},
    )

    def counters() -> dict:
        proc.check_alive()
        try:
            return dict(json.loads(stats.read_text()))
        except (OSError, ValueError):
            return {}

    return proc, counters


def count_routing_hashes(monkeypatch) -> list[int]:
    """Counts the prompts globalrouter.routing hashes (their token counts, in order), hashing them
    as before: the decision's "hash the whole prompt only when needed" rules are asserted on it."""
    import globalrouter.routing as routing

    calls: list[int] = []
    real = routing.block_hashes

    def counting(tokens, size, seed=0):
        calls.append(len(tokens))
        return real(tokens, size, seed)

    monkeypatch.setattr(routing, "block_hashes", counting)
    return calls
