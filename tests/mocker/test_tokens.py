"""Deterministic output tokens: a function of the whole sequence, so continuation is exact."""

from __future__ import annotations

import struct

import xxhash

from mocker.tokens import VOCAB_SIZE, TokenStream, continue_sequence


def test_token_stream_known_answers():
    """Pins the mocker's output: any mocker, on any platform, continues a sequence with these tokens."""
    assert continue_sequence([1, 2, 3], 8) == [13640, 2622, 19093, 28859, 25012, 24665, 4969, 31438]
    assert continue_sequence([0x01020304, 4294967295], 4) == [30837, 4673, 25023, 29166]
    # Written out: the next token is xxh3_64(all tokens so far as u32 little-endian) mod VOCAB_SIZE.
    seq = [0x01020304, 4294967295]
    for expected in [30837, 4673]:
        token = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(seq)}I", *seq)) % VOCAB_SIZE
        assert token == expected
        seq.append(token)


def test_same_prompt_same_output_different_prompt_different_output():
    prompt = list(range(50))
    assert continue_sequence(prompt, 40) == continue_sequence(prompt, 40)
    assert continue_sequence(prompt, 40) != continue_sequence([*prompt[:-1], 7], 40)
    assert all(0 <= t < VOCAB_SIZE for t in continue_sequence(prompt, 500))


def test_output_depends_on_every_earlier_token_not_just_the_last():
    a = continue_sequence([1, 2, 3, 9], 10)
    b = continue_sequence([5, 2, 3, 9], 10)
    assert a != b


def test_continuation_from_prompt_plus_first_k_matches_uninterrupted_run():
    prompt = [17, 4, 99, 31_999, 0, 12]
    full = continue_sequence(prompt, 64)
    for k in (0, 1, 5, 33, 63, 64):
        assert continue_sequence(prompt + full[:k], 64 - k) == full[k:]


def test_stream_in_batches_equals_one_go():
    prompt = list(range(100))
    stream = TokenStream(prompt)
    batched = stream.next(3) + stream.next(1) + stream.next(12)
    assert batched == continue_sequence(prompt, 16)
