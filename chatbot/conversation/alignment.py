"""Rendered text and token ids kept in step: the conversation's text is tokenized piece by
piece as it reads *in* the conversation, not alone.

With a SentencePiece tokenizer (Llama-2, Mistral, Vicuna) an answer "▁Hello" decodes alone as
"Hello" but reads " Hello" after "[/INST]", and "USER:" encodes alone as "▁USER:" but as
"USER", ":" after "</s>". `TextCodec` encodes and decodes a piece after its left context;
`split_answer` finds an answer inside the template's rendering; `LeadingText` puts back the
text a continued answer's first tokens have only in context.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from chatbot.conversation.harmony import harmony_messages
from chatbot.engine.chunk import GenerationChunk
from chatbot.models.template_budget import install as install_template_budget
from chatbot.models.templates import is_harmony

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
        install_template_budget()  # a template that loops for ever is refused, not waited on
        self.tokenizer = tokenizer
        self._specials: tuple[str, ...] | None = None
        self.template_kwargs: dict[str, Any] = {}  # e.g. enable_thinking (`thinking_kwargs`)

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        if not messages and not add_generation_prompt:
            return ""
        if is_harmony(getattr(self.tokenizer, "chat_template", None)):
            messages = harmony_messages(messages)  # an answer's analysis apart, as `thinking`
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )

    def encode(self, text: str, literal: bool = False) -> list[int]:
        """Token ids of `text`; with `literal`, special-token text in it (`<|im_end|>`) is
        encoded as plain text, never as the control token."""
        if not text:
            return []
        if literal:
            return list(
                self.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            )
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
                ids = (
                    self.encode_after(context, head)
                    + self.encode_after(context + head, content, literal=True)
                    + self.encode_after(context + head + content, tail)
                )
                return Segment(kind, text, ids)
        return Segment(kind, text, self.encode_after(context, text))

    def ids_for_cut_answer(
        self, before: list[int], ids: list[int], text: str, context: str
    ) -> tuple[list[int], int]:
        """Ids that read `text` after the ids `before`, for an answer cut before a stop
        string, and how many of them lead as generated.

        The generated ids are kept as far as they decode to a prefix of the text; the rest
        of it (a stop string that begins inside a token) is re-encoded, after the text
        `context`. Should that not
        join, the whole text is encoded afresh, keeping the ids it shares with the answer.
        """
        kept = len(ids)
        while kept and not text.startswith(self.decode_after(before, ids[:kept])):
            kept -= 1
        head = self.decode_after(before, ids[:kept])
        new = ids[:kept] + self.encode_after(context + head, text[len(head) :])
        if self.decode_after(before, new) != text:
            new = self.encode_after(context, text)
            kept = 0
            while kept < min(len(ids), len(new)) and ids[kept] == new[kept]:
                kept += 1
        return new, kept


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


Render = Callable[[list[dict[str, str]], bool], str]
Pieces = list[tuple[str, str, str]]


def conversation(sys_msgs: list[dict[str, str]], turns: Sequence[Any]) -> list[dict[str, str]]:
    """Role/content records of the system messages and the turns (``.user``, ``.answer``)."""
    msgs = list(sys_msgs)
    for t in turns:
        msgs.append({"role": "user", "content": t.user})
        msgs.append({"role": "assistant", "content": t.answer})
    return msgs


def turn_pieces(
    render: Render, sys_msgs: list[dict[str, str]], turns: Sequence[Any], text: str
) -> Pieces | None:
    """Each turn's text as (prompt, answer, closing text), found by rendering the
    conversation up to each message: quadratic in the turns, for any template. None
    when the template cannot be split turn by turn.

    Args:
        text: the rendered text before the first turn (the system prompt's segment).
    """
    msgs = list(sys_msgs)
    pieces = []
    for turn in turns:
        msgs = [*msgs, {"role": "user", "content": turn.user}]
        full = render(msgs, True)
        msgs = [*msgs, {"role": "assistant", "content": turn.answer}]
        after = render(msgs, False)
        split = split_answer(after[len(full) :], turn.answer) if after.startswith(full) else None
        if not full.startswith(text) or split is None:
            return None
        pieces.append((full[len(text) :], *split))
        text = after
    return pieces


def turn_pieces_windowed(
    render: Render, sys_msgs: list[dict[str, str]], turns: Sequence[Any], text: str
) -> Pieces | None:
    """As `turn_pieces`, in time linear in the turns: each turn is rendered after only
    the system prompt and the turn before it, and the pieces are accepted when together
    they are exactly the whole conversation as rendered (else None: the template looks
    further back, and `turn_pieces` is used).
    """
    if len(turns) < 4:
        return None  # short conversations: the exact method costs as little
    pieces = []
    prev: list[dict[str, str]] = []
    try:
        for i, turn in enumerate(turns):
            window = [*sys_msgs, *prev]
            base = text if i == 0 else render(window, False)
            user = {"role": "user", "content": turn.user}
            full = render([*window, user], True)
            after = render([*window, user, {"role": "assistant", "content": turn.answer}], False)
            split = split_answer(after[len(full) :], turn.answer) if after.startswith(full) else None
            if not full.startswith(base) or split is None:
                return None
            pieces.append((full[len(base) :], *split))
            prev = [user, {"role": "assistant", "content": turn.answer}]
    except Exception:  # noqa: BLE001 - a template that refuses a window: use the exact method
        return None
    whole = text + "".join(p + a + c for p, a, c in pieces)
    return pieces if whole == render(conversation(sys_msgs, turns), False) else None


def segment_after(
    codec: TextCodec, before: Sequence[Segment], kind: str, text: str, content: str | None = None
) -> Segment:
    """A segment of `text` as it reads after the segments `before` (see `TextCodec.segment`)."""
    context = next((seg.text for seg in reversed(before) if seg.text), "")
    return codec.segment(kind, text, context, content)


def conversation_segments(
    codec: TextCodec, system: str | None, turns: Sequence[Any]
) -> tuple[list[Segment], list[int]]:
    """The whole conversation tokenized afresh, turn by turn, and where each turn's prompt
    segment is.

    Answers are re-tokenized too, as the template renders them (with the space it writes
    before one). When the template cannot be split turn by turn, the conversation is one
    prompt segment and every turn's start is -1 (undo and retry then re-encode).
    """
    segments: list[Segment] = []
    text = ""
    sys_msgs = [{"role": "system", "content": system}] if system else []
    if sys_msgs:
        sys_text = codec.render(sys_msgs, False)
        probe = codec.render([*sys_msgs, {"role": "user", "content": "x"}], True)
        if sys_text and probe.startswith(sys_text):
            segments.append(segment_after(codec, segments, "prompt", sys_text, content=system))
            text = sys_text
    pieces = turn_pieces_windowed(codec.render, sys_msgs, turns, text) or turn_pieces(
        codec.render, sys_msgs, turns, text
    )
    if pieces is None:
        whole = codec.render(conversation(sys_msgs, turns), False)
        return ([Segment("prompt", whole, codec.encode(whole))] if whole else []), [-1] * len(turns)
    starts = []
    for turn, (prompt, answer, suffix) in zip(turns, pieces):
        starts.append(len(segments))
        segments.append(segment_after(codec, segments, "prompt", prompt, content=turn.user))
        segments.append(segment_after(codec, segments, "answer", answer, content=answer))
        if suffix:
            segments.append(segment_after(codec, segments, "prompt", suffix))
    return segments, starts
