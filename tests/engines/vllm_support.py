"""What the real-vLLM tests share: making the tiny model, waiting for a vLLM, starting its relay."""

from __future__ import annotations

import subprocess
from pathlib import Path

from meshlaunch.vllm_engine import ENGINE_BLOCK, Engine
from tests.support import REPO, ProcessGroup, command, wait_until

START_TIMEOUT_S = 900.0  # vLLM on a busy 2-core machine: about 65 s idle, several minutes loaded


def make_engine_files(python: str, out: Path, script: str = "make_model.py") -> Path:
    """Runs scripts/engines/SCRIPT under the engines' interpreter to write a tiny model (or adapter) to OUT."""
    subprocess.run(
        [python, str(REPO / "scripts" / "engines" / script), str(out)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    return out


def wait_vllm(engine: Engine, name: str = "vLLM") -> None:
    """Waits until the engine answers /health; a vLLM that exited fails at once with its log's tail."""

    def up() -> bool:
        if engine.proc is not None and not engine.proc.alive():
            raise AssertionError(f"{name} exited:\n{engine.proc.output()[-4000:]}")
        return engine.healthy()

    wait_until(up, START_TIMEOUT_S, interval=1.0, message=f"{name} healthy")


def start_vllm_relay(group: ProcessGroup, engine: Engine, pool: str, discovery: str, *extra: str):
    """Starts the relay of ENGINE's pool (`relay-POOL`, region local, reports every 0.2 s), plus EXTRA flags."""
    worker = f"url={engine.url},events=tcp://127.0.0.1:{engine.events},replay=tcp://127.0.0.1:{engine.replay}"
    return group.start(
        f"relay-{pool}",
        [
            command("poolrelay"), "serve", "--engine", "vllm", "--engine-worker", worker,
            "--engine-block-size", str(ENGINE_BLOCK), "--discovery", discovery,
            "--routing-pool", pool, "--routing-pool-region", "local", "--relay-id", f"relay-{pool}",
            "--report-interval", "0.2", *extra,
        ],
    )  # fmt: skip
