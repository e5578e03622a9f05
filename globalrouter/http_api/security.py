"""Security of the HTTP front: bounded request heads, the TLS peer's identity, and the mesh's one authorization table."""

from __future__ import annotations

import json
from typing import Any

import grpc
import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from meshkit.authz import Authorizer, Refusal
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
    """

    max_head_bytes = 32 * 1024
    max_headers = 100

    @classmethod
    def bounded(cls, max_head_bytes: int, max_headers: int) -> type[BoundedHttpProtocol]:
        """This protocol with the given bounds (uvicorn instantiates the class it is given)."""
        return type(cls.__name__, (cls,), {"max_head_bytes": max_head_bytes, "max_headers": max_headers})

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._header_count = 0
        self._head_error = ""
        # The handshake is over when a TLS transport reaches the protocol: the peer certificate (if
        # any) is verified; its URI SANs are read once per connection, not per request.
        self._peer_uris: tuple[str, ...] = ()
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            der = ssl_object.getpeercert(binary_form=True)
            if der:
                self._peer_uris = tuple(certificate_uris(der))

    def on_message_begin(self) -> None:
        super().on_message_begin()
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

    def send_400_response(self, msg: str) -> None:
        if not self._head_error:
            super().send_400_response(msg)
            return
        body = json.dumps(
            {
                "error": {
                    "message": self._head_error,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "headers_too_large",
                }
            }
        ).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body
        )
        self.transport.close()


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
            return
        scope.setdefault("state", {})["identity"] = identity
        await self.app(scope, receive, send)
