"""The bottom toolbar shows a model's name as every other text on screen is shown (issue 57,
item 15): a GGUF file named with a bidi override or an escape sequence, or a server's model
id holding them, reaches the terminal with those characters made visible, not acting."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from screen import Terminal

pytest.importorskip("pyte")

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).parent / "scripted_chat.py"
EVIL = "gpt\u202eevil\x1b]0;pwned\x07\x1b[31mred\x9b2J"
SHOWN = "gpt<U+202E>evil\u241b]0;pwned\u2407\u241b[31mred<U+009B>2J"  # as safe_line shows it


def _toolbar(term: Terminal) -> str:
    return next((line for line in reversed(term.lines()) if line.endswith("/help")), "")


def _loaded(term: Terminal) -> bool:
    return bool(_toolbar(term)) and "loading" not in _toolbar(term)


def test_a_model_name_with_controls_is_shown_visible_in_the_toolbar(tmp_path, terminals):
    """The name a server gives (its model id) or a file gives, while it loads and after."""
    answer = tmp_path / "answer.md"
    answer.write_text("Hi.", encoding="utf-8")
    loaded = tmp_path / "loaded"
    argv = [sys.executable, str(SCRIPT), str(answer), "--name", EVIL, "--load-when", str(loaded)]
    argv += ["--load-waits-on", f"reading {EVIL}"]
    term = Terminal(argv, cwd=str(tmp_path), env={"XDG_DATA_HOME": str(tmp_path / "data")})
    terminals.append(term)
    term.wait_for(lambda: "loading" in _toolbar(term), 120, "the toolbar of the load")
    assert f"reading {SHOWN}" in _toolbar(term), _toolbar(term)
    loaded.touch()
    term.wait_for(lambda: _loaded(term), 120, "the loaded model's toolbar")
    assert _toolbar(term).startswith(f" {SHOWN} · "), _toolbar(term)
    term.type("/quit\r")
    term.wait_for(lambda: not term.proc.isalive(), 60, "the chat to end")
    term.pump(0.2)
    assert "\u202e" not in term.raw and "\x9b" not in term.raw and "\x1b]0;pwned" not in term.raw


@pytest.mark.slow
def test_a_gguf_file_name_with_controls_is_shown_visible_in_the_toolbar(tmp_path, terminals):
    from chatbot.models.source import default_gguf_path

    model = tmp_path / f"{EVIL}.gguf"
    os.symlink(default_gguf_path(), model)
    env = {"HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data")}
    argv = [sys.executable, "-m", "chatbot.cli", "run", "--model", str(model)]
    term = Terminal(argv, env=env, cwd=str(ROOT))
    terminals.append(term)
    term.wait_for(lambda: _loaded(term), 180, "the loaded model's toolbar")
    assert SHOWN in _toolbar(term), _toolbar(term)
    assert "\u202e" not in term.raw and "\x9b" not in term.raw and "\x1b]0;pwned" not in term.raw
