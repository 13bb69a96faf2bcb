"""`StopOnStrings`: stop strings (`chatbot.engine.stops.StopStrings`) as a stopping
criterion, for `Engine.generate` and, in a transformers `StoppingCriteriaList`, `generate()`
(which only calls it: no base class of transformers' is needed, and the native path does
not import transformers)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from chatbot.engine.stops import StopStrings, StopView


class StopOnStrings:
    """A stopping criterion: true once the answer's text contains a stop string.

    Make one per answer: it counts the answer tokens it is asked about, so a stop string
    in the prompt never matches (set `answer_tokens` to the length of an answer being
    continued, so that its end counts too). The token that completes the stop string stays
    in the answer (as in transformers).

    Args:
        tokenizer: decodes the answer's last tokens.
        stops: the stop strings.
    """

    def __init__(self, tokenizer: Any, stops: StopStrings | Iterable[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        # a stop string spans at most one token per character; a few more for the text before it
        self.window = max((len(s) for s in self.stops.strings), default=0) + 4
        self.answer_tokens = 0

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.BoolTensor:
        self.answer_tokens += 1
        hit = False
        if self.stops:
            n = min(self.answer_tokens, self.window)
            tail = self.tokenizer.decode(input_ids[0, -n:].tolist(), skip_special_tokens=False)
            hit = self.stops.find(tail) >= 0
        return torch.full((input_ids.shape[0],), hit, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


def stop_checks(
    tokenizer: Any, stops: StopStrings, shown: str = "", answer_tokens: int = 0
) -> tuple[StopOnStrings | None, StopView | None]:
    """What ends an answer on `stops` and what of it may be shown: the stopping criterion for
    `Engine.generate` and the view of its chunks (both None without stop strings).

    Args:
        tokenizer: decodes the answer's tokens.
        stops: the stop strings.
        shown: the text of an answer being continued, already shown.
        answer_tokens: that answer's length in tokens (a stop string may begin in it).
    """
    if not stops:
        return None, None
    criterion = StopOnStrings(tokenizer, stops)
    criterion.answer_tokens = answer_tokens
    return criterion, StopView(stops, shown)
