"""Deterministic output tokens: the next token is a function of the whole sequence before it."""

from __future__ import annotations

from array import array

import xxhash

from meshkit.blocks import u32le

VOCAB_SIZE = 32_000


class TokenStream:
    """Generates the continuation of a token sequence.

    The next token is xxh3_64(every token so far, as little-endian u32) mod VOCAB_SIZE. A streaming
    hasher keeps that state, so generating costs O(1) per token while still depending on the whole
    sequence — and any pool given (prompt + the first k outputs) continues exactly as an
    uninterrupted run would, which is what makes migration verifiable.
    """

    def __init__(self, tokens: list[int] | array) -> None:
        self._hasher = xxhash.xxh3_64()
        self._hasher.update(u32le(tokens))

    def next(self, n: int) -> list[int]:
        """The next `n` tokens (and appends them to the sequence)."""
        out: list[int] = []
        for _ in range(n):
            token = self._hasher.intdigest() % VOCAB_SIZE
            out.append(token)
            self._hasher.update(token.to_bytes(4, "little"))
        return out


def continue_sequence(tokens: list[int], n: int) -> list[int]:
    """The `n` tokens any mocker generates after `tokens` (for tests that check migrated output)."""
    return TokenStream(tokens).next(n)
