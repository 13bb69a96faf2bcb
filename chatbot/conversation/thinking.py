"""A thinking model's answer cut into its thinking and the answer proper.

Models that think write it between tags (`<think>…</think>`, Qwen3, DeepSeek-R1, SmolLM3),
or their template opens the tag in the generation prompt so that the answer starts inside
it; servers with a reasoning parser send it apart, as `reasoning_content`. Whoever shows or
sends an answer cuts the text with `ThinkingSplitter` and decides where each part goes (the
terminal dims it, a pipe drops it, `serve` sends it as `reasoning_content`); the sessions
measure it with `ThinkingMeter` for the stats (`TurnStats.thinking_tokens`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from chatbot.conversation.harmony import CALL, RETURN, START, HarmonySplitter, held_tail
from chatbot.conversation.harmony import OPENED as HARMONY_OPENED

OPEN_TAGS = ("<think>", "<thinking>", "<reasoning>")
_OPEN = re.compile("|".join(re.escape(t) for t in OPEN_TAGS))


def close_tag(open_tag: str) -> str:
    return "</" + open_tag[1:]


def opens_thinking(text: str) -> str | None:
    """The thinking tag left open at the end of `text` (a generation prompt that opens
    `<think>`), or None. Where `text` ends in a harmony answer (gpt-oss's: a generation prompt
    ending with ``<|start|>assistant``, or an answer being continued), the text from that
    ``<|start|>assistant`` on: the answer is read by channels, from there (`splitter_for`)."""
    at = text.rfind(HARMONY_OPENED)
    if at >= 0 and not any(t in text[at + len(HARMONY_OPENED) :] for t in (START, RETURN, CALL)):
        return text[at:]
    matches = list(_OPEN.finditer(text))
    if not matches:
        return None
    last = matches[-1]
    return None if close_tag(last.group()) in text[last.end() :] else last.group()


class ThinkingSplitter:
    """Cuts streamed text into (piece, is_thinking) parts, the tags left out.

    A tag cut between two pieces is held back until it is told apart from text. Only the
    first thinking part of an answer is thinking: text after it is the answer, tags and all
    (a model explaining `<think>` tags is not thinking again).

    Args:
        opened: the tag the prompt left open (`opens_thinking`): the answer starts thinking.
    """

    def __init__(self, opened: str | None = None) -> None:
        self.close: str | None = close_tag(opened) if opened else None  # set while thinking
        self.done = False  # a thinking part has ended: no more tags are looked for
        self.started = False  # some answer text came (a tag after it is text)
        self.held = ""
        self.thought = bool(opened)  # there was a thinking part

    @property
    def thinking(self) -> bool:
        return self.close is not None

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """The parts of `text` (after what was held back) that can be told now."""
        out: list[tuple[str, bool]] = []
        text = self.held + text
        self.held = ""
        while text:
            if self.close is not None:
                end = text.find(self.close)
                if end >= 0:
                    out.append((text[:end], True))
                    text = text[end + len(self.close) :]
                    self.close = None
                    self.done = True
                    continue
                keep = held_tail(text, (self.close,))
                out.append((text[: len(text) - keep], True))
                self.held = text[len(text) - keep :]
                break
            if self.done or self.started:
                out.append((text, False))
                break
            lead = len(text) - len(text.lstrip())  # thinking may start after blank lines
            match = _OPEN.search(text)
            if match is not None and match.start() == lead:
                self.close = close_tag(match.group())
                self.thought = True
                text = text[match.end() :]
                continue
            if text.strip() == "" or (match is None and any(t.startswith(text.lstrip()) for t in OPEN_TAGS)):
                self.held = text  # blank so far, or the start of a tag
                break
            self.started = True
            out.append((text, False))
            break
        return [(p, t) for p, t in out if p]

    def flush(self) -> list[tuple[str, bool]]:
        """What was held back, at the answer's end."""
        held, self.held = self.held, ""
        return [(held, self.close is not None)] if held else []


def splitter_for(opened: str | None, calls_apart: bool = False) -> ThinkingSplitter | HarmonySplitter:
    """The splitter of an answer after a prompt that left `opened` open (`opens_thinking`):
    harmony's channels (in the state the answer so far left them; `calls_apart`: its messages
    to a tool kept apart as calls), or tags."""
    if opened is None or not opened.startswith(HARMONY_OPENED):
        return ThinkingSplitter(opened)
    splitter = HarmonySplitter(calls_apart)
    splitter.feed(opened[len(HARMONY_OPENED) :])
    return splitter


class ThinkingMeter:
    """Counts a streamed answer's thinking: its tokens and the time from the first token to
    the end of the thinking (`tokens`, `seconds`)."""

    def __init__(self, opened: str | None = None) -> None:
        self.splitter = splitter_for(opened)
        self.tokens = 0
        self.seconds = 0.0
        self.start: float | None = None

    def add(self, text: str, tokens: int, thinking: str = "") -> None:
        """A chunk: its text (tags and all), the tokens it covers, and thinking sent apart
        (a server's `reasoning_content`)."""
        now = time.perf_counter()
        if self.start is None:
            self.start = now
        was = self.splitter.thinking
        parts = self.splitter.feed(text)
        if thinking or was or self.splitter.thinking or any(t for _, t in parts):
            self.tokens += tokens
            self.seconds = now - self.start


CLOSING = "\n\nI have thought long enough; time to answer.\n"
"""What a thinking budget writes before the end-of-thinking tag (Qwen's budget recipe writes
a sentence so too: the model then answers from what it thought)."""


class ThinkingBudget:
    """Closes a model's thinking after `budget` tokens of it: the answer's next tokens are a
    closing sentence and the end-of-thinking tag (the engine's `insert` hook, told each
    answer token). 0: no thinking at all (an open tag is closed at once).

    Args:
        budget: the most thinking tokens.
        opened: the tag the prompt left open (`opens_thinking`).
        encode: text to token ids (special-token text as the control token).
        decode: a detokenizer's `add` (an id to its new text).
    """

    def __init__(
        self,
        budget: int,
        opened: str | None,
        encode: Callable[[str], list[int]],
        decode: Callable[[int], str],
    ) -> None:
        self.budget = budget
        self.splitter = splitter_for(opened)
        self.encode = encode
        self.decode = decode
        self.tokens = 0
        self.done = False

    def _close(self) -> list[int]:
        self.done = True
        assert self.splitter.close is not None
        sentence = CLOSING if self.tokens else "\n"
        after = "" if isinstance(self.splitter, HarmonySplitter) else "\n\n"  # a header ends it
        return self.encode(sentence + self.splitter.close + after)

    def __call__(self, token: int | None) -> list[int]:
        if self.done:
            return []
        if token is None:  # before the first token: a prompt that opened the thinking
            return self._close() if self.budget == 0 and self.splitter.thinking else []
        was = self.splitter.thinking
        self.splitter.feed(self.decode(token))
        if was or self.splitter.thinking:
            self.tokens += 1
        if self.splitter.done:
            self.done = True  # the model closed it itself
        elif self.splitter.thinking and self.tokens >= self.budget:
            return self._close()
        return []
