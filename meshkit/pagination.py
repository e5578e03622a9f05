"""AIP-158 pagination, the one copy: reading page_size/page_token, cutting a page, opaque tokens.

A token carries the last key served and a fingerprint of the filters, so it resumes after that
key and is refused when replayed with other filters.
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from meshkit.validation import Violations

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

T = TypeVar("T")


class PageTokenError(ValueError):
    """The page token is malformed or was issued for other filters."""


@dataclass(frozen=True, slots=True)
class PageRequest:
    """A validated page request: how many items, after which key, under which filters."""

    size: int
    after: str | None
    filters: tuple[str, ...]


def page_size(requested: int) -> int:
    """0 → default; above the max → the max; negative is an error."""
    if requested < 0:
        raise ValueError("page_size must not be negative")
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    return min(requested, MAX_PAGE_SIZE)


def page_request(v: Violations, size: int, token: str, filters: tuple[str, ...]) -> PageRequest:
    """Reads a request's page_size and page_token, recording a violation naming each that is wrong."""
    if size < 0:
        v.add("page_size", f"must not be negative (got {size})")
    after = None
    try:
        after = decode_page_token(token, filters)
    except PageTokenError as exc:
        v.add("page_token", str(exc))
    return PageRequest(size=page_size(max(size, 0)), after=after, filters=filters)


def after_key(items: Iterable[T], key: Callable[[T], str], after: str | None) -> Iterator[T]:
    """The items (ordered by `key`) whose key comes after `after` (all of them for None)."""
    if after is None:
        yield from items
        return
    for item in items:
        if key(item) > after:
            yield item


def take(items: Iterable[T], limit: int) -> tuple[list[T], bool]:
    """Up to `limit` items, and whether another follows (reads at most limit + 1 of them)."""
    page: list[T] = []
    for item in items:
        if len(page) == limit:
            return page, True
        page.append(item)
    return page, False


def next_token(page: list[T], more: bool, key: Callable[[T], str], filters: tuple[str, ...]) -> str:
    """The token of the page after `page` ('' when nothing follows)."""
    return encode_page_token(key(page[-1]), filters) if more and page else ""


def paginate(items: Iterable[T], key: Callable[[T], str], request: PageRequest) -> tuple[list[T], str]:
    """One page of `items` (ordered by `key`) for `request`, and the next page's token."""
    page, more = take(after_key(items, key, request.after), request.size)
    return page, next_token(page, more, key, request.filters)


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
