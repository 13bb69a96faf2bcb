"""Incremental detokenization that never emits half a character or a wrong space."""

from __future__ import annotations

from typing import Any

# Decoding a window of a few tokens before the new ones lets the tokenizer decide leading
# spaces and merges with context; the window is re-read, never re-emitted.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas.

    The joined deltas equal `tokenizer.decode(all_ids)`: a delta is only emitted once the
    decoded text no longer ends in an incomplete UTF-8 sequence (U+FFFD), and each delta is
    the difference between two decodes that share the same left context.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # ids before this index have been emitted as text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever text is still held back (at the end of a turn)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if not final and after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :] if after.startswith(before) else self._resync()
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        self.text += delta
        return delta

    def _resync(self) -> str:
        # The window decodes differently from its prefix (rare normalizers): fall back to
        # the full decode, which is always right.
        full = self._decode(self.ids)
        return full[len(self.text) :] if full.startswith(self.text) else ""
