'''What the user types: control characters dropped, `"""` blocks joined into one message,
slash-commands completed, and lines read from a pipe.'''

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator
from typing import IO

from prompt_toolkit.completion import CompleteEvent, Completer, Completion, PathCompleter
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory

from chatbot.conversation.log import append_whole
from chatbot.terminal.commands import complete

BLOCK = '"""'


def clean_message(text: str) -> str:
    """Drop control characters that a terminal or pipe let through (keep newline and tab)."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return "".join(ch for ch in text if ch in "\n\t" or (ord(ch) >= 32 and not 127 <= ord(ch) < 160))


class BlockReader:
    '''Joins the lines of a `"""` block into one message.

    A line starting with `"""` opens a block (text after the quotes is its first line); the
    first line ending with `"""` closes it. Other lines pass through unchanged.
    '''

    def __init__(self) -> None:
        self.lines: list[str] | None = None

    @property
    def is_open(self) -> bool:
        return self.lines is not None

    def feed(self, line: str) -> str | None:
        """Return a complete message, or None while a block is still open."""
        if self.lines is None:
            stripped = line.strip()
            if not stripped.startswith(BLOCK):
                return line
            rest = stripped[len(BLOCK) :]
            if rest.endswith(BLOCK):
                return rest[: -len(BLOCK)]
            self.lines = [rest] if rest else []
            return None
        if line.rstrip().endswith(BLOCK):
            self.lines.append(line.rstrip()[: -len(BLOCK)])
            return self.close()
        self.lines.append(line)
        return None

    def close(self) -> str:
        """End the block now (end of input): what it has so far."""
        lines, self.lines = self.lines or [], None
        while lines and not lines[-1].strip():
            lines.pop()
        return "\n".join(lines)


class SlashCompleter(Completer):
    """Tab completion of slash-commands, settings and file names."""

    def __init__(self) -> None:
        self.paths = PathCompleter(expanduser=True)

    def get_completions(self, document: Document, complete_event: CompleteEvent) -> Iterator[Completion]:
        line = document.text_before_cursor
        if "\n" in line:
            return
        candidates, start, kind = complete(line)
        if kind == "path":
            sub = Document(line[start:], len(line) - start)
            yield from self.paths.get_completions(sub, complete_event)
            return
        for c in candidates:
            yield Completion(c, start_position=start - len(line))


def read_lines(stream: IO[bytes]) -> Iterable[str]:
    """Lines of a byte stream as text; invalid UTF-8 becomes U+FFFD instead of an error."""
    for raw in stream:
        yield raw.decode("utf-8", errors="replace")


class KeptHistory(FileHistory):
    """prompt_toolkit's `FileHistory` that survives a file it cannot write (a full disk).

    prompt_toolkit stores a line inside its event loop, where an exception is reported as
    "Unhandled exception in event loop" with "Press ENTER to continue..." at every line.
    Here the first failure is kept in `warning` instead (for the REPL to show once, after
    the prompt), a line torn by it is cut off again, and from then on the history is kept
    in memory only. The file format is `FileHistory`'s.
    """

    def __init__(self, filename: str) -> None:
        super().__init__(filename)
        self.failed = False
        self.warning: str | None = None

    def store_string(self, string: str) -> None:
        if self.failed:
            return
        text = f"\n# {datetime.datetime.now()}\n" + "".join(f"+{line}\n" for line in string.split("\n"))
        try:
            append_whole(self.filename, text.encode("utf-8", errors="replace"))
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        self.failed = True
        self.warning = (
            f"warning: cannot write the input history {os.fsdecode(self.filename)} ({exc.strerror or exc}); "
            "this session's lines are kept in memory only"
        )

    def take_warning(self) -> str | None:
        """The warning of a failed write, once (None when there is nothing new to say)."""
        warning, self.warning = self.warning, None
        return warning
