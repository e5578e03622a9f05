"""RouterService on the wire: maps Generate, Route and ListPools requests onto the routing core and back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import grpc

from globalrouter.aliases import Resolved, ResolveError, Target
from globalrouter.config import RouterConfig
from globalrouter.encoding import Encoder, EncoderBusy
from globalrouter.migration import GenerateError, RunRecord
from globalrouter.pool_state import PoolState
from globalrouter.request_path import RequestPath
from globalrouter.routing import RoutingCore
from globalrouter.selection import Decision, FilterReason, Ranking
from globalrouter.serving import ServingLinks
from globalrouter.tenancy import PRIORITY_HEADER, grpc_status, parse_priority
from globalrouter.tokenizer import ModelTokenizer, Tokenizers
from globalrouter.v1 import router_pb2, router_pb2_grpc
from meshkit import pagination, tracing
from meshkit.authz import Authorizer, current_identity
from meshkit.blocks import DEFAULT_BLOCK_SIZE, text_to_tokens
from meshkit.errors import Reason, abort_with_reason
from meshkit.ids import request_id_from
from meshkit.limits import LimitExceeded, Slots
from meshkit.logs import get_logger
from meshkit.sampling import check_sampling
from meshkit.timeconv import duration
from meshkit.validation import Violations, check_identifier

log = get_logger(module="globalrouter.router_api")

MAX_PROMPT_TOKENS = 1_048_576
MAX_OUTPUT_TOKENS = 1_048_576
MAX_TOKEN_ID = 2**32 - 1
DEFAULT_ROUTE_MAX_TOKENS = 16
FILTER_REASONS = {r: router_pb2.FilterReason.Value(f"FILTER_REASON_{r.name}") for r in FilterReason}
"""selection.FilterReason -> the proto value of the same name (a missing name fails at import)."""


def prompt_tokens(
    v: Violations,
    field_path: str,
    prompt: router_pb2.Prompt,
    max_tokens: int = MAX_PROMPT_TOKENS,
    tokenizer: ModelTokenizer | None = None,
    *,
    encoded: Sequence[int] | None = None,
) -> Sequence[int]:
    """The prompt as token ids (text: `encoded` when the caller encoded it already, else the
    model's tokenizer, else one token per UTF-8 byte); records what is wrong with it.

    Token ids come back as the request's repeated field itself: copying it to a list costs more
    than building the pool's request from it."""
    kind = prompt.WhichOneof("content")
    tokens: Sequence[int]
    if kind == "text":
        if encoded is not None:
            tokens = encoded
        elif tokenizer:
            tokens = tokenizer.encode(prompt.text, add_special_tokens=True)
        else:
            tokens = text_to_tokens(prompt.text)
        if not tokens:
            v.add(f"{field_path}.text", "must not be empty")
    elif kind == "token_ids":
        tokens = prompt.token_ids.ids
        if not tokens:
            v.add(f"{field_path}.token_ids.ids", "must list at least one token id")
    else:
        v.add(field_path, "must set token_ids or text")
        return []
    if len(tokens) > max_tokens:
        v.add(field_path, f"must have at most {max_tokens} tokens (got {len(tokens)})")
    return tokens


def generate_streams(config: RouterConfig, *, enforced: bool) -> Slots:
    """The limit of concurrent Generate streams (gRPC and HTTP share one): per client identity
    only when callers are identified, since unchecked callers all look alike."""
    per_client = config.max_streams_per_client if enforced else None
    return Slots(
        "Generate streams",
        per_key=per_client or config.max_generate_streams,
        total=config.max_generate_streams,
    )


class RouterServicer(router_pb2_grpc.RouterServiceServicer):
    """The client API of one global frontend."""

    def __init__(
        self,
        core: RoutingCore,
        links: ServingLinks,
        config: RouterConfig,
        tokenizers: Tokenizers | None = None,
        authorizer: Authorizer | None = None,
        streams: Slots | None = None,
        path: RequestPath | None = None,
        encoder: Encoder | None = None,
    ) -> None:
        self._core = core
        self.config = config
        self._streams = streams or generate_streams(config, enforced=bool(authorizer and authorizer.enforced))
        self._tokenizers = tokenizers or Tokenizers()
        self.path = path or RequestPath.of(core, links, config)
        """Decides, runs and counts requests (shared with the HTTP front)."""
        self.encoder = encoder or Encoder(config.tokenizer_threads, config.tokenizer_queue)
        """Encodes text prompts off the event loop (shared with the HTTP front)."""

    async def _model_prompt(
        self, v: Violations, model: str, prompt: router_pb2.Prompt, context: grpc.aio.ServicerContext
    ) -> Sequence[int]:
        """Checks a request's prompt (text through its resolved model's tokenizer, in the
        encoder's threads); its tokens. A full encoder ends the call with RESOURCE_EXHAUSTED."""
        encoded = None
        if prompt.WhichOneof("content") == "text" and prompt.text:
            tokenizer = self._tokenizers.for_model(model)
            try:
                encoded = await self.encoder.run(tokenizer.encode, prompt.text, add_special_tokens=True)
            except EncoderBusy as exc:
                await context.abort_with_status(exc.status())
        tokens = prompt_tokens(v, "prompt", prompt, self.config.max_prompt_tokens, encoded=encoded)
        if prompt.WhichOneof("content") == "token_ids" and (
            unknown := self._tokenizers.unknown_token(model, tokens)
        ):
            v.add(f"prompt.token_ids.ids[{unknown[0]}]", unknown[1])  # known with --tokenizer only
        return tokens

    def _resolve(self, v: Violations, name: str, request_id: str) -> Resolved:
        """Checks a request's model name; the model (and adapter) it stands for (globalrouter.aliases)."""
        check_identifier(v, "model", name)
        try:
            return self.path.resolve(name, request_id)
        except ResolveError as exc:
            v.add("model", str(exc))
            return Resolved(name)

    # ---- Generate ---------------------------------------------------------------------------
    async def Generate(self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        # The id a caller gives (field, else the x-request-id header, as on the HTTP front) names
        # the request in every log line and at every pool, picks an alias's split, and is sent
        # back as x-request-id.
        metadata = dict(context.invocation_metadata() or ())
        header = metadata.get("x-request-id")
        request_id = request.request_id or request_id_from(header if isinstance(header, str) else None)
        priority = None
        asked = metadata.get(PRIORITY_HEADER)
        if asked is not None:
            try:
                priority = parse_priority(asked if isinstance(asked, str) else "")
            except ValueError as exc:
                v.add(f"metadata {PRIORITY_HEADER}", str(exc))
        target = self._resolve(v, request.model, request_id)
        tokens = await self._model_prompt(v, target.model, request.prompt, context)
        cap = self.config.max_output_tokens
        if request.max_tokens == 0 or request.max_tokens > cap:
            v.add("max_tokens", f"must be 1 to {cap} (got {request.max_tokens})")
        if request.request_id:
            check_identifier(v, "request_id", request.request_id)
        check_sampling(v, "sampling", request.sampling)
        await v.abort_if_any(context)
        caller = str(current_identity())
        try:
            self._streams.acquire(caller)
        except LimitExceeded as exc:
            await context.abort_with_status(exc.status())
        try:
            async for response in self._generate(request, request_id, target, tokens, context, priority):
                yield response
        finally:
            self._streams.release(caller)

    def _cached_tokens(self, summary: router_pb2.GenerateSummary, rec: RunRecord, prompt: int) -> None:
        """Sets the summary's cached prompt tokens (at the first pool's block size) and their source."""
        pool = self._core.table.pools.get(rec.pools[0]) if rec.pools else None
        block = pool.block_size if pool is not None and pool.block_size > 0 else DEFAULT_BLOCK_SIZE
        cached, source = rec.cached_tokens(prompt, block)
        summary.cached_tokens = cached
        summary.cached_tokens_source = _SOURCES[source]

    async def _generate(
        self,
        request: router_pb2.GenerateRequest,
        request_id: str,
        target: Resolved,
        tokens: Sequence[int],
        context,
        priority: int | None = None,
    ):
        # A header sent on its own is one more write per request; a client that asked for combined
        # messages gets the id in the summary and in the trailing metadata instead.
        combine = request.combine_messages
        sent_back = (("x-request-id", request_id),)
        if not combine:
            await context.send_initial_metadata(sent_back)
        id_trailer = sent_back if combine else ()
        try:
            run = await self.path.start(
                request_id=request_id,
                model=target.model,
                prompt=tokens,
                max_tokens=request.max_tokens,
                sampling=request.sampling if request.HasField("sampling") else None,
                adapter=target.adapter,
                identity=current_identity(),
                trace_context=(
                    tracing.extract_metadata(context.invocation_metadata()) if tracing.enabled() else None
                ),
                priority=priority,
            )
        except GenerateError as exc:
            await _abort(context, exc, id_trailer)
            return
        try:
            # Only this front builds protobuf: the path yields plain values.
            async with run as outputs:
                async for out in outputs:
                    ids = out.token_ids
                    if out.finish is None:
                        yield router_pb2.GenerateResponse(
                            tokens=router_pb2.TokenChunk(
                                token_ids=ids, offset=out.offset, pool_id=out.pool_id
                            )
                        )
                        continue
                    summary = _summary(run.record, out.finish, request_id)
                    self._cached_tokens(summary, run.record, len(tokens))
                    if ids:
                        chunk = router_pb2.TokenChunk(token_ids=ids, offset=out.offset, pool_id=out.pool_id)
                        if combine:  # the summary rides in the last chunk
                            chunk.summary.CopyFrom(summary)
                            yield router_pb2.GenerateResponse(tokens=chunk)
                            continue
                        yield router_pb2.GenerateResponse(tokens=chunk)
                    yield router_pb2.GenerateResponse(summary=summary)
        except GenerateError as exc:
            await _abort(context, exc, (*self._trailers(run.record), *id_trailer))
        # x-ratelimit-* (with --policy budgets), as the HTTP front sends them.
        context.set_trailing_metadata((*self._trailers(run.record), *id_trailer, *run.ratelimit_headers()))

    @staticmethod
    def _trailers(record: RunRecord) -> tuple[tuple[str, str], ...]:
        return (("x-pools", ",".join(record.pools)), ("x-migrations", str(record.migrations)))

    # ---- Route ------------------------------------------------------------------------------
    async def Route(self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        target = self._resolve(v, request.model, "")
        tokens = await self._model_prompt(v, target.model, request.prompt, context)
        if request.max_tokens > self.config.max_output_tokens:
            v.add("max_tokens", f"must be at most {self.config.max_output_tokens} (got {request.max_tokens})")
        await v.abort_if_any(context)
        regions = None
        if self.path.gate is not None:
            # A dry run shows what Generate would do for this caller: its model access and its
            # residency filter apply; its budget is not spent.
            policy = self.path.gate.for_identity(current_identity())
            if not policy.allows_model(target.model):  # the resolved model, as Generate checks
                await abort_with_reason(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    Reason.MODEL_NOT_ALLOWED,
                    f"{current_identity()} may not use model {target.model!r}",
                )
            regions = policy.regions
        decision = self._core.decide(
            target.model,
            tokens,
            request.max_tokens or DEFAULT_ROUTE_MAX_TOKENS,
            dry_run=True,
            adapter=target.adapter,
            regions=regions,
        )
        if not decision.model_served:
            await abort_with_reason(
                context,
                grpc.StatusCode.NOT_FOUND,
                Reason.NO_POOL_FOR_MODEL,
                f"no listed pool serves model {str(Target(target.model, target.adapter))!r}",
            )
        return route_response(decision, self._core.table.pools, request.max_candidates)

    # ---- ListPools --------------------------------------------------------------------------
    async def ListPools(self, request: router_pb2.ListPoolsRequest, context: grpc.aio.ServicerContext):
        v = Violations()
        page_request = pagination.page_request(v, request.page_size, request.page_token, (request.model,))
        await v.abort_if_any(context)
        pools = sorted(
            (p for p in self._core.table.pools.values() if not request.model or p.model == request.model),
            key=lambda p: p.pool_id,
        )
        page, token = pagination.paginate(pools, lambda p: p.pool_id, page_request)
        now = self._core.clock.monotonic()
        return router_pb2.ListPoolsResponse(pools=[self._view(p, now) for p in page], next_page_token=token)

    def _view(self, pool: PoolState, now: float) -> router_pb2.PoolView:
        limits = self._core.selector_limits
        view = router_pb2.PoolView(
            pool_id=pool.pool_id,
            model=pool.model,
            region=pool.region,
            frontends=pool.frontends,
            draining=pool.draining(),
            ready=pool.ready(pool.model, now, limits),
            load_freshness=_freshness(pool.load_at, pool.load_fresh(now, limits), now),
            kv_freshness=_freshness(pool.kv_at, pool.kv_fresh(now, limits), now),
            state_freshness=_freshness(pool.state_at, pool.state_fresh(now, limits), now),
            indexed_blocks=max((self._core.index.block_count(s) for s in pool.kv_sources), default=0),
            telemetry_streams=self._core.table.stream_counts.get(pool.pool_id, 0),
            pending_requests=pool.pending_requests,
            listed=pool.listed,
            frontend_protocol="openai_http" if pool.openai_http else "mesh_grpc",
            adapters=sorted(pool.adapters.get(pool.model, ())),
            directory_state=_directory_state(pool),
        )
        if pool.lease_grace_until is not None:
            view.lease_grace_left.CopyFrom(duration(max(0.0, pool.lease_grace_until - now)))
        if pool.load is not None:
            ld = pool.load
            view.load.CopyFrom(
                router_pb2.PoolLoadView(
                    requests_waiting=ld.requests_waiting,
                    requests_running=ld.requests_running,
                    prefill_tokens_in_flight=ld.prefill_tokens_in_flight,
                    kv_blocks_used=ld.kv_blocks_used,
                    kv_blocks_total=ld.kv_blocks_total,
                    max_running_requests=ld.max_running_requests,
                    decode_tokens_in_flight=ld.decode_tokens_in_flight,
                )
            )
        return view


async def _abort(
    context: grpc.aio.ServicerContext, error: GenerateError, trailers: tuple[tuple[str, str], ...] = ()
) -> None:
    """Ends the call with the error's code, message and ErrorInfo, keeping `trailers` beside them
    (abort's own trailing metadata would replace any set before)."""
    if error.reason is None:
        await context.abort(error.code, error.message, trailers)
    status = grpc_status(error)  # the ErrorInfo, and a tenant refusal's QuotaFailure and RetryInfo
    await context.abort(status.code, status.details, (*status.trailing_metadata, *trailers))


_SOURCES = {
    "pool": router_pb2.CACHED_TOKENS_SOURCE_POOL,
    "estimate": router_pb2.CACHED_TOKENS_SOURCE_ESTIMATE,
}


def _summary(rec: RunRecord, reason: int, request_id: str) -> router_pb2.GenerateSummary:
    return router_pb2.GenerateSummary(
        finish_reason=reason,  # type: ignore[arg-type]  # a proto enum field takes its number
        pools=rec.pools,
        cached_blocks=rec.cached_blocks,
        prompt_blocks=rec.prompt_blocks,
        migrations=rec.migrations,
        tokens_generated=len(rec.tokens),
        refused_by=rec.refused_by,
        request_id=request_id,
    )


DIRECTORY_STATES = {
    "listed": router_pb2.DIRECTORY_STATE_LISTED,
    "lease_lapsed": router_pb2.DIRECTORY_STATE_LEASE_LAPSED,
    "unlisted": router_pb2.DIRECTORY_STATE_UNLISTED,
}
"""PoolState.directory_state -> router.v1.DirectoryState."""


def route_response(
    decision: Decision, pools: Mapping[str, PoolState], max_candidates: int = 0
) -> router_pb2.RouteResponse:
    """A Route reply: the best `max_candidates` candidates (0: all), the filtered pools; `pools`:
    the directory the decision was made from (each candidate's directory state).

    Built from the ranking's cost vectors into the reply's own repeated field: at 1,000 eligible
    pools, building a RankedPool and then a Candidate per pool and copying the list into the reply
    took about 2 ms of the serving loop per Route (the decision itself 1 ms); this about half
    (BENCHMARKS.md, "Loop lag at 1,000 pools: what the long turns were")."""
    candidates = decision.candidates
    reply = router_pb2.RouteResponse(prompt_blocks=decision.prompt_blocks, candidates_total=len(candidates))
    if isinstance(candidates, Ranking):
        # The candidates are the directory's own PoolStates (RoutingCore.decide ranks the table's,
        # and the reply is built in the same loop turn): no lookup by id.
        rows: Iterable[tuple] = (
            (p.pool_id, p.region, DIRECTORY_STATES[p.directory_state()], *costs)
            for p, *costs in candidates.rows(max_candidates)
        )
    else:  # a plain list of RankedPools (tests, tools)
        listed = candidates if max_candidates <= 0 else candidates[:max_candidates]
        rows = (
            (
                c.pool_id,
                c.region,
                _directory_state(pools.get(c.pool_id)),
                c.total_cost,
                c.prefill_cost,
                c.load_cost,
                c.pending_cost,
                c.cached_blocks,
                c.prompt_blocks,
                c.load_known,
            )
            for c in listed
        )
    add = reply.candidates.add
    for rank, (pool_id, region, state, total, prefill, load, pending, cached, blocks, known) in enumerate(
        rows, start=1
    ):
        add(
            pool_id=pool_id,
            rank=rank,
            total_cost=total,
            prefill_cost=prefill,
            load_cost=load,
            pending_cost=pending,
            cached_blocks=cached,
            prompt_blocks=blocks,
            load_known=known,
            region=region,
            directory_state=state,
        )
    filtered = reply.filtered.add
    for f in decision.filtered:  # ordered by pool_id
        filtered(
            pool_id=f.pool_id,
            reason=FILTER_REASONS[f.reason],  # a proto enum field takes its number
            detail=f.detail,
        )
    return reply


def _directory_state(pool: PoolState | None) -> router_pb2.DirectoryState:
    return DIRECTORY_STATES[pool.directory_state() if pool is not None else "unlisted"]


def _freshness(at: float | None, fresh: bool, now: float) -> router_pb2.SignalFreshness:
    f = router_pb2.SignalFreshness(fresh=fresh)
    if at is not None:
        f.age.CopyFrom(duration(max(0.0, now - at)))
    return f
