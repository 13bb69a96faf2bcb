"""A long paste at the prompt, as a person sees it: a 12,000-character line pasted into the
REPL in a pseudo-terminal of 80 columns (bracketed paste), read back through a terminal
emulator (screen.py), with a scripted model, so that the message the session gets can be
checked whole."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from screen import Terminal, missing_words

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"
WORDS = ["river", "stone", "cloud", "lantern", "meadow", "copper", "whistle", "harbor", "violet", "timber"]
# One line of 12,000 characters: words in a varying order, so that a row of it says where it is.
PASTE = " ".join(f"{WORDS[i % 10]}{i}" for i in range(2000))[: 12_000 - len(" ENDMARK")] + " ENDMARK"
MARK = re.compile(r"\[… [\d,]+ characters …\]")


def start(tmp_path: Path) -> Terminal:
    answer = tmp_path / "answer.md"
    answer.write_text("Got it: a long line.", encoding="utf-8")
    # The tiny tokenizer spends about a token per two characters: room for the whole paste.
    argv = [sys.executable, str(SCRIPT), str(answer), "--max-context", "16384"]
    term = Terminal(argv, columns=80, lines=24, cwd=str(tmp_path))
    term.wait_prompt(120)
    return term


def paste(term: Terminal, text: str, then: str) -> None:
    """Paste `text` as a terminal does (bracketed), then type `then` at once."""
    data = "\x1b[200~" + text + "\x1b[201~" + then
    for i in range(0, len(data), 4096):  # the screen is read between parts: neither side blocks
        term.type(data[i : i + 4096])
        term.pump(0.01)


def input_rows(term: Terminal) -> list[str]:
    """The rows of the input: from the prompt's row (or the top) to the last one written above
    the toolbar."""
    rows = term.screen_lines()[:-1]
    top = max((i for i, row in enumerate(rows) if row.startswith("> ")), default=0)  # none: scrolled away
    rows = rows[top:]
    while rows and not rows[-1].strip():
        rows.pop()
    return rows


def sent_message(term: Terminal, tmp_path: Path) -> str:
    term.type("/save saved.json\r")
    term.wait_text("saved.json")
    term.wait_prompt(60)
    turns = json.loads((tmp_path / "saved.json").read_text(encoding="utf-8"))["turns"]
    assert len(turns) == 1
    return turns[0]["user"]


def test_a_long_pasted_line_is_folded_and_the_keys_after_it_follow_it(tmp_path, terminals):
    term = start(tmp_path)
    terminals.append(term)
    paste(term, PASTE, " How many words?")
    # What was typed after the paste shows after the paste's end, on the input's last row.
    term.wait_for(
        lambda: missing_words("ENDMARK How many words", input_rows(term)[-2:]) == [],
        120,
        "the typed words after the paste",
    )
    rows = input_rows(term)
    # The prompt's row starts the paste; a mark says how much is folded away; the input
    # takes at most half the screen, and ends with the paste's last rows and the question.
    assert rows[0].startswith("> river0 stone1 cloud2"), rows
    marks = [row for row in rows if MARK.search(row)]
    assert len(marks) == 1, rows
    assert len(rows) <= 12, rows
    tail = PASTE[PASTE.index(" ", len(PASTE) - 300) :]
    assert missing_words(tail + " How many words?", rows) == []
    term.type("\r")
    term.wait_text("Got it: a long line.", 300)
    term.wait_prompt(60)
    # The paste stays folded in the scrollback, above its answer.
    shown = term.lines()
    asked = max(i for i, line in enumerate(shown) if line.startswith("> river0 stone1"))
    assert MARK.search(" ".join(shown[asked : asked + 3]))
    assert sent_message(term, tmp_path) == PASTE + " How many words?"


def test_a_long_line_pasted_with_its_newline_stays_on_screen_above_the_next_line(tmp_path, terminals):
    term = start(tmp_path)
    terminals.append(term)
    paste(term, PASTE + "\n", "XYZ")
    term.wait_for(lambda: any(row == "… XYZ" for row in term.screen_lines()), 120, "the typed line")
    rows = input_rows(term)
    # Not a blank screen above the new line: the paste's start, the fold, and its end.
    assert rows[0].startswith("> river0 stone1 cloud2"), rows
    assert any(MARK.search(row) for row in rows), rows
    assert rows[-1] == "… XYZ" and "ENDMARK" in rows[-2], rows
    term.type("\r")
    term.wait_text("Got it: a long line.", 300)
    term.wait_prompt(60)
    assert sent_message(term, tmp_path) == PASTE + "\nXYZ"
