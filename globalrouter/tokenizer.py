"""Per-model tokenizers: a Hugging Face tokenizer.json + chat template from a local directory, or bytes."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from meshkit.blocks import text_to_tokens

# Used when a tokenizer directory has no chat template (and for the byte tokenizer): ChatML, the
# plainest widely used layout, so a chat request still renders to one deterministic prompt.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BYTE_VOCAB_SIZE = 256
# Prompt tokens the detokenizer decodes before the output: some decoders (SentencePiece's
# Metaspace, ByteLevel with prefix spaces) only render a token's leading space after a left neighbour.
DETOKENIZE_CONTEXT = 6


class TokenizerError(Exception):
    """A tokenizer directory cannot be loaded, or a chat template cannot be rendered."""


class ModelTokenizer(Protocol):
    """What the HTTP front needs of a model's tokenizer."""

    kind: str

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str: ...


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"the chat template refused the conversation: {message}")


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template compiled the way transformers does it, in an immutable sandbox: templates
    may come with a downloaded model and must not reach Python objects or mutate arguments."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template does not compile: {exc}") from exc


def render(
    template: jinja2.Template, messages: Sequence[Mapping[str, Any]], special: Mapping[str, str]
) -> str:
    """Renders a conversation with the generation prompt appended (what a completion continues)."""
    try:
        return template.render(messages=list(messages), add_generation_prompt=True, **special)
    except TokenizerError:
        raise
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"chat template failed: {exc}") from exc


class ByteTokenizer:
    """The mesh's default: one token per UTF-8 byte (meshkit.blocks.text_to_tokens)."""

    kind = "bytes"
    vocab_size = BYTE_VOCAB_SIZE

    def __init__(self) -> None:
        self._template = compile_chat_template(DEFAULT_CHAT_TEMPLATE)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return text_to_tokens(text)

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i if i < BYTE_VOCAB_SIZE else 0xFF for i in ids).decode("utf-8", errors="replace")

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return render(self._template, messages, {})


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string or an AddedToken dict with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _chat_template_source(directory: Path, config: Mapping[str, Any]) -> str | None:
    """The default chat template: chat_template.jinja beside the config, or the config's own
    (a string, or a list of named templates of which `default` is used)."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        chosen = named.get("default")
        if isinstance(chosen, str):
            return chosen
    return None


@dataclass
class HfTokenizer:
    """A Hugging Face fast tokenizer (tokenizer.json) with its chat template and special tokens."""

    kind = "hf"
    path: Path
    tokenizer: Any
    template: jinja2.Template
    special: dict[str, str]
    has_own_template: bool

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    @classmethod
    def load(cls, directory: str | Path) -> HfTokenizer:
        """Loads `directory`/tokenizer.json and, when present, tokenizer_config.json; raises TokenizerError."""
        from tokenizers import Tokenizer  # the Rust library loads only where a tokenizer is configured

        path = Path(directory)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{path} has no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the Rust library raises plain Exception on malformed files
            raise TokenizerError(f"{tok_file} is not a tokenizer: {exc}") from exc
        config: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                config = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{cfg_file} is not JSON: {exc}") from exc
            if not isinstance(config, dict):
                raise TokenizerError(f"{cfg_file} is not a JSON object")
        special = {
            key: text
            for key in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(key))) is not None
        }
        source = _chat_template_source(path, config)
        return cls(
            path=path,
            tokenizer=tokenizer,
            template=compile_chat_template(source or DEFAULT_CHAT_TEMPLATE),
            special=special,
            has_own_template=source is not None,
        )

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while the Rust code runs (encode does not), so a long
        # prompt encoded in a worker thread does not stall the event loop's other streams.
        return list(self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def render_chat(self, messages: Sequence[Mapping[str, Any]]) -> str:
        return render(self.template, messages, self.special)


class Tokenizers:
    """The tokenizer of each model; a model without one uses the byte tokenizer."""

    def __init__(self, by_model: Mapping[str, ModelTokenizer] | None = None) -> None:
        self._by_model = dict(by_model or {})
        self._bytes = ByteTokenizer()

    @classmethod
    def load(cls, paths: Sequence[tuple[str, str]]) -> Tokenizers:
        """Loads each (model, directory); raises TokenizerError naming the model that fails."""
        loaded: dict[str, ModelTokenizer] = {}
        for model, directory in paths:
            try:
                loaded[model] = HfTokenizer.load(directory)
            except TokenizerError as exc:
                raise TokenizerError(f"--tokenizer {model}={directory}: {exc}") from exc
        return cls(loaded)

    def for_model(self, model: str) -> ModelTokenizer:
        return self._by_model.get(model, self._bytes)

    def configured(self) -> dict[str, ModelTokenizer]:
        return dict(self._by_model)

    def unknown_token(self, model: str, ids: Sequence[int]) -> tuple[int, str] | None:
        """The first of `ids` outside `model`'s vocabulary, as (index, what is wrong), when a
        --tokenizer gives that vocabulary; None when all are inside it or it is not known.

        The frontend refuses such a prompt itself (gRPC INVALID_ARGUMENT / HTTP 400 naming the
        field) rather than passing it on for the engine to refuse in its own words. A model with no
        --tokenizer is not checked: the byte tokenizer says nothing of the engine's vocabulary."""
        tokenizer = self._by_model.get(model)
        if tokenizer is None or not ids:
            return None
        size = tokenizer.vocab_size
        if max(ids) < size:  # the common case: one pass in C
            return None
        index = next(i for i, t in enumerate(ids) if t >= size)
        return index, f"token id {ids[index]} is outside the vocabulary of {model!r} ({size} tokens)"


def prompt_context(tokens: Sequence[int]) -> list[int]:
    """The prompt tokens a detokenizer starts from (see DETOKENIZE_CONTEXT)."""
    return list(tokens[-DETOKENIZE_CONTEXT:])
