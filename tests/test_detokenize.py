"""The incremental detokenizer against tokenizer.decode of all ids."""

from __future__ import annotations

import pytest

from chatbot.engine.detokenize import IncrementalDetokenizer

TEXTS = [
    "Hello there! How are you today?",
    "Café, naïve, résumé — Zürich ✓ €5",
    "日本語のテキストと中文文本",
    "emoji 🙂🚀🎉 family 👨‍👩‍👧 flags 🇵🇹",
    "  leading spaces\n\ttabs and\nnew lines  ",
    "def add(a, b):\n    return a + b",
]


def stream(tokenizer, ids, interval):
    detok = IncrementalDetokenizer(tokenizer)
    chunks, buf = [], ""
    for i, tid in enumerate(ids, 1):
        buf += detok.add(tid)
        if i % interval == 0:
            chunks.append(buf)
            buf = ""
    chunks.append(buf + detok.flush())
    return chunks


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("text", TEXTS)
def test_joined_chunks_equal_full_decode(tiny_tokenizer, text, interval):
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = stream(tiny_tokenizer, ids, interval)
    assert "".join(chunks) == tiny_tokenizer.decode(ids, clean_up_tokenization_spaces=False)
    # No chunk ends inside a character: none contains the replacement character.
    assert all("\ufffd" not in c for c in chunks)


def test_multibyte_character_split_over_tokens_is_held_back(tiny_tokenizer):
    # Byte-level BPE splits rare emoji into several byte tokens.
    ids = tiny_tokenizer("🦜", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tiny_tokenizer)
    emitted = [detok.add(t) for t in ids]
    assert all(e == "" for e in emitted[:-1])
    assert "".join(emitted) + detok.flush() == "🦜"


@pytest.mark.slow
@pytest.mark.parametrize("interval", [1, 3])
def test_default_model_tokenizer(default_model, interval):
    tok = default_model.tokenizer
    text = " ".join(TEXTS)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert "".join(stream(tok, ids, interval)) == tok.decode(ids, clean_up_tokenization_spaces=False)
