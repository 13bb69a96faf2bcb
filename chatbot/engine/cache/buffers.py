"""The preallocated cache layer of the fast decode path, written in place.

Every layer of a cache (a `KVCache` or our `SinkCache`) is replaced by a
`BufferLayer` (`adopt_layers`), which keeps keys and values in a preallocated buffer
``[1, kv_heads, capacity, head_dim]`` and writes new tokens in place, gpt-fast style. It is
still a cache layer (prefill, `crop`, `reset` work as on a `KVLayer`), and it implements
the sink cache's `drop` in place, so `--enable-streaming` (eviction and re-rotation) keeps
working on the fast path (`chatbot.engine.backends.native.decoder`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

from chatbot.engine.cache.layers import (
    KVCache,
    is_empty_window_layer,
    is_plain_layer,
    lend_to_transformers,
)
from chatbot.engine.cache.sinks import SinkLayer, rotate_keys

_versions = itertools.count(1)


class BufferLayer(SinkLayer):
    """A cache layer whose keys and values live in a preallocated buffer, written in place.

    `keys` / `values` are views of the first `length` positions, so code written for
    `KVLayer` reads them unchanged. The buffer grows by doubling when full (a copy,
    amortized); `version` changes whenever it is reallocated, so holders of raw pointers
    know to refresh them.
    """

    MIN_CAPACITY = 256

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None  # [B, H, capacity, D]
        self._v: torch.Tensor | None = None
        self.length = 0
        self.version = 0
        super().__init__()

    # Views of the filled part; assigning a tensor replaces the contents.
    @property
    def keys(self) -> torch.Tensor | None:
        return None if self._k is None else self._k[:, :, : self.length]

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._assign("_k", value)

    @property
    def values(self) -> torch.Tensor | None:
        return None if self._v is None else self._v[:, :, : self.length]

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._assign("_v", value)

    @property
    def key_buffer(self) -> torch.Tensor | None:
        """The whole key buffer ``[B, H, capacity, D]`` (None before the first token), which
        the native kernels write in place."""
        return self._k

    @property
    def value_buffer(self) -> torch.Tensor | None:
        """The whole value buffer, as `key_buffer`."""
        return self._v

    def _assign(self, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            setattr(self, name, None)
            if self._k is None and self._v is None:
                self.length = 0
            return
        n = value.shape[-2]
        cap = max(self.capacity, self._grown(n))
        buf = value.new_zeros(*value.shape[:-2], cap, value.shape[-1])
        buf[:, :, :n] = value
        setattr(self, name, buf)
        self.length = n
        self.version = next(_versions)

    @property
    def capacity(self) -> int:
        return 0 if self._k is None else self._k.shape[-2]

    def _grown(self, needed: int) -> int:
        cap = max(self.capacity, self.MIN_CAPACITY)
        while cap < needed:
            cap *= 2
        return cap

    def reserve(self, needed: int, like: torch.Tensor | None = None, exact: bool = False) -> None:
        """Make room for `needed` positions (reallocating, and copying what is held): a
        capacity doubled until it holds them, or with `exact`, `needed` itself."""
        if self._k is not None and self.capacity >= needed:
            return
        ref = self._k if self._k is not None else like
        assert ref is not None, "reserve() before the first update needs a tensor to copy the shape from"
        cap = needed if exact else self._grown(needed)
        shape = (*ref.shape[:-2], cap, ref.shape[-1])
        k, v = ref.new_zeros(shape), ref.new_zeros(shape)
        if self._k is not None and self._v is not None:
            k[:, :, : self.length] = self._k[:, :, : self.length]
            v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v
        self.version = next(_versions)

    # -- CacheLayerMixin ------------------------------------------------------------------

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        self.reserve(self.length + n, like=key_states)
        assert self._k is not None and self._v is not None
        self._k[:, :, self.length : self.length + n] = key_states
        self._v[:, :, self.length : self.length + n] = value_states
        self.length += n
        return self._k[:, :, : self.length], self._v[:, :, : self.length]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove from the end")
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        # Keep the buffers: the next conversation reuses them.
        self.length = 0

    def drop(self, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Remove positions ``[start, end)`` in place and re-rotate the keys after them."""
        if self._k is None or self._v is None or end <= start:
            return
        n = self.length
        end = min(end, n)
        moved = n - end
        if moved > 0:
            self._k[:, :, start : start + moved] = rotate_keys(self._k[:, :, end:n], cos, sin)
            self._v[:, :, start : start + moved] = self._v[:, :, end:n].clone()
        self.length = n - (end - start)

    @property
    def nbytes(self) -> int:
        """Bytes of the preallocated buffers (what the layer holds, filled or not)."""
        if self._k is None or self._v is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


def adopt_layers(
    cache: KVCache | Any, make: Callable[[], BufferLayer] = BufferLayer, kind: type[BufferLayer] = BufferLayer
) -> bool:
    """Swap every layer of `cache` for a buffer layer (`make()`, of type `kind`) holding the
    same keys and values.

    Returns:
        True if the cache now holds only layers of type `kind` (False: a layer kind we cannot
        take over, e.g. a sliding-window layer holding tokens; the cache is left unchanged).
    """
    if not isinstance(cache, KVCache):
        lend_to_transformers()  # transformers' own cache, which our layers are to fill
    layers: list[Any] = cache.layers
    if all(type(layer) is kind for layer in layers):
        return True

    # Type identity, not names or isinstance: a subclass (a sliding-window layer is a
    # DynamicLayer subclass) or a same-named class elsewhere stores its tokens differently.
    # An empty sliding-window layer holds nothing to lose: as a buffer layer it keeps every
    # token, and the window is applied by the attention mask (transformers' for prefill,
    # the kernels' for decode) instead of by dropping old tokens.
    def adoptable(layer: Any) -> bool:
        return (
            is_empty_window_layer(layer)
            or is_plain_layer(layer)
            or type(layer) in (SinkLayer, BufferLayer, kind)
        )

    if not all(adoptable(layer) for layer in layers):
        return False
    for i, layer in enumerate(layers):
        if type(layer) is kind:
            continue
        new = make()
        keys, values = layer.keys, layer.values
        if layer.is_initialized and keys is not None and values is not None and keys.numel() > 0:
            new.lazy_initialization(keys, values)
            new.reserve(keys.shape[-2], like=keys)
            new.update(keys, values)
        layers[i] = new
    return True
