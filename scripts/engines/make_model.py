"""Makes a tiny random-weight Llama and a locally trained BPE tokenizer for the engine tests (no hub)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

# CPU attention in vLLM needs head_dim 64 and KV blocks of 32 tokens; this shape (hidden 128,
# 2 heads, 1 KV head, 2 layers, vocab 2,048) is the smallest that loads and runs there.
VOCAB = 2048
WORDS = (
    "router pool relay block cache token prefix engine worker stream frontend discovery lease "
    "region model drain migrate replay event batch sequence snapshot delta load health metric "
    "request prompt answer budget refusal admission queue running waiting capacity"
).split()


def corpus(lines: int, seed: int) -> list[str]:
    """Deterministic pseudo-text to train the tokenizer on (words, numbers, punctuation)."""
    rnd = random.Random(seed)
    out = []
    for _ in range(lines):
        n = rnd.randint(5, 30)
        out.append(
            " ".join(rnd.choice(WORDS) if rnd.random() < 0.8 else str(rnd.randint(0, 9999)) for _ in range(n))
        )
    return out


def make_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(4000, seed=7), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))


def make_model(path: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        # Wide initial weights: a greedy continuation then wanders over the vocabulary instead of
        # repeating the last token, so a lost or repeated token shows in the tests.
        initializer_range=0.5,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(path), safe_serialization=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("out", type=Path, help="directory to write the model and tokenizer into")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    make_model(args.out, args.seed)
    make_tokenizer(args.out)
    print(f"tiny model written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
