"""Writes SECURITY.md's generated sections: the authorization table (meshkit.authz.TABLE) and the
bad-input table (tests/security/bad_inputs.CASES). `python -m tests.security.security_doc` rewrites
them; test_security_doc.py fails when SECURITY.md is not current."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from meshkit.authz import HTTP, TABLE
from meshkit.identity import Role
from tests.security.bad_inputs import CASES

PATH = Path(__file__).resolve().parents[2] / "SECURITY.md"
_ROLE_ORDER = [Role.RELAY, Role.FRONTEND, Role.ADMIN, Role.CLIENT]


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def authz_table() -> str:
    lines = [
        "| RPC | relay | frontend | admin | client | must name the caller's own | why |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, rule in TABLE.items():
        if method.startswith(HTTP):
            name = method  # an HTTP path of the global frontend's OpenAI front
        else:
            name = method.strip("/").replace("/", ".") + ("*" if method.endswith("/") else "")
        marks = ["yes" if role in rule.roles else "" for role in _ROLE_ORDER]
        owned = ", ".join(
            f"{label}: `{path}`"
            for label, path in (("pool", rule.pool_field), ("id", rule.name_field))
            if path
        )
        if rule.server_pool:
            owned += "pool: the server's own (relays)"
        if rule.per_message:
            owned += " (every message)"
        if rule.anonymous:
            owned += "no credentials needed"
        lines.append(f"| `{name}` | " + " | ".join(marks) + f" | {owned} | {_cell(rule.note)} |")
    return "\n".join(lines)


def bad_input_table() -> str:
    lines = ["| # | service | call | input | answer | field / reason |", "|---|---|---|---|---|---|"]
    for i, case in enumerate(CASES, start=1):
        named = " · ".join(x for x in (f"`{case.field}`" if case.field else "", case.reason) if x) or "—"
        lines.append(f"| {i} | {case.service} | {case.call} | {_cell(case.attack)} | {case.code} | {named} |")
    return "\n".join(lines)


SECTIONS = {"authz": authz_table, "bad-inputs": bad_input_table}


def render(text: str) -> str:
    """`text` with every generated section replaced by its current content."""
    for name, build in SECTIONS.items():
        pattern = re.compile(
            rf"(<!-- BEGIN GENERATED {name} .*?-->\n).*?(<!-- END GENERATED {name} -->)", re.DOTALL
        )
        found = pattern.search(text)
        if found is None:
            raise ValueError(f"SECURITY.md has no generated section {name!r}")
        text = text[: found.end(1)] + build() + "\n" + text[found.start(2) :]
    return text


def main() -> int:
    PATH.write_text(render(PATH.read_text()))
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
