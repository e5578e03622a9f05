"""A plain `pip install` of the project (no extras) into a fresh virtualenv gives working commands and a mesh."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from mocker.tokens import continue_sequence
from tests.support import REPO

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# What `[tool.setuptools.packages.find]` installs, plus the files the build reads.
PACKAGES = [p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]]
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)
# Every console script with the subcommands it has today: a script may gain subcommands, never lose these.
SCRIPTS = {
    "globaldiscovery": {"serve", "pools"},
    "poolrelay": {"serve", "status"},
    "globalrouter": {"serve", "generate", "simulate", "replay"},
    "mocker": {"serve"},
}


def run(
    args: list[str | Path], timeout: float, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def subcommands(help_text: str) -> set[str]:
    """The subcommands a `--help` lists: `{a,b}` choices and the indented names under it."""
    section = help_text.split("positional arguments:", 1)[1].split("options:", 1)[0]
    names = {n for m in re.findall(r"\{([\w,-]+)\}", section) for n in m.split(",")}
    names |= set(re.findall(r"^    ([a-z][\w-]*)", section, flags=re.MULTILINE))
    return names


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh virtualenv with the project installed from a copy of its sources, without extras."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    env_dir = root / "venv"
    # No pip inside (faster); this interpreter's pip installs into it, from its cache where it can.
    run([sys.executable, "-m", "venv", "--without-pip", env_dir], timeout=120)
    python = env_dir / "bin" / "python"
    run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-compile", src],
        timeout=300,
    )
    return env_dir


def clean_env() -> dict[str, str]:
    """The environment minus anything that would let the repository's sources leak into the venv."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


def test_every_console_script_and_subcommand_prints_help(venv: Path, tmp_path: Path) -> None:
    assert set(SCRIPTS) == set(PYPROJECT["project"]["scripts"]), "SCRIPTS must name every console script"
    for script, known in SCRIPTS.items():
        exe = venv / "bin" / script
        assert exe.exists(), f"console script {script} was not installed"
        top = run([exe, "--help"], timeout=60, cwd=tmp_path, env=clean_env()).stdout
        listed = subcommands(top)
        assert known <= listed, f"{script} --help lists {sorted(listed)}, missing {sorted(known - listed)}"
        for sub in sorted(listed):
            out = run([exe, sub, "--help"], timeout=60, cwd=tmp_path, env=clean_env()).stdout
            assert out.startswith(f"usage: {script} {sub}"), out[:200]


MESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import meshlaunch
    PROMPT = list(range(1, 40))
    from meshlaunch import local_mesh, generate_cli

    # The launcher and the services come from the virtualenv, not from a checkout.
    assert Path(meshlaunch.__file__).is_relative_to(sys.prefix), meshlaunch.__file__
    with local_mesh(Path(sys.argv[1])) as mesh:
        mesh.start_discovery()
        mesh.start_pool("pool-a")
        router = mesh.start_router()
        mesh.wait_routable(router, ["pool-a"], timeout=60)
        result = generate_cli(router, PROMPT, 8)
    print(json.dumps(result))
    """
)


def test_one_pool_mesh_serves_a_generate_from_the_installed_package(venv: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    done = run([venv / "bin" / "python", "-c", MESH_SCRIPT, logs], timeout=240, cwd=tmp_path, env=clean_env())
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["pools"] == ["pool-a"], result
    assert result["tokens"] == continue_sequence(list(range(1, 40)), 8), result
