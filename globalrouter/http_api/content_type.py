"""Only JSON bodies on the generation endpoints: any other content type is answered 415 before it is read."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

JSON_MEDIA_TYPE = "application/json"


def is_json(content_type: bytes | None) -> bool:
    """`application/json`, with or without parameters (`; charset=utf-8`), in any case."""
    if content_type is None:
        return False
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == JSON_MEDIA_TYPE.encode()


class JsonBodiesOnly:
    """Refuses a POST to one of `paths` whose Content-Type is not JSON, with 415 in OpenAI's shape.

    A browser sends text/plain, form-encoded and multipart bodies cross-site without a CORS
    preflight; parsing those as JSON would let any web page a user opens call the API on the
    user's network. application/json needs a preflight, which this server never grants.
    """

    def __init__(self, app: Any, paths: Iterable[str]) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
        if is_json(content_type):
            await self.app(scope, receive, send)
            return
        shown = content_type.decode("latin-1")[:100] if content_type is not None else "none"
        body = json.dumps(
            {
                "error": {
                    "message": f"Content-Type must be {JSON_MEDIA_TYPE} (got {shown})",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "unsupported_media_type",
                }
            }
        ).encode()
        # The body is not read: the connection is closed after the reply rather than drained.
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 415, "headers": headers})
        await send({"type": "http.response.body", "body": body})
