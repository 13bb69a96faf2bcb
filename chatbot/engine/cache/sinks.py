"""StreamingLLM attention sinks as a KV cache (`chatbot.engine.cache.layers`).

The cache keeps a pinned head (the attention sinks, or the whole system prompt) and a
window of recent tokens. When a forward pass would overflow it, `evict_for_space` drops a
block from the middle, right after the pinned head, and re-rotates the keys that follow
the gap so that the cache reads as if those tokens had always sat at their new, smaller
positions. Positions therefore never leave ``[0, capacity)``: transformers derives the
position ids of new tokens from `get_seq_length()`, which is the physical length here.

Llama-family attention applies RoPE before ``cache.update``, so cached keys are already
rotated; moving a key from position ``p`` to ``p - d`` is a pure rotation by
``-d * inv_freq`` (no ``attention_scaling``: the cached key already carries it once).

Each layer is re-rotated with its own frequencies: models with several kinds of layer
(gemma3: sliding-window layers with a local rope base, full-attention layers with a global
base and rope scaling) keep one ``{layer_type}_inv_freq`` per kind on their rotary module,
and ``config.layer_types`` says which kind each layer is. Sliding-window layers are fine as
long as the whole cache fits in the window: positions never leave ``[0, capacity)``, so the
window mask never hides a cached token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import torch

from chatbot.engine.cache.layers import KVCache, KVLayer
from chatbot.engine.streaming_support import (
    check_streaming_support,
    layer_inv_freqs,
    streaming_window,
)
from chatbot.errors import StreamingUnsupportedError

__all__ = [
    "SinkCache",
    "SinkLayer",
    "StreamingUnsupportedError",
    "check_streaming_support",
    "layer_inv_freqs",
    "rotate_keys",
    "rotation_for_shift",
    "streaming_window",
]


def rotation_for_shift(shift: int, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin that move a rotated key back by `shift` positions.

    Args:
        shift: how many positions the keys move towards the start (> 0).
        inv_freq: the model's rotary inverse frequencies, ``[head_dim // 2]``.

    Returns:
        ``(cos, sin)`` in float32, each ``[head_dim]`` (frequencies duplicated as
        ``[freqs, freqs]``, the rotate_half layout of Llama).
    """
    angle = -float(shift) * inv_freq.to(torch.float32)  # [head_dim // 2]
    emb = torch.cat((angle, angle), dim=-1)  # [head_dim]
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotate_keys(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate cached keys ``[B, H, S, D]`` by the angles in `cos`/`sin` ``[D]``.

    The product is taken in float32 (bf16 rotations drift) and cast back to the keys' dtype.
    """
    k32 = keys.to(torch.float32)
    cos = cos.to(k32.device)
    sin = sin.to(k32.device)
    return (k32 * cos + _rotate_half(k32) * sin).to(keys.dtype)


class SinkLayer(KVLayer):
    """One decoder layer of a `SinkCache`: a `KVLayer` that can cut out a block.

    Tensors are ``[batch, kv_heads, seq, head_dim]`` on the device of the layer's first
    update (lazy initialisation, as `KVLayer`).
    """

    def drop(self, start: int, end: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Remove positions ``[start, end)`` and re-rotate the keys after them.

        Args:
            start: first physical index removed.
            end: one past the last index removed.
            cos: float32 ``[head_dim]`` rotation for the keys after the gap.
            sin: float32 ``[head_dim]``.
        """
        keys, values = self.keys, self.values
        if not self.is_initialized or end <= start or keys is None or values is None or keys.numel() == 0:
            return
        tail_keys = rotate_keys(keys[..., end:, :], cos, sin)
        self.keys = torch.cat([keys[..., :start, :], tail_keys], dim=-2)
        self.values = torch.cat([values[..., :start, :], values[..., end:, :]], dim=-2)

    @property
    def nbytes(self) -> int:
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None:
            return 0
        return keys.numel() * keys.element_size() + values.numel() * values.element_size()


class SinkCache(KVCache):
    """Attention-sink (StreamingLLM) cache: pinned head + recent window, re-rotated on eviction.

    Call `evict_for_space(n)` before every forward pass of ``n`` tokens; it returns the
    physical slice it removed so the caller can drop the same token ids (StreamingLLM's
    call forms are `chatbot.compat.streaming_llm.StreamingSinkCache`'s).
    """

    def __init__(
        self,
        num_layers: int,
        inv_freq: torch.Tensor | Sequence[torch.Tensor],
        start_size: int = 4,
        recent_size: int = 2000,
        evict_block: int = 64,
    ) -> None:
        """
        Args:
            num_layers: decoder layers of the model (one `SinkLayer` each).
            inv_freq: rotary inverse frequencies ``[head_dim // 2]`` (with rope scaling
                applied): one tensor for every layer, or one per layer (`layer_inv_freqs`).
            start_size: attention-sink tokens always kept at the start (0: plain sliding window).
            recent_size: tokens of the recent window.
            evict_block: evictions drop a multiple of this many tokens, so re-rotation
                (a copy of the whole cache) happens once per block instead of every token.

        Raises:
            ValueError: for a non-positive `num_layers`, `recent_size` or `evict_block`,
                a negative `start_size`, or per-layer frequencies for another number of layers.
        """
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        if start_size < 0:
            raise ValueError(f"start_size must be >= 0, got {start_size}")
        if recent_size <= 0:
            raise ValueError(f"recent_size must be positive, got {recent_size}")
        if evict_block <= 0:
            raise ValueError(f"evict_block must be positive, got {evict_block}")
        per_layer = [inv_freq] * num_layers if isinstance(inv_freq, torch.Tensor) else list(inv_freq)
        if len(per_layer) != num_layers:
            raise ValueError(
                f"got rotary frequencies for {len(per_layer)} layers, the cache has {num_layers}"
            )
        super().__init__(layers=[SinkLayer() for _ in range(num_layers)])
        # Layers sharing a frequency tensor share its float32 copy (and its rotation in `drop_range`).
        copies: dict[int, torch.Tensor] = {}
        for f in per_layer:
            if id(f) not in copies:
                copies[id(f)] = f.detach().to(torch.float32).flatten()
        self.inv_freqs: list[torch.Tensor] = [copies[id(f)] for f in per_layer]
        self.start_size = start_size
        self.recent_size = recent_size
        # A block larger than a quarter of the window would throw away most of it at once.
        self.evict_block = min(evict_block, max(1, recent_size // 4))
        self._pinned = start_size
        self.evicted_total = 0
        # Set by `for_model` for a sliding-window model: the cache must fit in its window.
        self.max_capacity: int | None = None

    @property
    def inv_freq(self) -> torch.Tensor:
        """The rotary frequencies every layer shares.

        Raises:
            ValueError: the layers have frequencies of their own (see `inv_freqs`).
        """
        first = self.inv_freqs[0]
        if any(f is not first for f in self.inv_freqs):
            raise ValueError("this cache re-rotates each layer with its own frequencies: read inv_freqs")
        return first

    @classmethod
    def for_model(
        cls,
        model: Any,
        start_size: int = 4,
        recent_size: int = 2000,
        evict_block: int = 64,
    ) -> SinkCache:
        """Build a cache for `model` after checking that it can stream.

        Raises:
            StreamingUnsupportedError: the model's positions cannot be re-rotated
                (see `check_streaming_support`).
        """
        check_streaming_support(model, capacity=start_size + recent_size, start_size=start_size)
        config = model.config.get_text_config(decoder=True)
        cache = cls(
            num_layers=config.num_hidden_layers,
            inv_freq=layer_inv_freqs(model),
            start_size=start_size,
            recent_size=recent_size,
            evict_block=evict_block,
        )
        cache.max_capacity = streaming_window(config)
        return cache

    # --- layout -----------------------------------------------------------------------

    @property
    def sink_layers(self) -> list[SinkLayer]:
        """The layers, as what they are: `SinkLayer`s (the fast path swaps in `BufferLayer`s,
        a subclass)."""
        return cast(list[SinkLayer], self.layers)

    @property
    def pinned(self) -> int:
        """Tokens at the start that are never evicted."""
        return self._pinned

    @property
    def capacity(self) -> int:
        """Most tokens the cache holds after `evict_for_space`: pinned + recent_size."""
        return self._pinned + self.recent_size

    def pin(self, n_tokens: int) -> None:
        """Keep the first `n_tokens` (e.g. the system prompt) forever, like llama.cpp ``--keep``.

        The pinned region never shrinks below `start_size`; capacity grows with it.

        Raises:
            ValueError: for a negative `n_tokens`.
            StreamingUnsupportedError: the pinned tokens plus the recent window would no
                longer fit in the model's sliding window (see `max_capacity`).
        """
        if n_tokens < 0:
            raise ValueError(f"cannot pin a negative number of tokens ({n_tokens})")
        pinned = max(self.start_size, n_tokens)
        if self.max_capacity is not None and pinned + self.recent_size > self.max_capacity:
            raise StreamingUnsupportedError(
                f"keeping {pinned} tokens plus a recent window of {self.recent_size} exceeds the "
                f"model's sliding window of {self.max_capacity} tokens",
                recent_fits=max(1, self.max_capacity - pinned),
            )
        self._pinned = pinned

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values of all layers."""
        return sum(layer.nbytes for layer in self.sink_layers)

    # --- eviction ---------------------------------------------------------------------

    def evict_for_space(self, num_coming: int) -> tuple[int, int] | None:
        """Make room for the `num_coming` tokens of the next forward pass.

        Drops a block right after the pinned region: at least what is needed, rounded up to
        a multiple of `evict_block`, but never more than the unpinned tokens present. Keys
        after the block are re-rotated so positions stay contiguous. When `num_coming` is
        larger than `recent_size`, every unpinned token goes and only the sinks stay, as in
        StreamingLLM; the cache then holds more than `capacity` after the forward pass (the
        engine feeds in chunks of at most `recent_size`, so it never gets there).

        Returns:
            The physical ``(start, end)`` slice removed (delete the same slice from the list
            of token ids in the cache), or None if nothing had to go.

        Raises:
            ValueError: for a negative `num_coming`.
        """
        if num_coming < 0:
            raise ValueError(f"num_coming must be >= 0, got {num_coming}")
        length = self.get_seq_length()
        needed = length + num_coming - self.capacity
        if needed <= 0:
            return None
        evictable = length - self._pinned
        if evictable <= 0:
            return None  # only the sinks are left: StreamingLLM keeps them whatever comes
        block = -(-needed // self.evict_block) * self.evict_block
        return self.drop_range(self._pinned, self._pinned + min(block, evictable))

    def rotations_for_shift(self, shift: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(cos, sin)`` that moves its keys back by `shift` positions (layers
        sharing frequencies share the tensors)."""
        by_freq: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for f in self.inv_freqs:
            if id(f) not in by_freq:
                by_freq[id(f)] = rotation_for_shift(shift, f)
        return [by_freq[id(f)] for f in self.inv_freqs]

    def drop_range(self, start: int, end: int) -> tuple[int, int]:
        """Remove the physical positions ``[start, end)`` (``0 <= start <= end <= length``);
        the keys after them are re-rotated, so positions stay contiguous. Returns the range."""
        rotations = self.rotations_for_shift(end - start)
        for layer, (cos, sin) in zip(self.sink_layers, rotations):
            layer.drop(start, end, cos, sin)
        self.evicted_total += end - start
        return start, end

    # --- Cache overrides --------------------------------------------------------------

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the tail (negative count, as `KVLayer.crop`)."""
        super().crop(tokens_to_remove)
        # A pin that reaches past the new end would pin whatever comes next.
        self._pinned = min(self._pinned, max(self.start_size, self.get_seq_length()))

    def reset(self) -> None:
        """Empty every layer, forget evictions and drop the pin back to `start_size`."""
        super().reset()
        self.evicted_total = 0
        self._pinned = self.start_size

    def __repr__(self) -> str:
        return (
            f"SinkCache(layers={len(self.layers)}, pinned={self._pinned}, recent={self.recent_size}, "
            f"length={self.get_seq_length()}, evicted_total={self.evicted_total})"
        )
