"""One object that knows what a KV cache holds.

A `TrackedCache` is a KV cache (our `KVCache`, the fast path's buffer cache, our
attention-sink `SinkCache`, or a transformers `DynamicCache` given to `chatbot.compat`)
together with the token ids it holds, every id it has taken in since it was last emptied
(evicted ones too), its pinned prefix, how many ids it has evicted, and its capacity. The
engine, the session, the compat adapters and the benches read and change a cache only
through it, so no other module asks what kind of
cache it has, and the bookkeeping lives in one place.

The invariant, after every method returns (checked by `check` when `DEBUG` is on, as the
tests run):

- every layer of the cache holds ``len(ids)`` tokens;
- ``len(seen) == len(ids) + evicted_total``;
- `ids` is the first ``pinned_held`` ids of `seen` followed by its last
  ``len(ids) - pinned_held``: a bounded cache drops only right after its pinned head.

Changes that a forward pass makes are recorded in two steps, each one statement: `evict_for`
(before the pass) and `feed` (after it). A KeyboardInterrupt between the two, or inside the
pass, leaves a state `settle` recognises: it cuts a cache left uneven back to the ids
recorded and, when it cannot vouch for the cache, empties it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from chatbot.engine.cache.layers import KVCache
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.seq import common_prefix
from chatbot.errors import ContextFullError


class _Layer(Protocol):
    """What a KV layer of the caches tracked here offers (DynamicLayer and subclasses)."""

    def get_seq_length(self) -> int: ...

    def crop(self, max_length: int) -> None: ...


# Check the invariant after every change (slow: a list comparison per token). The tests
# turn it on; so does CHATBOT_DEBUG_CACHE=1.
DEBUG = os.environ.get("CHATBOT_DEBUG_CACHE", "") not in ("", "0")


@dataclass(frozen=True)
class CacheLayout:
    """Where a cache stands, in tokens (what `/cache` shows)."""

    length: int
    capacity: int
    pinned: int  # pinned tokens the cache holds now (the sinks only once they are in it)
    recent: int  # tokens after the pinned ones
    evicted_total: int
    oldest_text: str = ""  # the session fills it: the oldest text held after the pinned part


class TrackedCache:
    """A KV cache and the ids it holds.

    Args:
        cache: the cache the model writes into (its layers may be swapped by the fast
            decoder; the object stays the same).
        max_context: the most tokens a growing cache may hold (the model's context).
    """

    def __init__(self, cache: KVCache | Any, max_context: int) -> None:
        self.cache = cache
        self.max_context = max_context
        self.ids: list[int] = []  # what the cache holds now, in order
        self.seen: list[int] = []  # every id taken in since the last reset, evicted ones too
        self._evicted = 0
        # The one place that asks what kind of cache this is.
        self._sink: SinkCache | None = cache if isinstance(cache, SinkCache) else None

    # -- what it is ------------------------------------------------------------------------

    @property
    def layers(self) -> list[_Layer]:
        """The cache's layers."""
        return cast(list[_Layer], self.cache.layers)

    @property
    def is_bounded(self) -> bool:
        """True for a cache that evicts to stay within its capacity (attention sinks)."""
        return self._sink is not None

    @property
    def capacity(self) -> int:
        """The most tokens the cache holds: its window when bounded, else the context."""
        return self._sink.capacity if self._sink is not None else self.max_context

    @property
    def start_size(self) -> int:
        """Attention-sink tokens of a bounded cache (0 for a growing one)."""
        return self._sink.start_size if self._sink is not None else 0

    @property
    def recent_size(self) -> int | None:
        """The recent window of a bounded cache; None for a growing one."""
        return self._sink.recent_size if self._sink is not None else None

    @property
    def pinned(self) -> int:
        """Tokens at the start a bounded cache never evicts (0 for a growing one)."""
        return self._sink.pinned if self._sink is not None else 0

    @property
    def pinned_held(self) -> int:
        """Pinned tokens the cache holds now."""
        return min(self.pinned, len(self.ids))

    @property
    def evicted_total(self) -> int:
        """Ids taken in and since evicted (or skipped, see `skip`)."""
        return self._evicted

    @property
    def length(self) -> int:
        """Tokens the cache holds (``len(ids)``)."""
        return len(self.ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the keys and values held, every layer."""
        total = 0
        for layer in self.cache.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if t is not None and getattr(layer, "is_initialized", True):
                    total += t.numel() * t.element_size()
        return total

    def layout(self) -> CacheLayout:
        held = self.pinned_held
        return CacheLayout(len(self.ids), self.capacity, held, len(self.ids) - held, self._evicted)

    def chunk_size(self, prefill_chunk: int) -> int:
        """Tokens per forward pass: a bounded cache takes at most its window at once."""
        recent = self.recent_size
        return min(prefill_chunk, recent) if recent else prefill_chunk

    def check_room(self, n_new: int) -> None:
        """Raise before a prefill that would overflow a growing cache.

        Raises:
            ContextFullError: the ids held plus `n_new` (and one answer token) exceed the
                context.
        """
        if self.is_bounded:
            return
        used = len(self.ids)
        if used + n_new + 1 > self.max_context:
            raise ContextFullError(f"context full ({used} + {n_new} new tokens > {self.max_context})")

    def room(self) -> int:
        """Tokens the cache takes before a bounded one must evict or a growing one is full
        (`is_full`): what a speculative draft's pass may feed without either."""
        if self._sink is not None:
            return max(0, self._sink.capacity - self._sink.get_seq_length())
        return max(0, self.max_context - 1 - len(self.ids))

    def is_full(self) -> bool:
        """True when a growing cache has room for no more token."""
        return not self.is_bounded and len(self.ids) + 1 >= self.max_context

    # -- changes around a forward pass -------------------------------------------------------

    def evict_for(self, n_coming: int) -> int:
        """Make room for `n_coming` tokens before a forward pass; returns how many ids went.

        A growing cache does nothing; a bounded one drops a block right after its pinned
        head (see `SinkCache.evict_for_space`).
        """
        if self._sink is None:
            return 0
        removed = self._sink.evict_for_space(n_coming)
        if removed is None:
            return 0
        start, end = removed
        del self.ids[start:end]
        self._evicted += end - start
        self._check()
        return end - start

    def would_evict(self, n_coming: int) -> bool:
        """Whether `evict_for(n_coming)` would drop ids now (it changes nothing)."""
        if self._sink is None:
            return False
        length = self._sink.get_seq_length()
        return length + n_coming > self._sink.capacity and length > self._sink.pinned

    def feed(self, ids: Sequence[int]) -> None:
        """Record that `ids` went through a forward pass into the cache."""
        self.ids.extend(ids)
        self.seen.extend(ids)
        self._check()

    def take_in(self, held: Sequence[int], seen: Sequence[int], pinned: int) -> None:
        """Record that the layers were filled (from a file) with the keys and values of
        `held`, the cache having taken in `seen` (the ids between its pinned head and `held`'s
        tail evicted) and pinned its first `pinned` ids. The cache had taken in nothing.

        Raises:
            ValueError: `held` is longer than `seen`, or `pinned` is negative.
            StreamingUnsupportedError: see `SinkCache.pin`.
        """
        if len(held) > len(seen):
            raise ValueError(f"{len(held)} ids held of {len(seen)} taken in")
        self.ids, self.seen = list(held), list(seen)
        self._evicted = len(seen) - len(held)
        if self._sink is not None:
            self._sink.pin(pinned)
            self._sink.evicted_total = self._evicted
        self._check()

    def skip(self, ids: Sequence[int]) -> None:
        """Count `ids` as taken in and evicted at once, without encoding them: an emptied
        bounded cache refilled with only its window (see `ChatSession`)."""
        self.seen.extend(ids)
        self._evicted += len(ids)
        if self._sink is not None:
            self._sink.evicted_total += len(ids)
        self._check()

    def pin(self, n_tokens: int) -> None:
        """Keep the first `n_tokens` forever (bounded caches; a growing one keeps all).

        Raises:
            StreamingUnsupportedError: see `SinkCache.pin`.
        """
        if self._sink is not None:
            self._sink.pin(n_tokens)

    # -- going back -----------------------------------------------------------------------

    def common_prefix(self, ids: Sequence[int]) -> int:
        """How many leading ids of `ids` the cache has taken in, in order."""
        return common_prefix(self.seen, ids)

    def rewindable(self) -> int:
        """How many ids can be cut from the tail so that the cache holds what it held after
        taking in a prefix of `seen`: all of them, or after an eviction the unpinned ones."""
        return len(self.ids) - (self.pinned_held if self._evicted else 0)

    def crop_to(self, n_seen: int) -> bool:
        """Go back to having taken in the first `n_seen` ids of `seen`.

        Cuts the tail of the cache when that is enough (see `rewindable`); otherwise empties
        it. Returns True when the cache now stands for ``seen[:n_seen]``, False when it was
        emptied (the caller feeds again from the start).
        """
        n_seen = max(0, n_seen)
        cut = len(self.seen) - n_seen
        if cut <= 0:
            return True
        if n_seen == 0 or cut > self.rewindable():
            self.reset()
            return n_seen == 0
        self._crop_layers(len(self.ids) - cut)
        del self.ids[len(self.ids) - cut :]
        del self.seen[n_seen:]
        self._check()
        return True

    def cut_unrecorded(self) -> None:
        """Cut from the layers what a forward pass wrote past the ids recorded (a step run
        ahead of its token being read, or torn by an interrupt)."""
        self._crop_layers(len(self.ids))

    def _crop_layers(self, length: int) -> None:
        """Cut every layer back to `length` tokens (also evens out a cache an interrupted
        forward pass left uneven), and pull a pin back inside the new length."""
        cut = False
        for layer in self.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
                cut = True
        if cut and self._sink is not None:
            self._sink.crop(0)  # (an empty cache keeps its pin: the pinned text comes first)

    def reset(self) -> None:
        """Empty the cache and forget every id (a bounded cache's pin drops to its sinks)."""
        self.cache.reset()
        self.ids = []
        self.seen = []
        self._evicted = 0

    def settle(self) -> bool:
        """After a run that may have been interrupted: cut the cache back to the ids
        recorded; if it still does not match them, empty it. True when it was sound."""
        self.cut_unrecorded()
        sound = (
            all(layer.get_seq_length() == len(self.ids) for layer in self.layers)
            and self.cache.get_seq_length() == len(self.ids)
            and (self._sink is None or self._sink.evicted_total == self._evicted)
            and len(self.seen) == len(self.ids) + self._evicted
        )
        if not sound:
            self.reset()
        self._check()
        return sound

    # -- the invariant --------------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariant of the module docstring.

        Raises:
            AssertionError: naming the part that does not hold.
        """
        n = len(self.ids)
        lengths = {layer.get_seq_length() for layer in self.layers}
        assert lengths <= {n}, f"cache layers hold {sorted(lengths)} tokens, ids {n}"
        assert len(self.seen) == n + self._evicted, (
            f"{len(self.seen)} ids seen != {n} held + {self._evicted} evicted"
        )
        head = self.pinned_held if self._evicted else n
        assert self.ids[:head] == self.seen[:head], "the cache's head is not what it took in first"
        tail = n - head
        assert tail == 0 or self.ids[head:] == self.seen[len(self.seen) - tail :], (
            "the cache's tail is not what it took in last"
        )
        if self._sink is not None:
            assert self._sink.evicted_total == self._evicted, "evicted counts differ"

    def _check(self) -> None:
        if DEBUG:
            self.check()

    def __repr__(self) -> str:
        kind = "bounded" if self.is_bounded else "growing"
        return (
            f"TrackedCache({kind}, held={len(self.ids)}, seen={len(self.seen)}, "
            f"pinned={self.pinned}, evicted={self._evicted}, capacity={self.capacity})"
        )


# Stands for an id a cache holds that nobody recorded: it matches no real id.
UNKNOWN = -1


__all__ = ["DEBUG", "UNKNOWN", "CacheLayout", "TrackedCache"]
