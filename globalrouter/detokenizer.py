"""Incremental detokenization of an output token stream, with stop strings and stop token ids.

Text is released only once it is final: a token that ends inside a multi-byte UTF-8 character
waits for the token that completes it, and text that could still be the start of a stop string
is held back until it cannot. The stream is fed the whole output in order, whichever pools
produced it, so a migration changes nothing in the text.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from globalrouter.tokenizer import BYTE_VOCAB_SIZE, ByteTokenizer, ModelTokenizer

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes and every token is at least one: a window still ending
# in a replacement character after this many tokens holds really invalid bytes, not a split one.
MAX_PENDING_TOKENS = 4


class IncrementalDecoder:
    """Decodes a growing id list to text deltas with a sliding window (the scheme of TGI and vLLM)."""

    def __init__(self, tokenizer: ModelTokenizer, context: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(context)
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, ids: Iterable[int]) -> str:
        """Appends ids; returns the text that became final."""
        # One token at a time, so that "pending" counts the tokens of one unfinished character.
        return "".join(self._step(token) for token in ids)

    def _step(self, token: int) -> str:
        self._ids.append(token)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read])
        new_text = decode(self._ids[self._prefix :])
        if new_text.endswith(REPLACEMENT):
            if len(self._ids) - self._read < MAX_PENDING_TOKENS:
                return ""  # the last token ends inside a character: wait for the rest of it
            # Invalid bytes for good: emit them as replacement characters and restart the window.
            self._prefix = self._read = len(self._ids)
            return new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """The text still held (an incomplete character at the very end decodes as U+FFFD)."""
        if len(self._ids) == self._read:
            return ""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        new_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text) :]


class ByteDecoder:
    """The byte tokenizer's decoder: an incremental UTF-8 decoder; ids >= 256 are U+FFFD."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if i < BYTE_VOCAB_SIZE:
                run.append(i)
                continue
            out.append(self._utf8.decode(bytes(run)) + self._utf8.decode(b"", final=True))
            self._utf8.reset()
            run.clear()
            out.append(REPLACEMENT)
        out.append(self._utf8.decode(bytes(run)))
        return "".join(out)

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class StopStrings:
    """Finds the first stop string in a text stream; holds back what might begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was found: the text ends before it)."""
        if not self._stops:
            return text, False
        self._buffer += text
        found = [i for i in (self._buffer.find(s) for s in self._stops) if i >= 0]
        if found:
            out, self._buffer = self._buffer[: min(found)], ""
            return out, True
        cut = max(0, len(self._buffer) - self._hold)
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return out


@dataclass
class Delta:
    """What one push produced: text to send, and whether the output is complete (a stop matched)."""

    text: str
    stopped: bool
    tokens_used: int
    """Of the ids pushed, how many belong to the output (a stop token id and what follows do not)."""


class TextStream:
    """An output's text as its tokens arrive: decoding, then stop token ids, then stop strings."""

    def __init__(
        self,
        tokenizer: ModelTokenizer,
        prompt_context: Sequence[int],
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._decoder: IncrementalDecoder | ByteDecoder = (
            ByteDecoder()
            if isinstance(tokenizer, ByteTokenizer)
            else IncrementalDecoder(tokenizer, prompt_context)
        )
        self._stops = StopStrings(stop)
        self._stop_ids = frozenset(stop_token_ids)
        self.stopped = False
        self.text_sent = 0

    def push(self, ids: Sequence[int]) -> Delta:
        """Feeds output ids in order; after a stop, nothing more is accepted."""
        if self.stopped:
            return Delta("", True, 0)
        used = len(ids)
        hit_stop_id = False
        if self._stop_ids:
            for k, token in enumerate(ids):
                if token in self._stop_ids:
                    # The stop token counts as generated (the pool produced it) but has no text.
                    used, ids, hit_stop_id = k + 1, ids[:k], True
                    break
        text = self._decoder.push(ids)
        if hit_stop_id:
            text += self._decoder.flush()
        out, matched = self._stops.feed(text)
        if hit_stop_id and not matched:
            out += self._stops.flush()
        self.stopped = matched or hit_stop_id
        self.text_sent += len(out)
        return Delta(out, self.stopped, used)

    def finish(self) -> str:
        """The held text once the output ended without a stop (length or end of sequence)."""
        if self.stopped:
            return ""
        out, matched = self._stops.feed(self._decoder.flush())
        if matched:
            self.stopped = True
            return out
        out += self._stops.flush()
        self.text_sent += len(out)
        return out
