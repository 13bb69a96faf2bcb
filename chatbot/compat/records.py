"""The records of the caches that the published APIs pass around bare (`past_key_values`, a
model's persistent cache): each cache keeps its `TrackedCache` on itself, so a later call
finds the ids it holds. The engine's own callers hold their records and need none of this."""

from __future__ import annotations

from collections.abc import Sequence

from chatbot.engine.cache.layers import AnyCache
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.cache.tracked import UNKNOWN, TrackedCache

# The record of a cache is kept on the cache itself, under this attribute: a record and its
# cache refer to each other, a cycle the garbage collector frees once neither is reachable.
# (Not a WeakKeyDictionary from cache to record: its value would hold its key, so no cache,
# e.g. one per request or per /reset, would ever be freed.)
_ATTR = "_chatbot_tracked"


def _register(cache: AnyCache, tracked: TrackedCache) -> None:
    object.__setattr__(cache, _ATTR, tracked)


def lookup(cache: AnyCache) -> TrackedCache | None:
    """The record of `cache`, if it has one that still matches it (not changed elsewhere)."""
    tracked: TrackedCache | None = vars(cache).get(_ATTR)
    if tracked is None:
        return None
    evicted = int(cache.evicted_total) if isinstance(cache, SinkCache) else 0
    if tracked.length != cache.get_seq_length() or tracked.evicted_total != evicted:
        return None
    return tracked


def track(cache: AnyCache, max_context: int, assume: Sequence[int] | None = None) -> TrackedCache:
    """The `TrackedCache` of a cache that callers pass around as a transformers object.

    A cache seen before keeps its record, unless it was changed elsewhere since (its length
    no longer matches): then, as for a new cache, its tokens are taken to be the first ones
    of `assume` (the caller's whole sequence, as transformers' API has it), or unknown ids
    (`UNKNOWN`, which match nothing) when `assume` is None.

    Raises:
        ValueError: the cache holds more tokens than `assume` has.
    """
    tracked = lookup(cache)
    if tracked is not None:
        tracked.max_context = max_context
        return tracked
    forget(cache)  # a stale record
    length = cache.get_seq_length()
    evicted = int(cache.evicted_total) if isinstance(cache, SinkCache) else 0
    held = length + evicted
    ids = [UNKNOWN] * held if assume is None else list(assume)
    if held > len(ids):
        raise ValueError(
            f"the cache holds {held} tokens but input_ids has only {len(ids)}; pass the "
            "whole conversation, or a new cache"
        )
    tracked = TrackedCache(cache, max_context)
    _register(cache, tracked)
    tracked.seen = ids[:held]
    pinned = min(tracked.pinned, length) if evicted else length
    tracked.ids = ids[:pinned] + ids[held - (length - pinned) : held]
    tracked._evicted = evicted
    return tracked


def forget(cache: AnyCache) -> None:
    """Drop the record of `cache` (it will be taken as new by `track`)."""
    cache.__dict__.pop(_ATTR, None)
