"""The answer on a terminal: append-only live Markdown.

Rich `Live` re-draws its whole renderable on every refresh. An answer taller than the
screen then either loses lines (cropped) or repeats them in the scrollback, and a line
longer than the width is cut. So the answer is split into Markdown blocks (paragraph, list,
code fence, table, heading, quote): a block is printed once, for good, as soon as the next
one starts, and only the block still being written lives in the `Live` region. A block that
grows taller than the screen has its top lines printed for good as it grows, so the live
region always fits. Everything is wrapped by words at the width read when it is drawn, so a
resized terminal gets later blocks at its new width and nothing printed is drawn again.

A table is the exception: its column widths depend on every row, so none of it is printed
before it ends. While it streams, the live region shows a preview (its header and the last
rows that fit the screen), and the table is drawn whole once, when it ends; whether a new
line still belongs to it is decided from the header and that line alone. So the work per
token stays the same however long the table grows. And a refresh that took long waits
longer for the next (`_COST_FACTOR`), so re-drawing never takes a large share of decoding.

Thinking parts (`<think>…</think>`) are shown dimmed, line by line; a code fence is plain
while it is open and highlighted once it closes. With `fold_thinking`, the thinking stays in
the live region (its last lines, as many as fit the screen) and nothing of it is printed for
good: `fold(line)` then replaces it with one line (`thought for 412 tok · 9.8 s`), which
never has to move the cursor above the live region, however long the thinking was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO

from markdown_it.rules_block import table as table_rule
from markdown_it.token import Token
from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.live import Live
from rich.segment import ControlType, Segment
from rich.style import Style
from rich.text import Text

from chatbot.terminal.render import CODE_THEME, THINK_OPEN, AnswerMarkdown, code_block, markdown_parser

_ERASE_TO_END = "\x1b[K"  # filled by the terminal with the background colour set before it
THINKING_STYLE = "dim italic"
# The parser Rich's Markdown uses, so that blocks are cut where Rich would see them.
_PARSER = markdown_parser()
# The next refresh waits at least this many times as long as the last one took: re-drawing
# the live region then takes at most about 1/_COST_FACTOR of the decoding time.
_COST_FACTOR = 20.0
# markdown-it ends a table once its rows have left out this many cells in all (None: no limit).
_LEFT_OUT_LIMIT: int | None = getattr(table_rule, "MAX_AUTOCOMPLETED_CELLS", None)


def _top_blocks(text: str) -> list[Token]:
    """The opening tokens of `text`'s top-level Markdown blocks."""
    return [t for t in _PARSER.parse(text) if t.level == 0 and t.map is not None and t.nesting >= 0]


def open_block_start(text: str) -> int:
    """Where the last top-level Markdown block of `text` starts (a character offset).

    `text` holds complete lines only. The blocks before that offset can no longer change:
    CommonMark parses line by line, and a block closed by the start of the next one never
    opens again. A closed code fence also counts as finished: it returns len(text) then.
    """
    tokens = _top_blocks(text)
    if not tokens:
        return 0
    lines = text.splitlines(keepends=True)
    last = tokens[-1]
    assert last.map is not None
    start, end = last.map
    if last.type == "fence" and end - start >= 2 and end <= len(lines):
        closing = lines[end - 1].strip()
        if closing.startswith(last.markup) and not closing.strip(last.markup[0]):
            return len(text)
    return sum(len(line) for line in lines[:start])


@dataclass
class _OpenTable:
    """The open block is a top-level table: what is known of it."""

    head: str  # its header and delimiter lines, newlines included
    columns: int
    checked: int  # the characters of the open block known to be the table's own lines
    rows: int  # the body rows among them
    ended: bool = False  # a line that is not one of its rows has come


def table_head(text: str) -> tuple[str, int] | None:
    """(the header and delimiter lines, the column count) when `text` (complete lines) is
    one top-level table from its first line."""
    tokens = _PARSER.parse(text)
    top = [t for t in tokens if t.level == 0 and t.map is not None and t.nesting >= 0]
    if len(top) != 1 or top[0].type != "table_open" or top[0].map is None or top[0].map[0] != 0:
        return None
    first, second, _ = text.split("\n", 2)
    return f"{first}\n{second}\n", sum(t.type == "th_open" for t in tokens)


def table_goes_on(table: _OpenTable, lines: str) -> bool | None:
    """Whether all of `lines` (complete lines that follow the table's checked ones) are rows
    of the table: True; False where the table ended among them and no other block started;
    None where another block started, or where this cannot be told from them alone.

    markdown-it decides a table row from the header and that line alone, apart from a limit on
    the cells left out in the whole table: as long as the table is too small to reach it, the
    header and the new lines parse as the whole table would.
    """
    count = lines.count("\n")
    if _LEFT_OUT_LIMIT is not None and (table.rows + count) * table.columns >= _LEFT_OUT_LIMIT:
        return None
    top = _top_blocks(table.head + lines)
    if len(top) != 1 or top[0].type != "table_open" or top[0].map is None or top[0].map[0] != 0:
        return None
    return top[0].map[1] == count + 2


def _trim(line: list[Segment]) -> list[Segment]:
    """The line without its trailing padding: spaces with no background colour are dropped;
    spaces with one (a code block's) become "erase to the end of the row", which the
    terminal fills with that colour.

    A line padded to the full width leaves the cursor at the right edge, where whatever
    the terminal adds (an echoed ^C, a glyph it counts wider than Rich does) wraps onto a
    new row that the live region does not know about, and the region is then re-drawn one
    row too low. And after the window is narrowed, the terminal re-wraps each padded row
    onto two: a code block would show a blank row under every line.
    """
    line = list(line)
    fill: Style | None = None
    while line:
        last = line[-1]
        if last.control:
            break
        text = last.text.rstrip(" ")
        if text != last.text and last.style is not None and last.style.bgcolor is not None:
            fill = fill or Style(bgcolor=last.style.bgcolor)
        if text:
            line[-1] = Segment(text, last.style, last.control)
            break
        line.pop()
    if fill is not None:
        line.append(Segment(_ERASE_TO_END, fill, [(ControlType.ERASE_IN_LINE, 0)]))
    return line


def _fence(text: str, closed_too: bool) -> tuple[str, str] | None:
    """(code, info string) when `text` is one code fence that has not closed yet (or, with
    `closed_too`, one code fence)."""
    tokens = [t for t in _PARSER.parse(text) if t.level == 0 and t.map is not None]
    if len(tokens) != 1 or tokens[0].type != "fence":
        return None
    token = tokens[0]
    assert token.map is not None
    lines = text.splitlines()
    closed = (
        token.map[1] - token.map[0] >= 2
        and token.map[1] <= len(lines)
        and (
            lines[token.map[1] - 1].strip().startswith(token.markup)
            and not lines[token.map[1] - 1].strip().strip(token.markup[0])
        )
    )
    if closed and not closed_too:
        return None
    return token.content, token.info


def _rows(line: str, width: int) -> int:
    """The rows a code line takes when wrapped between words at `width` (`code_block`)."""
    if cell_len(line) <= width:
        return 1
    return len(Text(line).wrap(_MEASURE, width))


_MEASURE = Console(width=10_000, color_system=None)  # measures text only, writes nothing


class _Lines:
    """Already rendered lines, printed as they are (no second wrapping)."""

    def __init__(self, lines: Iterable[list[Segment]], blank_first: bool = False) -> None:
        self.lines = list(lines)
        self.blank_first = blank_first

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.blank_first:
            yield Segment.line()
        for line in self.lines:
            yield from line
            yield Segment.line()


class MarkdownAnswer:
    """Live Markdown for a streamed answer, printed block by block (see the module doc).

    Use as a context manager; `add(text)` per piece of text. The screen is refreshed at most
    `refresh_per_second` times a second, from `add`, so nothing runs in another thread.

    Args:
        console: a terminal console (its width and height are read for each block).
        refresh_per_second: the most re-draws of the live block per second.
        clock: seconds, for the refresh rate (a test or bench may pass its own).
        fold_thinking: hold a thinking part in the live region until `fold` replaces it with
            one line (a closing tag that comes through `add` prints it in full instead).
    """

    def __init__(
        self,
        console: Console,
        refresh_per_second: float = 12.0,
        clock: Callable[[], float] = time.monotonic,
        fold_thinking: bool = False,
    ) -> None:
        self.console = console
        self.fold_thinking = fold_thinking
        self.text = ""
        self._open = ""  # source of the block being written (not yet printed for good)
        self._skip = 0  # rendered lines of the open block already printed for good
        self._lead_blank_done = False  # the blank line before the open block is printed
        self._thinking_close: str | None = None  # the closing tag while inside a thinking part
        self._printed = False  # a block of this answer has been printed
        self._interval = 1.0 / refresh_per_second
        self._clock = clock
        self._last_refresh = -1e9
        self._tail_key: tuple[str, int, int, int] | None = None
        self._tail = _Lines([])
        self._drawn: tuple[int, list[int]] | None = None  # width and line lengths last drawn
        self._fence_continued = False  # the open block is the rest of a code fence printed in part
        self._table: _OpenTable | None = None  # the open block is a table (see the module doc)
        self._wait = self._interval  # the least time from one refresh to the next
        self.live = Live(
            console=console,
            auto_refresh=False,
            transient=True,
            redirect_stdout=False,
            redirect_stderr=False,
            vertical_overflow="crop",
            get_renderable=self._live_renderable,
        )

    # -- the public interface ----------------------------------------------------------

    def __enter__(self) -> MarkdownAnswer:  # noqa: PYI034
        self.live.start()
        return self

    def add(self, text: str) -> None:
        """Take the next piece of the answer; print what it finished; refresh now and then."""
        self.text += text
        self._open += text
        if "\n" in text or ">" in text:
            self._settle()
        now = self._clock()
        if now - self._last_refresh >= self._wait:
            self._refresh()

    def fold(self, line: str) -> None:
        """The thinking ended: drop the thinking part still open (held in the live region,
        `fold_thinking`) and print `line` for good in its place, dimmed."""
        if self._thinking_close is not None:
            self._drop(len(self._open))
            self._thinking_close = None
        self._emit(self._render_lines(Text(line, style=THINKING_STYLE)), blank=False)

    def __exit__(self, *exc: object) -> None:
        """Print the rest for good (also after Ctrl-C: the partial block stays, rendered)."""
        try:
            self._print_and_drop(len(self._open), thinking=self._thinking_close is not None)
        finally:
            self._after_resize()
            self.live.stop()

    # -- blocks ------------------------------------------------------------------------

    def _settle(self) -> None:
        """Print every block that can no longer change; keep the open one."""
        while True:
            if self._thinking_close is not None:
                end = self._open.find(self._thinking_close)
                if end >= 0:
                    end += len(self._thinking_close)
                    self._print_and_drop(end, thinking=True)
                    self._thinking_close = None
                    self._open = self._open.lstrip("\n")
                    continue
                if self.fold_thinking:
                    return  # held in the live region until it folds (`fold`)
                cut = self._open.rfind("\n") + 1  # complete lines of thinking are final
                if cut:
                    self._print_and_drop(cut, thinking=True)
                return
            match = THINK_OPEN.search(self._open)
            if match is not None:
                if self._open[: match.start()].strip():
                    self._print_and_drop(match.start(), thinking=False)
                else:
                    self._drop(match.start())
                self._thinking_close = f"</{match.group(1)}>"
                continue
            complete = self._open[: self._open.rfind("\n") + 1]
            cut = self._open_block_start(complete) if complete.strip() else 0
            if cut:
                self._print_and_drop(cut, thinking=False)
            return

    def _open_block_start(self, complete: str) -> int:
        """`open_block_start(complete)`, where `complete` is the open block's complete lines;
        for a table, from the lines not seen before alone."""
        table = self._table
        if table is not None and not table.ended:
            lines = complete[table.checked :]
            if not lines:
                return 0
            goes_on = table_goes_on(table, lines)
            if goes_on:
                table.checked, table.rows = len(complete), table.rows + lines.count("\n")
                return 0
            table.ended = True  # what follows it is parsed with it from now on
            if goes_on is not None:
                return 0
        cut = open_block_start(complete)
        if not cut and table is None and self._skip == 0 and "|" in complete.partition("\n")[0]:
            head = table_head(complete)
            if head is not None:
                rows = complete.count("\n") - 2
                self._table = _OpenTable(head[0], head[1], checked=len(complete), rows=rows)
        return cut

    def _print_and_drop(self, end: int, thinking: bool) -> None:
        """Print `_open[:end]` for good and keep the rest open."""
        source, rest, skip = self._open[:end], self._open[end:], self._skip
        blank = skip == 0 and not self._lead_blank_done and not thinking and not self._fence_continued
        continued = self._fence_continued
        self._drop(end)
        lines = self._render(source, thinking, final=True, continued=continued)
        if skip > len(lines):
            # A tall open region had its top printed already, past this block and into the
            # next: find where the next block's own lines start in that region.
            whole = self._render(source + rest, thinking, final=False)
            gap = max(0, len(whole) - len(lines) - len(self._render(rest, thinking, final=False)))
            self._skip = max(0, skip - len(lines) - gap)
            self._lead_blank_done = True
        self._emit(lines[skip:], blank=blank)

    def _drop(self, end: int) -> None:
        self._open = self._open[end:]
        self._skip = 0
        self._lead_blank_done = False
        self._fence_continued = False
        self._table = None

    def _blank_before_open(self) -> bool:
        """The open block's first line is still to be printed, after a blank line."""
        return (
            self._skip == 0
            and not self._lead_blank_done
            and self._thinking_close is None
            and not self._fence_continued
        )

    def _renderable(self, source: str, thinking: bool, final: bool, continued: bool) -> RenderableType:
        if thinking:
            return Text(source.rstrip("\n"), style=THINKING_STYLE)
        fence = _fence(source, closed_too=True)
        if fence is not None:
            # Open: plain. Final: highlighted. Either way as /history draws it (`code_block`):
            # wrapped between words, so the live region and the lines printed for good match.
            # The rest of a fence whose top is printed already has no top padding.
            lexer = fence[1].partition(" ")[0] or "text" if final else "text"
            padding = (0, 0, 1, 0) if continued else (1, 0, 1, 0)
            return code_block(fence[0].rstrip(), lexer, padding)
        return AnswerMarkdown(source, code_theme=CODE_THEME)

    def _render(
        self,
        source: str,
        thinking: bool,
        final: bool,
        width: int | None = None,
        continued: bool | None = None,
    ) -> list[list[Segment]]:
        if not source.strip():
            return []
        continued = self._fence_continued if continued is None else continued
        return self._render_lines(self._renderable(source, thinking, final, continued), width)

    def _render_lines(self, renderable: RenderableType, width: int | None = None) -> list[list[Segment]]:
        # One column short of the width: a glyph the terminal draws wider than Rich counts
        # (an emoji with a variation selector) then still fits the row instead of wrapping
        # onto one the live region does not know about.
        width = self.console.width if width is None else width
        options = self.console.options.update(height=None).update_width(max(width - 1, 10))
        lines = self.console.render_lines(renderable, options, pad=False)
        # Rich starts some blocks (lists) with an empty line; blocks are spaced here instead.
        start, end = 0, len(lines)
        while start < end and not lines[start]:
            start += 1
        while end > start and not lines[end - 1]:
            end -= 1
        return [_trim(line) for line in lines[start:end]]

    def _emit(self, lines: list[list[Segment]], blank: bool) -> None:
        """Print lines for good above the live region (the state already excludes them)."""
        if not lines:
            return
        # Re-draw the live region first: the print below re-draws the last one it drew.
        self._redraw()
        # not cropped: a code line wider than the screen goes out whole, for the terminal to wrap
        self.console.print(_Lines(lines, blank_first=blank and self._printed), crop=False)
        self._printed = True

    # -- the live region ---------------------------------------------------------------

    def _max_live_lines(self) -> int:
        return max(3, self.console.height - 3)

    def _fit(self) -> None:
        """Print the top lines of an open block taller than the screen, so the live region
        always fits (a region taller than the screen repeats itself in the scrollback)."""
        if self._table is not None:
            return  # shown in part until it ends (`_table_preview`), never printed in part
        if self.fold_thinking and self._thinking_close is not None:
            return  # its last lines only are shown (`_thinking_tail`), none printed
        limit = self._max_live_lines()
        width = max(self.console.width, 1)
        # A cheap upper bound first: rendering is only needed for a block that may be tall.
        if self._open.count("\n") + 2 * len(self._open) // width + 4 <= limit:
            return
        thinking = self._thinking_close is not None
        fence = None if thinking or self._skip else _fence(self._open, closed_too=self._fence_continued)
        if fence is not None:
            self._fit_fence(fence[1], limit, width)
            return
        lines = self._render(self._open, thinking, final=False)
        extra = len(lines) - self._skip - limit
        if extra > 0:
            skip, blank = self._skip, self._blank_before_open()
            self._skip += extra
            self._emit(lines[skip : skip + extra], blank=blank)

    def _fit_fence(self, info: str, limit: int, width: int) -> None:
        """Print the top lines of an open code fence taller than the screen, highlighted (the
        lines are complete), and keep only its rest open: re-rendering all of a long fence at
        every refresh would cost more than decoding it."""
        opener, _, code = self._open.partition("\n")
        body = code.split("\n")  # the last item is the line still being written
        inner = max(width - 1, 1)  # the width less one column
        rows = [_rows(line, inner) for line in body[:-1]]
        total, count = sum(rows) + 3, 0  # + top padding, the open line, bottom padding
        while count < len(rows) and total > limit:
            total -= rows[count]
            count += 1
        if not count:
            return
        first = not self._fence_continued
        blank = first and self._blank_before_open()
        lexer = info.partition(" ")[0] or "text"
        code = "\n".join(body[:count])
        head = code_block(code, lexer, padding=(1 if first else 0, 0, 0, 0))
        self._open = opener + "\n" + "\n".join(body[count:])
        self._fence_continued = True
        self._emit(self._render_lines(head, width), blank=blank)

    def _refresh(self) -> None:
        start = self._clock()
        self._fit()
        self._redraw()
        self._wait = max(self._interval, _COST_FACTOR * (self._clock() - start))

    def _redraw(self) -> None:
        self._last_refresh = self._clock()
        self._after_resize()
        self.live.refresh()
        tail, width = self._tail, self._tail_key[2] if self._tail_key else self.console.width
        self._drawn = (width, [1] * tail.blank_first + [Segment.get_line_length(x) for x in tail.lines])

    def _table_preview(self) -> str:
        """The open table's header and its last lines, as many as the live region shows: its
        column widths are those of these rows only, until the whole table is drawn at its end."""
        assert self._table is not None
        head = self._table.head
        keep = max(1, self._max_live_lines() - 3)  # less the header, its rule and the top edge
        lines = self._open[len(head) :].rsplit("\n", keep)
        return head + "\n".join(lines[-keep:])

    def _thinking_tail(self, width: int) -> list[list[Segment]]:
        """The last lines of a held thinking part that fit the live region, rendered from the
        end of its text only (a row holds at most `width` characters), so a long thinking
        costs no more per refresh than a short one."""
        limit = self._max_live_lines()
        tail = self._open[-2 * limit * max(width, 10) :]
        tail = "\n".join(tail.rsplit("\n", limit)[-limit:])
        return self._render(tail, True, final=False, width=width)[-limit:]

    def _after_resize(self) -> None:
        """After the terminal got narrower, count the rows the live region now takes.

        Most terminals (tmux, VTE, kitty, iTerm2, Windows Terminal) re-wrap a line longer
        than the new width onto several rows; Rich would move up only as many rows as it
        drew lines, leave the top of the region on screen, and draw the region again
        below it. The lines are unpadded (see `_trim`), so their lengths tell the rows.
        """
        if self._drawn is None:
            return
        width, lengths = self._drawn
        now = self.console.width
        if now >= width or not lengths:
            return
        rows = sum(max(1, -(-length // now)) for length in lengths)
        render = getattr(self.live, "_live_render", None)
        if render is not None and getattr(render, "_shape", None) is not None:
            render._shape = (now, rows)  # Rich keeps no public way to say so
        self._drawn = (now, lengths)

    def _live_renderable(self) -> RenderableType:
        width = self.console.width  # read once: a resize may come at any moment
        key = (self._open, self._skip, width, int(self._thinking_close is not None))
        if key != self._tail_key:
            if self._table is not None:
                lines = self._render(self._table_preview(), False, final=False, width=width)
                lines = lines[-self._max_live_lines() :]
            elif self.fold_thinking and self._thinking_close is not None:
                lines = self._thinking_tail(width)
            else:
                lines = self._render(self._open, self._thinking_close is not None, final=False, width=width)
                lines = lines[self._skip :]
            self._tail = _Lines(
                lines, blank_first=bool(lines) and self._printed and self._blank_before_open()
            )
            self._tail_key = key
        return self._tail


class PlainAnswer:
    """Raw text as it arrives (pipes, --plain), less the whitespace around the answer: the
    space a base model starts with after "Assistant:", the newlines it ends with before its
    stop string. Whitespace is held back until text follows it; what ends the answer is
    dropped, so each answer is its text and one newline (none where it failed before any
    text). `text` keeps every character.
    `keep_leading`: the answer goes on from text shown before (/continue), so its leading
    whitespace is kept."""

    def __init__(self, out: IO[str] | None = None, keep_leading: bool = False) -> None:
        import sys

        self.out = out or sys.stdout
        self.keep_leading = keep_leading
        self.text = ""
        self._held = ""  # trailing whitespace not written yet

    def __enter__(self) -> PlainAnswer:  # noqa: PYI034
        return self

    def add(self, text: str) -> None:
        started = self.keep_leading or bool(self.text.strip())  # text was written already
        self.text += text
        pending = self._held + text if started else text.lstrip()
        shown = pending.rstrip()
        self._held = pending[len(shown) :]
        if shown:
            self.out.write(shown)
            self.out.flush()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and not self.text and not self.keep_leading:
            return  # failed (or stopped) before any text: the error says so on stderr, stdout stays empty
        self.out.write("\n")
        self.out.flush()
