"""What the compat adapters share: checking the arguments a caller passes as the CLI checks
its flags, syncing a caller's cache with the ids it passes, and reading a one-row batch."""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Sequence
from typing import Any

import torch

from chatbot.compat.records import track
from chatbot.config import Range, SamplingConfig
from chatbot.engine.cache.layers import AnyCache
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.generate import Engine
from chatbot.errors import ConfigError


class CompatArgumentError(ConfigError, ValueError):
    """An argument of a published API that the engine cannot take: a setting outside the
    range the CLI allows, a token id that is not an integer, a history entry without text,
    no model. A `ConfigError` (a `ChatbotError`), and a `ValueError` for code written
    against the originals."""


def check_model(model: Any, api: str) -> None:
    """Refuse what is not a loaded causal LM before it is used (not an AttributeError later).

    Raises:
        CompatArgumentError: `model` has no input embeddings or config.
    """
    if not (callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "config")):
        got = "None" if model is None else f"a {type(model).__name__}"
        raise CompatArgumentError(
            f"{api}: model must be a loaded transformers causal LM "
            f"(AutoModelForCausalLM.from_pretrained(...)), got {got}"
        )


def check_tokenizer(tokenizer: Any, api: str) -> None:
    """Raises: CompatArgumentError: `tokenizer` is None or cannot encode text."""
    if tokenizer is None or not callable(tokenizer):
        got = "None" if tokenizer is None else f"a {type(tokenizer).__name__}"
        raise CompatArgumentError(
            f"{api}: tokenizer must be the model's tokenizer (AutoTokenizer.from_pretrained(...)), got {got}"
        )


def check_text(value: Any, name: str, api: str) -> str:
    """Raises: CompatArgumentError: `value` is not a string."""
    if not isinstance(value, str):
        raise CompatArgumentError(f"{api}: {name} must be a string, got {type(value).__name__}")
    return value


def check_range(api: str, key: str, value: Any, allowed: Range | None = None) -> Any:
    """`value` checked against `allowed` (by default the CLI's range of setting `key`),
    as the type the range holds.

    Raises:
        CompatArgumentError: naming the API, the argument and the allowed range.
    """
    try:
        return (allowed or SamplingConfig.RANGES[key]).check(key, value)
    except ConfigError as exc:
        raise CompatArgumentError(f"{api}: {exc}") from None


def check_sampling(api: str, settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling settings among `settings` (None: not given) checked against the CLI's
    ranges; returns them as the types the engine takes (``top_k=50.0`` becomes 50).

    Raises:
        CompatArgumentError: one is outside its range.
    """
    return {
        key: check_range(api, key, value)
        for key, value in settings.items()
        if key in SamplingConfig.RANGES and key != "seed" and value is not None
    }


def token_id(value: Any, name: str, api: str, kind: str = "an integer token id") -> int:
    """One token id (or another count): an integer (a Python, NumPy or 0-d tensor int),
    never a float, which would be truncated.

    Raises:
        CompatArgumentError: `value` is not an integer.
    """
    if not isinstance(value, bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise CompatArgumentError(f"{api}: {name} must be {kind}, got {value!r} ({type(value).__name__})")


def check_vocab(ids: Sequence[int], model: Any, api: str) -> None:
    """Token ids inside the model's embedding table (outside it, CUDA kills the process).

    Raises:
        CompatArgumentError: an id is negative or past the vocabulary.
    """
    vocab = getattr(model.get_input_embeddings(), "num_embeddings", None)
    if not ids or vocab is None:
        return
    low, high = min(ids), max(ids)
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise CompatArgumentError(
            f"{api}: token id {bad} is outside the model's vocabulary (0 to {vocab - 1})"
        )


class NoText:
    """Stands in for a tokenizer where only ids are wanted (`stream_generate` without one)."""

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return ""


def sync_cache(engine: Engine, cache: AnyCache, ids: Sequence[int]) -> tuple[TrackedCache, int]:
    """Make `cache` hold a prefix of `ids`, reusing as much as it can.

    A cache with a record (`TrackedCache`) is compared with `ids` token by token and cut
    back to the common prefix, so a caller who passes the cache back with the whole
    sequence, as transformers' API has it, feeds only what the cache has not seen, even
    after an edit in the middle; a cache without one is taken to hold ``ids[:length]``, as
    transformers assumes. At least one id is always left to feed.

    Returns:
        The cache's record, and how many leading ids it already holds (feed ``ids[start:]``).

    Raises:
        ValueError: an unknown cache holds more tokens than `ids`.
    """
    kv = track(cache, engine.max_context, assume=ids)
    keep = min(kv.common_prefix(ids), len(ids) - 1)
    if not kv.crop_to(keep):
        keep = 0  # the tokens to cut were evicted long ago: start over (a sink cache re-streams)
    return kv, keep


def single_row(input_ids: Any, attention_mask: Any = None) -> list[int]:
    """The token ids of a one-row batch, with padding (mask 0) removed wherever it sits.

    Raises:
        ValueError: not one row, or nothing left after the padding.
        CompatArgumentError: the ids are not integers (a float tensor is refused, not truncated).
    """
    try:
        ids = torch.as_tensor(input_ids)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise CompatArgumentError(
            f"stream_generate: input_ids must be a [1, n] tensor or list of token ids: {exc}"
        ) from None
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        dtype = str(ids.dtype).removeprefix("torch.")
        raise CompatArgumentError(
            f"stream_generate: input_ids must be integer token ids, got a {dtype} tensor "
            "(convert with .long() if the values are whole)"
        )
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"one sequence at a time: input_ids has shape {tuple(ids.shape)}, expected [1, n]")
    row = ids[0].tolist()
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).reshape(-1).tolist()
        if len(mask) != len(row):
            raise CompatArgumentError(
                f"stream_generate: attention_mask has {len(mask)} entries for {len(row)} input ids"
            )
        row = [t for t, m in zip(row, mask) if m]
    if not row:
        raise ValueError("input_ids is empty")
    return [int(t) for t in row]
