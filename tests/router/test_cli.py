"""Flag parsing of `globalrouter serve` and `globalrouter generate`."""

from __future__ import annotations

import pytest

from globalrouter.cli import build_parser


def test_serve_defaults_parse():
    args = build_parser().parse_args(["serve", "--discovery", "127.0.0.1:50051"])
    assert args.listen == "127.0.0.1:50061" and args.migration_limit == 3
    assert args.advertise is None and args.metrics_listen is None and args.frontend_id is None


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--discovery", "nohost"],
        ["serve", "--discovery", "h:1", "--advertise", "ftp://h:1"],
        ["serve", "--discovery", "h:1", "--migration-limit", "-1"],
        ["serve", "--discovery", "h:1", "--admission-tries", "0"],
        ["serve", "--discovery", "h:1", "--frontend-id", " x"],
        ["generate", "--router", "h:1", "--model", "m", "--tokens", "1,x", "--max-tokens", "3"],
        [
            "generate",
            "--router",
            "h:1",
            "--model",
            "m",
            "--prompt",
            "a",
            "--tokens",
            "1",
            "--max-tokens",
            "3",
        ],
    ],
)
def test_bad_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert "error" in capsys.readouterr().err
