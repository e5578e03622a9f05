"""The demo's OpenAI step: the official openai client streams a chat completion through a global
frontend's HTTP port, with the model's tokenizer (trained here, nothing downloads)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path

import httpx2
import openai
from openai.types.chat import ChatCompletionMessageParam

from globalrouter.tokenizer import HfTokenizer
from globalrouter.tokenizer_train import train_word_tokenizer
from meshlaunch import MODEL


def demo_tokenizer(directory: Path) -> tuple[Path, int]:
    """A small word-level tokenizer with a chat template, trained in a moment on built-in text, and
    its vocabulary size (the demo's pools run with that --vocab-size, so each of their ids is a word)."""
    path = train_word_tokenizer(directory)
    return path, HfTokenizer.load(path).vocab_size


def chat(http: str, say: Callable[[str], None], certs: Path | None = None) -> str:
    """Streams one chat completion from the frontend at `http` and prints it as it arrives (over
    mutual TLS with the dev PKI's client certificate when `certs` is given)."""
    scheme, http_client = "http", None
    if certs is not None:
        tls = ssl.create_default_context(cafile=str(certs / "ca.crt"))
        tls.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
        scheme, http_client = "https", httpx2.Client(verify=tls, timeout=30)
    client = openai.OpenAI(
        base_url=f"{scheme}://{http}/v1", api_key="unused", max_retries=0, timeout=30, http_client=http_client
    )
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "You are a simulated pool: your words are deterministic."},
        {"role": "user", "content": "Say something about prefix-aware routing."},
    ]
    say(f"  client.chat.completions.create(model={MODEL!r}, stream=True, ...) at {scheme}://{http}/v1:")
    pieces: list[str] = []
    usage = None
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
    text = "".join(pieces)
    say(f"  > {text!r}")
    if usage is not None:
        say(
            f"  usage: {usage.prompt_tokens} prompt tokens (chat template + tokenizer), "
            f"{usage.completion_tokens} completion tokens. The pools are simulated: their tokens are a "
            "deterministic function of the sequence, here words of the tokenizer's small vocabulary."
        )
    say(f"  The live status page of this frontend is at http://{http}/ (pools, decisions, migrations).")
    return text
