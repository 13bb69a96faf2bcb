"""A chat ended by a signal (SIGTERM, SIGHUP) leaves the terminal as it found it: the cursor
shown, no bracketed paste, the line settings of the start, on a real pseudo-terminal behind
pyte; the turn is logged as far as it got and the exit status says which signal."""

from __future__ import annotations

import json
import signal
import sys
import termios
import time
from pathlib import Path

import pytest
from screen import Terminal

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"
ANSWER = " ".join(f"word{i}" for i in range(400))


def _chat(tmp_path: Path, terminals: list[Terminal]) -> Terminal:
    answer = tmp_path / "answer.md"
    answer.write_text(ANSWER, encoding="utf-8")
    argv = [sys.executable, str(SCRIPT), str(answer), "--delay", "0.05"]
    term = Terminal(
        argv, columns=80, lines=24, cwd=str(tmp_path), env={"XDG_DATA_HOME": str(tmp_path / "data")}
    )
    terminals.append(term)
    term.wait_prompt(120)
    return term


def _fresh_terminal() -> list:
    """A new pseudo-terminal's settings: those the chat found (the prompt has it in raw mode)."""
    import os

    leader, follower = os.openpty()
    try:
        return termios.tcgetattr(follower)
    finally:
        os.close(leader)
        os.close(follower)


def _ended(term: Terminal) -> int:
    end = time.monotonic() + 30
    while term.proc.isalive() and time.monotonic() < end:
        term.pump(0.1)
    term.pump(0.3)
    assert not term.proc.isalive()
    term.proc.wait()
    return term.proc.exitstatus if term.proc.exitstatus is not None else -term.proc.signalstatus


def _logged_answers(tmp_path: Path) -> list[str]:
    (log,) = (tmp_path / "data").rglob("*.jsonl")
    events = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e.get("answer", "") for e in events if e.get("answer")]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_an_answer_puts_the_terminal_back(tmp_path, terminals, signum):
    term = _chat(tmp_path, terminals)
    settings = _fresh_terminal()
    term.type("tell me\r")
    term.wait_text("word20", 60)
    assert term.screen.cursor.hidden  # the live answer hides it
    term.proc.kill(signum)
    status = _ended(term)
    assert status == 128 + signum
    assert not term.screen.cursor.hidden
    assert term.raw.rfind("\x1b[?25h") > term.raw.rfind("\x1b[?25l")
    assert term.raw.rfind("\x1b[?2004l") >= term.raw.rfind("\x1b[?2004h")
    assert termios.tcgetattr(term.proc.fd)[3] == settings[3]  # echo and canonical mode as before
    assert "Traceback" not in term.raw
    answers = _logged_answers(tmp_path)
    assert answers and answers[-1].startswith("word0 word1") and "word20" in answers[-1]


def test_a_signal_at_the_prompt_puts_the_terminal_back(tmp_path, terminals):
    term = _chat(tmp_path, terminals)
    settings = _fresh_terminal()
    term.type("half typed")
    term.pump(0.5)
    term.proc.kill(signal.SIGTERM)
    assert _ended(term) == 128 + signal.SIGTERM
    assert not term.screen.cursor.hidden
    assert term.raw.rfind("\x1b[?2004l") > term.raw.rfind("\x1b[?2004h")
    assert termios.tcgetattr(term.proc.fd)[3] == settings[3]
    assert "Traceback" not in term.raw


def test_ctrl_backslash_during_an_answer_puts_the_terminal_back(tmp_path, terminals):
    """Ctrl-\\ (SIGQUIT, which Python leaves to its default: die, the cursor hidden) ends
    the chat as SIGTERM does: the terminal put back, the turn logged, exit 128+3."""
    term = _chat(tmp_path, terminals)
    settings = _fresh_terminal()
    term.type("tell me\r")
    term.wait_text("word20", 60)
    assert term.screen.cursor.hidden
    term.type("\x1c")  # the key: the terminal's line discipline sends SIGQUIT
    assert _ended(term) == 128 + signal.SIGQUIT
    assert not term.screen.cursor.hidden
    assert term.raw.rfind("\x1b[?25h") > term.raw.rfind("\x1b[?25l")
    assert termios.tcgetattr(term.proc.fd)[3] == settings[3]
    assert "Traceback" not in term.raw
    answers = _logged_answers(tmp_path)
    assert answers and "word20" in answers[-1]
