"""Tenant budgets: window arithmetic and chunk accounting on a fake clock, over the memory store and a real etcd."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from globalrouter.budgets import (
    BudgetExceeded,
    BudgetLedger,
    Kind,
    MemoryStore,
    StoreError,
    TenantBudgets,
    window_at,
)
from globalrouter.policy import BudgetSettings, TenantPolicy
from meshkit.clock import FakeClock

SETTINGS = BudgetSettings(minute_seconds=10.0, day_seconds=100.0, chunk_fraction=0.1)
TPM = TenantPolicy(name="client/a", tokens_per_minute=10_000)


def clock_at_window_start() -> FakeClock:
    # wall = monotonic + offset; start at a window boundary of both 10 s and 100 s.
    return FakeClock(start=0.0, wall_offset=1_700_000_000.0)


def test_windows_are_aligned_to_the_wall_clock():
    assert window_at(1_700_000_000.0, 10.0) == (170_000_000, 1_700_000_010.0)
    assert window_at(1_700_000_009.999, 10.0)[0] == 170_000_000
    assert window_at(1_700_000_010.0, 10.0)[0] == 170_000_001


def test_the_ledger_asks_whole_chunks_covering_the_shortfall():
    ledger = BudgetLedger(SETTINGS)
    now = 1_700_000_000.0
    assert ledger.ask("t", Kind.TOKENS_PER_MINUTE, 10_000, 300, now) == 1000
    held = ledger.allowance("t", Kind.TOKENS_PER_MINUTE, now)
    ledger.granted("t", Kind.TOKENS_PER_MINUTE, held.window, 1000, 1000)
    assert ledger.ask("t", Kind.TOKENS_PER_MINUTE, 10_000, 300, now) == 0
    assert ledger.ask("t", Kind.TOKENS_PER_MINUTE, 10_000, 2500, now) == 2000  # shortfall 1500 -> 2 chunks
    # A grant for a window that is over is dropped, and a new window starts empty.
    later = now + 10.0
    assert ledger.allowance("t", Kind.TOKENS_PER_MINUTE, later).available == 0
    ledger.granted("t", Kind.TOKENS_PER_MINUTE, held.window, 1000, 2000)
    assert ledger.allowance("t", Kind.TOKENS_PER_MINUTE, later).available == 0


async def test_one_frontend_admits_up_to_the_limit_then_refuses_until_the_window_resets():
    clock = clock_at_window_start()
    budgets = TenantBudgets(MemoryStore(clock), SETTINGS, clock)
    served = 0
    with pytest.raises(BudgetExceeded) as caught:
        for _ in range(100):
            ticket = await budgets.admit("client/a", TPM, 300)
            ticket.settle(300)
            served += 300
    assert served == 9900  # 33 requests of 300; the 34th would pass 10,000
    refusal = caught.value.exceeded
    assert (refusal.kind, refusal.limit, refusal.remaining) == (Kind.TOKENS_PER_MINUTE, 10_000, 100)
    assert refusal.reset_seconds == pytest.approx(10.0)
    await clock.advance(4.0)
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.admit("client/a", TPM, 300)
    assert caught.value.exceeded.reset_seconds == pytest.approx(6.0)
    await clock.advance(6.0)
    ticket = await budgets.admit("client/a", TPM, 300)
    assert ticket.quotas[0].remaining == 9700


async def test_unused_output_tokens_are_refunded_to_the_frontend_allowance():
    clock = clock_at_window_start()
    store = MemoryStore(clock)
    budgets = TenantBudgets(store, SETTINGS, clock)
    for _ in range(50):  # each reserves 1000 (prompt + max_tokens) and uses 100
        (await budgets.admit("client/a", TPM, 1000)).settle(100)
    # Reserved from the store: what the spent tokens needed (5000) plus room for the next
    # request's max_tokens, one chunk at a time, not 50 x 1000.
    assert next(iter(store.counters.values()))[0] == 6000
    ticket = await budgets.admit("client/a", TPM, 1000)
    ticket.settle(1000)
    ticket.settle(0)  # idempotent: a second settle refunds nothing
    assert budgets.ledger.allowance("client/a", Kind.TOKENS_PER_MINUTE, clock.wall()).available == 0


async def test_requests_per_minute_and_tokens_per_day_both_hold():
    clock = clock_at_window_start()
    budgets = TenantBudgets(MemoryStore(clock), SETTINGS, clock)
    policy = TenantPolicy(name="client/a", requests_per_minute=3, tokens_per_day=1000)
    for _ in range(3):
        await budgets.admit("client/a", policy, 10)
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.admit("client/a", policy, 10)
    assert caught.value.exceeded.kind is Kind.REQUESTS_PER_MINUTE
    await clock.advance(10.0)
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.admit("client/a", policy, 971)  # 30 of 1000 spent today
    assert caught.value.exceeded.kind is Kind.TOKENS_PER_DAY and caught.value.exceeded.remaining == 970
    await budgets.admit("client/a", policy, 970)


async def test_unlimited_tenants_never_touch_the_store():
    class Broken(MemoryStore):
        async def reserve(self, *a):
            raise AssertionError("no limit: no reservation")

    clock = clock_at_window_start()
    budgets = TenantBudgets(Broken(clock), SETTINGS, clock)
    ticket = await budgets.admit("client/a", TenantPolicy(), 10**9)
    ticket.settle(0)


async def test_a_failing_store_refuses_with_store_error():
    class Down(MemoryStore):
        async def reserve(self, *a):
            raise OSError("connection refused")

    clock = clock_at_window_start()
    budgets = TenantBudgets(Down(clock), SETTINGS, clock)
    with pytest.raises(StoreError, match="connection refused"):
        await budgets.admit("client/a", TPM, 10)


async def test_frontends_sharing_a_store_never_admit_past_the_limit_and_a_restart_loses_nothing():
    clock = clock_at_window_start()
    store = MemoryStore(clock)
    fleet = [TenantBudgets(store, SETTINGS, clock) for _ in range(3)]
    admitted = 0
    for i in range(200):
        try:
            (await fleet[i % 3].admit("client/a", TPM, 70)).settle(70)
            admitted += 70
        except BudgetExceeded:
            pass
        if i == 60:  # one frontend restarts: gives back what it holds, and a new one starts empty
            await fleet[0].close()
            fleet[0] = TenantBudgets(store, SETTINGS, clock)
    assert 10_000 - 3 * 1000 <= admitted <= 10_000


async def test_closing_gives_the_unused_allowance_back():
    clock = clock_at_window_start()
    store = MemoryStore(clock)
    budgets = TenantBudgets(store, SETTINGS, clock)
    (await budgets.admit("client/a", TPM, 100)).settle(100)
    assert next(iter(store.counters.values()))[0] == 1000
    await budgets.close()
    assert next(iter(store.counters.values()))[0] == 100


# ---- etcd -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd_endpoint():
    from tests.discovery.etcd_support import running_etcd

    with running_etcd() as address:
        yield address


async def test_etcd_frontends_racing_for_one_budget_never_pass_it(etcd_endpoint):
    from globalrouter.budget_etcd import EtcdBudgetStore

    clock = clock_at_window_start()
    tenant = f"client/{uuid.uuid4().hex[:8]}"
    stores = [EtcdBudgetStore(etcd_endpoint, clock) for _ in range(3)]
    fleet = [TenantBudgets(s, SETTINGS, clock) for s in stores]
    admitted = 0

    async def client(budgets: TenantBudgets) -> None:
        nonlocal admitted
        for _ in range(60):
            try:
                (await budgets.admit(tenant, TPM, 90)).settle(90)
                admitted += 90
            except BudgetExceeded:
                pass

    await asyncio.gather(*(client(b) for b in fleet for _ in range(2)))
    key = fleet[0].ledger.allowance(tenant, Kind.TOKENS_PER_MINUTE, clock.wall()).key
    assert await stores[0].counter(key) == 10_000  # reserved exactly up to the limit, never past
    assert 10_000 - 3 * 1000 <= admitted <= 10_000
    # A frontend that restarts finds the counter where it was: nothing more to reserve.
    await fleet[0].close()
    again = TenantBudgets(EtcdBudgetStore(etcd_endpoint, clock), SETTINGS, clock)
    before = await stores[1].counter(key)
    with pytest.raises(BudgetExceeded):
        for _ in range(20):
            (await again.admit(tenant, TPM, 900)).settle(900)
    assert await stores[1].counter(key) == 10_000
    assert before <= 10_000
    for b in (*fleet[1:], again):
        await b.close()


async def test_etcd_give_back_returns_a_stopping_frontends_unused_chunk(etcd_endpoint):
    from globalrouter.budget_etcd import EtcdBudgetStore

    clock = clock_at_window_start()
    tenant = f"client/{uuid.uuid4().hex[:8]}"
    store = EtcdBudgetStore(etcd_endpoint, clock)
    budgets = TenantBudgets(store, SETTINGS, clock)
    (await budgets.admit(tenant, TPM, 150)).settle(120)  # reserves one chunk, uses 120
    key = budgets.ledger.allowance(tenant, Kind.TOKENS_PER_MINUTE, clock.wall()).key
    assert await store.counter(key) == 1000
    reader = EtcdBudgetStore(etcd_endpoint, clock)
    await budgets.close()  # gives back 880
    assert await reader.counter(key) == 120
    await reader.close()


# ---- the gate both fronts share ---------------------------------------------------------------


def _gate(text: str, clock: FakeClock):
    from globalrouter.metrics import RouterMetrics
    from globalrouter.policy import PolicyFile, parse
    from globalrouter.tenancy import TenantGate

    held = PolicyFile(None)
    held.current = parse(text)
    return TenantGate(held, TenantBudgets(MemoryStore(clock), held.current.budget, clock), RouterMetrics())


GATE_POLICY = """
[budget]
minute_seconds = 10
[identity."client/alice"]
tokens_per_minute = 1000
requests_per_minute = 100
models = ["llama"]
regions = ["eu"]
"""


def _sample(gate, name: str, labels: dict[str, str]) -> float:
    return gate.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_the_gate_refuses_a_model_the_policy_does_not_allow():
    import grpc

    from globalrouter.tenancy import TenantRefusal
    from meshkit.identity import Identity, Role

    gate = _gate(GATE_POLICY, clock_at_window_start())
    alice = Identity(Role.CLIENT, "alice")
    with pytest.raises(TenantRefusal) as caught:
        await gate.admit(alice, "mistral", 10, 10)
    assert (
        caught.value.code is grpc.StatusCode.PERMISSION_DENIED and caught.value.reason == "MODEL_NOT_ALLOWED"
    )
    assert "mistral" in caught.value.message
    admission = await gate.admit(alice, "llama", 10, 10)
    assert admission.regions == frozenset({"eu"}) and admission.tenant == "client/alice"
    # Strangers get the default (no limits, any model) and the "other" label.
    stranger = await gate.admit(Identity(Role.CLIENT, "zed"), "mistral", 10**6, 10**6)
    assert stranger.label == "other" and stranger.headers() == []
    filtered = "globalrouter_tenant_filter_refusals_total"
    assert _sample(gate, filtered, {"tenant": "client/alice", "reason": "MODEL_NOT_ALLOWED"}) == 1


async def test_a_budget_refusal_carries_quota_failure_retry_info_and_openai_headers():
    import grpc
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    from globalrouter.tenancy import TenantRefusal, grpc_status
    from meshkit.identity import Identity, Role

    clock = clock_at_window_start()
    gate = _gate(GATE_POLICY, clock)
    alice = Identity(Role.CLIENT, "alice")
    first = await gate.admit(alice, "llama", 100, 500)
    headers = dict(first.headers())
    assert headers["x-ratelimit-limit-tokens"] == "1000" and headers["x-ratelimit-reset-tokens"] == "10s"
    assert headers["x-ratelimit-limit-requests"] == "100"
    first.finish(150)  # 450 of the 600 reserved come back
    first.finish(150)  # counted once
    assert _sample(gate, "globalrouter_tenant_tokens_total", {"tenant": "client/alice"}) == 150
    await clock.advance(2.5)
    with pytest.raises(TenantRefusal) as caught:
        await gate.admit(alice, "llama", 100, 800)  # 900 > 850 left
    refusal = caught.value
    assert refusal.code is grpc.StatusCode.RESOURCE_EXHAUSTED and refusal.reason == "BUDGET_EXCEEDED"
    assert refusal.http_type == "tokens"
    headers = dict(refusal.headers)
    assert headers["retry-after"] == "8" and headers["x-ratelimit-remaining-tokens"] == "850"
    assert headers["x-ratelimit-reset-tokens"] == "8s"
    built = grpc_status(refusal)
    decoded = rpc_status.from_call(_FakeCall(built))  # type: ignore[arg-type]
    kinds = {}
    for detail in decoded.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.QuotaFailure, error_details_pb2.RetryInfo):
            msg = cls()
            if detail.Unpack(msg):
                kinds[cls.__name__] = msg
    assert kinds["ErrorInfo"].reason == "BUDGET_EXCEEDED"
    assert kinds["QuotaFailure"].violations[0].subject == "tenant:client/alice"
    assert kinds["RetryInfo"].retry_delay.seconds == 8
    refused = "globalrouter_tenant_budget_refusals_total"
    assert _sample(gate, refused, {"tenant": "client/alice", "limit": "tokens_per_minute"}) == 1


class _FakeCall:
    """Enough of a grpc call for rpc_status.from_call: the trailers a status travels in."""

    def __init__(self, status) -> None:
        self._status = status

    def trailing_metadata(self):
        return self._status.trailing_metadata

    def code(self):
        return self._status.code

    def details(self):
        return self._status.details


def test_reset_text_writes_durations_as_openai_does():
    from globalrouter.tenancy import reset_text

    assert [reset_text(s) for s in (0.25, 7.0, 6.2, 90.0, 7200.0)] == ["250ms", "7s", "7s", "1m30s", "2h0m0s"]


async def test_a_request_larger_than_the_limit_is_refused_without_reserving():
    clock = clock_at_window_start()
    store = MemoryStore(clock)
    budgets = TenantBudgets(store, SETTINGS, clock)
    with pytest.raises(BudgetExceeded) as caught:
        await budgets.admit("client/a", TPM, 10_001)
    assert caught.value.exceeded.too_large and caught.value.exceeded.remaining == 10_000
    assert store.counters == {}


async def test_a_refused_request_keeps_at_most_one_chunk_of_what_it_reserved():
    clock = clock_at_window_start()
    store = MemoryStore(clock)
    one, other = TenantBudgets(store, SETTINGS, clock), TenantBudgets(store, SETTINGS, clock)
    (await other.admit("client/a", TPM, 4_500)).settle(4_500)  # other holds 5,000, spent 4,500
    # 6,000 does not fit the 5,000 left: `one` got those 5,000, keeps one chunk, gives 4,000 back.
    with pytest.raises(BudgetExceeded):
        await one.admit("client/a", TPM, 6_000)
    key = one.ledger.allowance("client/a", Kind.TOKENS_PER_MINUTE, clock.wall()).key
    assert store.counters[key][0] == 6_000
    assert one.ledger.allowance("client/a", Kind.TOKENS_PER_MINUTE, clock.wall()).available == 1_000
    # What went back serves the other frontend this window.
    (await other.admit("client/a", TPM, 3_000)).settle(3_000)


async def test_allowances_of_past_windows_are_dropped_past_the_bound(monkeypatch):
    from globalrouter import budgets as module

    monkeypatch.setattr(module, "MAX_ALLOWANCES", 10)
    clock = clock_at_window_start()
    budgets = TenantBudgets(MemoryStore(clock), SETTINGS, clock)
    for i in range(20):
        await budgets.admit(f"client/t{i}", TPM, 10)
    await clock.advance(10.0)
    await budgets.admit("client/late", TPM, 10)
    assert budgets.ledger.size <= 2


async def test_the_request_path_refunds_a_request_no_pool_takes():
    from globalrouter.kv_index import KvIndex
    from globalrouter.migration import GenerateError
    from globalrouter.pool_directory import PoolTable
    from globalrouter.request_path import RequestPath
    from globalrouter.routing import RoutingCore
    from globalrouter.selection import Selector
    from globalrouter.stall import StallPolicy
    from globalrouter.tenancy import TenantRefusal
    from meshkit.identity import Identity, Role

    clock = clock_at_window_start()
    gate = _gate(GATE_POLICY, clock)
    core = RoutingCore(PoolTable(), KvIndex(), Selector(), clock, gate.metrics)
    path = RequestPath(core, None, migration_limit=1, admission_tries=1, stall=StallPolicy(), gate=gate)  # type: ignore[arg-type]
    alice = Identity(Role.CLIENT, "alice")
    for _ in range(5):  # 5 x 300 reserved would pass the 1,000 limit if nothing came back
        with pytest.raises(GenerateError) as caught:
            await path.start(
                request_id="r", model="llama", prompt=list(range(100)), max_tokens=200, identity=alice
            )
        assert caught.value.reason == "NO_POOL_FOR_MODEL"
    held = gate.budgets.ledger.allowance("client/alice", Kind.TOKENS_PER_MINUTE, clock.wall())
    assert held.available == held.counter == 300  # one reservation, given back each time
    with pytest.raises(TenantRefusal):  # the gate comes first: no decision for a refused model
        await path.start(request_id="r", model="mistral", prompt=[1], max_tokens=1, identity=alice)
