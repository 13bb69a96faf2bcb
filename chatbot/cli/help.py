"""`--help` screens a person reads whole at any width from 40 columns up.

click's formatter as typer uses it breaks words at hyphens ("[default: no-" over
"enable-streaming]"), keeps a 30-column option column on a 50-column terminal (which leaves
16 for the help, so "SmolLM2-135M-Instruct" is broken too), and cuts each command's line in
a commands list at about 45 characters with "...". `HelpGroup` (the `chatbot` app's group)
gives every command below it a formatter that wraps between words only, with a narrower
option column where the terminal is narrow, and a commands-list line that is the command's
`short_help`, else the first sentence of its help, whole.
"""

from __future__ import annotations

import inspect
import shutil
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import typer
from typer.core import TyperGroup

HELP_COLUMN = 28  # the fewest characters an option's help gets per line: the longest words fit
NARROWEST = 40  # below this many columns the help is written for 40 (the terminal wraps it)


def wrap_words(text: str, width: int, indent: str = "") -> str:
    """`text` wrapped to `width` between words only: never at a hyphen, a word longer than a
    line stands alone. Paragraphs (split by blank lines) stay apart, keep their own indent,
    and one that starts with a "\\b" line is kept as written (click's convention)."""
    out: list[str] = []
    for paragraph in text.expandtabs().split("\n\n"):
        lines = paragraph.splitlines()
        if not lines:
            continue
        if lines[0].strip() == "\b":
            out.append("\n".join(indent + line for line in lines[1:]))
            continue
        own = indent + " " * (len(lines[0]) - len(lines[0].lstrip()))
        wrapper = textwrap.TextWrapper(
            width=max(width, len(own) + 1),
            initial_indent=own,
            subsequent_indent=own,
            break_on_hyphens=False,
            break_long_words=False,
        )
        out.append(wrapper.fill(" ".join(line.strip() for line in lines)))
    return "\n\n".join(out)


class WordWrapFormatter(typer.Context.formatter_class):  # type: ignore[valid-type,misc]  # click's, as typer vendors it
    """click's help formatter, wrapping between words (see the module's docstring)."""

    def __init__(
        self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None
    ) -> None:
        if width is None:  # click's floor is 50: on a 40-column terminal every line would wrap
            columns = shutil.get_terminal_size().columns
            width = max(min(columns, max_width or 80) - 2, NARROWEST - 2)
        super().__init__(indent_increment, width, max_width)

    def write_text(self, text: str) -> None:
        self.write(wrap_words(text, self.width, " " * self.current_indent) + "\n")

    def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        """Options or commands, each name with its help beside it (below it when the name is
        longer than the first column)."""
        rows = list(rows)
        # On a narrow terminal the first column gives way, so that the help keeps HELP_COLUMN.
        col_max = max(min(col_max, self.width - self.current_indent - col_spacing - HELP_COLUMN), 8)
        first_col = min(max((len(name) for name, _ in rows), default=0), col_max) + col_spacing
        text_indent = " " * (self.current_indent + first_col)
        text_width = self.width - len(text_indent)
        for name, help_text in rows:
            self.write(" " * self.current_indent + name)
            if not help_text:
                self.write("\n")
                continue
            if len(name) <= first_col - col_spacing:
                self.write(" " * (first_col - len(name)))
            else:
                self.write("\n" + text_indent)
            wrapped = wrap_words(help_text, text_width).splitlines() or [""]
            self.write(wrapped[0] + "\n")
            self.write("".join(text_indent + line + "\n" if line else "\n" for line in wrapped[1:]))


class HelpContext(typer.Context):
    formatter_class = WordWrapFormatter


def first_sentence(help_text: str | None) -> str:
    """The first sentence of a help text's first paragraph (all of it when it has no
    sentence end), on one line."""
    paragraph = inspect.cleandoc(help_text or "").partition("\f")[0].split("\n\n")[0]
    words: list[str] = []
    for word in paragraph.split():
        words.append(word)
        if word.endswith("."):
            break
    return " ".join(words)


def _commands(group: Any) -> Iterable[Any]:
    for command in getattr(group, "commands", {}).values():
        yield command
        yield from _commands(command)


class HelpGroup(TyperGroup):
    """typer's group, whose commands (and theirs) write their help with `WordWrapFormatter`,
    each listed with its whole `short_help` or first sentence."""

    context_class = HelpContext

    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        for command in _commands(self):
            command.context_class = HelpContext
            if not command.short_help:
                command.short_help = first_sentence(command.help)
