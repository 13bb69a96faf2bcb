"""Log probabilities of the answer's tokens, in OpenAI's shapes.

A token's logprob is the log-softmax of the model's raw logits at that step: its distribution
at temperature 1, before the repetition penalty, temperature, top-k or top-p (as OpenAI reports
them; the token itself was chosen under the request's settings). `LogprobTracker` records one
entry per answer token (an observer of `Engine.generate`) and hands them out in step with the text
a client is shown, so that a token inside a stop string that ended the answer is not reported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch


@dataclass(frozen=True)
class TopToken:
    token: str
    logprob: float
    bytes: list[int]


@dataclass(frozen=True)
class TokenLogprob:
    """One answer token: its text, logprob, UTF-8 bytes and the most likely tokens there."""

    token: str
    logprob: float
    bytes: list[int]
    top: list[TopToken] = field(default_factory=list)

    def chat(self) -> dict[str, Any]:
        """`choices[].logprobs.content[i]` of a chat completion."""
        return {
            "token": self.token,
            "logprob": self.logprob,
            "bytes": self.bytes,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in self.top],
        }


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    return {"content": [e.chat() for e in entries], "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
    """A text completion's `choices[].logprobs`: the top tokens and the chosen one (so up to
    `logprobs` + 1 of them, as OpenAI's legacy API); `offset` is where the text starts."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(bytes(e.bytes).decode("utf-8", "replace"))
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{**{t.token: t.logprob for t in e.top}, e.token: e.logprob} for e in entries],
        "text_offset": offsets,
    }


class TokenTexts:
    """Each token's bytes, as the tokenizer's vocabulary spells them: byte-level BPE's
    characters mapped back to bytes (GPT-2's table), SentencePiece's `▁` as a space and
    `<0xNN>` as the byte; otherwise the token decoded alone."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.byte_level = _byte_level(tokenizer)
        self.byte_of = {ch: b for b, ch in _bytes_to_unicode().items()}
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id not in self.special and isinstance(piece, str):
            if self.byte_level and all(ch in self.byte_of for ch in piece):
                return bytes(self.byte_of[ch] for ch in piece)
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if not self.byte_level and "\u2581" in piece:
                return piece.replace("\u2581", " ").encode()
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return str(text).encode("utf-8", "surrogatepass")

    def text(self, token_id: int) -> tuple[str, list[int]]:
        """The token's text (OpenAI's `bytes:\\xe2\\x80` for part of a character) and bytes."""
        raw = self.bytes_of(token_id)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return text, list(raw)


class LogprobTracker:
    """The logprobs of one answer, as an observer of `Engine.generate`.

    Args:
        texts: the tokenizer's token texts.
        top: how many of the most likely tokens to list at each step (0 to 20).
    """

    def __init__(self, texts: TokenTexts, top: int) -> None:
        self.texts = texts
        self.top = top
        self.entries: list[TokenLogprob] = []
        self.starts: list[int] = []  # byte offset of each token in the answer
        self.ends: list[int] = []
        self.given = 0
        self.shown = 0  # bytes of the answer's text shown so far

    def __call__(self, logits: torch.Tensor, token: int) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top: list[TopToken] = []
        if self.top:
            values, ids = torch.topk(logprobs, self.top)
            for value, tid in zip(values.tolist(), ids.tolist()):
                text, raw = self.texts.text(int(tid))
                top.append(TopToken(text, float(value), raw))
        text, raw = self.texts.text(token)
        start = self.ends[-1] if self.ends else 0
        self.entries.append(TokenLogprob(text, float(logprobs[token]), raw, top))
        self.starts.append(start)
        self.ends.append(start + len(raw))

    def take(self, text: str, final: bool = False) -> list[TokenLogprob]:
        """The entries of the tokens whose text is now shown, `text` being what was just shown
        (held back text is not). At the end (`final`) a token counts once any of it is shown:
        one whose end became part of a stop string still wrote the text before it."""
        self.shown += len(text.encode("utf-8", "surrogatepass"))
        n = self.given
        while n < len(self.entries) and (
            self.ends[n] <= self.shown or (final and self.starts[n] < self.shown)
        ):
            n += 1
        out = self.entries[self.given : n]
        self.given = n
        return out


def _byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        spec = json.loads(backend.to_str())
    except (AttributeError, TypeError, ValueError):
        return False
    decoder = spec.get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(step.get("type") == "ByteLevel" for step in steps)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character table of byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))
