"""SECURITY.md's tables are generated from the code and the tests: they must be current."""

from __future__ import annotations

from tests.security import security_doc


def test_security_md_tables_are_current():
    text = security_doc.PATH.read_text()
    assert security_doc.render(text) == text, (
        "run `make security-doc` (python -m tests.security.security_doc)"
    )
