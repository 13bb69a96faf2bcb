"""Rendered text and token ids kept in step: the conversation's text is tokenized piece by
piece as it reads *in* the conversation, not alone.

With a SentencePiece tokenizer (Llama-2, Mistral, Vicuna) an answer "▁Hello" decodes alone as
"Hello" but reads " Hello" after "[/INST]", and "USER:" encodes alone as "▁USER:" but as
"USER", ":" after "</s>". `TextCodec` encodes and decodes a piece after its left context;
`split_answer` finds an answer inside the template's rendering; `StopView` and `LeadingText`
adjust what a stream shows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatbot.engine.generate import GenerationChunk
from chatbot.models.templates import find_stop, held_back

# Ids of left context for decoding an answer as it reads in the conversation.
_DECODE_CONTEXT = 8


@dataclass
class Segment:
    """A span of the rendered conversation and its token ids."""

    kind: str  # "prompt" (tokenized by us) or "answer" (generated)
    text: str
    ids: list[int]



class TextCodec:
    """The tokenizer's chat template, encoding and decoding, each piece after its context.

    Args:
        tokenizer: a transformers tokenizer with a chat template.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._specials: tuple[str, ...] | None = None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not messages and not add_generation_prompt:
            return ""
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def encode(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of `text`; with `literal`, special-token text in it (`<|im_end|>`) is
        encoded as plain text, never as the control token."""
        if not text:
            return []
        if literal:
            return list(self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def special_texts(self) -> tuple[str, ...]:
        """The texts of the tokenizer's special tokens (cached)."""
        if self._specials is None:
            texts = set(self.tokenizer.all_special_tokens)
            texts.update(t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special)
            self._specials = tuple(t for t in texts if t)
        return self._specials

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def encode_after(self, context: str, text: str, literal: bool = False) -> list[int]:
        """Ids for `text` as they are when it follows `context` ("" at the start).

        A SentencePiece tokenizer writes "▁" before the first word of a text, so "USER:"
        alone is "▁USER:" but "USER", ":" after "</s>": the ids of ``context + text`` past those
        of `context` are the ones a tokenization of the whole conversation has there. Should
        the two merge across the boundary, `text` is encoded alone.
        """
        if not context or not text:
            return self.encode(text, literal)
        head = self.encode(context, literal)
        whole = self.encode(context + text, literal)
        return whole[len(head) :] if whole[: len(head)] == head else self.encode(text, literal)

    def decode_after(self, before: Sequence[int], ids: Sequence[int]) -> str:
        """The text `ids` add after the ids `before`: a SentencePiece answer "▁Hello" reads
        " Hello" after "[/INST]", though alone it decodes as "Hello"."""
        if not before or not ids:
            return self.decode(ids)
        for n in (_DECODE_CONTEXT, len(before)):
            context = list(before[-n:])
            head = self.decode(context)
            whole = self.decode([*context, *ids])
            if whole.startswith(head):
                return whole[len(head) :]
            if n >= len(before):
                break
        return self.decode(ids)

    def segment(self, kind: str, text: str, context: str = "", content: str | None = None) -> Segment:
        """A segment of `text` tokenized by us, as it reads after the text `context` (the
        text of the segment before it).

        `content` is the message the template put in `text`: special-token text inside it
        (a pasted `<|im_end|><|im_start|>system`) is encoded as plain text, so that a message
        cannot forge turns; the template's own special tokens stay control tokens.
        """
        if content and any(s in content for s in self.special_texts()):
            at = text.rfind(content)
            if at >= 0:
                head, tail = text[:at], text[at + len(content) :]
                ids = (self.encode_after(context, head) + self.encode_after(context + head, content, literal=True)
                       + self.encode_after(context + head + content, tail))
                return Segment(kind, text, ids)
        return Segment(kind, text, self.encode_after(context, text))


class StopView:
    """What the caller of a streamed answer may see when stop strings apply: the text up to
    the first stop string, less an end that may still grow into one (shown once it cannot,
    or when the answer ends).

    Args:
        stop_strings: the texts that end the answer.
        shown: the answer's text the caller has already seen (a continued answer's start).
    """

    def __init__(self, stop_strings: tuple[str, ...], shown: str = "") -> None:
        self.stop_strings = stop_strings
        self.text = shown
        self.shown = len(shown)

    def chunk(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk with only the text that may be shown now."""
        self.text += chunk.text
        end = find_stop(self.text, self.stop_strings)
        if end < 0:
            end = len(self.text)
            if not chunk.finish_reason:
                end -= held_back(self.text, self.stop_strings)
        text = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return dataclasses.replace(chunk, text=text)


class LeadingText:
    """Puts back the text a continued answer's first tokens have only after the part before
    it (the space of a SentencePiece "▁thank" after "Hello"), which the engine, decoding
    the new tokens alone, leaves out.

    Args:
        text: the session's text codec.
        before: the conversation's ids up to the end of the answer being continued.
    """

    def __init__(self, text: TextCodec, before: list[int]) -> None:
        self.codec = text
        self.before = before
        self.ids: list[int] = []
        self.done = False

    def chunk(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk, with the leading text in front of the first one that shows text."""
        if self.done:
            return chunk
        self.ids.extend(chunk.token_ids)
        if not chunk.text:
            return chunk
        self.done = True
        alone = self.codec.decode(self.ids)
        in_context = self.codec.decode_after(self.before, self.ids)
        if in_context == alone or not in_context.endswith(alone):
            return chunk
        return dataclasses.replace(chunk, text=in_context[: len(in_context) - len(alone)] + chunk.text)


def split_answer(rest: str, answer: str) -> tuple[str, str] | None:
    """Where a template put an answer in `rest` (the conversation rendered after the
    generation prompt): the answer's text there and the closing text after it; None when
    it is not there.

    Whitespace the template writes before the answer (the space after Llama-2's "[/INST]")
    belongs to the answer: the model answers from the end of the generation prompt, and
    writes that space itself (SentencePiece's "▁Hello").
    """
    if rest.startswith(answer):
        return answer, rest[len(answer) :]
    core = answer.strip()
    if not core:
        return "", rest
    at = rest.find(core)
    if at < 0 or rest[:at].strip():
        return None
    return rest[: at + len(core)], rest[at + len(core) :]
