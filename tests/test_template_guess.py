"""Templates guessed from the vocabulary when a model ships none: each family's special
tokens pick its layout, a GGUF file without `tokenizer.chat_template` chats in its family's
layout, and `--help` and the unknown-name error list the same names as the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from chatbot.errors import ConfigError
from chatbot.models.templates import TEMPLATES, apply_template, check_template_choice

CHATBOT = str(Path(sys.executable).with_name("chatbot"))

# What real tokenizers of each family hold (gguf-py's CONTROL tokens, added tokens in a folder).
FAMILIES = {
    "chatml": ["<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "gemma": ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
    "phi3": ["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"],
    "mistral": ["<s>", "</s>", "[INST]", "[/INST]"],
}


def tokenizer_with(specials: list[str]):
    """A word-level tokenizer without a chat template, holding `specials` as special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hi": 1, "there": 2}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]")
    tok.add_special_tokens({"additional_special_tokens": specials})
    assert not tok.chat_template
    return tok


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_vocabulary_names_the_template(family):
    tok = tokenizer_with(FAMILIES[family])
    info = apply_template(tok, None, "auto")
    assert (info.name, info.source) == (family, "guessed")
    assert tok.chat_template == TEMPLATES[family].jinja
    assert f"using {family}" in info.warning and "--template" in info.warning
    # the turn's closing token is one token of this vocabulary: a stop id
    assert tok.convert_tokens_to_ids(TEMPLATES[family].stop_strings[0]) in info.stop_ids


def test_a_vocabulary_without_markers_stays_plain():
    info = apply_template(tokenizer_with(["<s>", "</s>"]), None, "auto")
    assert info.name == "plain" and "base model" in info.warning


def test_gemma_gguf_without_a_template_chats_as_gemma(tmp_path, monkeypatch):
    """A Gemma 3 file with no `tokenizer.chat_template` (its vocabulary has <start_of_turn>):
    the loaded tokenizer renders Gemma's turns, and <end_of_turn> ends an answer."""
    from chatbot.models.loader import load_model
    from devtools.gguf_synthetic import GEMMA_SPECIALS, SHAPES, write_synthetic_gguf

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "gemma3-no-template.gguf"
    write_synthetic_gguf(path, "gemma3", SHAPES["gemma3"]["tiny"], "Q8_0", seed=1, chat_template=False)
    loaded = load_model(str(path), dtype="float32")
    assert (loaded.template.name, loaded.template.source) == ("gemma", "guessed")
    assert any("using gemma" in note for note in loaded.notes)
    text = loaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    assert GEMMA_SPECIALS["<end_of_turn>"] in loaded.template.stop_ids


def test_help_and_error_list_the_tables_names():
    names = ", ".join(TEMPLATES)
    with pytest.raises(ConfigError) as caught:
        check_template_choice("alpaca")
    assert f"auto, {names}, or a .jinja file" in str(caught.value)
    out = subprocess.run(
        [CHATBOT, "run", "--help"],
        capture_output=True,
        text=True,
        env={"COLUMNS": "300", "PATH": ""},
        check=True,
    ).stdout
    assert f"{names}, or a .jinja file" in " ".join(out.split())
    for name in ("gemma", "phi3"):
        check_template_choice(name)
