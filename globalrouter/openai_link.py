"""Serving links to OpenAI-compatible HTTP pools (vLLM, SGLang, Dynamo): `POST /v1/completions`, streamed.

The request goes out as token ids (`prompt` is a list of ids, `return_token_ids` makes every
server-sent event carry the ids it adds), greedy (`temperature: 0`), with the usage chunk at the
end, so the answer is token ids like on the mesh's gRPC link and a migrated request continues
exactly; the usage chunk's `prompt_tokens_details.cached_tokens` (what the engine found in its
prefix cache) rides on the PoolFinish. The link maps HTTP onto the same Admitted / PoolStream
the gRPC link gives, so one request loop serves both: an answer other than 200 before the
stream starts is an admission failure (429 and 503 are the pool's own 'no', 404 means it does not
serve the model), a connection that cannot be made is an unreachable pool, and a stream that ends
without a finish is StreamBroken.

The client is aiohttp: asyncio-native, well kept, one ClientSession whose TCPConnector pools
keep-alive connections per host (so a request does not pay a TCP/TLS handshake), reads a response
body incrementally (what server-sent events need), and lets a cancelled stream close its
connection (the engine then aborts the request).
"""

from __future__ import annotations

import json
from array import array
from collections import deque
from urllib.parse import urlsplit

import aiohttp
import grpc

from globalrouter.config import OpenAILinkConfig
from globalrouter.v1 import pool_frontend_pb2 as pf
from meshkit.blocks import DEFAULT_BLOCK_SIZE
from meshkit.errors import Reason
from meshkit.limits import ByteBoundedCache

PoolRequest = pf.PoolFrontendServiceGenerateRequest
PoolResponse = pf.PoolFrontendServiceGenerateResponse

# Bounds on what a pool's answer may hold (outside input).
MAX_EVENT_BYTES = 64 * 1024 * 1024
MAX_ERROR_BODY = 4096
# Prompt ids kept JSON-encoded for the requests in flight (PromptJson), in bytes of text.
PROMPT_JSON_CACHE_BYTES = 64 * 1024 * 1024

_FINISH = {"length": pf.POOL_FINISH_REASON_LENGTH, "stop": pf.POOL_FINISH_REASON_STOP}


def completions_url(frontend: str) -> str:
    """Where a frontend takes completions: `{base}/completions` for a base path (OpenAI style,
    e.g. http://h:8000/v1), else `/v1/completions` on the host."""
    path = urlsplit(frontend).path.rstrip("/")
    base = frontend.rstrip("/")
    return f"{base}/completions" if path else f"{base}/v1/completions"


def request_body(request: PoolRequest) -> dict:
    """The JSON body of one completion request: greedy unless the request's sampling parameters
    say otherwise (they pass through as the engine's own fields; stop token ids as vLLM's)."""
    return {"model": served_name(request), "prompt": list(request.token_ids), **_body_rest(request)}


def served_name(request: PoolRequest) -> str:
    """The model name the pool knows: vLLM serves a LoRA adapter under its own name (its
    /v1/models entry), else the model's."""
    return request.adapter or request.model


def _body_rest(request: PoolRequest) -> dict:
    """request_body() but the prompt."""
    body = {
        "max_tokens": request.max_tokens,
        "stream": True,
        "temperature": 0,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
    }
    sampling = request.sampling
    for name in ("temperature", "top_p", "seed", "presence_penalty", "frequency_penalty"):
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    if sampling.stop_token_ids:
        body["stop_token_ids"] = list(sampling.stop_token_ids)
    return body


_COMMA = ","


class PromptJson:
    """The prompts' token ids as JSON text, kept per request id while it runs: a request asks
    several pools (admission tries) and continues elsewhere after a failure (its prompt plus the
    tokens so far), so its prompt, which may be a million ids, is encoded once, not on every try.
    Bounded by bytes (least recently used out); an entry is used only when the ids it encodes
    are the request's first ids (request ids come from clients and may repeat)."""

    def __init__(self, max_bytes: int = PROMPT_JSON_CACHE_BYTES) -> None:
        # The ids themselves are kept too (4 bytes each), to check a hit exactly.
        self._cache: ByteBoundedCache[str, tuple[array, str]] = ByteBoundedCache(
            max_bytes, lambda key, value: len(key) + len(value[1]) + value[0].itemsize * len(value[0])
        )

    def ids(self, request: PoolRequest) -> str:
        """`request.token_ids` as the JSON list's inside ("1,2,3")."""
        ids = request.token_ids
        hit = self._cache.get(request.request_id)
        if hit is not None:
            known, text = hit
            n = len(known)
            if n <= len(ids) and array("I", ids[:n]) == known:
                if n == len(ids):
                    return text
                more = _COMMA.join(map(str, ids[n:]))
                text = f"{text},{more}" if text else more
                self._cache.put(request.request_id, (array("I", ids), text))
                return text
        text = _COMMA.join(map(str, ids))
        self._cache.put(request.request_id, (array("I", ids), text))
        return text

    def body(self, request: PoolRequest) -> bytes:
        """request_body(request) as JSON bytes, the prompt's ids from the cache."""
        rest = json.dumps({"model": served_name(request), **_body_rest(request)}, separators=(",", ":"))
        return f'{{"prompt":[{self.ids(request)}],{rest[1:]}'.encode()


class LinkError(Exception):
    """A pool's answer before the stream: gRPC code, ErrorInfo reason, whether it is the pool's 'no'."""

    def __init__(self, code: grpc.StatusCode, reason: str | None, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.refused = refused


def status_error(status: int, body: str) -> LinkError:
    """What an HTTP status other than 200 before the stream means for admission."""
    text = f"HTTP {status}: {body[:MAX_ERROR_BODY]}".strip()
    if status == 429:
        return LinkError(grpc.StatusCode.RESOURCE_EXHAUSTED, Reason.QUEUE_FULL, text, refused=True)
    if status == 503:
        return LinkError(grpc.StatusCode.UNAVAILABLE, Reason.POOL_REFUSING, text, refused=True)
    if status == 404:
        return LinkError(grpc.StatusCode.NOT_FOUND, Reason.MODEL_NOT_SERVED, text, refused=True)
    if status in (400, 413, 422):
        return LinkError(grpc.StatusCode.INVALID_ARGUMENT, None, text, refused=False)
    return LinkError(grpc.StatusCode.UNAVAILABLE, None, text, refused=False)


class SseParser:
    """Splits a server-sent event body into its `data:` payloads (bounded line length)."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf
        buf += chunk
        out: list[bytes] = []
        start = 0
        while (nl := buf.find(b"\n", start)) >= 0:
            line = bytes(buf[start:nl]).rstrip(b"\r")
            start = nl + 1
            if line.startswith(b"data:"):
                out.append(line[5:].lstrip(b" "))
        del buf[:start]
        if len(buf) > MAX_EVENT_BYTES:
            raise ValueError(f"a server-sent event line exceeds {MAX_EVENT_BYTES} bytes")
        return out


class OpenAIPoolStream:
    """PoolStream over one streamed `/v1/completions` response."""

    def __init__(self, response: aiohttp.ClientResponse, broken: type[Exception]) -> None:
        self._resp = response
        self._broken = broken
        self._parser = SseParser()
        self._pending: deque[PoolResponse] = deque()
        self._generated = 0
        self._done = False
        """The pool gave its finish reason."""
        self._reason = pf.POOL_FINISH_REASON_UNSPECIFIED
        self._finish_sent = False
        """The PoolFinish is queued: it waits, after the finish reason, for the usage chunk that
        follows (its cached prompt tokens), [DONE] or the stream's end, whichever comes first."""
        self._error: Exception | None = None
        """A failure seen after tokens that are still to be read: raised once they are."""

    def _fail(self, detail: str) -> Exception:
        self.cancel()
        return self._broken(grpc.StatusCode.UNAVAILABLE, None, detail)

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            if not self._done:
                raise self._fail("the stream ended ([DONE]) without a finish reason")
            self._send_finish(None)
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise self._fail("the pool sent an event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise self._fail("the pool sent an event that is not a JSON object")
        if "error" in chunk:
            raise self._fail(f"the pool reported an error mid-stream: {str(chunk['error'])[:MAX_ERROR_BODY]}")
        choices = chunk.get("choices") or []
        if not isinstance(choices, list):
            raise self._fail("the event's choices is not a list")
        for choice in choices[:1]:
            ids = choice.get("token_ids") if isinstance(choice, dict) else None
            if ids:
                if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in ids):
                    raise self._fail("the event's token_ids are not token ids")
                self._generated += len(ids)
                self._pending.append(PoolResponse(tokens=pf.PoolTokens(token_ids=ids)))
            reason = choice.get("finish_reason") if isinstance(choice, dict) else None
            if reason is not None and not self._done:
                if reason not in _FINISH:
                    raise self._fail(f"the pool ended the request with finish_reason {str(reason)[:64]!r}")
                self._done = True
                self._reason = _FINISH[reason]
        if self._done and not self._finish_sent:
            cached = cached_tokens(chunk.get("usage"))
            if cached is not None:
                self._send_finish(cached)

    def _send_finish(self, cached: int | None) -> bool:
        """Queues the PoolFinish (once) with the pool's cached prompt tokens when it stated them;
        whether it did now."""
        if self._finish_sent or not self._done:
            return False
        self._finish_sent = True
        finish = pf.PoolFinish(reason=self._reason, tokens_generated=self._generated)
        if cached is not None:
            finish.cached_tokens = cached
        self._pending.append(PoolResponse(finish=finish))
        return True

    async def read(self) -> PoolResponse | None:
        """The next message; None after the finish. Raises the link's StreamBroken on a failure."""
        while not self._pending:
            if self._error is not None:
                raise self._error
            if self._resp.closed and self._done:
                if self._send_finish(None):
                    break
                return None
            try:
                chunk = await self._resp.content.readany()
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                if self._send_finish(None):  # the request was over: only its usage is lost
                    self.cancel()
                    break
                raise self._fail(f"the stream broke: {exc!r}") from None
            if not chunk:
                self._resp.release()
                if self._done:
                    if self._send_finish(None):
                        break
                    return None
                raise self._fail("the pool closed the stream before a finish")
            try:
                events = self._parser.feed(chunk)
            except ValueError as exc:
                raise self._fail(str(exc)) from None
            try:
                for data in events:
                    self._event(data)
            except self._broken as exc:
                # Tokens that came before the failure are the client's: deliver them first.
                if not self._pending:
                    raise
                self._error = exc
        return self._pending.popleft()

    def cancel(self) -> None:
        """Closes the connection (the engine aborts the request); idempotent."""
        if not self._resp.closed:
            self._resp.close()


class OpenAIClient:
    """The global frontend's HTTP client for every OpenAI pool: one session, pooled keep-alive connections."""

    def __init__(self, config: OpenAILinkConfig | None = None) -> None:
        self.config = config or OpenAILinkConfig()
        """Timeouts and the connection limit (`globalrouter serve --openai-*`)."""
        self._session: aiohttp.ClientSession | None = None
        self.prompts = PromptJson()
        """Each request's prompt encoded once for all its admission tries and migrations."""

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, keepalive_timeout=60.0),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self.config.connect_timeout, sock_read=self.config.read_timeout
                ),
                raise_for_status=False,
            )
        return self._session

    async def open(self, url: str, request: PoolRequest, broken: type[Exception]) -> OpenAIPoolStream:
        """Starts the request on `url`; raises LinkError when the pool does not take it."""
        try:
            resp = await self.session().post(
                completions_url(url),
                data=self.prompts.body(request),
                headers={
                    "X-Request-Id": request.request_id,
                    "Accept": "text/event-stream",
                    "Content-Type": "application/json",
                },
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise LinkError(
                grpc.StatusCode.UNAVAILABLE, None, f"cannot reach {url}: {exc!r}", refused=False
            ) from None
        if resp.status != 200:
            try:
                body = (await resp.content.read(MAX_ERROR_BODY)).decode("utf-8", "replace")
            except (aiohttp.ClientError, OSError, TimeoutError):
                body = ""
            resp.close()
            raise status_error(resp.status, body)
        return OpenAIPoolStream(resp, broken)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def cached_tokens(usage: object) -> int | None:
    """The prompt tokens a pool's usage says it found cached (`prompt_tokens_details.cached_tokens`,
    which vLLM sends when started with --enable-prompt-tokens-details); None when it says nothing
    or what it says is not a token count (outside input: a malformed figure is not reported)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached < 2**32:
        return cached
    return None


def admission(request: PoolRequest) -> pf.PoolAdmission:
    """The admission an HTTP pool implies by answering 200 (it states no cached prefix)."""
    return pf.PoolAdmission(prompt_blocks=len(request.token_ids) // DEFAULT_BLOCK_SIZE)
