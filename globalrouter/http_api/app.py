"""The OpenAI API on the routing core: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics, /.

A request is tokenized once with its model's tokenizer, then goes down the same path as a gRPC
Generate: RoutingCore.decide, then GenerateRun (admission, streaming, migration), with the same
metrics. Output tokens are detokenized incrementally; stop strings and stop token ids end it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar, cast

import structlog
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from globalrouter.aliases import Resolved, ResolveError, model_cards
from globalrouter.detokenizer import TextStream
from globalrouter.encoding import Encoder, EncoderBusy
from globalrouter.http_api.config import HttpConfig
from globalrouter.http_api.content_type import JsonBodiesOnly
from globalrouter.http_api.errors import ApiError, from_grpc
from globalrouter.http_api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidField,
    InvalidJson,
    check_supported,
    parse_json,
)
from globalrouter.http_api.security import AuthMiddleware
from globalrouter.http_api.status_page import PAGE, status
from globalrouter.http_api.streaming import EventStreamResponse, check_streamable
from globalrouter.migration import GenerateError, Output
from globalrouter.request_path import PathRun, RequestPath
from globalrouter.router_api import MAX_OUTPUT_TOKENS, MAX_PROMPT_TOKENS
from globalrouter.routing import RoutingCore
from globalrouter.tokenizer import ModelTokenizer, TokenizerError, Tokenizers, prompt_context
from globalrouter.v1 import router_pb2, sampling_pb2
from meshkit import tracing
from meshkit.authz import UNCHECKED, Authorizer
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.errors import Reason
from meshkit.identity import Role
from meshkit.ids import request_id_from
from meshkit.limits import LimitExceeded, Slots
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.http_api")

REQUEST_ID_HEADER = "x-request-id"
CLIENT_CLOSED_REQUEST = 499
"""The status counted for a request whose client left before its answer (nginx's convention; never sent)."""
_FINISH: dict[int, str] = {router_pb2.FINISH_REASON_LENGTH: "length", router_pb2.FINISH_REASON_STOP: "stop"}


class HttpMetrics:
    """What only the HTTP front counts, in the frontend's one registry (so /metrics shows both)."""

    def __init__(self, registry) -> None:
        self.responses = Counter(
            "globalrouter_http_responses",
            "HTTP responses by route and status (streams count when they start)",
            ["route", "status"],
            registry=registry,
        )
        self.slow_clients = Counter(
            "globalrouter_http_slow_clients",
            "Streams ended because the client stopped reading for longer than the write timeout",
            registry=registry,
        )


class RequestIdMiddleware:
    """Gives every request an id (the client's x-request-id or a new one), puts it on every response
    and binds it to the request's log lines; the same id goes to the pools as the request id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        request_id = request_id_from(header.decode("latin-1") if header is not None else None)
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", request_id.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        with structlog.contextvars.bound_contextvars(request_id=request_id):
            await self.app(scope, receive, send_with_id)


CACHED_SOURCE_HEADER = "x-cached-tokens-source"
"""Says where usage.prompt_tokens_details.cached_tokens comes from: "pool" (the pool reported what
it reused) or "estimate" (the frontend's routing estimate); a streamed response says it in an SSE
comment before its usage chunk."""


def _error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=dict(error.headers) or None)


def _sampling(req: CompletionRequest | ChatCompletionRequest) -> sampling_pb2.SamplingParams:
    params = sampling_pb2.SamplingParams(stop_token_ids=req.stop_token_ids or [])
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None:
            setattr(params, name, value)
    return params


def _chat_ids(tokenizer: ModelTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """A conversation through the model's chat template, encoded (one job in the encoder's threads)."""
    return tokenizer.encode(tokenizer.render_chat(messages), add_special_tokens=False)


class ClientGone(Exception):
    """The client disconnected before its answer: the work for it was cancelled."""


T = TypeVar("T")


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(receive, work: Awaitable[T]) -> T:
    """Awaits `work`; when the client disconnects first, cancels it (so the pool's stream is
    closed and the pool stops generating for nobody) and raises ClientGone. `receive` is the
    ASGI receive of a request whose body was read: its next message is the disconnect.

    The work runs in the calling task (one watcher task, no second task per request): the
    watcher cancels the caller, and the cancellation is told apart from any other by uncancel()."""
    task = asyncio.current_task()
    assert task is not None
    watching = True
    left = False

    def on_disconnect(watcher: asyncio.Future) -> None:
        nonlocal left
        # `watching`: a disconnect seen after the work ended must not cancel what the task does next.
        if watching and not watcher.cancelled() and watcher.exception() is None:
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if left and task.uncancel() == 0:
            raise ClientGone() from None
        raise
    finally:
        watching = False
        watcher.cancel()


class OpenAIFront:
    """The HTTP handlers of one global frontend; they share its routing core and serving links."""

    def __init__(
        self,
        core: RoutingCore,
        path: RequestPath,
        tokenizers: Tokenizers,
        config: HttpConfig,
        *,
        encoder: Encoder | None = None,
        frontend_id: str = "",
        authorizer: Authorizer | None = None,
        streams: Slots | None = None,
        max_prompt_tokens: int = MAX_PROMPT_TOKENS,
        max_output_tokens: int = MAX_OUTPUT_TOKENS,
    ) -> None:
        self.core = core
        self.authorizer = authorizer
        """Identifies callers and applies the mesh's table (None: nothing checked, as without flags)."""
        self.streams = streams or Slots("Generate streams", per_key=10_000, total=10_000)
        """Concurrent generations per identity, shared with gRPC Generate."""
        self.max_prompt_tokens = max_prompt_tokens
        self.max_output_tokens = max_output_tokens
        self.path = path
        """Decides, runs and counts requests: the same path as gRPC Generate, same configuration."""
        self.encoder = encoder or Encoder()
        """Encodes prompts off the event loop (shared with gRPC Generate)."""
        self.tokenizers = tokenizers
        self.config = config
        self.frontend_id = frontend_id
        self.serving = True
        self.metrics = HttpMetrics(core.metrics.registry)

    def app(self) -> RequestIdMiddleware:
        """The ASGI app: request ids outermost, then authorization (when enforced), then the routes."""
        routes = [
            Route("/", self.page, methods=["GET"]),
            Route("/status.json", self.status_json, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/livez", self.health, methods=["GET"]),
            Route("/readyz", self.readyz, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]
        app = Starlette(
            routes=routes,
            exception_handlers={404: self._not_found, 405: self._not_allowed, Exception: self._internal},
        )
        inner: Any = app
        if self.authorizer is not None and self.authorizer.enforced:
            inner = AuthMiddleware(app, self.authorizer)
        # Outermost, so that even the 500 of Starlette's error middleware (and a refusal) carries the request id.
        return RequestIdMiddleware(JsonBodiesOnly(inner, ("/v1/completions", "/v1/chat/completions")))

    # ---- plain endpoints ----------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        return HTMLResponse(PAGE, headers={"cache-control": "no-cache"})

    async def status_json(self, request: Request) -> Response:
        # A client sees the flow rows of its own tenant only: others' names and usage are not its to read.
        identity = request.scope.get("state", {}).get("identity", UNCHECKED)
        tenant = str(identity) if identity.role is Role.CLIENT else None
        data = status(self.core, self.frontend_id, tenant=tenant)
        return JSONResponse(data, headers={"cache-control": "no-store"})

    async def health(self, request: Request) -> Response:
        """/health and /livez: alive and not stopping (a liveness probe; readiness is /readyz)."""
        if not self.serving:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    readiness: Any = None
    """The frontend's globalrouter.readiness.Readiness (set by the server; None: always ready)."""

    async def readyz(self, request: Request) -> Response:
        """503 until the frontend can route (directory synced, pools' KV state or the bounded wait)."""
        if not self.serving:
            return JSONResponse({"status": "stopping"}, status_code=503)
        state = self.readiness.status() if self.readiness is not None else {"status": "ready"}
        return JSONResponse(state, status_code=200 if state["status"] == "ready" else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.core.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        # Models, the LoRA adapters served on them and the aliases, as vLLM lists them.
        cards = model_cards(self.core.table.pools.values(), self.core.resolver.aliases, "globalrouter")
        return JSONResponse({"object": "list", "data": cards})

    async def _not_found(self, request: Request, exc: Exception) -> Response:
        return _error_response(ApiError(404, f"no route {request.url.path}", code="not_found"))

    async def _internal(self, request: Request, exc: Exception) -> Response:
        # The exception may carry request content (a prompt, a rendered chat): it goes to the log,
        # under the request id, never into the reply.
        request_id = request.scope.get("state", {}).get("request_id", "")
        log.error("request failed unexpectedly", request_id=request_id, error=repr(exc), exc_info=exc)
        return _error_response(
            ApiError(
                500, f"internal error (request id {request_id})", type="server_error", code="internal_error"
            )
        )

    async def _not_allowed(self, request: Request, exc: Exception) -> Response:
        return _error_response(
            ApiError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
        )

    # ---- generation ---------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    async def _handle(self, request: Request, kind: str) -> Response:
        request_id: str = request.state.request_id
        route = request.url.path
        try:
            body = await self._read_body(request)
            try:
                req = parse_json(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
            except InvalidJson as exc:
                raise ApiError(
                    400, f"request body is not valid JSON: {exc.message}", code="invalid_json"
                ) from None
            check_supported(req)
            check_streamable(request.scope, req.stream)
            if req.user:
                structlog.contextvars.bind_contextvars(user=req.user)  # the end user, in every log line
            # The model name resolved once (alias, model:adapter, adapter), before tokenizing.
            try:
                target = self.path.resolve(req.model, request_id)
            except ResolveError as exc:
                raise InvalidField("model", f"model: {exc}") from None
            tokenizer = self.tokenizers.for_model(target.model)
            prompt = await self._prompt(req, tokenizer, target.model)
            self._check_max_tokens(req)
            caller = str(request.scope.get("state", {}).get("identity", UNCHECKED))
            try:
                self.streams.acquire(caller)
            except LimitExceeded as exc:
                raise ApiError(429, str(exc), type="rate_limit_error", code="LIMIT_EXCEEDED") from None
            try:
                response = await self._generate(request, request_id, kind, req, target, tokenizer, prompt)
            except BaseException:
                self.streams.release(caller)
                raise
            response = _Releasing(response, lambda: self.streams.release(caller))  # type: ignore[assignment]
        except InvalidField as exc:
            response = _error_response(ApiError(400, exc.message, param=exc.param, code="invalid_value"))
        except ApiError as exc:
            response = _error_response(exc)
        except ClientGone:
            log.info("client left before its answer; request cancelled")
            response = Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it: counted only
        self.metrics.responses.labels(route, str(response.status_code)).inc()
        return response

    async def _read_body(self, request: Request) -> bytes:
        """The body, bounded in size and in the time the client takes to send it."""
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(
                413, f"request body is {length} bytes; the limit is {limit}", code="body_too_large"
            )
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.config.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(
                            413, f"request body exceeds the limit of {limit} bytes", code="body_too_large"
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(
                408, f"request body not received within {self.config.body_timeout:g} s", code="body_timeout"
            ) from None
        except ClientDisconnect:
            raise ApiError(
                400, "client disconnected while sending the body", code="client_disconnected"
            ) from None
        return b"".join(chunks)

    async def _prompt(
        self, req: CompletionRequest | ChatCompletionRequest, tokenizer: ModelTokenizer, model: str
    ) -> list[int]:
        """The prompt as token ids: chat messages through the model's chat template, text encoded."""
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                ids = await self._encode(_chat_ids, tokenizer, messages)
            except TokenizerError as exc:
                raise InvalidField("messages", f"messages: {exc}") from None
        else:
            prompt = req.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # one prompt in a list (more are refused by check_supported)
            if isinstance(prompt, str):
                ids = await self._encode(tokenizer.encode, prompt, add_special_tokens=True)
            else:
                # Token ids: ints, range-checked by the schema, in a list of this request's own.
                ids = cast("list[int]", prompt)
                if (unknown := self.tokenizers.unknown_token(model, ids)) is not None:
                    raise InvalidField("prompt", f"prompt[{unknown[0]}]: {unknown[1]}")
        if not ids:
            raise InvalidField("prompt", "prompt: encodes to no token")
        if len(ids) > self.max_prompt_tokens:
            raise InvalidField(
                "prompt", f"prompt: {len(ids)} tokens; at most {self.max_prompt_tokens} are allowed"
            )
        return ids

    async def _encode(self, fn, *args, **kwargs) -> list[int]:
        """Runs an encoding job in the encoder's threads; a full encoder is 429, naming the bound."""
        try:
            return await self.encoder.run(fn, *args, **kwargs)
        except EncoderBusy as exc:
            raise ApiError(429, str(exc), type="rate_limit_error", code="LIMIT_EXCEEDED") from None

    def _check_max_tokens(self, req: CompletionRequest | ChatCompletionRequest) -> None:
        """The configured output cap (the same as gRPC's --max-output-tokens)."""
        for name in ("max_completion_tokens", "max_tokens"):
            value = getattr(req, name, None)
            if value is not None and value > self.max_output_tokens:
                raise InvalidField(name, f"{name}: must be at most {self.max_output_tokens} (got {value})")

    async def _generate(
        self,
        request: Request,
        request_id: str,
        kind: str,
        req: CompletionRequest | ChatCompletionRequest,
        target: Resolved,
        tokenizer: ModelTokenizer,
        prompt: list[int],
    ) -> Response:
        max_tokens = (
            getattr(req, "max_completion_tokens", None)
            or req.max_tokens
            or min(self.config.default_max_tokens, self.max_output_tokens)
        )
        try:
            run = await self.path.start(
                request_id=request_id,
                model=target.model,
                prompt=prompt,
                max_tokens=max_tokens,
                sampling=_sampling(req),
                adapter=target.adapter,
                identity=request.scope.get("state", {}).get("identity", UNCHECKED),
                trace_context=tracing.extract_headers(request.headers) if tracing.enabled() else None,
            )
        except GenerateError as exc:
            if exc.reason == Reason.NO_POOL_FOR_MODEL:
                raise ApiError(
                    404, f"the model {req.model!r} does not exist", param="model", code="model_not_found"
                ) from None
            # A tenant refusal (tenancy.TenantRefusal) brings its x-ratelimit-*, Retry-After and
            # OpenAI error type ("tokens", "requests").
            raise from_grpc(
                exc.code,
                exc.message,
                exc.reason,
                headers=getattr(exc, "headers", ()),
                type=getattr(exc, "http_type", ""),
            ) from None
        text = TextStream(
            tokenizer,
            prompt_context(prompt),
            stop=req.stop_strings(),
            stop_token_ids=req.stop_token_ids or (),
        )
        generation = Generation(self, run, kind, req, text, request_id, len(prompt))
        # Admission happens before any byte is sent, so that a refusal or an unreachable pool is a
        # proper HTTP status even for a streaming request. A client that leaves meanwhile (or,
        # not streaming, before its whole answer) cancels the request at the pool.
        # (One watch per request: a watcher task is a measurable share of a request's CPU.)
        try:
            if req.stream:
                await unless_client_leaves(request.receive, generation.start())
            else:
                body = await unless_client_leaves(request.receive, generation.whole())
        except GenerateError as exc:
            raise from_grpc(exc.code, exc.message, exc.reason) from None
        if req.stream:
            return EventStreamResponse(
                generation.sse(),
                headers=dict(run.ratelimit_headers()),  # x-ratelimit-* under --policy budgets
                write_timeout=self.config.write_timeout,
                on_slow_client=self.metrics.slow_clients.inc,
            )  # type: ignore[return-value]
        rec = run.record
        return JSONResponse(
            body,
            headers={
                "x-pools": ",".join(rec.pools),
                "x-migrations": str(rec.migrations),
                **dict(run.ratelimit_headers()),
                CACHED_SOURCE_HEADER: generation.cached_tokens()[1],
            },
        )


class _Releasing:
    """A response that runs `release` once it is over, however it ends (sent, failed, cancelled):
    the ASGI call of a streaming response lasts as long as its stream."""

    def __init__(self, response: Any, release: Any) -> None:
        self.response = response
        self.status_code = response.status_code
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self._release()


class Generation:
    """One OpenAI request's output: pulls the request path's outputs and turns them into text chunks."""

    def __init__(
        self,
        front: OpenAIFront,
        run: PathRun,
        kind: str,
        req: CompletionRequest | ChatCompletionRequest,
        text: TextStream,
        request_id: str,
        prompt_tokens: int,
    ) -> None:
        self.front = front
        self.run = run
        self.kind = kind
        self.req = req
        self.text = text
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.created = int(time.time())
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self._outputs: AsyncGenerator[Output, None] = run.outputs
        self._first: Output | None = None

    async def start(self) -> None:
        """Waits for the first output (a pool admitted the request and sent its first tokens)."""
        try:
            self._first = await anext(self._outputs)
        except BaseException as exc:
            await self.run.end(exc)
            raise

    async def _texts(self) -> AsyncIterator[str]:
        """The output text, in final pieces; sets finish_reason and completion_tokens."""
        error: BaseException | None = None
        try:
            out = self._first
            while out is not None:
                if out.token_ids:
                    delta = self.text.push(out.token_ids)
                    self.completion_tokens += delta.tokens_used
                    if delta.text:
                        yield delta.text
                    if delta.stopped:
                        self.finish_reason = "stop"
                        return
                if out.finish is not None:
                    tail = self.text.finish()
                    if tail:
                        yield tail
                    self.finish_reason = "stop" if self.text.stopped else _FINISH.get(out.finish, "length")
                    return
                out = await anext(self._outputs, None)
        except BaseException as exc:
            error = exc
            raise
        finally:
            await self.run.end(error)

    def cached_tokens(self) -> tuple[int, str]:
        """The prompt tokens found cached at the first pool and who says so ("pool" or "estimate")."""
        rec = self.run.record
        if not rec.pools:
            return 0, "estimate"
        pool = self.front.core.table.pools.get(rec.pools[0])
        block = pool.block_size if pool is not None and pool.block_size > 0 else DEFAULT_BLOCK_SIZE
        return rec.cached_tokens(self.prompt_tokens, block)

    def usage(self) -> dict[str, Any]:
        cached, _ = self.cached_tokens()
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    async def whole(self) -> dict[str, Any]:
        """start() then complete()."""
        await self.start()
        return await self.complete()

    async def complete(self) -> dict[str, Any]:
        """The whole response of a non-streaming request."""
        parts = [piece async for piece in self._texts()]
        text = "".join(parts)
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": self.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
            "usage": self.usage(),
        }

    def _chunk(self, text: str | None, finish: str | None, *, first: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.req.model,
            "choices": [choice],
        }
        if self._include_usage:
            chunk["usage"] = None
        return chunk

    @property
    def _include_usage(self) -> bool:
        opts = self.req.stream_options
        return bool(opts and opts.include_usage)

    async def sse(self) -> AsyncIterator[str]:
        """The response as server-sent events: chunks, a finish chunk, usage if asked, [DONE].

        An error after the stream started is the last event, in OpenAI's error shape."""

        def event(obj: dict[str, Any]) -> str:
            return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"

        if self.kind == "chat":
            yield event(self._chunk("", None, first=True))
        texts = self._texts()
        try:
            async for piece in texts:
                yield event(self._chunk(piece, None))
        except GenerateError as exc:
            error = from_grpc(exc.code, exc.message, getattr(exc, "reason", None))
            log.warning("stream failed after it started", code=exc.code.name, error=exc.message)
            yield event(error.body())
            return
        except Exception:  # a defect: still end the stream with an error event, not a cut
            log.exception("stream failed unexpectedly")  # the reply never carries the exception
            yield event(ApiError(500, "internal error", type="server_error", code="internal_error").body())
            return
        finally:
            await texts.aclose()  # type: ignore[attr-defined]
        yield event(self._chunk(None if self.kind == "chat" else "", self.finish_reason))
        if self._include_usage:
            # Headers are long gone: an SSE comment (ignored by clients) names the figure's source.
            yield f": {CACHED_SOURCE_HEADER}: {self.cached_tokens()[1]}\n\n"
            yield event(
                {
                    "id": self.id,
                    "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
                    "created": self.created,
                    "model": self.req.model,
                    "choices": [],
                    "usage": self.usage(),
                }
            )
        yield "data: [DONE]\n\n"
