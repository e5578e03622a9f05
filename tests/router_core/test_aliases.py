"""Model name resolution: aliases and traffic splits from the operator's file, adapters by name."""

from __future__ import annotations

import pytest

from globalrouter.aliases import (
    Alias,
    AliasError,
    ModelResolver,
    Resolved,
    ResolveError,
    Target,
    load_aliases,
    parse_aliases,
    served_models,
)
from globalrouter.pool_state import PoolState


def pool(pool_id: str, model: str, adapters: tuple[str, ...] = (), listed: bool = True) -> PoolState:
    return PoolState(pool_id=pool_id, listed=listed, model=model, adapters={model: frozenset(adapters)})


POOLS = [
    pool("a", "llama-v1", ("sql-lora",)),
    pool("b", "llama-v2", ("chat-lora", "both")),
    pool("c", "llama-v1", ("both",)),
    pool("d", "ghost", ("ghost-lora",), listed=False),
]


def test_a_file_maps_names_to_models_adapters_and_weighted_splits(tmp_path):
    f = tmp_path / "aliases.toml"
    f.write_text(
        '[aliases]\nfast = "llama-v1"\nsql = "llama-v1:sql-lora"\nchat = { "llama-v1" = 9, "llama-v2" = 1 }\n'
    )
    got = load_aliases(str(f))
    assert got["fast"] == Alias("fast", (Target("llama-v1"),), (1.0,))
    assert got["sql"].targets == (Target("llama-v1", "sql-lora"),)
    assert got["chat"].weights == pytest.approx((0.9, 0.1))


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ('[aliases]\nchat = { "llama-v1" = -1 }', "aliases.chat.llama-v1: a weight must be a finite number"),
        ('[aliases]\nchat = { "llama-v1" = "x" }', "aliases.chat.llama-v1: a weight must be a number"),
        ('[aliases]\nchat = { "a" = 0, "b" = 0 }', "aliases.chat: the weights sum to 0"),
        ("[aliases]\nchat = 3", "aliases.chat: must be a model name or a table"),
        ('[aliases]\nchat = " padded"', "aliases.chat: must not start or end with white space"),
        ('[aliases]\n"a:b" = "m"', "aliases.a:b: an alias name must not contain ':'"),
        ('[aliasses]\nchat = "m"', "unknown key 'aliasses'"),
        ("[aliases\n", "is not TOML"),
    ],
)
def test_a_bad_file_is_refused_naming_the_key(tmp_path, text, names):
    f = tmp_path / "aliases.toml"
    f.write_text(text)
    with pytest.raises(AliasError) as e:
        load_aliases(str(f))
    assert str(f) in str(e.value) and names in str(e.value)


def test_a_split_is_deterministic_per_request_id_and_follows_its_weights():
    (alias,) = parse_aliases({"aliases": {"chat": {"v1": 0.9, "v2": 0.1}}}, "f").values()
    picks = [alias.pick(f"req-{i}").model for i in range(20_000)]
    assert abs(picks.count("v2") / len(picks) - 0.1) < 0.01
    assert all(alias.pick(f"req-{i}").model == picks[i] for i in range(100))  # same id, same model
    # A 0 / 1 split sends everything to the one with weight.
    (all_v2,) = parse_aliases({"aliases": {"chat": {"v1": 0, "v2": 1}}}, "f").values()
    assert {all_v2.pick(f"req-{i}").model for i in range(1000)} == {"v2"}
    (all_v1,) = parse_aliases({"aliases": {"chat": {"v1": 1, "v2": 0}}}, "f").values()
    assert {all_v1.pick(f"req-{i}").model for i in range(1000)} == {"v1"}


def test_resolution_order_alias_model_model_colon_adapter_then_adapter_name():
    r = ModelResolver(parse_aliases({"aliases": {"llama-v2": "llama-v1", "sql": "llama-v1:sql-lora"}}, "f"))
    assert r.resolve("llama-v2", "id", POOLS) == Resolved("llama-v1", "", "llama-v2")  # an alias shadows
    assert r.resolve("sql", "id", POOLS) == Resolved("llama-v1", "sql-lora", "sql")
    assert r.resolve("llama-v1", "id", POOLS) == Resolved("llama-v1")
    assert r.resolve("llama-v1:whatever", "id", POOLS) == Resolved(
        "llama-v1", "whatever"
    )  # routing refuses it
    assert r.resolve("sql-lora", "id", POOLS) == Resolved("llama-v1", "sql-lora")
    assert r.resolve("chat-lora", "id", POOLS).served_name == "chat-lora"
    assert r.resolve("ghost-lora", "id", POOLS) == Resolved("ghost-lora")  # unlisted pools serve nothing
    assert r.resolve("unknown", "id", POOLS) == Resolved("unknown")
    with pytest.raises(
        ResolveError, match=r"served on several models \(llama-v1, llama-v2\): name one as MODEL:both"
    ):
        r.resolve("both", "id", POOLS)
    assert served_models(POOLS) == {"llama-v1": {"sql-lora", "both"}, "llama-v2": {"chat-lora", "both"}}


def test_reload_takes_a_good_file_and_keeps_the_old_aliases_on_a_bad_one(tmp_path):
    f = tmp_path / "aliases.toml"
    f.write_text('[aliases]\nchat = "llama-v1"\n')
    r = ModelResolver.from_file(str(f))
    assert r.resolve("chat", "id", POOLS).model == "llama-v1"
    f.write_text('[aliases]\nchat = { "llama-v1" = 0, "llama-v2" = 1 }\n')
    assert r.reload() is True
    assert r.resolve("chat", "id", POOLS).model == "llama-v2"
    f.write_text('[aliases]\nchat = { "llama-v1" = "lots" }\n')
    assert r.reload() is False
    assert r.resolve("chat", "id", POOLS).model == "llama-v2"
    f.unlink()
    assert r.reload() is False and r.resolve("chat", "id", POOLS).model == "llama-v2"


def test_reported_adapters_are_bounded_and_named_validly():
    from globalrouter.telemetry_ingest import MAX_ADAPTERS_PER_MODEL, reported_adapters
    from poolrelay.v1 import pool_events_pb2 as pe

    models = [
        pe.ModelStatus(model="m", adapters=[f"a{i}" for i in range(MAX_ADAPTERS_PER_MODEL + 10)]),
        pe.ModelStatus(model="n", adapters=["ok", "x" * 129, ""]),
        pe.ModelStatus(model="o"),
    ]
    got = reported_adapters(models)
    assert len(got["m"]) == MAX_ADAPTERS_PER_MODEL and got["n"] == frozenset({"ok"}) and "o" not in got
