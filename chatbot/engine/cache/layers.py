"""The KV cache the engine keeps: a list of layers, each holding one attention layer's keys
and values ``[batch, kv_heads, seq, head_dim]``.

Why our own classes: transformers' `cache_utils` imports the transformers package, ~1 s of a
one-shot answer on a GGUF model whose forward pass is ours and whose steps run in the native
kernels (docs/benchmarks.md, "Start-up"). These keep the contract of transformers v5's
`DynamicLayer` and `Cache` that a model's forward pass calls (`update`, `get_seq_length`,
`get_mask_sizes`, `get_query_offset`, `is_sliding`, `is_compileable`) and that the engine
calls (`crop`, `reset`), so transformers' own model classes run on them unchanged: they ask
a cache what it holds and never what class it is (tests/test_own_cache.py runs both on the
same passes). Every layer here is a full-attention layer: a sliding window is applied by the
attention mask, not by dropping tokens.

Caches made by transformers (`DynamicCache`, given to `chatbot.compat` or built by a model
for a call without one) are accepted wherever a plain layer is: `is_plain_layer`.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch

AnyCache = Any
"""A KV cache of either family, ours (`KVCache`) or transformers' (`Cache`, which the compat
adapters take from their callers): typed loosely, since naming transformers' class would
import it."""


class KVLayer:
    """One attention layer's keys and values, grown by concatenation (transformers'
    `DynamicLayer`): on the device and in the dtype of its first update."""

    is_sliding = False
    is_compileable = False
    is_croppable = True
    supports_early_init = True

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.device: torch.device | None = None

    def __repr__(self) -> str:
        return type(self).__name__

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.keys = key_states.new_empty(0)
        self.values = value_states.new_empty(0)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `key_states` / `value_states` ``[B, H, n, D]``; returns everything held."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """The attention mask's key length and offset for a pass of `query_length` tokens."""
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        if not self.is_initialized or self.keys is None or self.keys.numel() == 0:
            return 0
        return int(self.keys.shape[-2])

    def get_max_length(self) -> int:
        return -1  # no bound

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tokens from the end (a negative count, as transformers')."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove from the end")
        if tokens_to_remove == 0 or not self.is_initialized or self.keys is None or self.values is None:
            return
        self.keys = self.keys[..., :tokens_to_remove, :]
        self.values = self.values[..., :tokens_to_remove, :]

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        if self.get_seq_length() > 0 and self.keys is not None and self.values is not None:
            self.keys = self.keys.index_select(0, beam_idx.to(self.keys.device))
            self.values = self.values.index_select(0, beam_idx.to(self.values.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0 and self.keys is not None and self.values is not None:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0 and self.keys is not None and self.values is not None:
            self.keys = self.keys[indices, ...]
            self.values = self.values[indices, ...]


class KVCache:
    """A model's cache: one layer per decoder layer (transformers' `Cache` over a list).

    Args:
        layers: the layers, in the model's order.
    """

    def __init__(self, layers: Sequence[Any]) -> None:
        self.layers: list[Any] = list(layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={len(self.layers)}, length={self.get_seq_length()})"

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append a pass's keys and values to layer `layer_idx`; returns what it holds."""
        return self.layers[layer_idx].update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        # the layer's own answer, as it is: a compiled step's layer answers with a tensor, which
        # `int()` would read back from the device inside the graph
        return 0 if layer_idx >= len(self.layers) else self.layers[layer_idx].get_seq_length()

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """The position of a pass's first token (what the mask starts from)."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_sliding(self) -> list[bool]:
        return [bool(getattr(layer, "is_sliding", False)) for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_dummy(self) -> list[bool]:
        return [False] * len(self.layers)

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_initialized(self) -> bool:
        return bool(self.layers) and all(layer.is_initialized for layer in self.layers)

    @property
    def is_croppable(self) -> bool:
        return all(getattr(layer, "is_croppable", False) for layer in self.layers)

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tokens from the end of every layer."""
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def reset(self) -> None:
        """Empty every layer (the layer objects stay)."""
        for layer in self.layers:
            layer.reset()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)


def new_cache(config: Any) -> KVCache:
    """An empty cache for a model of `config` (its text config's `num_hidden_layers`), every
    layer a full-attention `KVLayer`."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return KVCache([KVLayer() for _ in range(int(text.num_hidden_layers))])


def is_plain_layer(layer: Any) -> bool:
    """Whether `layer` is a plain growing layer, ours or transformers' `DynamicLayer` (a
    subclass stores its tokens otherwise: a sliding-window layer keeps only its window).
    transformers is not imported for the question: a layer of its class exists only once it is."""
    if type(layer) is KVLayer:
        return True
    theirs = sys.modules.get("transformers.cache_utils")
    return theirs is not None and type(layer) is theirs.DynamicLayer


def is_empty_window_layer(layer: Any) -> bool:
    """Whether `layer` is transformers' sliding-window layer that holds nothing yet (which a
    full layer may replace: the window is then the attention mask's)."""
    theirs = sys.modules.get("transformers.cache_utils")
    return theirs is not None and type(layer) is theirs.DynamicSlidingWindowLayer and not layer.is_initialized


def lend_to_transformers() -> None:
    """Let transformers' `Cache` hold our layers: its methods test each layer against its
    `CacheLayerMixin` (an ABC), which then counts `KVLayer` and its subclasses as its own.
    Called where one of its caches is given our layers (`adopt_layers`: the compiled
    backend's cache, a cache a compat caller passed in); a no-op while transformers is not
    imported, or the second time."""
    theirs = sys.modules.get("transformers.cache_utils")
    if theirs is not None and not issubclass(KVLayer, theirs.CacheLayerMixin):
        theirs.CacheLayerMixin.register(KVLayer)


def is_cache(value: Any) -> bool:
    """Whether `value` is a KV cache: ours, or transformers' `Cache` (any subclass)."""
    if isinstance(value, KVCache):
        return True
    theirs = sys.modules.get("transformers.cache_utils")
    return theirs is not None and isinstance(value, theirs.Cache)


__all__ = [
    "AnyCache",
    "KVCache",
    "KVLayer",
    "is_cache",
    "is_empty_window_layer",
    "is_plain_layer",
    "lend_to_transformers",
    "new_cache",
]
