"""Opaque AIP-158 page tokens: they carry the last key served and a fingerprint of the filters."""

from __future__ import annotations

import base64
import json
import zlib

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


class PageTokenError(ValueError):
    """The page token is malformed or was issued for other filters."""


def page_size(requested: int) -> int:
    """0 → default; above the max → the max; negative is an error."""
    if requested < 0:
        raise ValueError("page_size must not be negative")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def _fingerprint(filters: tuple[str, ...]) -> int:
    return zlib.crc32("\x00".join(filters).encode())


def encode_page_token(last_key: str, filters: tuple[str, ...]) -> str:
    """A token that resumes after `last_key` for the same `filters`."""
    raw = json.dumps({"k": last_key, "f": _fingerprint(filters)}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str, filters: tuple[str, ...]) -> str | None:
    """The key to resume after; None for an empty token. Raises PageTokenError when it does not fit."""
    if not token:
        return None
    try:
        padded = token + "=" * (-len(token) % 4)
        data = json.loads(base64.urlsafe_b64decode(padded.encode()))
        key, fp = data["k"], data["f"]
    except Exception as exc:
        raise PageTokenError("page_token is malformed") from exc
    if not isinstance(key, str) or fp != _fingerprint(filters):
        raise PageTokenError("page_token was issued for other filters")
    return key
