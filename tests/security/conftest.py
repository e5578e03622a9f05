"""Fixtures of the security tests: one test PKI per test module (certificates are cheap, but not free)."""

from __future__ import annotations

import pytest

from tests.security.pki import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))
