"""A real terminal for tests: a program in a pseudo-terminal, its output fed to `pyte`
(a VT100/xterm emulator), read back as the screen and scrollback a person would see."""

from __future__ import annotations

import os
import re
import time
import unicodedata
from collections.abc import Callable, Sequence

import pyte
from ptyprocess import PtyProcessUnicode


class _Screen(pyte.HistoryScreen):
    """Answers the terminal queries prompt_toolkit sends (cursor position)."""

    def __init__(self, columns: int, lines: int, reply: Callable[[str], None]) -> None:
        super().__init__(columns, lines, history=100_000, ratio=0.5)
        self._reply = reply

    def write_process_input(self, data: str) -> None:
        self._reply(data)


class Terminal:
    """`argv` running in a `columns` x `lines` pseudo-terminal behind an emulator."""

    def __init__(
        self,
        argv: Sequence[str],
        columns: int = 80,
        lines: int = 24,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> None:
        full_env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "", "LINES": "", **(env or {})}
        full_env = {k: v for k, v in full_env.items() if v != ""}
        self.proc = PtyProcessUnicode.spawn(list(argv), dimensions=(lines, columns), env=full_env, cwd=cwd)
        self.screen = _Screen(columns, lines, self.proc.write)
        self.stream = pyte.Stream(self.screen)
        self.raw = ""

    # -- input and output ----------------------------------------------------------------

    def pump(self, seconds: float = 0.05) -> None:
        """Read whatever the program wrote within `seconds` into the emulator."""
        import select

        end = time.monotonic() + seconds
        while True:
            # A program that has ended may still have output in the pseudo-terminal: drain it
            # without waiting, or the last lines it wrote are lost.
            alive = self.proc.isalive()
            left = end - time.monotonic()
            if alive and left <= 0:
                break
            left = max(left, 0.0) if alive else 0.0
            ready, _, _ = select.select([self.proc.fd], [], [], left)
            if not ready:
                break
            try:
                data = self.proc.read(65536)
            except EOFError:
                break
            self.raw += data
            self.stream.feed(data)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.pump(0.1)
            if predicate():
                return
            if not self.proc.isalive():
                self.pump(0.2)
                if predicate():
                    return
                raise AssertionError(f"the program ended before {what}:\n" + "\n".join(self.lines()))
        raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(self.lines()))

    def wait_text(self, text: str, timeout: float = 60.0) -> None:
        self.wait_for(lambda: text in "\n".join(self.lines()), timeout, repr(text))

    def at_prompt(self) -> bool:
        """The cursor sits after an empty `> ` prompt."""
        c = self.screen.cursor
        return c.x == 2 and self._line(self.screen.buffer[c.y]) == ">"

    def wait_prompt(self, timeout: float = 60.0) -> None:
        self.wait_for(self.at_prompt, timeout, "the prompt")

    def type(self, text: str) -> None:
        self.proc.write(text)

    def resize(self, columns: int, lines: int) -> None:
        self.screen.resize(lines, columns)
        self.proc.setwinsize(lines, columns)

    def close(self) -> None:
        if self.proc.isalive():
            self.proc.write("\x04")
            self.pump(1.0)
        self.proc.terminate(force=True)

    # -- what a person reads ---------------------------------------------------------------

    def _line(self, row: dict) -> str:
        return "".join(row[x].data for x in range(self.screen.columns)).rstrip()

    def history_lines(self) -> list[str]:
        return [self._line(row) for row in self.screen.history.top]

    def screen_lines(self) -> list[str]:
        return [self._line(self.screen.buffer[y]) for y in range(self.screen.lines)]

    def lines(self) -> list[str]:
        """Scrollback and screen, top to bottom."""
        return self.history_lines() + self.screen_lines()


def _wide(ch: str) -> bool:
    return unicodedata.east_asian_width(ch) in "WF"


def words(text: str) -> list[str]:
    """The words a reader checks: runs of letters and digits (each wide CJK character on its
    own, since a terminal may wrap between them) and emoji, in order."""
    out: list[str] = []
    for m in re.finditer(r"\w+|[^\w\s]", text):
        w = m.group()
        if w[0].isalnum() or w[0] == "_":
            run = ""
            for ch in w:
                if _wide(ch):
                    if run:
                        out.append(run)
                        run = ""
                    out.append(ch)
                else:
                    run += ch
            if run:
                out.append(run)
        elif unicodedata.category(w) == "So":  # emoji and other symbols
            out.append(w)
    return out


def missing_words(expected: str, shown: Sequence[str]) -> list[str]:
    """Words of `expected` that do not appear on the lines `shown`, in order (each word must
    come after the previous one). An empty list: every word is there."""
    have = words("\n".join(shown))
    missing, pos = [], 0
    for w in words(expected):
        try:
            pos = have.index(w, pos) + 1
        except ValueError:
            missing.append(w)
    return missing
