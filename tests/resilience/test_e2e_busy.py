"""A busy pool is not a broken one, with real processes: one client's burst fills every pool's run
slots and queues, its queued requests wait their turn past the first-token timeout without failing,
no serving link backs off, and another client's small request is served meanwhile (issue 18)."""

from __future__ import annotations

import asyncio
import signal
import time
from dataclasses import dataclass

import grpc
import pytest

from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit.errors import reason_of
from meshlaunch import MODEL, Mesh
from mocker.tokens import continue_sequence

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
BURST = 64
TOKENS = 300
FIRST_TOKEN_TIMEOUT = 1.0
# Two pools of 2 workers x 2 run slots, queues that hold the whole burst (so no pool refuses any of
# it, however the frontend spreads it): 8 requests run at once,
# each 300 tokens at 300 tokens/s (about 1 s), so the last of the 64 waits about 7 s for its turn,
# several times the first-token timeout.
POOL_FLAGS = (
    "--speedup",
    "1",
    "--workers",
    "2",
    "--max-running-per-worker",
    "2",
    "--max-queue",
    "64",
    "--decode-tokens-per-second",
    "300",
)
CALL_TIMEOUT = 60.0


@dataclass
class Outcome:
    """One request's result as its client saw it."""

    sent_at: float
    tokens: list[int]
    first_token_at: float | None = None
    ended_at: float = 0.0
    summary: router_pb2.GenerateSummary | None = None
    error: str | None = None


def prompt(i: int) -> list[int]:
    return [(7919 * i + 31 * k + 11) % 30_000 for k in range(40)]


async def generate(
    stub: router_pb2_grpc.RouterServiceAsyncStub,
    tokens: list[int],
    max_tokens: int,
    out: Outcome | None = None,
) -> Outcome:
    """Runs one Generate; `out` (filled as the stream goes) lets a caller watch it."""
    out = out or Outcome(time.monotonic(), [])
    request = router_pb2.GenerateRequest(
        model=MODEL,
        prompt=router_pb2.Prompt(token_ids=router_pb2.TokenIds(ids=tokens)),
        max_tokens=max_tokens,
    )
    try:
        async for msg in stub.Generate(request, timeout=CALL_TIMEOUT):
            if msg.WhichOneof("payload") == "tokens":
                if out.first_token_at is None:
                    out.first_token_at = time.monotonic()
                out.tokens.extend(msg.tokens.token_ids)
            else:
                out.summary = msg.summary
    except grpc.aio.AioRpcError as exc:
        out.error = f"{exc.code().name} {reason_of(exc)}: {exc.details()}"
    out.ended_at = time.monotonic()
    return out


async def burst_then_other_client(address: str) -> tuple[list[Outcome], Outcome, int, Outcome]:
    """The burst from one client; once queued requests have waited past the first-token timeout,
    a small request from another client (its own channel); then one more after the burst.
    Returns (burst, small request during it, burst requests still without a token then, after)."""
    # Distinct channel arguments: the other client gets its own connection, not the burst's.
    async with (
        grpc.aio.insecure_channel(address) as burst_channel,
        grpc.aio.insecure_channel(address, options=[("grpc.primary_user_agent", "other-client")]) as other,
    ):
        burst_stub: router_pb2_grpc.RouterServiceAsyncStub = router_pb2_grpc.RouterServiceStub(burst_channel)
        other_stub: router_pb2_grpc.RouterServiceAsyncStub = router_pb2_grpc.RouterServiceStub(other)
        started = time.monotonic()
        tasks = [asyncio.ensure_future(generate(burst_stub, prompt(i), TOKENS)) for i in range(BURST)]
        # Wait (on the clients' own view, robust to a slow machine) until the first tokens flow and
        # the queue wait has run past the timeout.
        deadline = started + 30.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if all(t.done() for t in tasks):
                break
            if time.monotonic() - started > 2.5 * FIRST_TOKEN_TIMEOUT:
                break
        waiting = sum(1 for t in tasks if not t.done())
        during = await generate(other_stub, prompt(1000), 4)
        burst = list(await asyncio.gather(*tasks))
        after = await generate(other_stub, prompt(1001), 4)
        return burst, during, waiting, after


@pytest.mark.parametrize(
    "report_interval",
    [
        pytest.param("0.5", id="queue-reports"),
        # One report as the request joins the line, then none: the frontend goes by the pools'
        # load reports (full, requests waiting), as for a pool that cannot say it queued a request.
        pytest.param("3600", id="load-reports"),
    ],
)
def test_a_burst_that_fills_every_pool_queues_without_stalling_and_others_are_still_served(
    procs, report_interval
):
    mesh = Mesh(procs)
    mesh.start_discovery()
    for name in ("pool-a", "pool-b"):
        mesh.start_pool(name, "eu", *POOL_FLAGS, "--queue-report-interval", report_interval)
    router = mesh.start_router("--first-token-timeout", str(FIRST_TOKEN_TIMEOUT))
    mesh.wait_routable(router, mesh.pools)

    burst, during, waiting, after = asyncio.run(burst_then_other_client(router.address))

    failed = [f"request {i}: {o.error}" for i, o in enumerate(burst) if o.error]
    assert not failed, f"{len(failed)} of the burst failed on a busy pool: {failed[:5]}"
    for i, out in enumerate(burst):
        assert out.tokens == continue_sequence(prompt(i), TOKENS), f"request {i}: tokens lost or repeated"
        assert out.summary is not None and not out.summary.refused_by, f"request {i}: {out.summary}"
    longest = max(o.first_token_at - o.sent_at for o in burst if o.first_token_at is not None)
    assert longest > 2 * FIRST_TOKEN_TIMEOUT, (
        f"the longest first-token wait was {longest:.1f} s: the burst never queued past the timeout"
    )
    assert waiting > 0, "the other client's request came after the burst, not during it"
    assert during.error is None and len(during.tokens) == 4, (
        f"another client during the burst: {during.error}"
    )
    assert after.error is None and len(after.tokens) == 4, f"another client after the burst: {after.error}"
    for pool_id in mesh.pools:
        assert router.metric("globalrouter_refusals_total", pool=pool_id, code="DEADLINE_EXCEEDED") == 0
    assert "serving link failed" not in router.proc.output(), "a busy pool's link was backed off"
    print(
        f"burst of {BURST} x {TOKENS} tokens: longest first-token wait {longest:.1f} s "
        f"(timeout {FIRST_TOKEN_TIMEOUT} s); another client's request sent while {waiting} waited "
        f"was served in {during.ended_at - during.sent_at:.1f} s"
    )


def test_a_request_waiting_its_turn_at_a_pool_that_is_then_stopped_moves_on_and_the_pool_backs_off(procs):
    """Silence is still a stall: a request queued at a pool that is then stopped (SIGSTOP: no more
    queue reports, and its load goes stale once its relay notices) goes to another pool."""
    mesh = Mesh(procs)
    mesh.start_discovery()
    one_slot = (
        "--speedup",
        "1",
        "--workers",
        "1",
        "--max-running-per-worker",
        "1",
        "--queue-report-interval",
        "0.5",
    )
    mesh.start_pool("pool-a", "eu", *one_slot)
    router = mesh.start_router("--first-token-timeout", str(FIRST_TOKEN_TIMEOUT), "--stall-timeout", "2")
    mesh.wait_routable(router, ["pool-a"])
    stopped = mesh.pools["pool-a"].pool

    async def scenario() -> tuple[Outcome, float]:
        loop = asyncio.get_running_loop()
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub: router_pb2_grpc.RouterServiceAsyncStub = router_pb2_grpc.RouterServiceStub(channel)
            holding = Outcome(time.monotonic(), [])
            holder = asyncio.ensure_future(generate(stub, prompt(1), 5_000, holding))  # pool-a's one slot
            while holding.first_token_at is None:
                assert not holder.done(), holding.error
                await asyncio.sleep(0.05)
            queued = asyncio.ensure_future(generate(stub, prompt(2), 5))
            await asyncio.sleep(3 * FIRST_TOKEN_TIMEOUT)
            assert not queued.done(), "waiting its turn at a busy pool is not a failure"
            # Another pool joins; then pool-a stops.
            await loop.run_in_executor(None, lambda: mesh.start_pool("pool-b", "eu", "--speedup", "1"))
            await loop.run_in_executor(None, lambda: mesh.wait_routable(router, ["pool-a", "pool-b"]))
            assert not queued.done()
            stopped.signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            out = await asyncio.wait_for(queued, 40)
            holder.cancel()
            return out, out.ended_at - stopped_at

    try:
        queued, moved_after = asyncio.run(scenario())
    finally:
        stopped.signal(signal.SIGCONT)
    assert queued.error is None and queued.tokens == continue_sequence(prompt(2), 5), queued.error
    assert queued.summary is not None and list(queued.summary.pools) == ["pool-b"]
    assert list(queued.summary.refused_by) == ["pool-a"]
    assert router.metric("globalrouter_refusals_total", pool="pool-a", code="DEADLINE_EXCEEDED") == 1
    assert "serving link failed" in router.proc.output(), "a stopped pool's link backs off"
    # Its queue reports stop at once; its load goes stale once the relay notices (a few seconds).
    assert moved_after < 20.0, f"the request sat {moved_after:.1f} s on a stopped pool"
    print(f"a request queued at a stopped pool moved on {moved_after:.1f} s after the stop")
