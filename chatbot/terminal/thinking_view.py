"""Where a streamed answer's thinking goes (`ThinkingRoute`).

On a terminal the thinking streams dimmed above the answer (the answer view dims a
`<think>` part). Into a pipe or in a one-shot run, stdout carries the answer alone: the
thinking goes to stderr with `--show-thinking`, else nowhere. Thinking comes as tags in the
text (`chatbot.conversation.thinking.ThinkingSplitter` cuts it out) or apart, from a server's
`reasoning_content` (a chunk's `thinking`).
"""

from __future__ import annotations

from typing import IO, Protocol

from chatbot.conversation.thinking import ThinkingSplitter
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
    """

    def __init__(
        self,
        answer: AnswerView,
        opened: str | None,
        inline: bool,
        apart: IO[str] | None = None,
        dim: bool = False,
        raw: bool = False,
    ) -> None:
        self.answer = answer
        self.splitter = ThinkingSplitter(opened)
        self.inline = inline
        self.apart = apart
        self.dim = dim
        self.raw = raw
        self.thinking = ""  # all of this answer's thinking (for /thinking)
        self._in_thinking = False  # the view has an open <think> part (inline) or a line (apart)

    def add(self, text: str, thinking: str = "") -> None:
        """A chunk: its text (with any tags) and the thinking sent apart."""
        if thinking:
            self._think(thinking)
        for part, is_thinking in self.splitter.feed(text):
            self._think(part) if is_thinking else self._answer(part)

    def end(self) -> None:
        """The answer ended (or stopped): show what was held back, close the thinking."""
        for part, is_thinking in self.splitter.flush():
            self._think(part) if is_thinking else self._answer(part)
        self._close()

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
        self._close()
        self.answer.add(self._show(text))

    def _close(self) -> None:
        if not self._in_thinking:
            return
        self._in_thinking = False
        if self.inline:
            self.answer.add("</think>")
        elif self.apart is not None:
            if not self.thinking.endswith("\n"):
                self.apart.write("\n")
            self.apart.flush()
