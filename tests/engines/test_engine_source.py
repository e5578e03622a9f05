"""The engine pool source against a fake engine over real HTTP: load, readiness, models, resets."""

from __future__ import annotations

import asyncio

from aiohttp import web

from meshkit.clock import FakeClock
from poolrelay.engine.config import EngineConfig, EngineWorker
from poolrelay.engine.metrics import SGLANG, VLLM, parse_load, parse_models
from poolrelay.engine.source import EngineSource
from poolrelay.engine.translate import Transition
from poolrelay.pool_blocks import PoolBlocks
from poolrelay.v1 import pool_events_pb2 as pe
from tests.support import free_port

VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="1000"} 1.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 512.0
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.7e+09
"""


def test_vllm_metrics_are_summed_over_engines():
    load = parse_load(VLLM_METRICS, VLLM)
    assert (load.running, load.waiting, load.kv_blocks_total, load.kv_blocks_used) == (5, 4, 1000, 250)
    assert load.prefix_hits == 512 and load.process_start == 1.7e9


def test_sglang_names_and_missing_gauges_read_as_zero():
    load = parse_load("sglang:num_running_reqs 2\nsglang:num_queue_reqs 1\n", SGLANG)
    assert (load.running, load.waiting, load.kv_blocks_total) == (2, 1, 0)


def test_models_leave_out_lora_adapters():
    body = {"data": [{"id": "base"}, {"id": "sql-lora", "parent": "base"}, {"id": 3}]}
    assert parse_models(body) == ["base"]


class FakeEngine:
    """/health, /metrics and /v1/models like a vLLM server; `up` and `metrics` are switched by the test."""

    def __init__(self) -> None:
        self.up = True
        self.metrics = VLLM_METRICS

    async def health(self, request):
        return web.Response(status=200 if self.up else 503)

    async def metrics_page(self, request):
        return web.Response(text=self.metrics)

    async def models(self, request):
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def start(self):
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_page)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"


async def test_status_follows_the_engine_and_a_down_or_restarted_engine_loses_its_blocks():
    engine = FakeEngine()
    url = await engine.start()
    statuses: list[pe.WatchPoolStatusResponse] = []
    reachable: list[bool] = []
    pool = PoolBlocks()
    worker = EngineWorker("w0", url, f"tcp://127.0.0.1:{free_port()}")
    config = EngineConfig(kind="vllm", workers=(worker,), block_size=32, poll_interval=0.05, down_after=2)
    changed = asyncio.Event()

    def report(into):
        def record(value) -> None:
            into.append(value)
            changed.set()

        return record

    source = EngineSource(
        config,
        pool,
        on_status=report(statuses),
        on_reachable=report(reachable),
        on_blocks=changed.set,
        clock=FakeClock(),
    )
    st = source.workers["w0"]
    task = asyncio.create_task(source.run())

    async def until(predicate):
        """Waits for `predicate` re-checking it whenever the source reports something."""
        async with asyncio.timeout(10.0):
            while not predicate():
                changed.clear()
                await changed.wait()

    try:
        await until(lambda: statuses)
        s = statuses[-1]
        assert [(m.model, m.state) for m in s.models] == [("tiny", pe.MODEL_STATE_READY)]
        assert (s.load.requests_running, s.load.requests_waiting, s.load.kv_blocks_total) == (5, 4, 1000)
        assert s.block_size == 16 and s.drain.state == pe.DRAIN_STATE_ACTIVE and reachable == [True]
        # Blocks the worker holds; a restart (process_start_time_seconds changes) drops them.
        source._apply("w0", Transition(stored=[1, 2, 3]))
        assert len(pool) == 3
        engine.metrics = VLLM_METRICS.replace("1.7e+09", "1.8e+09")
        await until(lambda: len(pool) == 0)
        # Down for `down_after` polls: unreachable, blocks dropped again.
        source._apply("w0", Transition(stored=[4]))
        engine.up = False
        await until(lambda: reachable[-1] is False)
        assert len(pool) == 0 and st.feed.counts.resets == 2
        # A drain the relay carries: DRAINING until the engine is idle.
        engine.up = True
        await until(lambda: reachable[-1] is True)
        reply = await source.start_drain(30.0, "discovery")
        assert reply.drain.state == pe.DRAIN_STATE_DRAINING
        engine.metrics = (
            VLLM_METRICS.replace("} 3.0", "} 0.0").replace("} 2.0", "} 0.0").replace("} 4.0", "} 0.0")
        )
        await until(lambda: statuses[-1].drain.state == pe.DRAIN_STATE_DRAINED)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await engine.runner.cleanup()
