"""Where a streamed answer's thinking goes (`ThinkingRoute`).

On a terminal the thinking streams dimmed above the answer (the answer view dims a
`<think>` part), and folds to one line (`thought for 412 tok · 9.8 s`) once it ends, unless
--show-thinking keeps it; with --hide-thinking that line alone is shown. A thinking cut short
(the answer never began) is kept in full where it streamed. Into a pipe or in a one-shot
run, stdout carries the answer alone: the thinking goes to stderr with `--show-thinking`,
else nowhere. Thinking comes as tags in the text
(`chatbot.conversation.thinking.ThinkingSplitter` cuts it out) or apart, from a server's
`reasoning_content` (a chunk's `thinking`); gpt-oss's comes on its analysis channel
(`chatbot.conversation.harmony`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import IO, Protocol

from chatbot.conversation.thinking import ThinkingMeter, splitter_for
from chatbot.terminal.sanitize import safe_text


class AnswerView(Protocol):
    def add(self, text: str) -> None: ...


class ThinkingRoute:
    """Sends a chunk's thinking and answer where they go.

    Args:
        answer: the answer's view (stdout).
        opened: the thinking tag the prompt left open (`Chat.thinking_opened`).
        inline: show the thinking in the answer's view, dimmed (a terminal); else it goes
            to `apart` (or nowhere, where that is None).
        apart: where thinking goes when not inline (stderr with --show-thinking).
        dim: write the thinking `apart` dimmed (stderr is a terminal).
        raw: keep the model's bytes (a pipe); else control characters are made visible.
        fold: where the thinking's one line goes once it ended (`MarkdownAnswer.fold`: the
            thinking streamed inline is replaced by it); None: no such line.
    """

    def __init__(
        self,
        answer: AnswerView,
        opened: str | None,
        inline: bool,
        apart: IO[str] | None = None,
        dim: bool = False,
        raw: bool = False,
        fold: Callable[[str], None] | None = None,
    ) -> None:
        self.answer = answer
        self.splitter = splitter_for(opened)
        self.inline = inline
        self.apart = apart
        self.dim = dim
        self.raw = raw
        self.fold = fold
        self.meter = ThinkingMeter(opened)  # its tokens and time, for the folded line
        self.thinking = ""  # all of this answer's thinking (for /thinking)
        self._in_thinking = False  # the view has an open <think> part (inline) or a line (apart)
        self._answered = False  # answer text came

    def add(self, text: str, thinking: str = "", tokens: int = 1) -> None:
        """A chunk: its text (with any tags), the thinking sent apart, and the tokens it
        covers."""
        self.meter.add(text, tokens, thinking)
        if thinking:
            self._think(thinking)
        for part, is_thinking in self.splitter.feed(text):
            self._think(part) if is_thinking else self._answer(part)

    def end(self) -> None:
        """The answer ended (or stopped): show what was held back, close the thinking."""
        for part, is_thinking in self.splitter.flush():
            self._think(part) if is_thinking else self._answer(part)
        self._close(ended=self._answered or self.splitter.done)

    def summary(self) -> str:
        """The thinking in one line: `thought for 412 tok · 9.8 s`."""
        return f"thought for {self.meter.tokens:,} tok · {self.meter.seconds:.1f} s"

    def _show(self, text: str) -> str:
        return text if self.raw else safe_text(text)

    def _think(self, text: str) -> None:
        self.thinking += text
        if self.inline:
            self.answer.add(("" if self._in_thinking else "<think>") + self._show(text))
        elif self.apart is not None:
            shown = self._show(text if self._in_thinking else text.lstrip("\n"))
            self.apart.write(f"\x1b[2m{shown}\x1b[0m" if self.dim and shown else shown)
            self.apart.flush()
        self._in_thinking = True

    def _answer(self, text: str) -> None:
        self._answered = True
        self._close(ended=True)
        self.answer.add(self._show(text))

    def _close(self, ended: bool) -> None:
        """The thinking part ends: `ended`, the answer began (or the closing tag came)."""
        if not self._in_thinking:
            return
        self._in_thinking = False
        if self.fold is not None and (ended or not self.inline):
            self.fold(self.summary())
        elif self.inline:
            self.answer.add("</think>")
        elif self.apart is not None:
            if not self.thinking.endswith("\n"):
                self.apart.write("\n")
            self.apart.flush()
