"""Stop strings: the one mechanism that ends an answer on text (multi-token stop strings such
as Vicuna's "USER:", a caller's ``stop_strings``), used by the session, the compat adapters
and the server.

- `StopStrings` finds the first stop string in a text and how much of a growing text must
  be held back because it may still become one (a stream never shows half a stop string).
- `StopOnStrings` (`chatbot.engine.stop_criteria`, apart: it needs torch,
  which the terminal's start-up does not import) is the stopping criterion for
  `Engine.generate` (and transformers): true once the answer's text contains a stop string.
- `StopView` is what a streamed answer may show now.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from chatbot.engine.chunk import GenerationChunk


class StopStrings:
    """A set of stop strings matched on text.

    Args:
        strings: the texts that end an answer (empty ones are ignored).
    """

    def __init__(self, strings: Iterable[str] = ()) -> None:
        self.strings = tuple(dict.fromkeys(s for s in strings if s))

    def __bool__(self) -> bool:
        return bool(self.strings)

    def __repr__(self) -> str:
        return f"StopStrings({self.strings!r})"

    def find(self, text: str) -> int:
        """Where the first stop string in `text` begins; -1 when there is none."""
        hits = [at for at in (text.find(s) for s in self.strings) if at >= 0]
        return min(hits, default=-1)

    def held_back(self, text: str) -> int:
        """Length of the longest end of `text` that is the start of a stop string (and so
        may still grow into one): text a stream must not show yet."""
        longest = 0
        for stop in self.strings:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def visible(self, text: str, final: bool = False) -> str:
        """What of a streamed `text` may be shown: up to the first stop string, less an end
        that may still grow into one (unless `final`)."""
        at = self.find(text)
        if at >= 0:
            return text[:at]
        return text if final else text[: len(text) - self.held_back(text)]


class StopView:
    """What the caller of a streamed answer may see when stop strings apply: the text up to
    the first stop string, less an end that may still grow into one (shown once it cannot,
    or when the answer ends).

    Args:
        stops: the stop strings.
        shown: the answer's text the caller has already seen (a continued answer's start).
    """

    def __init__(self, stops: StopStrings, shown: str = "") -> None:
        self.stops = stops
        self.text = shown
        self.shown = len(shown)

    def chunk(self, chunk: GenerationChunk) -> GenerationChunk:
        """The chunk with only the text that may be shown now."""
        self.text += chunk.text
        end = len(self.stops.visible(self.text, final=bool(chunk.finish_reason)))
        text = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return dataclasses.replace(chunk, text=text)
