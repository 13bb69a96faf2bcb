"""The chat loop: a prompt_toolkit prompt on a terminal, one message per line on a pipe."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.table import Table

from chatbot.errors import ChatbotError
from chatbot.models.loader import LoadedModel
from chatbot.session import ChatSession
from chatbot.terminal.commands import Command, help_text, is_command, parse_command
from chatbot.terminal.render import MarkdownAnswer, PlainAnswer, format_stats_line, stats_table

MAX_MESSAGE_CHARS = 200_000


def data_dir() -> Path:
    """`$XDG_DATA_HOME/chatbot` (default `~/.local/share/chatbot`)."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "chatbot"


def clean_message(text: str) -> str:
    """Drop control characters that a terminal or pipe let through (keep newline and tab)."""
    return "".join(ch for ch in text if ch in "\n\t" or (ord(ch) >= 32 and ord(ch) != 127))


class Repl:
    """Reads messages and commands, streams answers, prints stats.

    Args:
        session: the conversation.
        loaded: the model, for the banner and /model.
        console: where Rich output goes (stdout on a terminal).
        plain: print raw text instead of live Markdown.
        show_stats: print the stats line after each answer.
        info: where notes and stats go (stderr when stdout is a pipe).
    """

    def __init__(
        self,
        session: ChatSession,
        loaded: LoadedModel,
        console: Console,
        plain: bool = False,
        show_stats: bool = True,
        info: Console | None = None,
    ) -> None:
        self.session = session
        self.loaded = loaded
        self.console = console
        self.info = info or console
        self.plain = plain
        self.show_stats = show_stats
        self.running = True
        self.handlers: dict[str, Callable[[Command], None]] = {
            "help": lambda c: self.info.print(help_text(), highlight=False, markup=False),
            "exit": self._exit,
            "reset": self._reset,
            "stats": self._stats,
            "cache": self._cache,
        }

    # -- commands ----------------------------------------------------------------------

    def _exit(self, _: Command) -> None:
        self.running = False

    def _reset(self, _: Command) -> None:
        self.session.reset()
        self.note("conversation cleared (the system prompt is kept)")

    def _stats(self, _: Command) -> None:
        if not self.session.turns:
            self.note("no turns yet")
            return
        self.info.print(stats_table(self.session.turns, self.session.summary()))

    def _cache(self, _: Command) -> None:
        lay = self.session.cache_layout()
        table = Table(show_header=False, title="cache")
        table.add_row("tokens", f"{lay.length:,} / {lay.capacity:,}")
        table.add_row("pinned (sinks, system)", f"{lay.pinned:,}")
        table.add_row("recent", f"{lay.recent:,}")
        table.add_row("evicted so far", f"{lay.evicted_total:,}")
        table.add_row("oldest text in window", lay.oldest_text[:80] or "-")
        self.info.print(table)

    # -- output ------------------------------------------------------------------------

    def note(self, text: str) -> None:
        self.info.print(text, style="dim", highlight=False, markup=False)

    def error(self, text: str) -> None:
        self.info.print(f"error: {text}", style="red", highlight=False, markup=False)

    # -- one line of input -------------------------------------------------------------

    def handle(self, line: str) -> None:
        """Run a command or send a message; errors become one-line messages."""
        line = clean_message(line)
        if not line.strip():
            return
        if is_command(line):
            try:
                command = parse_command(line)
                self.handlers[command.name](command)
            except ChatbotError as exc:
                self.error(str(exc))
            return
        if line.startswith("//"):
            line = line[1:]
        if len(line) > MAX_MESSAGE_CHARS:
            self.error(f"message too long ({len(line):,} characters; the limit is {MAX_MESSAGE_CHARS:,})")
            return
        self.chat(line)

    def chat(self, text: str) -> None:
        try:
            chunks = self.session.send(text)
        except ChatbotError as exc:
            self.error(str(exc))
            return
        answer = PlainAnswer(self.console.file) if self.plain else MarkdownAnswer(self.console)
        stats = None
        try:
            with answer:
                for chunk in chunks:
                    if chunk.text:
                        answer.add(chunk.text)
                    stats = chunk.stats or stats
        except KeyboardInterrupt:
            chunks.close()
            self.note("[interrupted: the partial answer is kept]")
            return
        except ChatbotError as exc:
            self.error(str(exc))
            return
        if stats is not None and self.show_stats:
            self.note(format_stats_line(stats))

    # -- loops -------------------------------------------------------------------------

    def run_lines(self, lines: Iterable[str]) -> None:
        """One message or command per line (a pipe); stops at the end or /exit."""
        for line in lines:
            self.handle(line.rstrip("\r\n"))
            if not self.running:
                break

    def run_terminal(self) -> None:
        """The interactive prompt: Ctrl-C clears the line or stops an answer, Ctrl-D exits."""
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory

        history: FileHistory | InMemoryHistory
        try:
            path = data_dir() / "history"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
            history = FileHistory(str(path))
        except OSError as exc:
            self.note(f"warning: cannot keep input history ({exc.strerror}); going on without it")
            history = InMemoryHistory()
        prompt: PromptSession[str] = PromptSession(history=history)
        self.note("type a message; /help for commands; Ctrl-D to exit")
        while self.running:
            try:
                line = prompt.prompt("> ")
            except KeyboardInterrupt:
                self.note("(Ctrl-D or /exit to leave)")
                continue
            except EOFError:
                break
            self.handle(line)


def read_lines(stream: IO[bytes]) -> Iterable[str]:
    """Lines of a byte stream as text; invalid UTF-8 becomes U+FFFD instead of an error."""
    for raw in stream:
        yield raw.decode("utf-8", errors="replace")


def run(repl: Repl, interactive: bool) -> None:
    if interactive:
        repl.run_terminal()
    else:
        repl.run_lines(read_lines(sys.stdin.buffer))
