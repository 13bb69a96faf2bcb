"""What a GGUF file run as stored does when its file, or the cache made from it, changes on
disk: a same-size edit of the cached config is noticed by its hash and the metadata rebuilt
(no dequantized copy); a model file rewritten or truncated under a chat refuses the next turn
with one clear error (no garbage, no SIGBUS) and keeps the conversation."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from helpers import needs_kernels

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.errors import ChatbotError

pytestmark = needs_kernels

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=6)


def _session(path: Path):
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model
    from chatbot.session import ChatSession

    loaded = load_model(str(path), device="cpu")
    assert loaded.model.chatbot_gguf == str(path)  # the block-format model, mapped from the file
    return ChatSession(Engine(loaded.model, loaded.tokenizer), ChatConfig(sampling=GREEDY), loaded.template)


def test_same_size_edit_of_the_cached_config_rebuilds_the_metadata(tiny_gguf):
    from chatbot.models.loader import cache_root, load_model

    path, model, _ = tiny_gguf
    load_model(str(path), device="cpu")
    (folder,) = (cache_root() / "gguf-meta").iterdir()
    config = folder / "config.json"
    text = config.read_text()
    edited = text.replace('"hidden_size": 64', '"hidden_size": 32')
    assert edited != text and len(edited) == len(text)
    config.write_text(edited)
    again = load_model(str(path), device="cpu")
    assert any("was incomplete or changed; rebuilt it" in n for n in again.notes), again.notes
    assert again.model.config.hidden_size == model.config.hidden_size
    assert '"hidden_size": 64' in config.read_text()
    assert not (cache_root() / "gguf").exists()  # no dequantized copy
    third = load_model(str(path), device="cpu")
    assert third.notes == []


def test_model_file_rewritten_in_place_refuses_the_next_turn(tiny_gguf, tmp_path):
    path, _, _ = tiny_gguf
    session = _session(path)
    first = "".join(c.text for c in session.send("Hello there!"))
    messages = session.messages()
    time.sleep(0.05)  # file times move in the kernel's ticks (a few ms)
    size = path.stat().st_size
    with open(path, "r+b") as f:  # same size, other bytes: weights rewritten in place
        f.seek(size - 4096)
        f.write(bytes(range(256)) * 16)
    assert path.stat().st_size == size
    with pytest.raises(ChatbotError, match="changed on disk since it was loaded; restart") as caught:
        list(session.send("And again?"))
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ChatbotError, match="changed on disk"):
        list(session.retry())
    assert session.messages() == messages
    assert len(session.turns) == 1 and session.turns[0].answer == first


SCRIPT = """
import os, sys
from chatbot.config import ChatConfig, SamplingConfig
from chatbot.engine.generate import Engine
from chatbot.errors import ChatbotError
from chatbot.models.loader import load_model
from chatbot.session import ChatSession

path = sys.argv[1]
loaded = load_model(path, device="cpu")
config = ChatConfig(sampling=SamplingConfig(temperature=0.0, max_new_tokens=6))
session = ChatSession(Engine(loaded.model, loaded.tokenizer), config, loaded.template)
first = "".join(c.text for c in session.send("Hello there!"))
os.truncate(path, os.path.getsize(path) // 3)
try:
    "".join(c.text for c in session.send("And again?"))
    print("answered")
except ChatbotError as exc:
    print("refused:", exc)
print("turns:", len(session.turns), session.turns[0].answer == first)
"""


def test_model_file_truncated_under_a_chat_is_an_error_not_sigbus(tiny_gguf, tmp_path):
    """In a process of its own: SIGBUS would kill it."""
    path, _, _ = tiny_gguf
    result = subprocess.run(  # (the fixture's cache, XDG_CACHE_HOME, is inherited)
        [sys.executable, "-c", textwrap.dedent(SCRIPT), str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    lines = result.stdout.splitlines()
    assert lines[0] == (
        f"refused: the model file {path} changed on disk since it was loaded; restart to load it again"
    ), result.stdout
    assert lines[1] == "turns: 1 True"
