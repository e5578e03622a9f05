"""docs/configuration.md is what the command parsers generate (`make config-doc` rewrites it)."""

from __future__ import annotations

from meshkit import settings
from tests import config_doc


def test_configuration_doc_is_current():
    assert config_doc.PATH.read_text() == config_doc.render(), (
        "docs/configuration.md is stale: run `make config-doc` (python -m tests.config_doc) and commit it"
    )


def test_every_serve_setting_is_in_the_doc():
    text = config_doc.PATH.read_text()
    for command, build in config_doc.BINARIES:
        parser = config_doc.serve_parser(build())
        prefix = settings.prefix_of(parser)
        assert prefix is not None, f"{command} serve takes no environment or --config"
        for action in settings.settings_actions(parser):
            assert f"`{settings.env_name(prefix, action)}`" in text, (command, action.dest)
