"""PR #18077 registration semantics, in process: config checks in code, optional frontends, the
reason of a failed call with its causes, every failure retried (on a FakeClock), the relay logging
why it registers nothing."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, cast

import grpc
import pytest
from structlog.testing import capture_logs

from globaldiscovery.v1 import discovery_pb2 as dpb
from globaldiscovery.v1 import discovery_pb2_grpc as dpb_grpc
from meshkit.clock import FakeClock
from poolrelay.cli import main
from poolrelay.heartbeat import HeartbeatLoop, Renewal
from poolrelay.lease_stream import KeepAliveClient, StreamBroken
from poolrelay.model_choice import Reason
from poolrelay.relay import Relay, RelayConfig, RelayConfigError
from poolrelay.retry import describe_error
from poolrelay.v1 import pool_events_pb2_grpc as pe_grpc
from tests.relay.fakes import FakeDiscovery, FakePool, start_server, wait_for

GOOD_CONFIG = RelayConfig(
    pool="127.0.0.1:1",
    discovery="127.0.0.1:2",
    pool_id="pool-a",
    region="eu",
    frontends=("http://127.0.0.1:9000",),
    relay_id="relay-1",
    incarnation=7,
)


def rpc_error(code: grpc.StatusCode, details: str = "x") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


# --- the config checks run in code, not only on the command line ------------------------------


@pytest.mark.parametrize(
    ("field", "override"),
    [
        ("pool_id", {"pool_id": ""}),
        ("pool_id", {"pool_id": " padded"}),
        ("region", {"region": ""}),
        ("region", {"region": None}),
        ("frontends[0]", {"frontends": ("tcp://x:1",)}),
        ("frontends[1]", {"frontends": ("http://a:1", "http://a:1")}),
        ("relay_id", {"relay_id": ""}),
        ("incarnation", {"incarnation": 0}),
        ("global_frontends[0]", {"global_frontends": ("ftp://x:1",)}),
        ("report_interval", {"report_interval": 0.0}),
    ],
)
def test_a_relay_built_in_code_refuses_what_the_command_line_refuses(field, override):
    with pytest.raises(RelayConfigError) as info:
        replace(GOOD_CONFIG, **override)
    assert field in [f for f, _ in info.value.violations.items]
    assert field in str(info.value)


def test_frontends_are_optional_in_the_config():
    assert replace(GOOD_CONFIG, frontends=()).frontends == ()


def run_cli(capsys, argv: list[str]) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert isinstance(exc.value.code, int)
    return exc.value.code, capsys.readouterr().err


BASE = ["serve", "--pool", "127.0.0.1:1", "--discovery", "127.0.0.1:2"]


def test_empty_routing_pool_is_refused_like_a_missing_region(capsys):
    code, err = run_cli(capsys, [*BASE, "--routing-pool", "", "--routing-pool-region", "r"])
    assert code == 2 and "--routing-pool" in err and "empty" in err
    code, err = run_cli(capsys, [*BASE, "--routing-pool", "p", "--routing-pool-region", ""])
    assert code == 2 and "--routing-pool requires --routing-pool-region" in err


def test_config_errors_on_the_command_line_name_the_flag(capsys):
    code, err = run_cli(capsys, [*BASE, "--routing-pool", " p", "--routing-pool-region", "r"])
    assert code == 2 and "--routing-pool: must not start or end with white space" in err


def test_routing_pool_frontends_flag_is_optional():
    from poolrelay.cli import build_parser, config_from_args

    parser = build_parser()
    args = parser.parse_args([*BASE, "--routing-pool", "p", "--routing-pool-region", "r"])
    config = config_from_args(parser, args)
    assert config.frontends == () and config.unregister_on_exit is False
    args = parser.parse_args(
        [*BASE, "--routing-pool", "p", "--routing-pool-region", "r", "--unregister-on-exit"]
    )
    assert config_from_args(parser, args).unregister_on_exit is True


# --- a failed call's reason carries its chain of causes ----------------------------------------


def test_describe_error_follows_the_chain_of_causes():
    root = rpc_error(grpc.StatusCode.UNAVAILABLE, "connection refused")
    try:
        try:
            raise root
        except grpc.aio.AioRpcError as exc:
            raise StreamBroken("the KeepAlivePools stream ended") from exc
    except StreamBroken as outer:
        text = describe_error(outer)
    assert text == "StreamBroken: the KeepAlivePools stream ended <- UNAVAILABLE: connection refused"


def test_describe_error_is_bounded_and_survives_cycles():
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert describe_error(a) == "ValueError: a <- ValueError: b"
    assert describe_error(KeyError()) == "KeyError"


# --- every failure is retried, the permanent codes and UNIMPLEMENTED included -------------------


class _Unimplemented:
    """A KeepAlivePools call on a discovery without the RPC: the first read fails UNIMPLEMENTED."""

    async def read(self):
        raise rpc_error(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")

    async def write(self, message):
        return None

    def cancel(self) -> None:
        return None


class ScriptedDiscovery:
    """A DiscoveryService stub whose unary RegisterPool fails with `code` while `failing`."""

    def __init__(self, clock: FakeClock, code: grpc.StatusCode) -> None:
        self.clock = clock
        self.code = code
        self.failing = True
        self.calls: list[float] = []

    def KeepAlivePools(self):
        return _Unimplemented()

    async def RegisterPool(self, request, timeout=None):  # noqa: ASYNC109 (the stub's signature)
        self.calls.append(self.clock.monotonic())
        if self.failing:
            raise rpc_error(self.code, f"told to fail with {self.code.name}")
        return dpb.RegisterPoolResponse(heartbeat_interval={"seconds": 5}, lease_duration={"seconds": 15})


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNAVAILABLE,
    ],
)
async def test_every_failure_is_retried_on_the_schedule(fake_clock, code):
    stub = ScriptedDiscovery(fake_clock, code)
    client = KeepAliveClient(cast(Any, stub), unary_timeout=3.0)
    request = dpb.RegisterPoolRequest(pool_id="p")
    errors: list[str] = []

    async def register(_want: str) -> Renewal:
        reply = await client.register(request, 2.0)
        return Renewal(reply.heartbeat_interval.seconds, reply.lease_duration.seconds)

    loop = HeartbeatLoop(
        fake_clock, lambda: "m", register, on_failure=lambda _w, exc: errors.append(describe_error(exc))
    )
    task = asyncio.get_running_loop().create_task(loop.run())
    start = fake_clock.monotonic()
    await fake_clock.advance(20)
    times = [t - start for t in stub.calls]
    # Retried after 1 s, the wait doubling up to the (default) 5 s interval: never given up.
    assert times == [0, 1, 3, 7, 12, 17], f"{code.name}: {times}"
    assert all(code.name in e for e in errors)
    stub.failing = False
    await fake_clock.advance(5)
    assert len(stub.calls) == 7 and loop.schedule.lease_end is not None, "the next success renews"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# --- the relay logs why it registers nothing ---------------------------------------------------


@pytest.mark.timeout(30)
async def test_relay_logs_why_it_registers_nothing_and_a_pool_without_frontends_registers():
    pool, disco = FakePool({"a": True, "b": True}), FakeDiscovery()
    pool_server, pool_addr = await start_server((pe_grpc.add_PoolEventsServiceServicer_to_server, pool))
    disco_server, disco_addr = await start_server((dpb_grpc.add_DiscoveryServiceServicer_to_server, disco))
    relay = Relay(replace(GOOD_CONFIG, pool=pool_addr, discovery=disco_addr, frontends=()))
    try:
        with capture_logs() as logs:
            await relay.start()
            await wait_for(lambda: relay.unregistered[0] == Reason.SEVERAL_MODELS)
            pool.models = {}
            pool.changed()
            await wait_for(lambda: relay.unregistered[0] == Reason.NO_MODEL and relay.status.models == [])
        said = [(e["reason"], e["detail"]) for e in logs if e["event"] == "registering nothing"]
        assert said == [
            ("SEVERAL_MODELS", "several models are Ready: a, b"),
            ("NO_MODEL", "the pool's topology has no model"),
        ], "each reason logged once, with its sentence"
        pool.models = {"a": True}
        pool.changed()
        await wait_for(lambda: disco.registers, message="registered")
        assert list(disco.registers[0].frontends) == [], "a pool with no frontends still registers"
    finally:
        await relay.stop()
        await pool_server.stop(0)
        await disco_server.stop(0)
