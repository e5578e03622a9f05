"""Server-sent events to a client that may stop reading or go away: every write is bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from globalrouter.http_api.schemas import InvalidField
from meshkit.logs import get_logger

log = get_logger(module="globalrouter.http_api.streaming")


def check_streamable(scope, stream: bool) -> None:
    """Refuses `stream: true` over HTTP/1.0, naming the field, before any pool is asked.

    A stream's length is unknown when it starts, and the server frames it with chunked transfer
    encoding, which HTTP/1.0 does not have (uvicorn would send it anyway, and a 1.0 client would
    read the chunk sizes as part of the events). HTTP/1.0 clients get whole replies.
    """
    if stream and scope.get("http_version") == "1.0":
        raise InvalidField(
            "stream", "stream: needs HTTP/1.1 (HTTP/1.0 has no chunked transfer); set it false"
        )


class EventStreamResponse:
    """An ASGI response writing `events` (already framed `data: ...\\n\\n` strings) as they come.

    Unlike a plain streaming response, a write that waits longer than `write_timeout` for the
    client to read (uvicorn blocks in send() once the socket and its buffer are full) ends the
    request: the token stream is closed, which cancels the pool's work, and the connection is
    dropped. A client that disconnects ends it the same way at once.
    """

    media_type = "text/event-stream"
    status_code = 200

    def __init__(
        self,
        events: AsyncIterator[str],
        *,
        headers: dict[str, str],
        write_timeout: float,
        on_slow_client: Callable[[], None],
    ) -> None:
        self._events = events
        self._headers = headers
        self._write_timeout = write_timeout
        self._on_slow_client = on_slow_client

    async def __call__(self, scope, receive, send) -> None:
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self._headers.items()]
        raw += [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        writer = asyncio.ensure_future(self._write(send, raw))
        watcher = asyncio.ensure_future(self._wait_disconnect(receive))
        try:
            await asyncio.wait((writer, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, watcher):
                task.cancel()
            for task in (writer, watcher):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await self._events.aclose()  # type: ignore[attr-defined]

    async def _write(self, send, raw_headers) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
        try:
            async for data in self._events:
                async with asyncio.timeout(self._write_timeout):
                    await send(
                        {"type": "http.response.body", "body": data.encode("utf-8"), "more_body": True}
                    )
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except TimeoutError:
            self._on_slow_client()
            log.warning("client stopped reading; request ended", write_timeout_s=self._write_timeout)

    @staticmethod
    async def _wait_disconnect(receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
