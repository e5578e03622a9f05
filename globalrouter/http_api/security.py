"""Security of the HTTP front: bounded request heads, the TLS peer's identity, and the mesh's one authorization table."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import grpc
import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshkit.authz import HTTP, Authorizer, Refusal
from meshkit.errors import Reason
from meshkit.identity import certificate_uris

PEER_URIS = "mesh.peer_uris"
"""Scope key (under scope["extensions"]) of the verified client certificate's URI SANs."""


class HeadTooLarge(httptools.HttpParserCallbackError):
    """A request line or header block past its bound (answered 431, connection closed)."""


class BoundedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with bounds on the request head, and the TLS peer's identity in scope.

    httptools (llhttp) bounds neither the URL nor the header block, so a client could grow one
    request's head without limit; here the URL and headers together are capped in bytes and
    headers in count, and a request past either gets 431 before any handler runs.

    uvicorn has no timeout for a request head either (its keep-alive timer runs only between
    requests, and stops at the first byte), and its limit_concurrency answers 503 only once a head
    is complete, so slow-loris connections that never finish their heads were unbounded in time
    and number. Here a head must be complete within `head_timeout` (from the connection's accept,
    TLS handshake included, then from each next request's first byte; 408 and closed otherwise), and a connection past
    limit_concurrency is answered 503 and closed as soon as it is made.
    """

    max_head_bytes = 32 * 1024
    max_headers = 100
    head_timeout = 10.0

    @classmethod
    def bounded(cls, max_head_bytes: int, max_headers: int, head_timeout: float) -> type[BoundedHttpProtocol]:
        """This protocol with the given bounds (uvicorn instantiates the class it is given)."""
        bounds = {"max_head_bytes": max_head_bytes, "max_headers": max_headers, "head_timeout": head_timeout}
        return type(cls.__name__, (cls,), bounds)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Made at accept, before any TLS handshake: the head's deadline counts from here.
        self._accepted_at = self.loop.time()

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._header_count = 0
        self._head_error = ""
        self._head_timer: asyncio.TimerHandle | None = None
        # The handshake is over when a TLS transport reaches the protocol: the peer certificate (if
        # any) is verified; its URI SANs are read once per connection, not per request.
        self._peer_uris: tuple[str, ...] = ()
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            der = ssl_object.getpeercert(binary_form=True)
            if der:
                self._peer_uris = tuple(certificate_uris(der))
        if self.limit_concurrency is not None and len(self.connections) > self.limit_concurrency:
            # uvicorn counted this connection in already; it would wait for a complete head to say 503.
            self._reply_and_close(503, "too many connections", "server_busy", "server_error")
            return
        # One budget from accept: a TLS handshake (which the listener bounds by head_timeout too)
        # spends part of it, and the first head gets what is left.
        remaining = self.head_timeout - (self.loop.time() - self._accepted_at)
        self._head_timer = self.loop.call_later(max(0.0, remaining), self._head_timed_out)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:  # a next request on a kept-alive connection: its head's deadline
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)
        self._head_bytes = 0
        self._header_count = 0
        # ASGI extensions map names to dicts; this one carries the verified peer's URI SANs.
        self.scope["extensions"] = {PEER_URIS: {"uris": self._peer_uris}}

    def _count(self, size: int, header: bool) -> None:
        self._head_bytes += size
        self._header_count += header
        if self._head_bytes > self.max_head_bytes:
            self._head_error = f"request line and headers exceed {self.max_head_bytes} bytes"
        elif self._header_count > self.max_headers:
            self._head_error = f"more than {self.max_headers} headers"
        if self._head_error:
            raise HeadTooLarge(self._head_error)

    def on_url(self, url: bytes) -> None:
        self._count(len(url), False)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), True)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_head_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # A pipelined head trickling in while a response is still being written: a 408 would
            # land inside that response, so the connection is just closed.
            self.transport.close()
            return
        self._reply_and_close(
            408,
            f"request head not complete within {self.head_timeout:g} s",
            "head_timeout",
            "invalid_request_error",
        )

    def send_400_response(self, msg: str) -> None:
        if not self._head_error:
            super().send_400_response(msg)
            return
        self._reply_and_close(431, self._head_error, "headers_too_large", "invalid_request_error")

    def _reply_and_close(self, status: int, message: str, code: str, kind: str) -> None:
        """An error in OpenAI's shape, written straight to the transport (no request reached the app)."""
        self._cancel_head_timer()
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\n" % (status, _REASONS[status])
            + b"content-length: "
            + str(len(body)).encode()
            + b"\r\nconnection: close\r\n\r\n"
            + body
        )
        self.transport.close()


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


_HTTP_STATUS = {grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403}
_ERROR_TYPE = {401: "authentication_error", 403: "permission_error"}


class AuthMiddleware:
    """Identifies the caller of every HTTP request (client certificate, else `Authorization: Bearer`)
    and applies the mesh's authorization table before any handler runs, so a refusal changes nothing.

    The identity is left in scope["state"]["identity"] (the key of the per-identity stream limit).
    """

    def __init__(self, app: Any, authorizer: Authorizer) -> None:
        self.app = app
        self.authorizer = authorizer

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        uris = list(scope.get("extensions", {}).get(PEER_URIS, {}).get("uris", ()))
        header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        authorization = header.decode("latin-1") if header is not None else None
        try:
            identity = self.authorizer.admit_http(scope["path"], uris, authorization)
        except Refusal as refusal:
            await _refuse(send, refusal)
            return
        scope.setdefault("state", {})["identity"] = identity
        if not identity.key:
            await self.app(scope, receive, send)
            return
        refused: Refusal | None = None

        async def checked(message: dict[str, Any]) -> None:
            # A caller identified by an API key: once a reload (SIGHUP) revokes the key, nothing
            # more is sent (a dict lookup per message).
            nonlocal refused
            if refused is not None:
                return  # the 401 went out instead of the app's response; the rest is dropped
            if not self.authorizer.key_in_force(identity):
                refused = Refusal(
                    grpc.StatusCode.UNAUTHENTICATED, Reason.UNAUTHENTICATED, "the API key was revoked"
                )
                self.authorizer.record(HTTP + scope["path"], refused)
                if message["type"] == "http.response.start":
                    await _refuse(send, refused)
                    return
                # Mid-response (a stream): the rest is not sent; the server closes the connection,
                # so the client sees the response end incomplete.
                raise KeyRevoked(refused)
            await send(message)

        with contextlib.suppress(KeyRevoked):
            await self.app(scope, receive, checked)


class KeyRevoked(Exception):
    """The API key of a request in progress was revoked: the rest of its response is not sent."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(str(refusal))
        self.refusal = refusal


async def _refuse(send: Any, refusal: Refusal) -> None:
    """A refusal as 401 (with WWW-Authenticate) or 403, in OpenAI's error shape."""
    status = _HTTP_STATUS.get(refusal.code, 403)
    body = json.dumps(
        {
            "error": {
                "message": str(refusal),
                "type": _ERROR_TYPE[status],
                "param": None,
                "code": str(refusal.reason),
            }
        }
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="globalrouter"'))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
