"""meshkit.pagination, the one copy every listing uses (discovery's ListPools/ListFrontends, the router's ListPools)."""

from __future__ import annotations

import pytest

from meshkit import pagination
from meshkit.validation import Violations

KEYS = [f"k{i:02d}" for i in range(25)]


def walk(size: int, filters=("f",)) -> list[list[str]]:
    """Every page of KEYS, following the tokens."""
    pages, token = [], ""
    while True:
        v = Violations()
        request = pagination.page_request(v, size, token, filters)
        assert not v
        page, token = pagination.paginate(KEYS, lambda k: k, request)
        pages.append(page)
        if not token:
            return pages


@pytest.mark.parametrize("size", [1, 7, 24, 25, 26])
def test_pages_cover_every_key_once_in_order(size):
    pages = walk(size)
    assert [k for page in pages for k in page] == KEYS
    assert all(len(page) == size for page in pages[:-1])
    assert 0 < len(pages[-1]) <= size


def test_size_zero_is_the_default_and_large_sizes_are_capped():
    v = Violations()
    assert pagination.page_request(v, 0, "", ()).size == pagination.DEFAULT_PAGE_SIZE
    assert pagination.page_request(v, 10**6, "", ()).size == pagination.MAX_PAGE_SIZE
    assert not v


def test_bad_size_and_token_are_named_together():
    v = Violations()
    other = pagination.encode_page_token("k03", ("other",))
    request = pagination.page_request(v, -1, other, ("f",))
    assert [f for f, _ in v.items] == ["page_size", "page_token"]
    assert request.after is None


def test_take_reads_at_most_one_more_than_the_page():
    read = []

    def items():
        for k in KEYS:
            read.append(k)
            yield k

    page, more = pagination.take(items(), 3)
    assert page == KEYS[:3] and more and read == KEYS[:4]
    assert pagination.take(iter(KEYS[:3]), 3) == (KEYS[:3], False)
    assert pagination.next_token([], True, lambda k: k, ()) == ""
