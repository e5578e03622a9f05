"""Packages whose private APIs the code uses are pinned to tested versions in pyproject.toml, the
installed versions satisfy the pins, and each such pin says why next to it."""

from __future__ import annotations

import importlib.metadata
import tomllib

import pytest
from packaging.requirements import Requirement

from tests.support import REPO

PYPROJECT = REPO / "pyproject.toml"
# Package -> (a file that uses its internals, what it uses): such a package needs an upper bound.
INTERNALS = {
    "uvicorn": ("globalrouter/http_api/security.py", "uvicorn.protocols.http.httptools_impl"),
    "httptools": ("globalrouter/http_api/security.py", "httptools.HttpParserCallbackError"),
    "aetcd": ("globaldiscovery/store/etcd.py", "kvstub.Range"),
    "grpcio": ("globalrouter/v1/router_pb2_grpc.py", "grpc._utilities"),
}


def requirements() -> dict[str, Requirement]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    return {Requirement(d).name.lower(): Requirement(d) for d in deps}


@pytest.mark.parametrize("package", INTERNALS)
def test_packages_used_through_internals_have_a_tested_upper_bound(package):
    path, used = INTERNALS[package]
    assert used in (REPO / path).read_text(), f"{path} no longer uses {used}: update INTERNALS"
    spec = requirements()[package].specifier
    assert any(s.operator in ("<", "<=", "==", "~=") for s in spec), f"{package}{spec} has no upper bound"
    installed = importlib.metadata.version(package)
    assert spec.contains(installed, prereleases=True), f"installed {package} {installed} is outside {spec}"


@pytest.mark.parametrize("package", INTERNALS)
def test_each_pin_says_why(package):
    lines = PYPROJECT.read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith(f'"{package}'))
    assert lines[at - 1].strip().startswith("#"), f"the {package} pin has no comment above it saying why"
