"""MockerAdminService: readiness, fault injection and inspection of the simulated pool (tests, demos)."""

from __future__ import annotations

import grpc

from meshkit.errors import Reason, abort_with_reason
from meshkit.logs import get_logger
from meshkit.timeconv import seconds
from meshkit.validation import Violations, check_identifier
from mocker.config import Faults
from mocker.pool import Pool
from mocker.v1 import admin_pb2 as adm
from mocker.v1 import admin_pb2_grpc as adm_grpc

log = get_logger(module="mocker.admin")


class MockerAdmin(adm_grpc.MockerAdminServiceServicer):
    def __init__(self, pool: Pool) -> None:
        self.pool = pool

    async def SetModelReady(
        self, request: adm.SetModelReadyRequest, context: grpc.aio.ServicerContext
    ) -> adm.SetModelReadyResponse:
        v = Violations()
        check_identifier(v, "model", request.model)
        await v.abort_if_any(context)
        try:
            self.pool.set_model_ready(request.model, request.ready)
        except KeyError:
            await abort_with_reason(
                context,
                grpc.StatusCode.NOT_FOUND,
                Reason.MODEL_NOT_SERVED,
                f"pool {self.pool.config.pool_id} has no model {request.model!r} "
                f"(it has {', '.join(sorted(self.pool.models))})",
            )
        log.info("model readiness set", model=request.model, ready=request.ready)
        return adm.SetModelReadyResponse()

    async def SetFaults(
        self, request: adm.SetFaultsRequest, context: grpc.aio.ServicerContext
    ) -> adm.SetFaultsResponse:
        latency = seconds(request.added_latency)
        v = Violations()
        if latency < 0:
            v.add("added_latency", f"must not be negative (got {latency:g} s)")
        await v.abort_if_any(context)
        faults = Faults(
            fail_after_tokens=request.fail_after_tokens,
            added_latency=latency,
            refuse_all=request.refuse_all,
            stall_after_tokens=request.stall_after_tokens,
        )
        self.pool.set_faults(faults)
        log.info("faults set", **faults.__dict__)
        return adm.SetFaultsResponse()

    async def GetWorkerBlocks(
        self, request: adm.GetWorkerBlocksRequest, context: grpc.aio.ServicerContext
    ) -> adm.GetWorkerBlocksResponse:
        return adm.GetWorkerBlocksResponse(
            workers=[
                adm.WorkerBlocks(worker_id=w.worker_id, block_hashes=w.cache.blocks())
                for w in sorted(self.pool.workers, key=lambda w: w.worker_id)
            ]
        )

    async def GetPoolStats(
        self, request: adm.GetPoolStatsRequest, context: grpc.aio.ServicerContext
    ) -> adm.GetPoolStatsResponse:
        s = self.pool.stats
        return adm.GetPoolStatsResponse(
            requests_admitted=s.requests_admitted,
            requests_refused=s.requests_refused,
            requests_finished=s.requests_finished,
            requests_handed_back=s.requests_handed_back,
            prompt_blocks=s.prompt_blocks,
            cached_blocks=s.cached_blocks,
            tokens_generated=s.tokens_generated,
        )
