"""The request path's spans, in-process against fake pools and a real OTLP receiver: refusals are
admission spans of their own, a request no pool serves ends its span with its outcome."""

from __future__ import annotations

import secrets

import grpc
import pytest

from meshkit import tracing
from meshkit.errors import Reason
from meshkit.tracing import TracingConfig
from tests.router.fakes import gen_request, pool_msg, start_fake_pool, start_router
from tests.tracing.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.timeout(60)
PROMPT = list(range(100, 164))


@pytest.fixture
async def traced(monkeypatch):
    """A router with three fake pools p1..p3, tracing on to a real receiver."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    receiver = OtlpReceiver()
    tracing.setup("globalrouter", TracingConfig(otlp_endpoint=receiver.endpoint))
    router, stub, channel = await start_router(migration_limit=2, admission_tries=3)
    pools, servers = {}, []
    for name in ("p1", "p2", "p3"):
        fake, server, url = await start_fake_pool()
        pools[name] = fake
        servers.append(server)
        router.core.table.apply_listed(pool_msg(name, url))
    try:
        yield router, stub, pools, receiver
    finally:
        await channel.close()
        await router.handle.server.stop(0)
        for server in servers:
            await server.stop(0)
        tracing.shutdown()
        receiver.stop()


def traced_call(trace_id: str) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id}-{secrets.token_hex(8)}-01"),)


def of(receiver: OtlpReceiver, trace_id: str) -> list[ReceivedSpan]:
    tracing.shutdown()  # flushes every span ended so far
    return [s for s in receiver.spans() if s.trace_id == trace_id]


async def test_each_admission_attempt_is_a_span_with_its_refusal(traced):
    router, stub, pools, receiver = traced
    ranked = [c.pool_id for c in router.core.decide("m", PROMPT, 8).candidates]
    pools[ranked[0]].behaviour.refuse = grpc.StatusCode.RESOURCE_EXHAUSTED
    pools[ranked[0]].behaviour.refuse_reason = Reason.QUEUE_FULL
    trace_id = secrets.token_hex(16)
    tokens = []
    async for msg in stub.Generate(gen_request(PROMPT, 5), metadata=traced_call(trace_id), timeout=20):
        if msg.WhichOneof("payload") == "tokens":
            tokens.extend(msg.tokens.token_ids)
    assert len(tokens) == 5
    spans = of(receiver, trace_id)
    attempts = [s for s in spans if s.name == "globalrouter.admission"]
    assert [a.attributes["pool.id"] for a in attempts] == ranked[:2]
    refused, admitted = attempts
    assert refused.error and refused.attributes["admission.refused"] is True
    assert refused.attributes["admission.code"] == "RESOURCE_EXHAUSTED"
    assert refused.attributes["admission.reason"] == str(Reason.QUEUE_FULL)
    assert not admitted.error and admitted.attributes["admission.code"] == "OK"
    decide = next(s for s in spans if s.name == "globalrouter.decide")
    assert decide.attributes["decision.chosen_pool"] == ranked[0]


async def test_a_request_no_pool_serves_ends_its_span_with_the_outcome(traced):
    _router, stub, _pools, receiver = traced
    trace_id = secrets.token_hex(16)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.Generate(
            gen_request(PROMPT, 5, model="nobody-serves-this"), metadata=traced_call(trace_id), timeout=20
        ):
            pass
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    spans = of(receiver, trace_id)
    request = next(s for s in spans if s.name == "globalrouter.request")
    assert request.error and request.attributes["request.outcome"] == "NOT_FOUND"
    decide = next(s for s in spans if s.name == "globalrouter.decide")
    assert decide.attributes["decision.pools_considered"] == []
    assert sorted(decide.attributes["decision.pools_filtered"]) == [
        "p1: OTHER_MODEL",
        "p2: OTHER_MODEL",
        "p3: OTHER_MODEL",
    ]
    assert not any(s.name == "globalrouter.admission" for s in spans)


async def test_a_tenant_refusal_ends_the_request_span_before_any_decision(traced):
    from globalrouter.budgets import MemoryStore, TenantBudgets
    from globalrouter.metrics import RouterMetrics
    from globalrouter.policy import PolicyFile, parse
    from globalrouter.request_path import RequestPath
    from globalrouter.stall import StallPolicy
    from globalrouter.tenancy import TenantGate, TenantRefusal
    from meshkit.clock import FakeClock
    from meshkit.identity import Identity, Role

    router, _stub, _pools, receiver = traced
    held = PolicyFile(None)
    held.current = parse('[identity."client/alice"]\nmodels = ["llama"]\n')
    clock = FakeClock()
    gate = TenantGate(held, TenantBudgets(MemoryStore(clock), held.current.budget, clock), RouterMetrics())
    path = RequestPath(
        router.core, router.links, migration_limit=1, admission_tries=1, stall=StallPolicy(), gate=gate
    )
    trace_id = secrets.token_hex(16)
    with pytest.raises(TenantRefusal):
        await path.start(
            request_id="r1",
            model="m",
            prompt=PROMPT,
            max_tokens=4,
            identity=Identity(Role.CLIENT, "alice"),
            trace_context=tracing.extract_metadata(traced_call(trace_id)),
        )
    spans = of(receiver, trace_id)
    assert [s.name for s in spans] == ["globalrouter.request"]
    assert spans[0].error and spans[0].attributes["request.outcome"] == "PERMISSION_DENIED"
