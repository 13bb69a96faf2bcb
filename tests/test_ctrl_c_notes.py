"""Issue 59, item 11: what a Ctrl-C says is true where it is said. A one-shot (`chatbot run
"PROMPT"`, on a terminal or in a pipe) has no /continue: it says `[interrupted]`, keeps the
partial answer and exits 130. A Ctrl-C while the model reads a long message (before any
answer) keeps the message, says that /retry answers it, and leaves no empty answer: /retry
answers it, and the message is in the conversation and the log throughout."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from screen import Terminal, missing_words

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"
ANSWER = " ".join(f"word{i}" for i in range(100)) + "."
LONG = " ".join(["zq"] * 600)  # some 1,800 tokens: four prefill chunks of 512


def answer_file(tmp_path: Path) -> str:
    path = tmp_path / "answer.md"
    path.write_text(ANSWER, encoding="utf-8")
    return str(path)


def logged_messages(data: Path) -> list[str]:
    folder = data / "chatbot" / "sessions"
    events = [
        json.loads(line) for log in sorted(folder.glob("*.jsonl")) for line in log.read_text().splitlines()
    ]
    return [e["user"] for e in events if e["event"] == "turn"]


def test_ctrl_c_in_a_one_shot_on_a_terminal_says_interrupted_and_exits_130(tmp_path, terminals):
    argv = [sys.executable, str(SCRIPT), answer_file(tmp_path), "--delay", "0.2", "--prompt", "Count."]
    term = Terminal(argv, columns=80, lines=24, cwd=str(tmp_path))
    terminals.append(term)
    term.wait_text("word3", 120)
    term.type("\x03")
    term.wait_for(lambda: not term.proc.isalive(), 60, "the end of the run")
    term.pump(0.3)
    shown = "\n".join(term.lines())
    term.proc.wait()
    assert term.proc.exitstatus == 130, shown
    assert "[interrupted]" in shown, shown
    assert "/continue" not in shown and "/retry" not in shown, shown
    assert missing_words("word0 word1 word2 word3", term.lines()) == [], shown  # the partial answer stays
    assert "word99" not in shown


def test_ctrl_c_in_a_one_shot_in_a_pipe_keeps_the_answer_on_stdout_and_exits_130(tmp_path):
    argv = [sys.executable, str(SCRIPT), answer_file(tmp_path), "--delay", "0.2", "--prompt", "Count."]
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=str(tmp_path)
    )
    try:
        out = b""
        end = time.monotonic() + 120
        while b"word3" not in out and time.monotonic() < end:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                data = os.read(proc.stdout.fileno(), 4096)
                if not data:
                    break
                out += data
        assert b"word3" in out, out
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    stdout, stderr = (out + rest).decode(), err.decode()
    assert proc.returncode == 130, stderr
    assert "[interrupted]" in stderr, stderr
    assert "/continue" not in stderr and "/retry" not in stderr, stderr
    assert stdout.startswith("word0 word1 word2 word3"), stdout
    assert "word99" not in stdout


def test_ctrl_c_while_the_message_is_read_keeps_it_for_retry_with_no_empty_answer(tmp_path, terminals):
    data = Path(os.environ["XDG_DATA_HOME"])
    argv = [sys.executable, str(SCRIPT), answer_file(tmp_path), "--chunk-delay", "600"]
    term = Terminal(argv, columns=80, lines=24, cwd=str(tmp_path))
    terminals.append(term)
    term.wait_prompt(120)
    term.type(LONG + "\r")
    term.wait_text("512/", 120)  # the first chunk is in the cache; the second is held
    term.type("\x03")
    term.wait_text("[interrupted", 60)
    term.wait_prompt(60)
    shown = "\n".join(term.lines())
    assert "[interrupted before the answer: the message is kept; /retry answers it]" in shown, shown
    assert "partial answer" not in shown and "/continue" not in shown, shown
    assert logged_messages(data) == [LONG]

    term.type("/history\r")
    term.wait_prompt(60)
    history = "\n".join(line for line in term.lines()[term.lines().index("> /history") :])
    assert "[1] bot  [not answered: interrupted]" in history, history
    assert "word0" not in history

    term.type("/retry\r")
    term.wait_text("word99", 120)
    term.wait_prompt(60)
    term.type("/save saved.json\r")
    term.wait_prompt(60)
    saved = json.loads((tmp_path / "saved.json").read_text(encoding="utf-8"))
    assert [(t["user"], t["answer"], t["interrupted"]) for t in saved["turns"]] == [(LONG, ANSWER, False)]
    assert logged_messages(data) == [LONG, LONG]  # the turn, then the turn answered in its place
