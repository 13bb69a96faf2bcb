"""gpt-oss's "harmony" answers: channels, not tags.

The template's generation prompt ends with ``<|start|>assistant``; the model writes a header
(``<|channel|>analysis``) and, after ``<|message|>``, the message, which ``<|end|>`` closes. It
goes on with ``<|start|>assistant<|channel|>final<|message|>`` and the answer, which
``<|return|>`` ends (a tool call, on the commentary channel, ends with ``<|call|>``): so
``<|end|>`` is no stop, ``<|return|>`` and ``<|call|>`` are. The analysis channel is the
model's thinking, every other channel's message is answer text (`HarmonySplitter`), but for a
message addressed to a tool (a header with ``to=functions.NAME``), which a splitter told to
can keep apart as a call (`HarmonySplitter.calls`).

The template renders an earlier answer's final message alone (its analysis dropped), and
refuses channel tokens in a message's content: an answer is given to it as its final text in
``content`` and its analysis in ``thinking`` (`harmony_messages`).
"""

from __future__ import annotations

import re

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL = "<|return|>", "<|call|>"
OPENED = START + "assistant"
"""The end of a harmony generation prompt (`opens_thinking` gives it as the tag left open)."""
_BODY_ENDS = (END, RETURN, CALL, START)
_TO = "to="
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


def held_tail(text: str, marks: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may be the start of one of `marks` (a tag
    or control token cut between two pieces of a stream)."""
    for n in range(min(len(text), max(len(m) for m in marks) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in marks):
            return n
    return 0


class HarmonySplitter:
    """Cuts a streamed harmony answer into (piece, is_thinking) parts, the headers and
    control tokens left out: the analysis channel's messages are thinking, the others'
    (final, commentary) answer.

    An answer that does not open with a header (``<|channel|>``) is plain answer text, as
    a model that does not write harmony writes it. A control token cut between two pieces is
    held back until it is told apart from text. `ThinkingSplitter`'s interface: `thinking`
    (a thinking message is open), `done` (a thinking part ended), `thought`, `close` (what
    a thinking budget writes to end the thinking: the analysis's end and the final
    message's header).

    Args:
        calls_apart: a message with a recipient (``to=functions.get_weather``) is no answer
            text: it goes to `calls`, as (recipient, message), the message as written (a
            call's arguments, JSON text).
    """

    def __init__(self, calls_apart: bool = False) -> None:
        self.mode = "start"  # start, header, body, between (after <|end|>), plain
        self.header = ""
        self.channel = ""
        self.recipient = ""
        self.held = ""
        self.done = False
        self.thought = False
        self.calls_apart = calls_apart
        self.calls: list[tuple[str, str]] = []

    @property
    def thinking(self) -> bool:
        return self.mode == "body" and self.channel == "analysis"

    @property
    def close(self) -> str | None:
        return END + OPENED + CHANNEL + "final" + MESSAGE if self.thinking else None

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """The parts of `text` (after what was held back) that can be told now."""
        out: list[tuple[str, bool]] = []
        text = self.held + text
        self.held = ""
        while text:
            if self.mode == "plain":
                out.append((text, False))
                break
            if self.mode == "start":
                lead = text.lstrip()
                if lead.startswith((CHANNEL, _TO)):  # the header: its channel or its recipient first
                    self.mode, text = "header", lead
                    continue
                if not lead or CHANNEL.startswith(lead) or _TO.startswith(lead):
                    self.held = text
                    break
                self.mode = "plain"
                continue
            if self.mode in ("header", "between"):
                whole, self.header = self.header + text, ""
                at = whole.find(MESSAGE)
                if at < 0:
                    self.header = whole  # a header is short: it is read whole
                    break
                self._open(whole[:at])
                text = whole[at + len(MESSAGE) :]
                continue
            # in a message's body: up to the token that ends it
            ends = [(text.find(m), m) for m in _BODY_ENDS if m in text]
            if ends:
                at, mark = min(ends)
                self._body(text[:at], out)
                self._end_message(mark)
                text = text[at + len(mark) :]
                continue
            keep = held_tail(text, _BODY_ENDS)
            self._body(text[: len(text) - keep], out)
            self.held = text[len(text) - keep :]
            break
        return [(p, t) for p, t in out if p]

    def _open(self, header: str) -> None:
        """A message begins after `header` (``<|start|>assistant<|channel|>final``)."""
        channel = header.split(CHANNEL, 1)[1] if CHANNEL in header else ""
        self.channel = channel.split()[0] if channel.split() else ""
        to = _RECIPIENT.search(header)
        self.recipient = to.group(1) if to and self.calls_apart else ""
        if self.recipient:
            self.calls.append((self.recipient, ""))
        self.mode = "body"
        if self.channel == "analysis":
            self.thought = True

    def _body(self, piece: str, out: list[tuple[str, bool]]) -> None:
        """A piece of the open message's body: a part, or the call's message."""
        if self.recipient:
            self.calls[-1] = (self.recipient, self.calls[-1][1] + piece)
        else:
            out.append((piece, self.thinking))

    def _end_message(self, mark: str) -> None:
        if self.channel == "analysis":
            self.done = True
        self.mode, self.recipient = "between", ""
        self.header = START if mark == START else ""

    def flush(self) -> list[tuple[str, bool]]:
        """What was held back, at the answer's end (an unfinished header is dropped)."""
        held, self.held = self.held, ""
        if self.mode == "body" and held:
            out: list[tuple[str, bool]] = []
            self._body(held, out)
            return out
        if self.mode in ("start", "plain") and held.strip():
            return [(held, False)]
        return []


def split_harmony(text: str) -> tuple[str, str]:
    """An answer's (thinking, answer) text: its analysis messages and the rest."""
    splitter = HarmonySplitter()
    parts = splitter.feed(text) + splitter.flush()
    return "".join(p for p, t in parts if t), "".join(p for p, t in parts if not t)


def harmony_messages(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages as the harmony template takes them: an assistant message written in
    harmony becomes its final text (``content``) and its analysis (``thinking``)."""
    out = []
    for message in messages:
        content = message.get("content", "")
        if message.get("role") == "assistant" and CHANNEL in content:
            thinking, answer = split_harmony(content)
            message = {**message, "content": answer}
            if thinking:
                message["thinking"] = thinking
        out.append(message)
    return out
