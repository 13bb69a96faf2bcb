"""What the compat adapters share: syncing a caller's cache with the ids it passes, and
reading a one-row batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache

from chatbot.engine.generate import Engine
from chatbot.engine.tracked_cache import TrackedCache


class _NoText:
    """Stands in for a tokenizer where only ids are wanted (`stream_generate` without one)."""

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return ""


def _sync_cache(engine: Engine, cache: Cache, ids: Sequence[int]) -> tuple[TrackedCache, int]:
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
    kv = engine.track(cache, assume=ids)
    keep = min(kv.common_prefix(ids), len(ids) - 1)
    if not kv.crop_to(keep):
        keep = 0  # the tokens to cut were evicted long ago: start over (a sink cache re-streams)
    return kv, keep


def _single_row(input_ids: Any, attention_mask: Any = None) -> list[int]:
    """The token ids of a one-row batch, with padding (mask 0) removed wherever it sits."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"one sequence at a time: input_ids has shape {tuple(ids.shape)}, expected [1, n]")
    row = ids[0].tolist()
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).reshape(-1).tolist()
        row = [t for t, m in zip(row, mask) if m]
    if not row:
        raise ValueError("input_ids is empty")
    return [int(t) for t in row]
