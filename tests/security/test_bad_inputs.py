"""Every case of the bad-input table against a live mesh: exact status, the field named, service healthy, nothing changed."""

from __future__ import annotations

import pytest

from meshlaunch import process_group
from tests.security.bad_inputs import CASES, ROUTER_FLAGS, Case
from tests.security.secure_mesh import SecureMesh, wait_serving

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    with process_group(tmp_path_factory.mktemp("logs")) as group:
        yield SecureMesh(None, group, router_flags=ROUTER_FLAGS).start_all()


def test_the_table_has_at_least_30_cases_across_the_four_services():
    assert len(CASES) >= 30
    assert {c.service for c in CASES} >= {"discovery", "router", "mocker", "relay"}


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.service}-{c.call}-{c.attack}")
def test_bad_input(mesh, case: Case):
    before = mesh.state()
    outcome = case.send(mesh)
    assert outcome.code == case.code, outcome
    if case.field:
        assert case.field in outcome.fields or case.field in outcome.message, outcome
    if case.reason:
        assert outcome.reason == case.reason, outcome
    for name, address in (("discovery", mesh.discovery), ("router", mesh.router), ("pool", mesh.pool)):
        wait_serving(address, None, mesh.procs[name], timeout=10)
    assert mesh.procs["relay"].alive()
    assert mesh.state() == before
