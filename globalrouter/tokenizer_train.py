"""Trains a small byte-level BPE tokenizer directory locally (tests, demo, benchmarks: nothing downloads)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# A template in the layout of real ones (system prompt, BOS, generation prompt), exercising the
# parts of Jinja that real chat templates use: loops, conditions, raise_exception.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unsupported role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

DEFAULT_CORPUS = (
    "The global router picks the pool; the pool picks the worker.",
    "Prefix-aware routing sends a prompt to the pool that already caches its prefix.",
    "A request whose pool fails mid-stream continues on another pool with no token lost.",
    "Les requêtes migrent d'un pool à l'autre sans perte. Größe, Übergang, naïve café.",
    "日本語のテキストもトークンに分割されます。中文文本也一样。",
    "Emoji travel in four bytes: 🙂 🚀 🌍 and the mesh keeps them whole.",
    "hello world, hello mesh, hello pools, hello tokens, streaming text back to the client.",
)


def train_tokenizer(
    directory: str | Path, corpus: Iterable[str] = DEFAULT_CORPUS, vocab_size: int = 400
) -> Path:
    """Writes tokenizer.json and tokenizer_config.json (with CHAT_TEMPLATE) into `directory`.

    Byte-level BPE, as GPT-2/Llama-3 style tokenizers are: any text encodes, and multi-byte
    characters may split across tokens, which is what the incremental detokenizer must handle.
    The result is deterministic for a given corpus and vocab_size.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return _save(tokenizer, path)


def train_word_tokenizer(directory: str | Path, corpus: Iterable[str] = DEFAULT_CORPUS) -> Path:
    """Like train_tokenizer, but one token per word (WordLevel): every id decodes to a whole word,
    so the mocker's pseudo-random ids read as words (the demo uses it). Unknown words are <unk>."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", *SPECIAL_TOKENS], show_progress=False)
    tokenizer.train_from_iterator(list(corpus), trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    return _save(tokenizer, path)


def _save(tokenizer: Any, path: Path) -> Path:
    """tokenizer.json, and tokenizer_config.json with the special tokens and CHAT_TEMPLATE."""
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "special": True},
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 1_000_000,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path
