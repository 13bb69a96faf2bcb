"""What the generation loop yields: one piece of a streamed answer (`GenerationChunk`).

Its own module, below the loop and the stop-string matcher that both speak of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatbot.engine.stats import TurnStats


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of a streamed answer.

    `text` is the new text since the previous chunk; `token_ids` the answer tokens it covers
    (a stop token is never among them). The last chunk has `finish_reason` ("stop",
    "length" or "context") and `stats`.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: TurnStats | None = None
