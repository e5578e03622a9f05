"""Tokenizers and incremental detokenization: a tokenizer trained here, known answers, split characters."""

from __future__ import annotations

import json

import pytest

from globalrouter.detokenizer import ByteDecoder, StopStrings, TextStream
from globalrouter.tokenizer import (
    ByteTokenizer,
    HfTokenizer,
    TokenizerError,
    Tokenizers,
    compile_chat_template,
)
from globalrouter.tokenizer_train import train_tokenizer

# Token ids the trained tokenizer (DEFAULT_CORPUS, 400 entries) gives: training is deterministic,
# so these pin both the training and the encoding path.
KNOWN = {
    "hello world": [283, 320, 364],
    "Größe 🙂": [336, 397, 259, 74, 290, 253, 230],
    "日本語": [168, 251, 382, 170, 383],
}
MULTI_BYTE = "Größe 🙂 日本語 naïve café 🚀🌍 中文"


@pytest.mark.parametrize(("text", "ids"), sorted(KNOWN.items()))
def test_known_answer_ids(hf_tokenizer, text, ids):
    assert hf_tokenizer.encode(text, add_special_tokens=False) == ids
    assert hf_tokenizer.decode(ids) == text


def test_special_tokens_and_chat_template(hf_tokenizer):
    assert hf_tokenizer.encode("hi", add_special_tokens=True)[0] == 0  # <s> from the post-processor
    text = hf_tokenizer.render_chat(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert text == "<s><|system|>\nbe brief<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 0  # the template's BOS is the special token, not its characters
    assert hf_tokenizer.tokenizer.decode(ids, skip_special_tokens=False).replace(" ", "") == text.replace(
        " ", ""
    )


def test_template_refusal_is_a_tokenizer_error(hf_tokenizer):
    with pytest.raises(TokenizerError, match="unsupported role developer"):
        hf_tokenizer.render_chat([{"role": "developer", "content": "x"}])


def test_template_sandbox_blocks_python_internals():
    template = compile_chat_template("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError):
        from globalrouter.tokenizer import render

        render(template, [{"role": "user", "content": "x"}], {})


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_multi_byte_characters_split_across_tokens_stream_whole(hf_tokenizer, chunk):
    ids = hf_tokenizer.encode(MULTI_BYTE, add_special_tokens=False)
    # Some tokens of this text carry only part of a character's bytes.
    assert any("\ufffd" in hf_tokenizer.decode([i]) for i in ids)
    stream = TextStream(hf_tokenizer, [])
    pieces = [stream.push(ids[i : i + chunk]).text for i in range(0, len(ids), chunk)]
    pieces.append(stream.finish())
    assert "".join(pieces) == MULTI_BYTE
    assert all("\ufffd" not in p for p in pieces)


def test_output_after_a_prompt_keeps_its_leading_space(hf_tokenizer):
    prompt = hf_tokenizer.encode("hello", add_special_tokens=False)
    out = hf_tokenizer.encode(" world", add_special_tokens=False)
    stream = TextStream(hf_tokenizer, prompt)
    assert stream.push(out).text + stream.finish() == " world"


def test_invalid_bytes_do_not_stall_the_stream(hf_tokenizer):
    lone = hf_tokenizer.encode("🙂", add_special_tokens=False)[:1]  # a lead byte alone
    stream = TextStream(hf_tokenizer, [])
    texts = [stream.push(lone * 1).text for _ in range(6)]
    assert "".join(texts).count("\ufffd") >= 1  # emitted as replacement characters, not held for ever


def test_byte_decoder_joins_split_utf8_and_marks_out_of_range_ids():
    data = "é🙂".encode()
    dec = ByteDecoder()
    out = "".join(dec.push([b]) for b in data) + dec.flush()
    assert out == "é🙂"
    assert ByteDecoder().push([104, 300, 105]) == "h\ufffdi"


def test_stop_strings_hold_back_only_a_possible_prefix():
    stops = StopStrings(["END", "stop!"])
    assert stops.feed("hello E") == ("hel", False)  # "lo E" could start "stop!"/"END"
    assert stops.feed("N") == ("l", False)
    assert stops.feed("Dx") == ("o ", True)


def test_stop_string_across_tokens(hf_tokenizer):
    text = "hello world, hello mesh"
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(hf_tokenizer, [], stop=["d, he"])
    out = []
    for i in ids:
        delta = stream.push([i])
        out.append(delta.text)
        if delta.stopped:
            break
    assert "".join(out) == "hello worl" and stream.stopped


def test_stop_token_id_ends_without_its_text(hf_tokenizer):
    ids = hf_tokenizer.encode("hello world", add_special_tokens=False)
    stream = TextStream(hf_tokenizer, [], stop_token_ids=[ids[1]])
    delta = stream.push(ids)
    assert (delta.text, delta.stopped, delta.tokens_used) == ("hello", True, 2)


def test_byte_tokenizer_is_the_default():
    registry = Tokenizers()
    tok = registry.for_model("anything")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("hé", add_special_tokens=True) == [104, 195, 169]
    assert "<|im_start|>user\nhi<|im_end|>" in tok.render_chat([{"role": "user", "content": "hi"}])


def test_loading_names_the_model_and_the_problem(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"--tokenizer m=.*is not a tokenizer"):
        Tokenizers.load([("m", str(tmp_path))])
    with pytest.raises(TokenizerError, match=r"has no tokenizer\.json"):
        Tokenizers.load([("m", str(tmp_path / "missing"))])


def test_chat_template_jinja_file_and_named_templates(tmp_path):
    d = train_tokenizer(tmp_path / "t", vocab_size=300)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "T"},
        {"name": "default", "template": "D{{ bos_token }}"},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert HfTokenizer.load(d).render_chat([]) == "D<s>"
    (d / "chat_template.jinja").write_text("J")
    assert HfTokenizer.load(d).render_chat([]) == "J"


def test_word_tokenizer_decodes_every_id_to_a_word(tmp_path):
    from globalrouter.tokenizer_train import train_word_tokenizer

    tok = HfTokenizer.load(train_word_tokenizer(tmp_path / "w"))
    specials = {
        tok.tokenizer.token_to_id(t)
        for t in ("<unk>", "<s>", "</s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")
    }
    words = [tok.decode([i]) for i in range(tok.vocab_size) if i not in specials]
    assert words and all(w.strip() for w in words)
    assert tok.encode("hello mesh", add_special_tokens=False) == [
        tok.tokenizer.token_to_id("hello"),
        tok.tokenizer.token_to_id("mesh"),
    ]
