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
    from chatbot.conversation.session import ChatSession
    from chatbot.engine.generate import Engine
    from chatbot.models.loader import load_model

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
from chatbot.conversation.session import ChatSession

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


def test_a_server_whose_model_file_changed_answers_500_on_both_endpoints_and_stays_up(tmp_path):
    """The server's fault, not the request's: 500 with the reason, for chat and for raw
    completions (which run the engine without a session), and the process lives on."""
    import httpx
    from helpers import make_model, make_tokenizer, write_tiny_gguf
    from serve_helpers import running_server

    tok = make_tokenizer()
    gguf = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf, make_model(len(tok)), tok)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_DATA_HOME": str(tmp_path / "data")}
    with running_server("--model", str(gguf), "--served-model-name", "tiny", env=env) as url:
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        complete = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        assert httpx.post(f"{url}/chat/completions", json=chat, timeout=60).status_code == 200
        assert httpx.post(f"{url}/completions", json=complete, timeout=60).status_code == 200
        data = bytearray(gguf.read_bytes())
        data[-64:] = bytes(64)  # the same size, other bytes: the stamp's times change
        gguf.write_bytes(bytes(data))
        for path, body in (("chat/completions", chat), ("completions", complete)):
            r = httpx.post(f"{url}/{path}", json=body, timeout=60)
            assert r.status_code == 500, (path, r.text)
            error = r.json()["error"]
            assert error["type"] == "server_error" and "changed on disk" in error["message"], error
        assert httpx.get(url.removesuffix("/v1") + "/health", timeout=10).status_code == 200
