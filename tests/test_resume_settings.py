"""`chatbot run --resume` goes on with the session's own settings (defect 10 of issue 37):
a `--enable-streaming --recent-size 64` chat came back on a full cache of the default size,
its history re-encoded whole, without a word. The log records the model, template, cache
and sampling; a resume takes them back unless a flag is given, and says so in one note."""

from __future__ import annotations

import io
import json
import re

import pytest
from helpers import cli, make_model, make_tokenizer

from chatbot.conversation.log import find_session, replay
from chatbot.conversation.settings import logged_settings

MESSAGES = ["Hello there! How are you today?", "The quick brown fox jumps.", "Tell me more about it please."]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    tok = make_tokenizer()
    make_model(len(tok)).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def chat(capsys, monkeypatch, lines: list[str], *args: str) -> str:
    """A piped `chatbot run ARGS` on the CPU; its stdout and stderr."""
    piped = "".join(line + "\n" for line in lines).encode()
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(piped), encoding="utf-8"))
    code, out, err = cli(capsys, "run", "--device", "cpu", "--opt", "off", *args)
    assert code == 0, err
    return out + err


def cache_size(shown: str) -> tuple[int, int]:
    """What the last /cache said: tokens held and capacity."""
    used, capacity = re.findall(r"tokens\W+([\d,]+) / ([\d,]+)", shown)[-1]
    return int(used.replace(",", "")), int(capacity.replace(",", ""))


def notes(shown: str) -> list[str]:
    return [" ".join(line.split()) for line in shown.splitlines() if line.startswith("note: ")]


def test_a_resumed_streaming_chat_keeps_its_window_and_a_flag_given_wins(capsys, monkeypatch, tiny_dir):
    first = chat(capsys, monkeypatch, [*MESSAGES, "/cache"], "--model", str(tiny_dir), "--enable-streaming",
                 "--recent-size", "64", "--temperature", "0", "--max-new-tokens", "24")  # fmt: skip
    assert "4 sinks" in first and cache_size(first)[1] == 4 + 64
    assert re.search(r"[1-9][\d,]* evicted", first)  # the chat was longer than its window

    # No flag: the model, the streaming window and the sampling come back, and one note says so.
    again = chat(capsys, monkeypatch, ["/cache", "One more message, please."], "--resume")
    (note,) = notes(again)
    assert note.startswith("note: the session's settings come back: ")
    for flag in (f"--model {tiny_dir}", "--enable-streaming", "--recent-size 64", "--temperature 0"):
        assert flag in note
    assert "resuming session" in again and "that session was with" not in again  # the same model
    used, capacity = cache_size(again)
    assert capacity == 4 + 64 and 0 < used <= capacity  # a sink cache of the logged window
    assert re.search(r"cache [\d,]+/68 · 4 sinks", again)  # the new answer's stats line

    # A flag given wins over the log, and the note says which.
    narrower = chat(capsys, monkeypatch, ["/cache"], "--resume", "--recent-size", "32")
    (note,) = notes(narrower)
    assert "the command line's win: --recent-size 32 (the session's: --recent-size 64)" in note
    assert "--enable-streaming" in note and "--recent-size 64," not in note
    assert cache_size(narrower)[1] == 4 + 32
    # ... and the session goes on with it next time (the resume line records it).
    assert replay(find_session("last"))["engine"]["recent_size"] == 32
    full = chat(capsys, monkeypatch, ["/cache"], "--resume", "--no-enable-streaming")
    assert "--no-enable-streaming (the session's: --enable-streaming)" in notes(full)[0]
    assert cache_size(full)[1] == tiny_dir_context(tiny_dir)


def tiny_dir_context(folder) -> int:
    return json.loads((folder / "config.json").read_text())["max_position_embeddings"]


def test_a_resume_of_the_same_settings_says_nothing_of_them(capsys, monkeypatch, tiny_dir):
    args = ("--model", str(tiny_dir), "--temperature", "0", "--max-new-tokens", "8")
    chat(capsys, monkeypatch, MESSAGES[:1], *args)
    again = chat(capsys, monkeypatch, ["/cache"], "--resume", *args)
    assert notes(again) == []


def test_old_and_damaged_logs_give_what_they_can():
    """A log written before the load and engine records gives its system prompt and
    sampling; a wrongly recorded value is left out, by name."""
    old = {"system": "Be brief.", "settings": {"temperature": 0.2, "stream_interval": 1}}
    assert logged_settings(old) == ({"system": "Be brief.", "temperature": 0.2}, [])
    damaged = {
        "system": None,
        "settings": {"temperature": -5, "top_k": "x", "seed": None},
        "engine": {"enable_streaming": "yes", "recent_size": 64, "start_size": None, "max_context": None},
        "load": {"model": 3, "template": "no-such-template"},
    }
    good, bad = logged_settings(damaged)
    assert good == {"system": None, "seed": None, "recent_size": 64, "max_context": None}
    assert sorted(bad) == ["enable_streaming", "model", "start_size", "temperature", "template", "top_k"]
