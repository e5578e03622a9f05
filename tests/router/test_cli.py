"""Flag parsing of `globalrouter serve` and `globalrouter generate`, and how generate reports errors."""

from __future__ import annotations

import asyncio
import json

import pytest

from globalrouter.cli import build_parser
from globalrouter.config import RouterConfig
from globalrouter.server import create_server
from globalrouter.wait_slo import WaitSlo
from tests.router.fakes import start_router


def test_serve_defaults_parse():
    args = build_parser().parse_args(["serve", "--discovery", "127.0.0.1:50051"])
    assert args.listen == "127.0.0.1:50061" and args.migration_limit == 3
    assert args.advertise is None and args.metrics_listen is None and args.frontend_id is None


def test_stall_flags_parse():
    args = build_parser().parse_args(["serve", "--discovery", "h:1"])
    assert (args.first_token_timeout, args.max_queue_wait) == (10.0, 120.0)
    args = build_parser().parse_args(["serve", "--discovery", "h:1", "--max-queue-wait", "30"])
    assert args.max_queue_wait == 30.0


def test_wait_slo_flags_parse():
    args = build_parser().parse_args(["serve", "--discovery", "h:1", "--wait-slo", "4.5"])
    assert (args.wait_slo, args.wait_slo_quantile) == (4.5, 0.99)
    assert build_parser().parse_args(["serve", "--discovery", "h:1"]).wait_slo is None


async def test_a_frontend_under_a_wait_slo_prices_waits_and_exports_the_price():
    priced = create_server(RouterConfig(wait_slo=WaitSlo(4.5, quantile=0.95)))
    price = priced.core.selector.wait_price
    assert price is not None and price.slo == WaitSlo(4.5, quantile=0.95)
    price.observe(10.0)
    exported = priced.metrics.registry.get_sample_value("globalrouter_wait_slo_price")
    assert exported == pytest.approx(price.excess_weight) and exported > 2.0
    fixed = create_server(RouterConfig())
    assert fixed.core.selector.wait_price is None
    assert fixed.metrics.registry.get_sample_value("globalrouter_wait_slo_price") == 0.0


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--discovery", "nohost"],
        ["serve", "--discovery", "h:1", "--advertise", "ftp://h:1"],
        ["serve", "--discovery", "h:1", "--migration-limit", "-1"],
        ["serve", "--discovery", "h:1", "--admission-tries", "0"],
        ["serve", "--discovery", "h:1", "--frontend-id", " x"],
        ["serve", "--discovery", "h:1", "--wait-slo", "0"],
        ["serve", "--discovery", "h:1", "--max-queue-wait", "0"],
        ["serve", "--discovery", "h:1", "--wait-slo", "inf"],
        ["serve", "--discovery", "h:1", "--wait-slo", "2", "--wait-slo-quantile", "1"],
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


@pytest.mark.timeout(30)
async def test_generate_prints_the_error_reason(capsys):
    router, _stub, channel = await start_router()
    try:
        argv = ["generate", "--router", f"127.0.0.1:{router.port}", "--model", "m", "--tokens", "1,2"]
        args = build_parser().parse_args([*argv, "--max-tokens", "3", "--json"])
        assert await asyncio.to_thread(args.func, args) == 1
        out = json.loads(capsys.readouterr().out)
        assert (out["error"], out["reason"]) == ("NOT_FOUND", "NO_POOL_FOR_MODEL")
        args = build_parser().parse_args([*argv, "--max-tokens", "3"])
        assert await asyncio.to_thread(args.func, args) == 1
        assert capsys.readouterr().err.startswith("error: NOT_FOUND (NO_POOL_FOR_MODEL): ")
    finally:
        await channel.close()
        await router.handle.server.stop(0)


def test_aliases_flag_takes_a_good_file_and_refuses_a_bad_one_naming_the_key(tmp_path, capsys):
    good = tmp_path / "good.toml"
    good.write_text('[aliases]\nchat = { "llama-v1" = 0.9, "llama-v2" = 0.1 }\n')
    assert build_parser().parse_args(["serve", "--discovery", "h:1", "--aliases", str(good)]).aliases == str(
        good
    )
    bad = tmp_path / "bad.toml"
    bad.write_text('[aliases]\nchat = { "llama-v1" = -0.5 }\n')
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--discovery", "h:1", "--aliases", str(bad)])
    assert exit_.value.code == 2
    assert "aliases.chat.llama-v1: a weight must be a finite number ≥ 0" in capsys.readouterr().err


async def test_a_frontend_with_routed_prefixes_exports_the_blocks_it_holds():
    on = create_server(RouterConfig(routed_prefix_ttl=10.0))
    assert on.core.routed is not None and on.core.routed.ttl == 10.0
    on.core.routed.record("p", [1, 2, 3], 0.0)
    assert on.metrics.registry.get_sample_value("globalrouter_routed_prefix_blocks") == 3.0
    off = create_server(RouterConfig())
    assert off.core.routed is None
    assert off.metrics.registry.get_sample_value("globalrouter_routed_prefix_blocks") == 0.0
