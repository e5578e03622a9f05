"""Deterministic output tokens: a function of the whole sequence, so continuation is exact."""

from __future__ import annotations

from mocker.tokens import VOCAB_SIZE, TokenStream, continue_sequence


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
