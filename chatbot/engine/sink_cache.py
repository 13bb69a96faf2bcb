"""StreamingLLM attention sinks as a transformers v5 cache.

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
from typing import Any, cast, overload

import torch
from transformers import Cache
from transformers.cache_utils import DynamicLayer

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


class SinkLayer(DynamicLayer):
    """One decoder layer of a `SinkCache`: a `DynamicLayer` that can cut out a block.

    Tensors are ``[batch, kv_heads, seq, head_dim]`` on the device of the layer's first
    update (lazy initialisation, as `DynamicLayer`).
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


class SinkCache(Cache):
    """Attention-sink (StreamingLLM) cache: pinned head + recent window, re-rotated on eviction.

    Call `evict_for_space(n)` before every forward pass of ``n`` tokens; it returns the
    physical slice it removed so the caller can drop the same token ids. StreamingLLM's
    forms (``evict_for_space(past_key_values, n)``, ``evict_range``, calling the cache) are
    here too: they return the cache to hand to the model.
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
        # Layers sharing a frequency tensor share its float32 copy (and its rotation in `_drop`).
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
        a subclass); transformers types `layers` as any kind of layer."""
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
                f"model's sliding window of {self.max_capacity} tokens; lower --recent-size "
                f"(to {max(1, self.max_capacity - pinned)} or less)"
            )
        self._pinned = pinned

    @property
    def nbytes(self) -> int:
        """Bytes held by the keys and values of all layers."""
        return sum(layer.nbytes for layer in self.sink_layers)

    # --- eviction ---------------------------------------------------------------------

    @overload
    def evict_for_space(self, num_coming: int) -> tuple[int, int] | None: ...

    @overload
    def evict_for_space(self, past_key_values: Any, num_coming: int) -> SinkCache: ...

    def evict_for_space(self, *args: Any, **kwargs: Any) -> Any:
        """Make room for the tokens of the next forward pass, in either of two forms.

        - ``evict_for_space(num_coming)`` (the engine's form) returns the physical
          ``(start, end)`` slice it removed (delete the same slice from the list of token
          ids in the cache), or None if nothing had to go.
        - ``evict_for_space(past_key_values, num_coming)`` (StreamingLLM's form) returns the
          cache to hand to the model: this cache, after taking in `past_key_values` (see
          `take`; None means a new conversation and gives this cache emptied).

        Drops a block right after the pinned region: at least what is needed, rounded up to
        a multiple of `evict_block`, but never more than the unpinned tokens present. Keys
        after the block are re-rotated so positions stay contiguous. When `num_coming` is
        larger than `recent_size`, every unpinned token goes and only the sinks stay, as in
        StreamingLLM; the cache then holds more than `capacity` after the forward pass (the
        engine feeds in chunks of at most `recent_size`, so it never gets there).

        Raises:
            ValueError: for a negative `num_coming`.
            TypeError: for another number of arguments, or a `past_key_values` that is
                neither a cache nor per-layer ``(key, value)`` pairs.
        """
        names = ("past_key_values", "num_coming") if len(args) + len(kwargs) == 2 else ("num_coming",)
        given = dict(zip(names, args))
        if len(args) > len(names) or set(kwargs) & set(given) or set(kwargs) - set(names):
            raise TypeError(
                "evict_for_space takes (num_coming) or (past_key_values, num_coming), got "
                f"{len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        given.update(kwargs)
        if len(given) != len(names):
            raise TypeError(f"evict_for_space is missing {sorted(set(names) - set(given))}")
        if len(names) == 1:
            return self._evict(given["num_coming"])
        cache = self.take(given["past_key_values"])
        cache._evict(given["num_coming"])
        return cache

    def _evict(self, num_coming: int) -> tuple[int, int] | None:
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
        return self._drop(self._pinned, self._pinned + min(block, evictable))

    def rotations_for_shift(self, shift: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's ``(cos, sin)`` that moves its keys back by `shift` positions (layers
        sharing frequencies share the tensors)."""
        by_freq: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for f in self.inv_freqs:
            if id(f) not in by_freq:
                by_freq[id(f)] = rotation_for_shift(shift, f)
        return [by_freq[id(f)] for f in self.inv_freqs]

    def _drop(self, start: int, end: int) -> tuple[int, int]:
        rotations = self.rotations_for_shift(end - start)
        for layer, (cos, sin) in zip(self.sink_layers, rotations):
            layer.drop(start, end, cos, sin)
        self.evicted_total += end - start
        return start, end

    # --- StreamingLLM's call forms (its caches were tuples handed back and forth) ----------

    def take(self, past_key_values: Any) -> SinkCache:
        """This cache, holding what `past_key_values` holds.

        Args:
            past_key_values: None (a new conversation: this cache is emptied), this cache
                (returned as it is), or another `Cache` or per-layer ``(key, value)`` pairs
                from the same model (their tensors are copied in, and they count as the
                conversation so far, positions ``0..n-1``).

        Raises:
            TypeError: for anything else, a cache with another number of layers, or one
                whose keys are not at positions ``0..n-1`` (`StartRecentKVCache`'s, after it
                evicted).
        """
        if past_key_values is self:
            return self
        if past_key_values is None:
            self.reset()
            return self
        if isinstance(past_key_values, Cache):
            if any(getattr(layer, "evicted", 0) for layer in past_key_values.layers):
                # StartRecentKVCache's keys sit at their old positions, with a gap: taking
                # them as positions 0..n-1 would silently misplace them.
                raise TypeError("a cache that kept its keys at their old positions cannot be taken in")
            pairs = [
                (getattr(layer, "keys", None), getattr(layer, "values", None))
                for layer in past_key_values.layers
            ]
            evicted = int(getattr(past_key_values, "evicted_total", 0))
        elif isinstance(past_key_values, (tuple, list)):
            pairs = [(kv[0], kv[1]) for kv in past_key_values]
            evicted = 0
        else:
            raise TypeError(
                f"past_key_values must be None, a transformers Cache or per-layer (key, value) pairs, "
                f"got {type(past_key_values).__name__}"
            )
        if len(pairs) != len(self.layers):
            raise TypeError(f"past_key_values has {len(pairs)} layers, this cache {len(self.layers)}")
        self.reset()
        for layer, (keys, values) in zip(self.sink_layers, pairs):
            if keys is not None and values is not None and keys.numel():
                layer.update(keys, values)
        self.evicted_total = evicted
        return self

    def evict_range(self, past_key_values: Any, start: int, end: int) -> SinkCache:
        """Remove the physical positions ``[start, end)``, as StreamingLLM's `evict_range`.

        The keys after the range are re-rotated, so positions stay contiguous.

        Args:
            past_key_values: what to evict from (see `take`).
            start: first position removed.
            end: one past the last position removed.

        Returns:
            This cache, to hand to the model.

        Raises:
            ValueError: unless ``0 <= start <= end <= length``.
        """
        cache = self.take(past_key_values)
        length = cache.get_seq_length()
        if not 0 <= start <= end <= length:
            raise ValueError(f"evict_range needs 0 <= start <= end <= {length}, got ({start}, {end})")
        if end > start:
            cache._drop(start, end)
        return cache

    def __call__(self, past_key_values: Any) -> SinkCache | None:
        """StreamingLLM's ``kv_cache(past_key_values)`` after a forward pass: keep the sinks
        and the newest `recent_size` tokens. None stays None, as in StreamingLLM."""
        if past_key_values is None:
            return None
        return self.evict_for_space(past_key_values, 0)

    # --- Cache overrides --------------------------------------------------------------

    def crop(self, tokens_to_remove: int) -> None:
        """Remove tokens from the tail (negative count, as `DynamicLayer.crop`)."""
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


# --- support check ------------------------------------------------------------------------

# model_type -> how it encodes positions, for models that cannot be re-rotated.
_NO_ROPE = {
    "gpt2": "learned absolute positions",
    "gpt_neo": "learned absolute positions",
    "gpt_bigcode": "learned absolute positions",
    "opt": "learned absolute positions",
    "biogpt": "learned absolute positions",
    "xglm": "sinusoidal absolute positions",
    "bloom": "ALiBi attention biases",
    "mpt": "ALiBi attention biases",
    "jais": "ALiBi attention biases",
}
# Rotary, but pairs (x0, x1), (x2, x3)... instead of the rotate_half halves we re-rotate.
_INTERLEAVED_ROPE = {"gptj", "codegen"}


def _find_rotary(model: Any) -> Any | None:
    inner = getattr(model, "model", None)
    # A multimodal wrapper (Gemma3ForConditionalGeneration) keeps it on its language model.
    candidates = [inner, getattr(inner, "language_model", None), getattr(model, "base_model", None), model]
    for module in candidates:
        rotary = getattr(module, "rotary_emb", None) if module is not None else None
        if rotary is not None:
            return rotary
    return None


def _rope_parameter_dicts(config: Any) -> list[dict[str, Any]]:
    """The rope parameter dicts of a v5 config: one flat dict, or one per layer type."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return []
    nested = [value for value in params.values() if isinstance(value, dict)]
    return nested or [params]


def _sliding_window(config: Any) -> int | None:
    """The window of a model whose full-attention layers still mask beyond it (Mistral)."""
    window = getattr(config, "sliding_window", None)
    if window is None or not getattr(config, "use_sliding_window", True):
        return None
    return int(window)


def _text_config(model_or_config: Any) -> tuple[Any, bool]:
    """The decoder's config of a model or config, and whether a model was given."""
    is_model = hasattr(model_or_config, "config") and not hasattr(model_or_config, "to_dict")
    config = model_or_config.config if is_model else model_or_config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    return config, is_model


def streaming_window(model_or_config: Any) -> int | None:
    """The smallest attention window among the model's layers, which a streaming cache must
    fit in (None: every layer attends to the whole cache).

    ``config.layer_types`` says which layers slide (gemma2, gemma3, qwen2 with
    ``use_sliding_window``); without it a ``sliding_window`` applies to every layer (Mistral).
    """
    config, _ = _text_config(model_or_config)
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return _sliding_window(config)
    window = getattr(config, "sliding_window", None)
    return int(window) if window and "sliding_attention" in layer_types else None


def layer_inv_freqs(model: Any) -> list[torch.Tensor]:
    """Each decoder layer's rotary inverse frequencies, as the model rotates its keys.

    The rotary module holds one ``inv_freq`` for every layer or, in a model with several
    kinds of layer (gemma3: local and global rope), one ``{layer_type}_inv_freq`` per kind;
    ``config.layer_types[i]`` is the kind of layer ``i``.

    Raises:
        StreamingUnsupportedError: no rotary module, or a layer whose frequencies it lacks.
    """
    config, _ = _text_config(model)
    model_type = getattr(config, "model_type", "") or "this model"
    rotary = _find_rotary(model)
    if rotary is None:
        raise StreamingUnsupportedError(
            f"--enable-streaming needs rotary position embeddings; no rotary embedding module "
            f"found on {type(model).__name__}"
        )
    layer_types = list(getattr(config, "layer_types", None) or [])
    shared = getattr(rotary, "inv_freq", None)
    freqs = []
    for i in range(config.num_hidden_layers):
        kind = layer_types[i] if i < len(layer_types) else None
        freq = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
        freq = freq if isinstance(freq, torch.Tensor) else shared
        if not isinstance(freq, torch.Tensor):
            raise StreamingUnsupportedError(
                f"--enable-streaming cannot read the rotary frequencies of {model_type}"
                + (f" {kind} layers" if kind else "")
                + " (non-standard rotary embedding)"
            )
        freqs.append(freq)
    return freqs


def check_streaming_support(
    model_or_config: Any, capacity: int | None = None, start_size: int | None = None
) -> None:
    """Refuse models whose cached keys cannot be moved to new positions.

    Args:
        model_or_config: a loaded model (checked for rotary frequencies for every layer,
            see `layer_inv_freqs`, whose size matches the head dim) or a bare `PretrainedConfig`.
        capacity: start + recent of the intended cache; a model with sliding-window layers
            is accepted when the whole cache fits in the smallest window (the window mask
            then never bites).
        start_size: the sinks of the intended cache, for the ``--recent-size`` that would
            fit (default 4).

    Raises:
        StreamingUnsupportedError: with a message naming the reason.
    """
    config, is_model = _text_config(model_or_config)
    model_type = getattr(config, "model_type", "") or "this model"
    need = "--enable-streaming needs rotary position embeddings"

    if model_type in _NO_ROPE:
        raise StreamingUnsupportedError(f"{need}; {model_type} uses {_NO_ROPE[model_type]}")
    if model_type == "falcon" and getattr(config, "alibi", False):
        raise StreamingUnsupportedError(f"{need}; this falcon model uses ALiBi attention biases")
    if model_type in _INTERLEAVED_ROPE:
        raise StreamingUnsupportedError(
            f"--enable-streaming re-rotates keys in the Llama (rotate_half) layout; "
            f"{model_type} uses interleaved rotary embeddings"
        )
    if getattr(config, "qk_rope_head_dim", None):
        raise StreamingUnsupportedError(
            f"--enable-streaming cannot re-rotate {model_type} keys: only part of each key "
            "is rotary (multi-head latent attention)"
        )

    rope_dicts = _rope_parameter_dicts(config)
    if not rope_dicts and getattr(config, "rope_theta", None) is None and not is_model:
        raise StreamingUnsupportedError(f"{need}; the {model_type} config declares none")

    factors = [getattr(config, "partial_rotary_factor", None)] + [
        d.get("partial_rotary_factor") for d in rope_dicts
    ]
    partial = [f for f in factors if f is not None and float(f) < 1.0]
    if partial:
        raise StreamingUnsupportedError(
            f"--enable-streaming needs rotary embeddings on the whole head; {model_type} "
            f"rotates only a part (partial_rotary_factor={partial[0]})"
        )
    if any(d.get("mrope_section") for d in rope_dicts) or any(
        str(d.get(key, "")).startswith("mrope") for d in rope_dicts for key in ("rope_type", "type")
    ):
        raise StreamingUnsupportedError(
            f"--enable-streaming cannot re-rotate {model_type} keys: it uses multimodal "
            "rotary embeddings (mrope_section)"
        )

    layer_types = getattr(config, "layer_types", None) or []
    other_types = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
    if other_types:
        raise StreamingUnsupportedError(
            f"--enable-streaming needs full or sliding-window attention in every layer; {model_type} "
            f"has {', '.join(other_types)} layers"
        )
    window = streaming_window(config)
    if window is not None and (capacity is None or capacity > window):
        fits = window - (4 if start_size is None else start_size)
        where = " (its sliding_attention layers)" if "sliding_attention" in layer_types else ""
        raise StreamingUnsupportedError(
            f"--enable-streaming needs the whole cache inside {model_type}'s sliding window of "
            f"{window} tokens{where}"
            + (
                ""
                if capacity is None
                else f", smaller than the cache's {capacity} tokens"
                if start_size is None
                else f"; {start_size} sinks + {capacity - start_size} recent make {capacity}"
            )
            + (f"; use --recent-size {fits} or less" if fits > 0 else "; use fewer --start-size tokens")
        )

    if is_model:
        head_dim = getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads)
        for inv_freq in layer_inv_freqs(model_or_config):
            if inv_freq.numel() * 2 != head_dim:
                raise StreamingUnsupportedError(
                    f"--enable-streaming needs rotary embeddings on the whole head; {model_type} "
                    f"rotates {inv_freq.numel() * 2} of {head_dim} dims"
                )
