"""The decode loop's guard against NaN and infinity: a damaged model ends its answer with one
line instead of answering garbage.

A NaN block scale in a middle layer, a NaN rope base or a negative RMS epsilon turn the hidden
state, and so every logit, into NaN; argmax then picks token 0 at every step and the chat
prints it over and over. The check reads nothing the loop does not read already: the chosen
token's raw logit is tested on the device and folded into the one value the loop reads back
(the token id), so it costs a few tensor operations and no extra host sync per token. Argmax
treats NaN as the largest value, so a greedy step over logits holding any NaN picks one and is
caught; a sampled step over them fails in `torch.multinomial` (NaN probabilities), which is
caught too.
"""

from __future__ import annotations

from typing import Any

import torch

from chatbot.errors import NonFiniteOutputError


def checked_token(logits: torch.Tensor, chosen: torch.Tensor, model: Any = None) -> int:
    """The token id in `chosen` (one element), read back once, after testing that its logit
    in `logits` is finite.

    Args:
        logits: the model's raw logits of this step (``[vocab]``), before any sampling transform.
        chosen: the token picked from them (argmax or a sample), on the same device.
        model: the model, only to name its file in the error.

    Returns:
        The token id.

    Raises:
        NonFiniteOutputError: the logit is NaN or infinite.
    """
    index = chosen.reshape(())
    token = int(torch.where(torch.isfinite(logits[index]), index, -1))  # the step's one device read
    if token < 0:
        raise NonFiniteOutputError(nonfinite_message(model))
    return token


def sampled_token(
    logits: torch.Tensor, scores: torch.Tensor, generator: torch.Generator | None, model: Any = None
) -> int:
    """A token sampled from `scores` (``[1, vocab]``, the transformed logits), checked as
    `checked_token` checks one.

    Raises:
        NonFiniteOutputError: the logits hold NaN or infinity (which make the probabilities
            NaN, so that torch refuses to sample).
    """
    probs = torch.softmax(scores, dim=-1)
    try:
        chosen = torch.multinomial(probs, 1, generator=generator)
    except RuntimeError:
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteOutputError(nonfinite_message(model)) from None
        raise
    return checked_token(logits, chosen, model)


def nonfinite_message(model: Any) -> str:
    """One line: what NaN logits mean and how to find the damage."""
    source = getattr(model, "chatbot_gguf", None) or getattr(model, "name_or_path", None) or "MODEL"
    return (
        "the model's output is NaN or infinite, so the answer was stopped: its weights or metadata "
        "are damaged (a NaN block scale in a layer, a NaN rope base, a negative RMS epsilon); "
        f"check it with: chatbot doctor --check-model {source}"
    )
