"""StreamingLLM (mit-han-lab/streaming-llm): `enable_streaming_llm`, `StartRecentKVCache`, and
the helpers its example scripts import (`load_jsonl`, `download_url`, `parse_args`)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.request
import warnings
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any, cast, overload

import torch
from transformers.cache_utils import Cache, DynamicLayer

from chatbot.compat._common import CompatArgumentError, check_model, check_range
from chatbot.compat.tinychat import PERSISTENT
from chatbot.config import MAX_TOKENS, Range
from chatbot.engine.cache.layers import is_cache
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.generate import Engine

# --- StreamingLLM: enable_streaming_llm, StartRecentKVCache ----------------------------------

# Models given a sink cache by `enable_streaming_llm`: the hook that watches their forward
# passes, and whether it has warned yet.
_WATCHED: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_WARNED: weakref.WeakSet[Any] = weakref.WeakSet()


def _cache_argument(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if "cache" in kwargs:
        return kwargs["cache"]
    if "past_key_values" in kwargs:
        return kwargs["past_key_values"]
    return args[3] if len(args) > 3 else None  # forward(input_ids, attention_mask, position_ids, cache)


def _warn_unbounded_cache(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook: warn (once per model) when a model that `enable_streaming_llm` gave
    a sink cache runs with a cache that never evicts, the silent half of a port."""
    if model in _WARNED or kwargs.get("use_cache") is False:
        return
    cache = _cache_argument(args, kwargs)
    if isinstance(cache, (SinkCache, _StartRecentCache)):  # both evict
        return
    if cache is None and kwargs.get("use_cache") is None and not getattr(model.config, "use_cache", True):
        return
    _WARNED.add(model)
    what = "no cache, so it builds a DynamicCache" if cache is None else f"a {type(cache).__name__}"
    warnings.warn(
        f"enable_streaming_llm gave this model a sink cache, but it is running with {what}: "
        "nothing will be evicted and the cache grows without bound. Hand the model the sink "
        "cache: `past_key_values = kv_cache.evict_for_space(past_key_values, num_coming)` returns it "
        "(also from None), or pass `cache=kv_cache`",
        RuntimeWarning,
        stacklevel=_caller_stacklevel(),
    )


def _caller_stacklevel() -> int:
    """The `warnings.warn` stacklevel of the first frame outside torch and this module: the
    line of the caller that ran the model."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__))
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def enable_streaming_llm(
    model: Any, start_size: int = 4, recent_size: int = 2000, *, evict_block: int = 1
) -> StreamingSinkCache:
    """Give `model` an attention-sink cache, like StreamingLLM's `enable_streaming_llm`.

    The model itself is not patched: our `SinkCache` re-rotates the keys it keeps when it
    evicts, so positions stay inside the window on transformers v5. StreamingLLM's own lines
    work on it: ``past_key_values = kv_cache.evict_for_space(past_key_values, num_coming)``
    before a forward pass returns the sink cache to hand to the model (from None too),
    ``kv_cache(past_key_values)`` after one keeps the sinks and the newest `recent_size`
    tokens, and ``kv_cache.evict_range(past_key_values, start, end)`` cuts a range. The
    engine's form, ``evict_for_space(num_coming)``, works too. The cache also becomes the
    model's persistent cache for `StreamGenerator`, and it can be given to
    `stream_generate` / `streaming_chat` or to `Engine.generate`, which evict on their own.
    From now on, a forward pass of `model` with a cache that is not a sink cache (None
    included: the model would build a `DynamicCache`) warns once.

    Args:
        model: a causal LM with rotary positions (Llama, Mistral, Qwen2, ...).
        start_size: attention-sink tokens kept at the start.
        recent_size: tokens of the recent window.
        evict_block: evict a multiple of this many tokens. 1 keeps exactly the sinks and
            the newest ``recent_size - num_coming`` tokens, as the original; a larger block
            re-rotates less often when evicting token by token.

    Returns:
        The `StreamingSinkCache`.

    Raises:
        CompatArgumentError: no model, or sizes the CLI refuses too: sizes that are not
            integers, more sinks than the recent window, or sinks plus window larger than
            the model's context (``max_position_embeddings``).
        StreamingUnsupportedError: the model's positions cannot be re-rotated.
    """
    api = "enable_streaming_llm"
    check_model(model, api)
    # (the model's context bounds both, below; the CLI's --recent-size starts at 16, but
    # StreamingLLM's own scripts use smaller windows)
    start_size = check_range(api, "start_size", start_size, Range(int, 0))
    recent_size = check_range(api, "recent_size", recent_size, Range(int, 1))
    evict_block = check_range(api, "evict_block", evict_block, Range(int, 1, MAX_TOKENS))
    if start_size > recent_size:
        raise CompatArgumentError(
            f"{api}: start_size ({start_size:,}) must not be larger than the recent window "
            f"(recent_size {recent_size:,})"
        )
    cache = cast(
        StreamingSinkCache,
        StreamingSinkCache.for_model(
            model, start_size=start_size, recent_size=recent_size, evict_block=evict_block
        ),
    )
    context = Engine(model, None).max_context  # the model's trained context
    if start_size + recent_size > context:
        raise CompatArgumentError(
            f"{api}: start_size + recent_size ({start_size:,} + {recent_size:,}) must be at most "
            f"the model's context ({context:,} tokens); e.g. recent_size={max(1, context - start_size):,}"
        )
    PERSISTENT[model] = cache
    if model not in _WATCHED and hasattr(model, "register_forward_pre_hook"):
        _WATCHED[model] = model.register_forward_pre_hook(_warn_unbounded_cache, with_kwargs=True)
    return cache


class StreamingSinkCache(SinkCache):
    """The engine's `SinkCache` with StreamingLLM's call forms, whose caches were tuples handed
    back and forth: ``evict_for_space(past_key_values, num_coming)`` returns the cache to hand
    to the model, ``evict_range`` cuts a range, and calling the cache after a forward pass
    keeps the sinks and the newest `recent_size` tokens. The engine's form,
    ``evict_for_space(num_coming)``, works as on any `SinkCache`."""

    @overload
    def evict_for_space(self, num_coming: int) -> tuple[int, int] | None: ...

    @overload
    def evict_for_space(self, past_key_values: Any, num_coming: int) -> StreamingSinkCache: ...

    def evict_for_space(self, *args: Any, **kwargs: Any) -> Any:
        """Make room for the tokens of the next forward pass, in either of two forms.

        - ``evict_for_space(num_coming)`` (the engine's form) returns the physical
          ``(start, end)`` slice it removed, or None (see `SinkCache.evict_for_space`).
        - ``evict_for_space(past_key_values, num_coming)`` (StreamingLLM's form) returns the
          cache to hand to the model: this cache, after taking in `past_key_values` (see
          `take`; None means a new conversation and gives this cache emptied).

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
            return super().evict_for_space(given["num_coming"])
        cache = self.take(given["past_key_values"])
        super(StreamingSinkCache, cache).evict_for_space(given["num_coming"])
        return cache

    def take(self, past_key_values: Any) -> StreamingSinkCache:
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
        if is_cache(past_key_values):
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

    def evict_range(self, past_key_values: Any, start: int, end: int) -> StreamingSinkCache:
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
            cache.drop_range(start, end)
        return cache

    def __call__(self, past_key_values: Any) -> StreamingSinkCache | None:
        """StreamingLLM's ``kv_cache(past_key_values)`` after a forward pass: keep the sinks
        and the newest `recent_size` tokens. None stays None, as in StreamingLLM."""
        if past_key_values is None:
            return None
        cache = self.take(past_key_values)
        super(StreamingSinkCache, cache).evict_for_space(0)
        return cache


class _StartRecentLayer(DynamicLayer):
    """A layer of `StartRecentKVCache`'s cache: tokens keep the positions they were fed at.

    `get_seq_length` counts the evicted tokens too, so transformers gives new tokens their
    true positions (it derives them from it), and `get_mask_sizes` reports the physical keys
    at an offset, as transformers' own sliding-window layer does.
    """

    def __init__(self) -> None:
        super().__init__()
        self.evicted = 0

    def physical_length(self) -> int:
        return super().get_seq_length()

    def get_seq_length(self) -> int:
        return self.physical_length() + self.evicted

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length() + query_length, self.evicted

    def keep(self, start_size: int, recent: int) -> None:
        """Keep the first `start_size` and the last `recent` physical positions."""
        length = self.physical_length()
        keys, values = self.keys, self.values
        if not self.is_initialized or keys is None or values is None or start_size + recent >= length:
            return
        tail = length - recent
        self.keys = torch.cat([keys[..., :start_size, :], keys[..., tail:, :]], dim=-2)
        self.values = torch.cat([values[..., :start_size, :], values[..., tail:, :]], dim=-2)
        self.evicted += tail - start_size

    def cut(self, start: int, end: int) -> None:
        keys, values = self.keys, self.values
        if keys is None or values is None:
            return
        self.keys = torch.cat([keys[..., :start, :], keys[..., end:, :]], dim=-2)
        self.values = torch.cat([values[..., :start, :], values[..., end:, :]], dim=-2)
        self.evicted += end - start

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a StartRecentKVCache cache cannot be cropped")

    def reset(self) -> None:
        super().reset()
        self.evicted = 0


class _StartRecentCache(Cache):
    """The transformers `Cache` that `StartRecentKVCache` hands to the model."""

    def __init__(self, num_layers: int) -> None:
        super().__init__(layers=[_StartRecentLayer() for _ in range(num_layers)])

    @property
    def own_layers(self) -> list[_StartRecentLayer]:
        """The layers as what they are (transformers types `layers` as any kind of layer)."""
        return cast(list[_StartRecentLayer], self.layers)

    def physical_length(self) -> int:
        return self.own_layers[0].physical_length()


class StartRecentKVCache:
    """StreamingLLM's ``StartRecentKVCache``: keep `start_size` sinks and `recent_size` recent
    tokens, on the caches transformers v5 models return.

    Use it as StreamingLLM's `eval_long_ppl.py` does: ``past_key_values =
    kv_cache(past_key_values)`` after each forward pass, or ``past_key_values =
    kv_cache.evict_for_space(past_key_values, num_coming)`` before one. Each returns the
    `Cache` to hand to the model next: the first time, a cache of ours that takes over the
    tensors of the model's `DynamicCache`; then that same cache, evicted in place.

    Unlike StreamingLLM's (tuples sliced with no position handling: new tokens then got
    positions counted from the cache length, which disagree with the cached keys unless the
    model was patched with its ``pos_shift`` attention), every token here keeps the
    position it was fed at, and new tokens get their true positions. Attention therefore
    sees the same relative distances as with the whole text, minus the evicted middle.
    Nothing is re-rotated, so it needs no model; positions keep growing, so it suits texts
    within the model's trained context. For unbounded streams use `enable_streaming_llm`,
    whose cache moves the kept keys to positions inside the window.
    """

    def __init__(self, start_size: int = 4, recent_size: int = 512, k_seq_dim: int = 2, v_seq_dim: int = 2):
        """
        Args:
            start_size: attention sinks kept at the start.
            recent_size: recent tokens kept.
            k_seq_dim: accepted for compatibility (1, 2 or 3): transformers v5 caches always
                hold ``[batch, heads, seq, head_dim]``.
            v_seq_dim: likewise.

        Raises:
            ValueError: a negative size, or a sequence dimension StreamingLLM did not know.
        """
        if start_size < 0 or recent_size < 0:
            raise ValueError(f"start_size and recent_size must be >= 0, got {start_size}, {recent_size}")
        if k_seq_dim not in (1, 2, 3) or v_seq_dim not in (1, 2, 3):
            raise ValueError(f"k_seq_dim and v_seq_dim must be 1, 2 or 3, got {k_seq_dim}, {v_seq_dim}")
        self.start_size = start_size
        self.recent_size = recent_size
        self.cache_size = start_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim

    def _own(self, past_key_values: Any) -> _StartRecentCache:
        """`past_key_values` as our cache: ours as it is, else its tensors moved into one."""
        if isinstance(past_key_values, _StartRecentCache):
            return past_key_values
        if is_cache(past_key_values):
            pairs = [
                (getattr(layer, "keys", None), getattr(layer, "values", None))
                for layer in past_key_values.layers
            ]
        elif isinstance(past_key_values, (tuple, list)):
            pairs = [(kv[0], kv[1]) for kv in past_key_values]
        else:
            raise TypeError(
                f"past_key_values must be None, a transformers Cache or per-layer (key, value) pairs, "
                f"got {type(past_key_values).__name__}"
            )
        cache = _StartRecentCache(len(pairs))
        for layer, (keys, values) in zip(cache.own_layers, pairs):
            if keys is not None and values is not None and keys.numel():
                layer.update(keys, values)
        return cache

    def __call__(self, past_key_values: Any) -> Cache | None:
        """After a forward pass: keep the sinks and the newest `recent_size` tokens."""
        if past_key_values is None:
            return None
        cache = self._own(past_key_values)
        if cache.physical_length() > self.cache_size:
            for layer in cache.own_layers:
                layer.keep(self.start_size, self.recent_size)
        return cache

    def evict_for_space(self, past_key_values: Any, num_coming: int) -> Cache | None:
        """Before a forward pass of `num_coming` tokens: keep the sinks and the newest
        ``recent_size - num_coming`` tokens (only the sinks when `num_coming` is larger)."""
        if past_key_values is None:
            return None
        if num_coming < 0:
            raise ValueError(f"num_coming must be >= 0, got {num_coming}")
        cache = self._own(past_key_values)
        if cache.physical_length() + num_coming > self.cache_size:
            for layer in cache.own_layers:
                layer.keep(self.start_size, max(0, self.recent_size - num_coming))
        return cache

    def evict_range(self, past_key_values: Any, start: int, end: int) -> Cache | None:
        """Remove the physical positions ``[start, end)``; the rest keep their positions.

        Raises:
            ValueError: unless ``0 <= start <= end <= length``.
        """
        if past_key_values is None:
            return None
        cache = self._own(past_key_values)
        length = cache.physical_length()
        if not 0 <= start <= end <= length:
            raise ValueError(f"evict_range needs 0 <= start <= end <= {length}, got ({start}, {end})")
        if end > start:
            for layer in cache.own_layers:
                layer.cut(start, end)
        return cache

    def __repr__(self) -> str:
        return f"StartRecentKVCache(start_size={self.start_size}, recent_size={self.recent_size})"


# --- StreamingLLM's script helpers (streaming_llm.utils), so its examples need no other import --


def load_jsonl(file_path: str | os.PathLike[str]) -> list[Any]:
    """One JSON value per non-empty line of `file_path` (StreamingLLM's `load_jsonl`)."""
    with open(file_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def download_url(url: str, folder: str | os.PathLike[str] = "folder") -> str:
    """Download `url` into `folder` unless the file is already there; return its path
    (StreamingLLM's `download_url`, with certificates checked)."""
    name = url.rpartition("/")[2].split("?")[0] or "download"
    path = os.path.join(folder, name)
    if os.path.exists(path):
        return path
    os.makedirs(folder, exist_ok=True)
    with urllib.request.urlopen(url) as response, open(path, "wb") as f:
        shutil.copyfileobj(response, f)
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command-line flags of StreamingLLM's `eval_long_ppl.py`, with its defaults."""
    parser = argparse.ArgumentParser(description="StreamingLLM's long-text perplexity flags")
    parser.add_argument("--model_name_or_path", type=str, default="models/llama/llama-7b")
    parser.add_argument("--revision", type=str, default="main")
    parser.add_argument("--tokenizer_name_or_path", type=str, default=None)
    parser.add_argument("--dataset_name", type=str, default="wikitext")
    parser.add_argument("--task", type=str, default="wikitext-2-raw-v1")
    parser.add_argument("--split", type=str, default="test", choices=["validation", "test"])
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--output_dir", type=str, default="outputs/debug")
    parser.add_argument("--enable_start_recent_kv_cache", action="store_true")
    parser.add_argument("--start_size", type=int, default=1)
    parser.add_argument("--recent_size", type=int, default=255)
    parser.add_argument("--enable_pos_shift", action="store_true")
    parser.add_argument("--num_eval_tokens", type=int, default=None)
    return parser.parse_args(argv)
