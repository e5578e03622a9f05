"""The policy file: parsing, validation (errors name the file, entry and key), lookups and reload diffs."""

from __future__ import annotations

import pytest

from globalrouter.policy import OTHER_LABEL, Policy, PolicyError, TenantPolicy, load, parse
from meshkit.authz import UNCHECKED
from meshkit.identity import Identity, Role

GOOD = """
[budget]
minute_seconds = 10
chunk_fraction = 0.1

[default]
priority = 1
tokens_per_minute = 1000
models = []

[identity."client/alice"]
priority = 5
weight = 2.5
tokens_per_minute = 10000
requests_per_minute = 30
regions = ["eu-west", "eu-north"]
models = ["llama"]

[identity."spiffe://mesh.test/client/bob"]
tokens_per_day = 50000

[identity.unchecked]
priority = 9
"""

ALICE = Identity(Role.CLIENT, "alice")
BOB_BY_KEY = Identity(Role.CLIENT, "bob", source="api-key")


def test_entries_start_from_the_default_and_override_what_they_set():
    policy = parse(GOOD, "p.toml")
    alice = policy.for_identity(ALICE)
    assert (alice.priority, alice.weight, alice.tokens_per_minute, alice.requests_per_minute) == (
        5,
        2.5,
        10000,
        30,
    )
    assert alice.regions == frozenset({"eu-west", "eu-north"}) and alice.models == frozenset({"llama"})
    assert alice.allows_model("llama") and not alice.allows_model("mistral")
    assert alice.allows_region("eu-west") and not alice.allows_region("us-east")
    # A SPIFFE id and an API key name the same client; unset keys come from [default].
    bob = policy.for_identity(BOB_BY_KEY)
    assert bob.name == "client/bob" and bob.tokens_per_day == 50000 and bob.tokens_per_minute == 1000
    assert bob.models == frozenset() and not bob.allows_model("llama")  # [] in the default: none
    assert bob.regions is None and bob.allows_region("anywhere")
    assert policy.for_identity(UNCHECKED).priority == 9
    stranger = policy.for_identity(Identity(Role.CLIENT, "mallory"))
    assert stranger.name == "default" and stranger.priority == 1
    assert policy.budget.minute_seconds == 10 and policy.budget.chunk(10_000) == 1000
    assert policy.budget.buckets == 10 and parse("[budget]\nbuckets = 60").budget.buckets == 60


def test_metric_labels_are_bounded_to_listed_identities():
    policy = parse(GOOD)
    assert policy.label(ALICE) == "client/alice"
    assert policy.label(UNCHECKED) == "unchecked"
    assert policy.label(Identity(Role.CLIENT, "x" * 100)) == OTHER_LABEL


def test_no_policy_lets_everyone_do_everything():
    p = Policy().for_identity(ALICE)
    assert p == TenantPolicy() and p.allows_model("any") and p.allows_region("any") and not p.limited


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("[default]\npriority = 10", ["[default]", "priority"]),
        ("[default]\nweight = 0", ["[default]", "weight"]),
        ("[default]\ntokens_per_minute = -1", ["[default]", "tokens_per_minute"]),
        ("[default]\ntokens_per_minute = 1.5", ["[default]", "tokens_per_minute"]),
        ("[default]\ntokens_per_minut = 1", ["[default]", "tokens_per_minut"]),
        ('[identity."client/a"]\nmodels = "llama"', ['[identity."client/a"]', "models"]),
        ('[identity."client/a"]\nregions = [1]', ['[identity."client/a"]', "regions[0]"]),
        ('[identity."client/a"]\nregions = [" x"]', ['[identity."client/a"]', "regions[0]"]),
        ('[identity."bogus/a"]\npriority = 1', ['[identity."bogus/a"]', "not an identity"]),
        ('[identity."client/a/b"]\npriority = 1', ['[identity."client/a/b"]', "not an identity"]),
        (
            '[identity."client/a"]\npriority = 1\n[identity."spiffe://d/client/a"]\npriority = 2',
            ["client/a", "another entry"],
        ),
        ("[budget]\nminute_seconds = 0.5", ["[budget]", "minute_seconds"]),
        ("[budget]\nchunk_fraction = 0", ["[budget]", "chunk_fraction"]),
        ("[budget]\nbuckets = 0", ["[budget]", "buckets must be a whole number 1 to 100"]),
        ("[budget]\nbuckets = 101", ["[budget]", "buckets", "101"]),
        ("[budget]\nbuckets = 2.5", ["[budget]", "buckets", "2.5"]),
        ("[budget]\nchunk = 1", ["[budget]", "chunk"]),
        ("[tenants]\nx = 1", ["tenants"]),
        ("[default\n", ["not valid TOML"]),
        ("default = 3", ["[default]", "table"]),
    ],
)
def test_bad_policies_are_refused_naming_the_file_entry_and_key(text, names):
    with pytest.raises(PolicyError) as caught:
        parse(text, "/etc/policy.toml")
    message = str(caught.value)
    assert message.startswith("/etc/policy.toml: ")
    for name in names:
        assert name in message


def test_load_names_a_missing_file(tmp_path):
    with pytest.raises(PolicyError, match=r"missing\.toml: cannot be read"):
        load(tmp_path / "missing.toml")
    path = tmp_path / "p.toml"
    path.write_text(GOOD)
    assert load(path).source == str(path)


def test_changes_say_what_a_reload_changed():
    old = parse(GOOD)
    new = parse(
        GOOD.replace("tokens_per_minute = 10000", "tokens_per_minute = 20000").replace(
            '[identity."spiffe://mesh.test/client/bob"]\ntokens_per_day = 50000\n',
            '[identity."client/carol"]\n',
        )
    )
    assert old.changes(new) == [
        "client/alice tokens_per_minute: 10000 -> 20000",
        "removed client/bob",
        "added client/carol",
    ]
    assert old.changes(parse(GOOD)) == []


def test_a_reload_keeps_the_policy_in_force_when_the_new_file_is_bad(tmp_path):
    from globalrouter.policy import PolicyFile

    path = tmp_path / "p.toml"
    path.write_text(GOOD)
    held = PolicyFile(path)
    path.write_text(GOOD.replace("priority = 5", "priority = 50"))
    assert held.reload() is False
    assert held.current.for_identity(ALICE).priority == 5
    path.write_text(GOOD.replace("priority = 5", "priority = 6"))
    assert held.reload() is True
    assert held.current.for_identity(ALICE).priority == 6
    assert PolicyFile(None).current == Policy() and PolicyFile(None).reload()


def test_residency_is_a_hard_filter_named_in_the_decision():
    from globalrouter.selection import FilterReason, Selector
    from tests.router_core.test_selection import MODEL, NOW, pool

    pools = [
        pool("eu", region="eu-west"),
        pool("us", region="us-east"),
        pool("x", model="other", region="us"),
    ]
    regions = parse(GOOD).for_identity(ALICE).regions
    d = Selector().select(pools, MODEL, 64, 16, {}, NOW, regions=regions)
    assert [c.pool_id for c in d.candidates] == ["eu"]
    assert [(f.pool_id, f.reason) for f in d.filtered] == [
        ("us", FilterReason.REGION_NOT_ALLOWED),
        ("x", FilterReason.OTHER_MODEL),  # another model is named as such, whatever its region
    ]
    assert "us-east" in d.filtered[0].detail and "eu-west" in d.filtered[0].detail
    # No pool in the allowed regions: no candidate, the residency filter named for each pool.
    d = Selector().select(pools, MODEL, 64, 16, {}, NOW, regions=frozenset({"ap-south"}))
    assert not d.candidates and d.model_served
    assert {f.reason for f in d.filtered if f.pool_id != "x"} == {FilterReason.REGION_NOT_ALLOWED}
    # No residency: every region.
    assert len(Selector().select(pools, MODEL, 64, 16, {}, NOW).candidates) == 2


def test_serve_refuses_a_bad_policy_file_as_a_usage_error(tmp_path, capsys):
    from globalrouter.cli import build_parser
    from globalrouter.serve_cli import router_config

    bad = tmp_path / "bad.toml"
    bad.write_text('[identity."client/alice"]\ntokens_per_minute = -3\n')
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--discovery", "h:1", "--policy", str(bad)])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert (
        "--policy" in err
        and str(bad) in err
        and 'identity."client/alice"' in err
        and "tokens_per_minute" in err
    )
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    args = build_parser().parse_args(
        ["serve", "--discovery", "h:1", "--policy", str(good), "--budget-etcd-endpoints", "127.0.0.1:2379"]
    )
    args.security = None
    config = router_config(args)
    assert (config.policy, config.budget_etcd) == (str(good), "127.0.0.1:2379")
