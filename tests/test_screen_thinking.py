"""Issue 62 on a terminal at 80 columns: a thinking model's thinking streams dimmed, then folds
to one line (`thought for 412 tok · 9.8 s`) when the answer starts; --show-thinking keeps it,
--hide-thinking shows only that line, and /thinking prints it in full.

The REPL runs in a pseudo-terminal behind pyte (screen.py) with the scripted model of
test_screen.py (its answers begin with `<think>`) or against the loopback stand-in server
of test_remote_clients.py (thinking sent apart, as `reasoning_content`).
"""

from __future__ import annotations

import re

import pytest
from screen import Terminal, missing_words
from serve_helpers import CHATBOT
from test_remote_clients import FakeServer
from test_screen import send, start

pytest.importorskip("pyte")

THOUGHT = "\n".join(
    f"Pondering step {i} of the question about zebras and their stripes." for i in range(1, 9)
)
ANSWER = "Zebras have stripes to confuse biting flies."
SCRIPT = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}\n"
FOLDED = re.compile(r"^thought for ([\d,]+) tok · \d+\.\d s$")


def folded_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if FOLDED.match(line)]


def thought_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "Pondering" in line]


def is_dim(term: Terminal, word: str) -> bool:
    """Every cell of `word` where it shows on the screen is drawn faint (dim) or italic."""
    screen = term.screen
    for y in range(screen.lines):
        row = screen.buffer[y]
        text = "".join(row[x].data for x in range(screen.columns))
        if word in text:
            return row[text.index(word)].italics
    raise AssertionError(f"{word!r} is not on the screen")


def test_the_thinking_streams_dimmed_then_folds_to_one_line(tmp_path, terminals):
    term = start(tmp_path, [SCRIPT, "No more thinking here.\n"], 80, 24, 0.03)
    terminals.append(term)
    term.type("why stripes?\r")
    term.wait_text("Pondering step 3")  # while it streams, the thinking is on screen, dimmed
    assert is_dim(term, "Pondering")
    term.wait_prompt(120)
    lines = term.lines()
    # folded: the dimmed lines replaced by one, then the answer; nothing of them left above
    assert thought_lines(lines) == [], "\n".join(lines)
    assert len(folded_lines(lines)) == 1, "\n".join(lines)
    index = lines.index(folded_lines(lines)[0])
    assert lines[index - 1].startswith("> why stripes?") or not lines[index - 1].strip()
    assert ANSWER in "\n".join(lines[index + 1 :])
    assert is_dim(term, "thought for")
    # the line counts the thinking as the stats line does
    tokens = FOLDED.match(folded_lines(lines)[0]).group(1)  # type: ignore[union-attr]
    assert any(f"thought {tokens} tok" in line for line in lines), "\n".join(lines)

    send(term, "/thinking")  # the whole thinking, dimmed
    shown = term.lines()[term.lines().index("> /thinking") + 1 :]
    assert missing_words(THOUGHT, shown) == [], "\n".join(shown)
    assert is_dim(term, "zebras")

    send(term, "and now?")  # an answer with no thinking: nothing folds, /thinking says so
    send(term, "/thinking")
    after = term.lines()[max(i for i, line in enumerate(term.lines()) if line.startswith("> and now?")) :]
    assert not folded_lines(after) and not thought_lines(after)
    assert any("the last answer had no thinking" in line for line in after), "\n".join(after)
    send(term, "/undo")  # the answer before is the last again: /thinking shows its thinking
    send(term, "/thinking")
    last = term.lines()[max(i for i, line in enumerate(term.lines()) if line.startswith("> /thinking")) :]
    assert missing_words(THOUGHT, last) == [], "\n".join(last)


def test_a_thinking_taller_than_the_screen_folds_and_the_screen_stays_whole(tmp_path, terminals):
    tall = "\n".join(f"Pondering line {i}, a thought that goes on." for i in range(60))
    term = start(tmp_path, [f"<think>\n{tall}\n</think>\n\n{ANSWER}\n"], 80, 24, 0.0)
    terminals.append(term)
    send(term, "think hard")
    lines = term.lines()
    assert thought_lines(lines) == [], "\n".join(lines)
    assert len(folded_lines(lines)) == 1
    # the message, the folded line, the answer, in this order, once each
    assert sum(line.startswith("> think hard") for line in lines) == 1
    order = [lines.index(next(x for x in lines if x.startswith("> think hard"))),
             lines.index(folded_lines(lines)[0]), lines.index(ANSWER)]  # fmt: skip
    assert order == sorted(order), "\n".join(lines)
    send(term, "/thinking")  # the whole of it comes back, however tall
    assert missing_words(tall, term.lines()) == []


def test_show_thinking_keeps_it_in_full(tmp_path, terminals):
    term = start(tmp_path, [SCRIPT], 80, 24, 0.0, "--thinking", "show")
    terminals.append(term)
    send(term, "why stripes?")
    lines = term.lines()
    assert missing_words(THOUGHT + "\n" + ANSWER, lines) == [], "\n".join(lines)
    assert folded_lines(lines) == []
    assert is_dim(term, "Pondering")


def test_hide_thinking_shows_only_the_line(tmp_path, terminals):
    term = start(tmp_path, [SCRIPT], 80, 24, 0.03, "--thinking", "hide")
    terminals.append(term)
    send(term, "why stripes?")
    assert "Pondering" not in term.raw  # never drawn, not even while it streamed
    lines = term.lines()
    assert len(folded_lines(lines)) == 1 and ANSWER in lines, "\n".join(lines)
    send(term, "/thinking")
    assert missing_words(THOUGHT, term.lines()) == []


def test_thinking_from_a_server_folds_too(tmp_path, terminals):
    server = FakeServer()
    server.story = ANSWER
    server.reasoning = "Pondering the zebras and their stripes, at some length."
    try:
        env = {"XDG_DATA_HOME": str(tmp_path / "data")}
        term = Terminal([CHATBOT, "run", "--server", server.url], columns=80, lines=24, env=env)
        terminals.append(term)
        term.wait_prompt(120)
        send(term, "why stripes?")
        lines = term.lines()
        assert thought_lines(lines) == [] and ANSWER in lines, "\n".join(lines)
        assert len(folded_lines(lines)) == 1
        send(term, "/thinking")
        assert missing_words(server.reasoning, term.lines()) == []
    finally:
        server.close()
