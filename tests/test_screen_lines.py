"""Lines outside the chat at 80 and 50 columns, in a pseudo-terminal behind pyte (issue 59,
item 10): `chatbot doctor`, an error line, the `--resume` note. The terminal cut them
mid-word (`...(buil` / `t)`, `(alone: the last sess` / `ion)`): they were printed by a
console that left the wrapping to the terminal. They break between words now."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from screen import Terminal
from test_screen_widths import ROOT, broken_words, env_for

pytest.importorskip("pyte")


def shown_and_piped(argv: list[str], columns: int, env: dict[str, str]) -> tuple[list[str], str]:
    """The rows `chatbot ARGV` leaves on a `columns`-wide terminal, and what it writes into
    pipes (stdout and stderr: each line whole), the reference for a broken word."""
    term = Terminal(
        [sys.executable, "-m", "chatbot.cli", *argv], columns=columns, lines=60, env=env, cwd=str(ROOT)
    )
    try:
        term.wait_for(lambda: not term.proc.isalive(), 180, f"chatbot {' '.join(argv)} to end")
    except AssertionError:
        if term.proc.isalive():
            raise
    term.pump(0.2)
    term.close()
    lines = [line for line in term.lines() if line.strip()]
    run = subprocess.run([sys.executable, "-m", "chatbot.cli", *argv], env={**os.environ, **env}, cwd=ROOT,
                         capture_output=True, text=True, check=False, timeout=180)  # fmt: skip
    return lines, run.stdout + run.stderr


def broken_fitting_words(shown: list[str], piped: str, columns: int) -> list[str]:
    """`broken_words`, less those of a word longer than the line (a path: folded, whole)."""
    long = [token for token in piped.split() if len(token) >= columns]
    return [b for b in broken_words(shown, piped) if not any(b.replace("|", "") in t for t in long)]


@pytest.mark.parametrize("columns", [80, 50])
def test_an_error_line_breaks_between_words(tmp_path, columns):
    shown, piped = shown_and_piped(["run", "--resume", "what is the capital of France", "hi"], columns,
                                   env_for(tmp_path))  # fmt: skip
    assert "(alone: the last session)" in piped
    assert len(shown) > 1, shown  # it wraps
    assert broken_fitting_words(shown, piped, columns) == [], "\n".join(shown)


@pytest.mark.parametrize("columns", [80, 50])
def test_doctor_breaks_no_word(tmp_path, columns):
    shown, piped = shown_and_piped(["doctor"], columns, env_for(tmp_path))
    assert "python" in piped and len(shown) > 3
    assert broken_fitting_words(shown, piped, columns) == [], "\n".join(shown)


@pytest.mark.parametrize("columns", [80, 50])
def test_the_stats_line_and_the_toolbar_count_the_cache_alike(tmp_path, terminals, columns):
    """Issue 59, item 15: `cache 72` under the answer, `cache 74/8,192` under the prompt (the
    stats line left out the closing text that waits to enter the cache)."""
    import re

    from test_screen import send, start

    term = start(tmp_path, ["A short answer.", "Another one."], columns)
    terminals.append(term)
    for message in ("hello", "and again"):
        send(term, message)
        stats = re.findall(r"cache ([\d,]+) ", " ".join(term.lines()[:-1]) + " ")[-1]
        term.wait_for(
            lambda: re.search(r"cache [\d,]+/", term.screen_lines()[-1]) is not None, 30, "the toolbar"
        )
        toolbar = re.search(r"cache ([\d,]+)/", term.screen_lines()[-1])
        assert toolbar is not None and stats == toolbar.group(1), term.screen_lines()


def test_the_banner_counts_the_seconds_since_the_command():
    """Issue 59, item 14: the banner said `loaded in 2.8 s` when the model was ready 6.3 s
    after the command (imports and set-up were not counted). A process that spends 1.5 s
    before its banner says at least that."""
    code = (
        "import time; time.sleep(1.5)\n"
        "from chatbot.cli.load import seconds_since_start; print(seconds_since_start())"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert 1.5 <= float(run.stdout) < 120
