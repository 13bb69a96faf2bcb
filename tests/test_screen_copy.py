"""What a person copies from the screen (issue 37, defects 7-9), in a pseudo-terminal behind
pyte at 80 and 50 columns: code blocks start in column 0, each line that fits whole, a longer
one wrapped between words as /history wraps it (issue 59, item 6); a long message typed at the prompt
wraps between words, without the "… " of a new line; the stats line breaks between its
phrases."""

from __future__ import annotations

import re

import pytest
from test_screen import after, saved_answers, send, start

pytest.importorskip("pyte")

LONG = (
    '    return [fruit for fruit in fruits if fruit["colour"] == "red" and fruit["ripe"] '
    'and fruit["weight_in_grams"] > 120]'
)
CODE = f"def pick(fruits):\n{LONG}\n\n\nprint(pick([]))"
ANSWER = f"Here is the code:\n\n```python\n{CODE}\n```\n\nDone.\n"


def code_rows(lines: list[str]) -> list[str]:
    """The rows of the code block in `lines`: from `def pick` to `print(pick([]))`."""
    top = next(i for i, line in enumerate(lines) if "def pick" in line)
    end = next(i for i in range(top, len(lines)) if lines[i].startswith("print(pick"))
    return lines[top : end + 1]


@pytest.mark.parametrize("columns", [50, 80])
def test_code_is_wrapped_between_words_as_history_shows_it(tmp_path, terminals, columns):
    """Issue 59, item 6: a code line longer than the screen went out whole while the answer
    streamed, and the terminal cut it mid-word (`...all elements exce` / `pt one`), while
    /history wrapped it between words. Both now draw it the same way."""
    term = start(tmp_path, [ANSWER], columns, lines=30)
    terminals.append(term)
    send(term, "code please")
    (answer,) = saved_answers(term, tmp_path)
    assert answer.strip() == ANSWER.strip()
    streamed = code_rows(after(term.lines(), "> code please"))
    assert streamed[0] == "def pick(fruits):"  # column 0: no indent added
    assert streamed[-3:] == ["", "", "print(pick([]))"]  # lines that fit are whole
    wrapped = streamed[1:-3]
    assert len(wrapped) > 1 and all(len(row) < columns for row in wrapped)
    assert " ".join(row.strip() for row in wrapped) == " ".join(LONG.split())  # every word, in order
    tokens = LONG.split()
    for row in wrapped:  # each row holds whole words: none is cut across two rows
        assert all(word in tokens for word in row.split()), wrapped
    send(term, "/history")
    assert code_rows(after(term.lines(), "> /history")) == streamed


@pytest.mark.parametrize("columns", [50, 80])
def test_a_long_message_wraps_between_words_at_the_prompt(tmp_path, terminals, columns):
    term = start(tmp_path, ["Fine."], columns)
    terminals.append(term)
    message = " ".join(["then a Markdown table with some rows"] * 5)
    term.type(message)
    term.wait_for(lambda: any(line.endswith("rows") for line in term.screen_lines()), 30, "the last word")
    shown = [line for line in term.screen_lines() if line.strip()][:-1]  # less the toolbar
    first = next(i for i, line in enumerate(shown) if line.startswith("> "))
    rows = shown[first:]
    assert len(rows) > 1
    assert not any(row.lstrip().startswith("…") for row in rows[1:])  # not a new line of the message
    assert all(len(row) <= columns for row in rows)
    words = message.split()
    assert " ".join(" ".join(rows).removeprefix("> ").split()) == message
    for row in rows:  # every row holds whole words only
        assert all(w in words for w in row.removeprefix("> ").split())
    term.type("\r")
    term.wait_prompt(60)
    assert saved_answers(term, tmp_path) == ["Fine."]


@pytest.mark.parametrize("columns", [50, 80])
def test_the_stats_line_breaks_between_phrases(tmp_path, terminals, columns):
    term = start(tmp_path, ["A short answer."], columns)
    terminals.append(term)
    send(term, "hello")
    lines = after(term.lines(), "> hello")
    begin = next(i for i, line in enumerate(lines) if line.startswith("context "))
    end = next(i for i in range(begin, len(lines)) if re.search(r"cache [\d,]+", lines[i]))
    stats = lines[begin : end + 1]
    for line in stats[:-1]:
        assert line.endswith(" ·"), stats  # a break comes after a separator, never mid-phrase
    assert re.search(r"[\d.]+ ms/tok", " ".join(stats))
