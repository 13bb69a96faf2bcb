"""Lines outside the chat at 80 and 50 columns, in a pseudo-terminal behind pyte (issue 59,
item 10): `chatbot doctor`, an error line, the `--resume` note. The terminal cut them
mid-word (`...(buil` / `t)`, `(alone: the last sess` / `ion)`): they were printed by a
console that left the wrapping to the terminal. They break between words now."""

from __future__ import annotations

import os
import re
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


SOURCE = "/home/someone/.cache/chatbot/hub/models--someone--smol/snapshots/main/smol-135m-instruct-q4.gguf"
DECODE = (
    "native kernels (--opt fast): 120 q4_1 + 1 q8_0 matrices, 92 MB, int16 activations "
    "(int16 inputs, 2^-16 steps), up to 2 threads"
)


def scripted(tmp_path, terminals, columns: int, *flags: str) -> Terminal:
    from test_screen_widths import SCRIPT

    answer = tmp_path / "answer.md"
    answer.write_text("A short answer.", encoding="utf-8")
    term = Terminal([sys.executable, str(SCRIPT), str(answer), *flags], columns=columns, lines=60,
                    cwd=str(tmp_path))  # fmt: skip
    terminals.append(term)
    term.wait_prompt(120)
    return term


def command_output(term: Terminal, command: str) -> list[str]:
    term.type(command + "\r")
    term.wait_prompt(60)
    lines = term.lines()
    start = max(i for i, line in enumerate(lines) if line == f"> {command}")
    end = max(i for i, line in enumerate(lines) if line == ">")
    return lines[start + 1 : end]


@pytest.mark.parametrize("columns", [80, 50])
def test_model_keeps_a_number_with_its_unit_and_folds_a_path_after_its_slashes(tmp_path, terminals, columns):
    """Issue 59, item 10: /model broke `92` / `MB` across lines and folded a path anywhere
    (`...SmolLM2-` / `135M...`). A value breaks between words, a number stays with its unit,
    and only a path longer than its column is folded, after a "/"."""
    term = scripted(tmp_path, terminals, columns, "--source", SOURCE, "--decode", DECODE)
    shown = command_output(term, "/model")
    assert all(len(line) <= columns for line in shown), "\n".join(shown)
    rows: dict[str, list[str]] = {}
    key = ""
    for line in shown:
        cells = line.split("│")
        if len(cells) == 4:
            key = cells[1].strip() or key
            rows.setdefault(key, []).append(cells[2].strip())
    source, decode = rows["source"], rows["decode"]
    assert "".join(source) == SOURCE, "\n".join(shown)  # whole, on lines of its own
    assert len(source) > 1 and all(part.endswith("/") for part in source[:-1]), "\n".join(shown)
    assert " ".join(decode) == DECODE, "\n".join(shown)  # broken between words only
    assert any("92 MB" in part for part in decode), "\n".join(shown)
    for part in decode[:-1]:  # no line ends with a number whose unit went to the next
        assert not re.search(r"(^|\s)\d[\d.,]*$", part), "\n".join(shown)


@pytest.mark.parametrize("columns", [80, 50])
def test_the_stats_key_is_whole_and_leaves_no_orphan_line(tmp_path, terminals, columns):
    """Issue 59, item 10: the caption under /stats wrapped to a last line far shorter than the
    others (at 50 columns, where /stats is a line per turn, it was not shown at all)."""
    from screen import missing_words

    from chatbot.terminal.render import STATS_KEY

    term = scripted(tmp_path, terminals, columns)
    for message in ("hello", "and again"):
        term.type(message + "\r")
        term.wait_prompt(60)
    shown = command_output(term, "/stats")
    last = max(i for i, line in enumerate(shown) if line.startswith(("└", "all ·")))
    key = [line.strip() for line in shown[last + 1 :] if line.strip()]
    assert missing_words(" ".join(STATS_KEY), key) == [], "\n".join(shown)
    longest = max(len(line) for line in key)
    assert all(2 * len(line) >= longest for line in key), "\n".join(shown)
    assert " ".join(" ".join(key).split()) == " ".join(STATS_KEY), "\n".join(shown)
    assert all(len(line) <= columns for line in shown), "\n".join(shown)
