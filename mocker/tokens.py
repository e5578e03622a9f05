"""Deterministic output tokens: the next token is a function of the whole sequence before it."""

from __future__ import annotations

from array import array

import xxhash

from meshkit.blocks import u32le

VOCAB_SIZE = 32_000


class TokenStream:
    """Generates the continuation of a token sequence.

    The next token is xxh3_64(every token so far, as little-endian u32) mod `vocab_size`. A streaming
    hasher keeps that state, so generating costs O(1) per token while still depending on the whole
    sequence — and any pool given (prompt + the first k outputs) continues exactly as an
    uninterrupted run would, which is what makes migration verifiable.

    `vocab_size` makes the ids decodable by a real tokenizer of that size (default: VOCAB_SIZE,
    the stream every mocker produced before the flag existed). `seed` is the request's sampling
    seed, used as the hash seed: another seed gives another stream, the same seed the same one,
    and a migrated request carries its seed along, so it still continues exactly.
    """

    def __init__(self, tokens: list[int] | array, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> None:
        if vocab_size < 1:
            raise ValueError("vocab_size must be at least 1")
        self._vocab_size = vocab_size
        # xxh3 seeds are unsigned 64-bit; a negative request seed maps to its two's complement.
        self._hasher = xxhash.xxh3_64(seed=seed % 2**64)
        self._hasher.update(u32le(tokens))

    def next(self, n: int) -> list[int]:
        """The next `n` tokens (and appends them to the sequence)."""
        out: list[int] = []
        for _ in range(n):
            token = self._hasher.intdigest() % self._vocab_size
            out.append(token)
            self._hasher.update(token.to_bytes(4, "little"))
        return out


def continue_sequence(tokens: list[int], n: int, vocab_size: int = VOCAB_SIZE, seed: int = 0) -> list[int]:
    """The `n` tokens any mocker generates after `tokens` (for tests that check migrated output)."""
    return TokenStream(tokens, vocab_size, seed).next(n)
