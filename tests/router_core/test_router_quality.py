"""Router-quality telemetry (issue 19 item 5), on a fake clock: per admission, the cached prefix the
admitting pool had against the best any eligible pool had (available vs achieved), recorded where
the request was admitted (a refusal moves it down the ranking) and never for a Route dry run; per
pool, the age of its KV view as a gauge computed at scrape time; both on the status page's data."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from globalrouter.http_api.status_page import status
from globalrouter.kv_index import KvIndex
from globalrouter.metrics import RouterMetrics
from globalrouter.migration import GenerateRun
from globalrouter.pool_directory import PoolTable
from globalrouter.pool_state import LoadSignal, PoolState
from globalrouter.routing import RoutingCore
from globalrouter.selection import Selector
from globalrouter.serving import AdmissionFailed, Admitted, PoolRequest, PoolResponse, ServingLinks
from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit.blocks import block_hashes
from meshkit.clock import FakeClock
from meshkit.errors import Reason

pytestmark = pytest.mark.timeout(30)
BLOCK = 16
PROMPT = list(range(10 * BLOCK))  # 10 full blocks
IDLE = LoadSignal(max_running_requests=4)
LOADED = LoadSignal(
    requests_running=4, requests_waiting=40, prefill_tokens_in_flight=400_000, max_running_requests=4
)


def mesh(clock: FakeClock, cached: dict[str, int]) -> RoutingCore:
    """Listed pools with fresh load and KV views; pool `name` caches `cached[name]` leading blocks."""
    table, index = PoolTable(), KvIndex()
    hashes = block_hashes(PROMPT, BLOCK)
    now = clock.monotonic()
    for name, blocks in cached.items():
        pool = PoolState(
            pool_id=name, listed=True, model="m", frontends=(f"http://{name}:1",), block_size=BLOCK
        )
        source = f"{name}/relay/1"
        index.apply_snapshot(source, hashes[:blocks])
        pool.kv_sources, pool.kv_at = {source}, now
        pool.record_load(IDLE, now)
        table.pools[name] = pool
    return RoutingCore(table, index, Selector(), clock, RouterMetrics())


def sample(core: RoutingCore, name: str) -> float | None:
    return core.metrics.registry.get_sample_value(name)


def test_a_loaded_best_cache_holder_records_available_above_achieved(fake_clock):
    core = mesh(fake_clock, {"warm": 8, "cold": 0})
    core.table.pools["warm"].record_load(LOADED, fake_clock.monotonic())
    decision = core.decide("m", PROMPT, 4)
    assert [c.pool_id for c in decision.candidates] == ["cold", "warm"], "the load sends it off the cache"
    quality = core.record_admission(decision, "cold")
    assert quality is not None
    assert (quality.achieved, quality.available, quality.forgone_tokens) == (0.0, 0.8, 8 * BLOCK)
    assert sample(core, "globalrouter_cached_prefix_achieved_ratio_sum") == 0.0
    assert sample(core, "globalrouter_cached_prefix_available_ratio_sum") == pytest.approx(0.8)
    assert sample(core, "globalrouter_cached_prefix_available_ratio_count") == 1
    bucket = core.metrics.registry.get_sample_value
    assert bucket("globalrouter_cached_prefix_achieved_ratio_bucket", {"le": "0.0"}) == 1
    assert bucket("globalrouter_cached_prefix_available_ratio_bucket", {"le": "0.75"}) == 0
    assert sample(core, "globalrouter_cached_prefix_forgone_tokens_total") == 8 * BLOCK


def test_the_best_cache_holder_at_rank_one_gives_nothing_up(fake_clock):
    core = mesh(fake_clock, {"warm": 8, "cold": 0})
    decision = core.decide("m", PROMPT, 4)
    assert decision.candidates[0].pool_id == "warm"
    quality = core.record_admission(decision, "warm")
    assert quality is not None and (quality.achieved, quality.available, quality.forgone_tokens) == (
        0.8,
        0.8,
        0,
    )
    assert sample(core, "globalrouter_cached_prefix_forgone_tokens_total") == 0


def test_a_prompt_without_a_full_block_records_no_ratio(fake_clock):
    core = mesh(fake_clock, {"warm": 8, "cold": 0})
    decision = core.decide("m", PROMPT[: BLOCK - 1], 4)
    assert core.record_admission(decision, decision.candidates[0].pool_id) is None
    assert sample(core, "globalrouter_cached_prefix_achieved_ratio_count") == 0


class RefusingLinks(ServingLinks):
    """Pools in `refusing` answer RESOURCE_EXHAUSTED/QUEUE_FULL; the others admit at once and
    finish with one token."""

    def __init__(self, refusing: set[str]) -> None:
        super().__init__(backoff_initial=1.0, backoff_max=15.0)
        self.refusing = refusing

    async def admit(self, pool: PoolState, request: PoolRequest) -> Admitted:
        if pool.pool_id in self.refusing:
            raise AdmissionFailed(
                pool.pool_id, grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL, "full", refused=True
            )
        stream: asyncio.Queue[PoolResponse] = asyncio.Queue()
        finish = pf.PoolFinish(reason=pf.POOL_FINISH_REASON_LENGTH, tokens_generated=1)
        stream.put_nowait(PoolResponse(tokens=pf.PoolTokens(token_ids=[7], finish=finish)))
        admission = pf.PoolAdmission(worker_id="w", cached_blocks=0, prompt_blocks=10)
        return Admitted(
            pool_id=pool.pool_id, url=pool.frontends[0], stream=_Stream(stream), admission=admission
        )

    async def release(self, admitted: Admitted) -> None:
        return None


class _Stream:
    def __init__(self, queue: asyncio.Queue[PoolResponse]) -> None:
        self._queue = queue

    async def read(self) -> PoolResponse | None:
        return await self._queue.get()

    def cancel(self) -> None:
        return None


async def generate(core: RoutingCore, links: ServingLinks, request_id: str) -> list[str]:
    run = GenerateRun(
        core,
        links,
        request_id=request_id,
        model="m",
        prompt=PROMPT,
        max_tokens=1,
        migration_limit=1,
        admission_tries=3,
    )
    [_ async for _ in run.stream(core.decide("m", PROMPT, 1))]
    return run.record.pools


async def test_a_refusal_records_the_admitting_pool_and_a_dry_run_nothing(fake_clock):
    core = mesh(fake_clock, {"warm": 8, "lukewarm": 3, "cold": 0})
    core.decide("m", PROMPT, 4, dry_run=True)  # Route: never admitted, records nothing
    assert sample(core, "globalrouter_cached_prefix_available_ratio_count") == 0
    assert sample(core, "globalrouter_cached_prefix_forgone_tokens_total") == 0
    assert await generate(core, RefusingLinks({"warm"}), "r1") == ["lukewarm"]
    assert sample(core, "globalrouter_cached_prefix_achieved_ratio_sum") == pytest.approx(0.3)
    assert sample(core, "globalrouter_cached_prefix_available_ratio_sum") == pytest.approx(0.8)
    assert sample(core, "globalrouter_cached_prefix_forgone_tokens_total") == 5 * BLOCK
    (event,) = core.events.latest(kind="decision")
    assert (event.pool_id, event.achieved_share, event.available_share) == ("lukewarm", 0.3, 0.8)
    data = status(core, "f")
    assert [(d["request_id"], d["achieved_share"], d["available_share"]) for d in data["decisions"]] == [
        ("r1", 0.3, 0.8)
    ]
    assert data["cached_prefix"] == {
        "decisions": 1,
        "achieved_mean": 0.3,
        "available_mean": 0.8,
        "gave_up": 1,
    }


def kv_ages(core: RoutingCore) -> dict[str, float]:
    text = generate_latest(core.metrics.registry).decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "globalrouter_pool_kv_age_seconds"
    ]
    return {s.labels["pool"]: s.value for s in family.samples}


def test_kv_view_age_is_computed_at_scrape_time_per_listed_pool(fake_clock):
    core = mesh(fake_clock, {"a": 1, "b": 1})
    core.metrics.pool_kv_ages(core.kv_ages)
    core.table.pools["quiet"] = PoolState(pool_id="quiet", listed=True, model="m", frontends=("http://q:1",))
    core.table.pools["gone"] = PoolState(pool_id="gone", listed=False, kv_at=fake_clock.monotonic())
    assert kv_ages(core) == {"a": 0.0, "b": 0.0}, "no KV view yet (quiet) or not listed (gone): no series"
    fake_clock.set(fake_clock.monotonic() + 12.5)
    core.table.pools["b"].kv_at = fake_clock.monotonic() - 2.0  # a heartbeat 2 s ago
    assert kv_ages(core) == {"a": 12.5, "b": 2.0}
    del core.table.pools["a"]
    assert kv_ages(core) == {"b": 2.0}, "a pool that left the table leaves the metric"


def test_status_page_shows_each_pools_kv_view_age_apart_from_its_other_signals(fake_clock):
    core = mesh(fake_clock, {"a": 1})
    fake_clock.set(fake_clock.monotonic() + 45.0)
    now = fake_clock.monotonic()
    pool = core.table.pools["a"]
    pool.record_load(IDLE, now)  # load is fresh, the KV view is not (past --kv-max-age, 30 s)
    (row,) = status(core, "f")["regions"][0]["pools"]
    assert (row["telemetry_age_s"], row["kv_age_s"], row["kv_fresh"]) == (0.0, 45.0, False)
    pool.kv_at = now - 1.0
    (row,) = status(core, "f")["regions"][0]["pools"]
    assert (row["kv_age_s"], row["kv_fresh"]) == (1.0, True)
    pool.kv_at = None
    (row,) = status(core, "f")["regions"][0]["pools"]
    assert (row["kv_age_s"], row["kv_fresh"]) == (None, False)
    assert status(core, "f")["cached_prefix"] == {
        "decisions": 0,
        "achieved_mean": None,
        "available_mean": None,
        "gave_up": 0,
    }
