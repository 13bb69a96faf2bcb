"""What a person reads on a terminal: the REPL in a pseudo-terminal behind a terminal
emulator (pyte), with a scripted model, so that the expected answer is known exactly.

Each test asserts on the screen and scrollback (screen.py), not on the bytes written.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from screen import Terminal, missing_words

if TYPE_CHECKING:
    from rich.segment import Segment

pytest.importorskip("pyte")

SCRIPT = Path(__file__).parent / "scripted_chat.py"

MIXED = """\
## A heading for the <answer>

Here is a first paragraph that is long enough to wrap at every width we test, with \
ordinary words, a `code span`, some **bold** and *italic* text, and a rather \
longwordwithoutanyspacesinside that must still appear whole.

- a bulleted item that also goes on for a while, so that it wraps under its bullet
- a second item, with <br> and <placeholder> written by the model
  with a continuation line

1. first numbered step
2. second numbered step, with more words than fit on a narrow line of forty columns

```python
def add(first, second):
    return first + second
```

| name  | value |
|-------|-------|
| alpha | 1     |
| beta  | 2     |

日本語のテキストと中文文本が折り返されても読めること、emoji 🙂🚀🎉 too.

> a quoted line at the end, to close the answer.
"""


def start(
    tmp_path: Path, answers: list[str], columns: int, lines: int = 24, delay: float = 0.0, *flags: str
) -> Terminal:
    files = []
    for i, text in enumerate(answers):
        path = tmp_path / f"answer{i}.md"
        path.write_text(text, encoding="utf-8")
        files.append(str(path))
    argv = [sys.executable, str(SCRIPT), *files, "--delay", str(delay), *flags]
    term = Terminal(argv, columns=columns, lines=lines, cwd=str(tmp_path))
    term.wait_prompt(120)
    return term


def send(term: Terminal, line: str, timeout: float = 120) -> None:
    term.type(line + "\r")
    term.wait_prompt(timeout)


def saved_answers(term: Terminal, tmp_path: Path) -> list[str]:
    path = tmp_path / "saved.json"
    send(term, "/save saved.json")
    return [t["answer"] for t in json.loads(path.read_text(encoding="utf-8"))["turns"]]


def readable(markdown: str) -> str:
    """The text a reader sees of `markdown`: a code fence's language name is not shown."""
    return re.sub(r"(?m)^(\s*)(```|~~~)[\w+-]*", r"\1", markdown)


def after(lines: list[str], marker: str) -> list[str]:
    """The lines after the last one that starts with `marker`."""
    index = max(i for i, line in enumerate(lines) if line.startswith(marker))
    return lines[index + 1 :]


@pytest.mark.parametrize("columns", [40, 80, 120])
def test_every_word_of_the_answer_and_the_commands_is_on_screen(tmp_path, terminals, columns):
    from chatbot.terminal.commands import help_text

    term = start(tmp_path, [MIXED], columns)
    terminals.append(term)
    # The line under the prompt fits: it ends with its last field.
    term.wait_for(lambda: term.screen_lines()[-1].endswith("/help"), 20, "the toolbar, whole")
    send(term, "Show me some Markdown.")
    (answer,) = saved_answers(term, tmp_path)
    assert answer.strip() == MIXED.strip()  # the script ran through the real engine
    shown = after(term.lines(), "> Show me")
    assert missing_words(readable(answer), shown) == []
    # The stats line is wrapped by words, not cut: its last field is there.
    assert any(re.search(r"cache [\d,]+", line) for line in shown)

    send(term, "/history")
    assert (
        missing_words("you Show me some Markdown. bot " + readable(answer), after(term.lines(), "> /history"))
        == []
    )
    send(term, "/help")
    assert missing_words(help_text(), after(term.lines(), "> /help")) == []
    send(term, "/stats")
    stats = after(term.lines(), "> /stats")
    assert any("stop" in line for line in stats)  # the last column: how the turn ended
    # Nothing anywhere was cropped with an ellipsis.
    assert not [line for line in term.lines() if "…" in line]


def test_a_closed_code_fence_is_highlighted_and_thinking_is_dimmed(tmp_path, terminals):
    answer = (
        "<think>\nThe user wants code.\n</think>\nHere it is:\n\n"
        "```python\ndef add(a, b):\n    return a + b\n```\n"
    )
    term = start(tmp_path, [answer], 80, 24, 0.0, "--thinking", "show")  # kept, not folded
    terminals.append(term)
    send(term, "code please")
    screen = term.screen
    cells = {}
    for y in range(screen.lines):
        row = screen.buffer[y]
        text = "".join(row[x].data for x in range(screen.columns))
        for word in ("user", "return", "Here"):
            if word in text and word not in cells:
                cells[word] = row[text.index(word)]
    assert cells["user"].italics  # thinking: dim italic
    assert not cells["Here"].italics
    assert cells["return"].fg != cells["Here"].fg  # a keyword in colour: highlighted


def test_an_answer_three_screens_tall_is_in_the_scrollback_once(tmp_path, terminals):
    items = "\n".join(f"- item{i:02d} of the list, with a few more words" for i in range(25))
    paragraph = " ".join(f"word{i:03d}" for i in range(220))  # one block taller than the screen
    code = "\n".join(f"line{i:02d} = {i}" for i in range(25))
    answer = f"{items}\n\n{paragraph}\n\n```\n{code}\n```\n\nThe end.\n"
    term = start(tmp_path, [answer], 60, lines=20)
    terminals.append(term)
    send(term, "a long one")
    lines = after(term.lines(), "> a long one")
    assert missing_words(answer, lines) == []
    markers = re.findall(r"(?:item|word|line)\d+", answer)
    shown = re.findall(r"(?:item|word|line)\d+", "\n".join(lines))
    assert shown == markers  # each once, in order: nothing repeated, nothing lost


def test_a_resize_mid_answer_draws_later_blocks_at_the_new_width(tmp_path, terminals):
    paragraphs = [f"p{i:02d} " + " ".join(f"w{i:02d}x{j:02d}" for j in range(24)) for i in range(5)]
    answer = "\n\n".join(paragraphs) + "\n"
    term = start(tmp_path, [answer], 60, lines=24, delay=0.02)
    terminals.append(term)
    term.type("resize me\r")
    term.wait_text("w02x05", 120)
    term.resize(100, 24)
    term.wait_prompt(120)
    lines = after(term.lines(), "> resize me")
    assert missing_words(answer, lines) == []
    assert re.findall(r"w\d\dx\d\d", "\n".join(lines)) == re.findall(r"w\d\dx\d\d", answer)
    last = [line for line in lines if "w04x" in line]
    assert max(len(line) for line in last) > 60  # the last paragraph fills the wider screen


def test_ctrl_c_in_a_code_fence_keeps_the_partial_block_on_screen(tmp_path, terminals):
    code = "\n".join(f"value_{i:03d} = {i}" for i in range(300))
    answer = f"Counting:\n\n```python\n{code}\n```\n"
    term = start(tmp_path, [answer], 80, lines=24, delay=0.02)
    terminals.append(term)
    term.type("count\r")
    term.wait_text("value_010", 120)
    term.type("\x03")
    term.wait_text("[interrupted", 60)
    term.wait_prompt(60)
    (partial,) = saved_answers(term, tmp_path)
    assert "value_299" not in partial  # it was cut short
    lines = after(term.lines(), "> count")
    assert missing_words(readable(partial), lines) == []
    values = re.findall(r"value_\d+", "\n".join(lines))
    assert values == re.findall(r"value_\d+", partial)  # once each, up to where it stopped
    # The chat goes on.
    send(term, "/history")
    assert any("[interrupted]" in line for line in term.lines())


def test_bench_render_prints_both_renderers(capsys):
    from devtools import run_tool
    from devtools.bench_render import main

    capsys.readouterr()
    code = run_tool("bench-render", main, ["--tokens", "300", "--width", "100"])
    out = capsys.readouterr().out
    assert code == 0
    assert "append-only blocks" in out and "whole-answer Live" in out
    assert re.search(r"\d+\.\d+%", out)  # the share of decode time


LIST_ANSWER = (
    "<<Python Tips for Beginners>>\n\n"
    + "\n".join(f"{i}. **Tip {i}:** " + " ".join(f"t{i}w{j}" for j in range(40)) for i in range(1, 6))
    + "\n"
)


def test_ctrl_c_while_a_full_width_line_grows_repeats_nothing(tmp_path, terminals):
    # The terminal echoes ^C where the cursor is; at the right edge it would wrap onto a
    # row the live region does not know about.
    term = start(tmp_path, [LIST_ANSWER], 80, lines=24, delay=0.03)
    terminals.append(term)
    term.type("tips\r")
    term.wait_text("t1w25", 120)
    term.type("\x03")
    term.wait_text("[interrupted", 60)
    term.wait_prompt(60)
    lines = after(term.lines(), "> tips")
    assert [line for line in lines if "Beginners" in line] == ["<<Python Tips for Beginners>>"]
    assert "^C" not in "\n".join(lines)
    words = re.findall(r"t\dw\d+", "\n".join(lines))
    assert words == sorted(set(words), key=words.index)  # none twice


def test_keys_typed_during_an_answer_wait_for_the_next_prompt(tmp_path, terminals):
    term = start(tmp_path, [LIST_ANSWER], 80, lines=24, delay=0.01)
    terminals.append(term)
    term.type("tips\r")
    term.wait_text("t1w5", 120)
    term.type("typed ahead")
    term.wait_text("tok/s", 120)
    term.wait_for(lambda: "> typed ahead" in term.lines(), 30, "the typed text at the prompt")
    answer = after(term.lines(), "> tips")
    assert [line for line in answer if "typed" in line] == ["> typed ahead"]


class Tmux:
    """A program in a tmux window: tmux (like most terminals) re-wraps long rows when the
    window gets narrower, which pyte does not."""

    def __init__(self, tmp_path: Path, command: str, columns: int, lines: int) -> None:
        self.name = f"chatbot-test-{os.getpid()}-{tmp_path.name}"
        self.tmux = ["tmux", "-L", self.name]
        subprocess.run(
            [*self.tmux, "new-session", "-d", "-s", self.name, "-x", str(columns), "-y", str(lines)]
            + ["-c", str(tmp_path), command],
            check=True,
        )

    def pane(self) -> list[str]:
        out = subprocess.run(
            [*self.tmux, "capture-pane", "-p", "-t", self.name, "-S", "-"],
            capture_output=True,
            text=True,
            check=False,
        )
        return [line.rstrip() for line in out.stdout.splitlines()]

    def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if predicate():
                return
            time.sleep(0.2)
        raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(self.pane()))

    def wait_text(self, text: str, timeout: float = 120) -> None:
        self.wait(lambda: text in "\n".join(self.pane()), repr(text), timeout)

    def send(self, text: str) -> None:
        subprocess.run([*self.tmux, "send-keys", "-t", self.name, text, "Enter"], check=True)

    def resize(self, columns: int, lines: int) -> None:
        subprocess.run(
            [*self.tmux, "resize-window", "-t", self.name, "-x", str(columns), "-y", str(lines)], check=True
        )

    def close(self) -> list[str]:
        """The last pane, then the window closed."""
        lines = self.pane()
        subprocess.run([*self.tmux, "kill-server"], check=False)
        return lines


needs_tmux = pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")


@needs_tmux
def test_narrowing_a_reflowing_terminal_mid_answer_repeats_nothing(tmp_path):
    paragraphs = [f"para{i} " + " ".join(f"r{i}x{j:02d}" for j in range(30)) for i in range(4)]
    # A first answer fills the screen, as in a chat under way: the cursor is at the bottom
    # row, where the terminal keeps it while it re-wraps the rows above.
    (tmp_path / "first.md").write_text("\n".join(f"- line {i}" for i in range(40)) + "\n", encoding="utf-8")
    (tmp_path / "answer.md").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    window = Tmux(tmp_path, f"{sys.executable} {SCRIPT} first.md answer.md --delay 0.02", 100, 30)
    try:
        window.wait(lambda: any(line == ">" for line in window.pane()), "the prompt")
        window.send("fill the screen")
        window.wait_text("tok/s")
        window.send("narrow")
        window.wait_text("r1x10")
        window.resize(60, 30)
        window.wait(lambda: "tok/s" in "\n".join(after(window.pane(), "> narrow")), "the end of the answer")
    finally:
        lines = window.close()
    shown = "\n".join(after(lines, "> narrow"))
    assert re.findall(r"r\dx\d\d", shown) == re.findall(r"r\dx\d\d", "\n".join(paragraphs))
    assert [line for line in shown.splitlines() if "para" in line] == [
        line for line in shown.splitlines() if re.match(r"para\d ", line)
    ] and len(re.findall(r"para\d", shown)) == 4


@needs_tmux
def test_a_code_block_keeps_one_row_a_line_after_the_window_is_narrowed(tmp_path):
    """Code blocks have a background colour to the right edge; drawn as padding spaces, each
    row would re-wrap onto two when the window narrows (a blank row under every line)."""
    code = [f"value_{i} = compute({i})" for i in range(6)]
    answer = "Code:\n\n```python\n" + "\n".join(code) + "\n```\n\nAfter the code.\n"
    (tmp_path / "answer.md").write_text(answer, encoding="utf-8")
    window = Tmux(tmp_path, f"{sys.executable} {SCRIPT} answer.md", 120, 40)
    try:
        window.wait(lambda: any(line == ">" for line in window.pane()), "the prompt")
        window.send("show code")
        window.wait_text("tok/s")
        window.resize(50, 40)
        time.sleep(1.0)  # tmux re-wraps the rows already there
    finally:
        lines = window.close()
    shown = after(lines, "> show code")
    first = next(i for i, line in enumerate(shown) if "value_0 " in line)
    assert [line.strip() for line in shown[first : first + len(code)]] == code
    assert "After the code." in shown


def render_on_screen(text: str, columns: int, lines: int) -> list[str]:
    """Feed `text` to the live answer renderer piece by piece (a clock at 100 tok/s) on a
    terminal console; the scrollback and screen of an emulator fed what it wrote."""
    import io

    import pyte
    from rich.console import Console

    from chatbot.terminal.live_answer import MarkdownAnswer

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=columns, height=lines, color_system="truecolor")
    now = [0.0]
    with MarkdownAnswer(console, clock=lambda: now[0]) as answer:
        for piece in re.findall(r"\s*\S+|\s+", text):
            now[0] += 0.01
            answer.add(piece)
    screen = pyte.HistoryScreen(columns, lines, history=100_000)
    pyte.Stream(screen).feed(out.getvalue().replace("\n", "\r\n"))
    rows = [*screen.history.top, *(screen.buffer[y] for y in range(lines))]
    return ["".join(row[x].data for x in range(columns)).rstrip() for row in rows]


@pytest.mark.parametrize("lines", [8, 12, 24])
@pytest.mark.parametrize("count", [30, 31, 60])
def test_a_code_fence_taller_than_the_screen_is_printed_whole_and_unbroken(lines, count):
    code = "\n".join(f"value_{i} = compute({i})  # step {i}" for i in range(count))
    shown = render_on_screen(f"Code:\n\n```python\n{code}\n```\n\nAfter.\n", 40, lines)
    first = next(i for i, line in enumerate(shown) if "value_0 " in line)
    last = next(i for i, line in enumerate(shown) if f"value_{count - 1} " in line)
    assert [line.split()[0] for line in shown[first : last + 1]] == [f"value_{i}" for i in range(count)]
    assert [line for line in shown if line == "After."] == ["After."]


@pytest.mark.parametrize("columns", [40, 80])
def test_system_leaves_no_progress_bar_on_screen(tmp_path, terminals, columns):
    """/system re-encodes the conversation behind a transient progress bar: once it is done,
    the note stays and the bar is gone, at every width (it was once seen left behind in tmux
    at 80 columns as `re-encoding ━━━ 0/? tokens`)."""
    long_answer = " ".join(f"word{i}" for i in range(1500))
    term = start(tmp_path, [long_answer], columns)
    terminals.append(term)
    send(term, "tell me a lot")
    term.wait_text("tok/s", 120)
    send(term, "/system You are terse.")
    term.wait_text("re-encoded", 60)
    term.pump(0.5)
    shown = term.lines()
    assert [line for line in shown if "re-encoded" in line], shown
    assert "re-encoding" in term.raw  # the bar was drawn...
    assert not [line for line in shown if "re-encoding" in line or "0/?" in line], shown  # ...and is gone


def table_answer(rows: int, after: str = "\nThat is all.\n") -> str:
    """A paragraph, a 5-column table whose columns widen at rows 10 and 29 (the second past the
    first screen at 80x24), and what follows it."""
    head = "Here is the comparison:\n\n| name | language | year | speed | notes |\n|---|---|---|---|---|\n"
    body = "".join(
        f"| item{i} | Python {i % 4} | {1990 + i} | {3.5 * i:.1f} ms | small {i} |\n" for i in range(rows)
    )
    return head + body + after


def feed_tokens(
    text: str, columns: int, lines: int, clock_step: float = 0.03
) -> tuple[Callable[[], str], Callable[[], None]]:
    """(what the live answer renderer has written, the end of the answer) for `text` streamed
    a token-sized piece at a time, at a clock of 1/clock_step tokens/s."""
    import io

    from rich.console import Console

    from chatbot.terminal.live_answer import MarkdownAnswer

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=columns, height=lines, color_system="truecolor")
    now = [0.0]
    answer = MarkdownAnswer(console, clock=lambda: now[0])
    answer.__enter__()
    for piece in re.findall(r" ?\w+| ?[^\w\s]+|\s+", text):
        now[0] += clock_step
        answer.add(piece)
    return out.getvalue, lambda: answer.__exit__(None, None, None)


def emulate(raw: str, columns: int, lines: int) -> list[str]:
    import pyte

    screen = pyte.HistoryScreen(columns, lines, history=100_000)
    pyte.Stream(screen).feed(raw.replace("\n", "\r\n"))
    rows = [*screen.history.top, *(screen.buffer[y] for y in range(lines))]
    return ["".join(row[x].data for x in range(columns)).rstrip() for row in rows]


def render_whole(text: str, columns: int, lines: int) -> list[str]:
    """The screen when all of `text` comes in one piece: every block drawn once, whole."""
    import io

    from rich.console import Console

    from chatbot.terminal.live_answer import MarkdownAnswer

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=columns, height=lines, color_system="truecolor")
    with MarkdownAnswer(console, clock=lambda: 0.0) as answer:
        answer.add(text)
    return emulate(out.getvalue(), columns, lines)


@pytest.mark.parametrize(
    "after",
    [
        "\nThat is all.\n",
        "## Next\n\nText.\n",
        "- a list item\n",
        "```\ncode\n```\n",
        "> a quote\n",
        "a row without pipes\n\nThat is all.\n",
        "\n\n    indented code\n",
        "",
    ],
)
def test_a_streamed_table_taller_than_the_screen_ends_drawn_whole_and_aligned(after):
    """A table's columns widen as rows come: printed in part while it streamed, its top kept
    the narrower columns of the first rows (seen at 80 columns: `speed` shifted at row 10)."""
    text = table_answer(40, after)
    written, close = feed_tokens(text, 80, 24)
    close()
    shown = emulate(written(), 80, 24)
    rows = [line for line in shown if re.match(r" item\d+ ", line)]
    assert [line.split()[0] for line in rows] == [f"item{i}" for i in range(40)]
    assert len({line.index(" small ") for line in rows}) == 1, "\n".join(rows)  # the notes in one column
    whole = render_whole(text, 80, 24)
    while shown[-1:] == [""] and whole[-1:] == [""]:  # the screen's empty rows below
        shown, whole = shown[:-1], whole[:-1]
    assert shown == whole


def test_a_streamed_table_shows_its_header_and_latest_rows_while_it_grows():
    text = table_answer(40, "")[: table_answer(40, "").index("| item30 |")]
    written, _ = feed_tokens(text, 80, 24)
    screen = emulate(written(), 80, 24)[-24:]
    assert any(line.split()[:2] == ["name", "language"] for line in screen), "\n".join(screen)
    assert any(line.split()[:1] == ["item29"] for line in screen), "\n".join(screen)


def markdown_work(monkeypatch: pytest.MonkeyPatch, text: str) -> int:
    """Characters of Markdown parsed (for cutting blocks and for drawing them) while `text`
    streams and ends at 80x24."""
    from markdown_it import MarkdownIt

    parsed = [0]
    parse = MarkdownIt.parse

    def counting(self: MarkdownIt, src: str, env: object = None) -> object:
        parsed[0] += len(src)
        return parse(self, src, env)

    monkeypatch.setattr(MarkdownIt, "parse", counting)
    _, close = feed_tokens(text, 80, 24)
    close()
    monkeypatch.setattr(MarkdownIt, "parse", parse)
    return parsed[0]


def test_the_work_per_token_of_a_streamed_table_does_not_grow_with_the_table(monkeypatch):
    """Each refresh re-drew the whole open table, and each new row re-parsed it: the work per
    token grew with the table, and decoding slowed (33 tok/s became 19 at 80 columns)."""
    short, long = table_answer(50), table_answer(200)
    per_char_short = markdown_work(monkeypatch, short) / len(short)
    per_char_long = markdown_work(monkeypatch, long) / len(long)
    assert per_char_long < 1.3 * per_char_short, (per_char_short, per_char_long)


def test_a_slow_refresh_makes_the_next_one_wait(monkeypatch):
    """A refresh that took 20 ms (or more) is followed by one at least 0.4 s later, not 1/12 s:
    at most about 5 % of the decoding time goes to re-drawing the live region."""
    import io

    from rich.console import Console

    from chatbot.terminal import live_answer

    now = [0.0]
    refreshes = []
    refresh, render = live_answer.MarkdownAnswer._refresh, live_answer.MarkdownAnswer._render_lines

    def counted(self: live_answer.MarkdownAnswer) -> None:
        refreshes.append(now[0])
        refresh(self)

    def slow(self: live_answer.MarkdownAnswer, *args: Any) -> list[list[Segment]]:
        now[0] += 0.02  # the time a render takes
        return render(self, *args)

    monkeypatch.setattr(live_answer.MarkdownAnswer, "_refresh", counted)
    monkeypatch.setattr(live_answer.MarkdownAnswer, "_render_lines", slow)
    console = Console(file=io.StringIO(), force_terminal=True, width=80, height=24)
    with live_answer.MarkdownAnswer(console, clock=lambda: now[0]) as answer:
        for i in range(300):
            now[0] += 0.01  # 100 tok/s
            answer.add(f" word{i}")
    gaps = [b - a for a, b in itertools.pairwise(refreshes)]
    assert len(gaps) > 3 and min(gaps) >= 0.4 - 1e-9, gaps
