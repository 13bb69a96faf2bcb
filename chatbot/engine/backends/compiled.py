"""Decode as one compiled step per token, on a static cache (`--opt compile`).

`CompiledBackend` runs transformers' forward pass of one token through `torch.compile`
(``fullgraph=True``; on CUDA ``mode="reduce-overhead"``, so that CUDA graphs replay the step).
A compiled step needs shapes and addresses that do not change from one token to the next, so
its cache layers are `StaticLayer`s:

- keys and values live in buffers ``[1, kv_heads, capacity, head_dim]`` taken from a
  `BufferPool`, so that a new conversation of the same capacity (/reset, /load, a server's
  next request) writes into the same memory and no step is compiled again;
- inside the compiled step a layer writes the new token at the slot given by a tensor (the
  backend's position tensor) with ``index_copy_`` and hands the whole buffers to attention;
  the mask hides every slot after the token, so stale slots (after a crop, an eviction, a
  reset) are never read;
- outside it a layer is a `BufferLayer`: prefill, crop, reset and the attention-sink cache's
  eviction (which moves the kept keys in place and re-rotates them) work as on the native path.

A growing cache's capacity follows what it holds: the bucket (`bucket`: powers of two from 256)
of its length, grown when a prefill or a step needs room; an attention-sink cache takes its
whole window (in a bucket) at once. A step compiles once per capacity (the buffers' shape is
the graph's): a new conversation starts again at 256, in the pool's buffers of that size and
on the graph already compiled. A GGUF model's packed products are custom ops
(`chatbot.engine.backends.native.packed`): one opaque kernel call each inside the graph. The token's query
heads attend in groups on the key/value heads the cache stores (`decode_attention`), with no
per-head copy of the buffers.

The next token is chosen on the device by a second compiled graph (`choose`,
`chatbot.engine.backends.device_sampling.choose_token`) and fed by `launch` from the buffer it wrote, so
`Engine.generate` reads each token back one step late (`device_sampling` lends the buffers to
one turn at a time).
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from chatbot.engine.backends.base import HFBackend, full_cache
from chatbot.engine.backends.device_sampling import DeviceSampler, choose_token
from chatbot.engine.backends.native import packed
from chatbot.engine.backends.native.pystack import call_with_room
from chatbot.engine.backends.native.threads import ThreadTuner, cap_threads
from chatbot.engine.cache.buffers import BufferLayer, adopt_layers
from chatbot.engine.cache.layers import KVCache
from chatbot.engine.cache.sinks import SinkCache

SMALLEST_BUCKET = 256


def bucket(needed: int) -> int:
    """The capacity a static cache takes to hold `needed` positions: the smallest power of two
    from `SMALLEST_BUCKET` up that holds them."""
    capacity = SMALLEST_BUCKET
    while capacity < needed:
        capacity *= 2
    return capacity


@dataclass
class _Lent:
    keys: torch.Tensor  # [B, H, capacity, D]
    values: torch.Tensor
    owner: weakref.ref[Any] | None = None


@dataclass
class BufferPool:
    """Key and value buffers, each lent to one live layer at a time; a buffer whose layer is
    gone (or gave it back) goes to the next layer asking for that shape, so that the compiled
    step sees the same addresses again."""

    mark_static: bool = False  # tell dynamo the buffers' addresses never change (CUDA graphs)
    held: dict[tuple[Any, ...], list[_Lent]] = field(default_factory=dict)

    def take(self, owner: Any, like: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers ``[*like.shape[:-2], capacity, like.shape[-1]]`` of `like`'s dtype and device,
        lent to `owner` until it is garbage or calls `give_back`."""
        shape = (*like.shape[:-2], capacity, like.shape[-1])
        key = (shape, like.dtype, like.device)
        lent = self.held.setdefault(key, [])
        for entry in lent:
            if entry.owner is None or entry.owner() is None:
                entry.owner = weakref.ref(owner)
                return entry.keys, entry.values
        keys, values = like.new_zeros(shape), like.new_zeros(shape)
        if self.mark_static:
            torch._dynamo.mark_static_address(keys)
            torch._dynamo.mark_static_address(values)
        lent.append(_Lent(keys, values, weakref.ref(owner)))
        return keys, values

    def give_back(self, owner: Any) -> None:
        """Free every buffer lent to `owner`."""
        for lent in self.held.values():
            for entry in lent:
                if entry.owner is not None and entry.owner() is owner:
                    entry.owner = None

    def addresses(self) -> set[int]:
        """The data pointers of every buffer held (the tests' proof that none moves)."""
        return {t.data_ptr() for lent in self.held.values() for e in lent for t in (e.keys, e.values)}


class StaticLayer(BufferLayer):
    """A `BufferLayer` whose buffers come from a `BufferPool`, and that a compiled step writes
    at the slot in `slot` (a ``[1]`` long tensor): inside `torch.compile`, `update` writes there
    and returns the whole buffers, `get_seq_length` is that slot and the mask spans the whole
    capacity; the caller counts the token in `length` after the step."""

    is_compileable = True

    def __init__(self, pool: BufferPool, slot: torch.Tensor) -> None:
        super().__init__()
        self.pool = pool
        self.slot = slot

    def reserve(self, needed: int, like: torch.Tensor | None = None, exact: bool = False) -> None:
        """Room for `needed` positions: `needed` itself with `exact`, else `bucket(needed)`;
        the buffers come from the pool, and what the layer holds is copied over."""
        if self._k is not None and self.capacity >= needed:
            return
        ref = self._k if self._k is not None else like
        assert ref is not None, "reserve() before the first update needs a tensor to copy the shape from"
        old_k, old_v = self._k, self._v
        self.pool.give_back(self)
        k, v = self.pool.take(self, ref, needed if exact else bucket(needed))
        if old_k is not None and old_v is not None and self.length:
            k[:, :, : self.length] = old_k[:, :, : self.length]
            v[:, :, : self.length] = old_v[:, :, : self.length]
        self._k, self._v = k, v
        self.version += 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling() and self._k is not None and self._v is not None:
            self._k.index_copy_(2, self.slot, key_states)
            self._v.index_copy_(2, self.slot, value_states)
            return self._k, self._v
        return super().update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self) -> Any:
        if torch.compiler.is_compiling():
            return self.slot[0]
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if torch.compiler.is_compiling():
            return self.capacity, 0
        return self.length + query_length, 0


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, except for one query token inside a compiled step of a
    grouped-query model: there its query heads are grouped under their key/value head
    (``[B, kv_heads, groups, D]``) and attend to the cache as it is stored.

    transformers does the same for one token in eager mode but not while dynamo traces, where it
    repeats every key and value head `groups` times (`repeat_kv`): on a static cache that is a
    copy of the whole capacity per layer and step, which costs the compiled step more than its
    fusion saves."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        groups == 1
        or query.shape[2] != 1
        or dropout
        or not torch.compiler.is_compiling()
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sinks"))
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
            **kwargs,
        )  # fmt: skip
    batch, heads, _, dim = query.shape
    grouped = query.reshape(batch, heads // groups, groups, dim)
    mask = attention_mask
    if mask is not None and mask.shape[1] != 1:  # a mask per query head: grouped alike
        mask = mask.reshape(batch, heads // groups, groups, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2).contiguous(), None


def use_decode_attention() -> None:
    """Make `decode_attention` transformers' "sdpa" (process-wide, as transformers registers
    attention): outside a compiled step it is sdpa itself, so every model's eager forward pass is
    unchanged, and a model's own checks for "sdpa" still hold."""
    from chatbot.engine.backends.native import skeleton

    AttentionInterface.register("sdpa", decode_attention)
    skeleton.attention_function = decode_attention  # our own model's layers (a llama GGUF file)


def adopt_static(cache: KVCache, pool: BufferPool, slot: torch.Tensor) -> bool:
    """Swap every layer of `cache` for a `StaticLayer` holding the same keys and values
    (see `chatbot.engine.cache.buffers.adopt_layers`); False where a layer cannot be taken over."""
    return adopt_layers(cache, lambda: StaticLayer(pool, slot), StaticLayer)


COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.TorchDynamoException,)
try:
    from torch._inductor.exc import InductorError

    COMPILE_ERRORS += (InductorError,)
except ImportError:  # pragma: no cover - older torch
    pass


@dataclass
class CompileFigures:
    """What compiling cost so far: one compile per capacity a step met."""

    compiles: int = 0
    compile_s: float = 0.0  # the first step at each capacity (tracing + code generation)
    graph_breaks: int = 0  # with fullgraph=True any break is a failure: 0 or the fallback's 1


class CompiledBackend(HFBackend):
    """transformers' forward pass of one token compiled as one graph, on `StaticLayer` caches.

    Prefill runs eagerly into the same buffers. Should compiling fail (a model dynamo cannot
    trace whole), `failure` says why and the steps run eagerly, with the same results.

    Args:
        model: a transformers causal LM on one device.
        mode: `torch.compile`'s mode (default: ``reduce-overhead`` on CUDA, inductor's
            default elsewhere).
        compiler: `torch.compile`'s backend (default inductor; the tests pass one that
            records the graphs).
    """

    compiled = True

    def __init__(
        self, model: Any, mode: str | None = None, compiler: str | Callable[..., Any] = "inductor"
    ) -> None:
        super().__init__(model)
        on_cuda = self.device.type == "cuda"
        use_decode_attention()
        if mode is None and on_cuda and compiler == "inductor":
            mode = "reduce-overhead"
        self.mode = mode
        self.pool = BufferPool(mark_static=on_cuda)
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # the step's input
        self.slot = torch.zeros(1, dtype=torch.long, device=self.device)  # where it is written
        self.failure: str | None = None
        self.figures = CompileFigures()
        self._compiled_at: set[int] = set()  # the capacities with a compiled step
        self._lock = threading.Lock()
        # a GGUF model's packed products inside the step take 1 thread or torch's count, as
        # the step times say (`packed.graph_threads`); a tuner by the most threads allowed
        self.tuners: dict[int, ThreadTuner] = {}
        # one compile per capacity and per model (a process may hold several): more than
        # dynamo's default of 8 for one function
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._step: Callable[..., torch.Tensor] = torch.compile(
            self._forward_one, fullgraph=True, dynamic=False, mode=self.mode, backend=compiler
        )
        self.sampler = DeviceSampler(self.device, mark_static=on_cuda)
        self._sampling_lock = threading.Lock()
        self._choose: Callable[..., torch.Tensor] = torch.compile(
            choose_token, fullgraph=True, dynamic=False, mode=self.mode, backend=compiler
        )

    def _forward_one(self, ids: torch.Tensor, slot: torch.Tensor, cache: KVCache) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=slot.view(1, 1), cache=cache, use_cache=True)
        return out.logits

    # -- caches ---------------------------------------------------------------------------

    def new_cache(self) -> KVCache:
        cache = full_cache(self.model.config)
        self.adopt(cache)
        return cache

    def adopt(self, cache: KVCache) -> None:
        adopt_static(cache, self.pool, self.slot)

    def _like(self) -> torch.Tensor:
        config = self.model.config.get_text_config(decoder=True)
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        dtype = self.model.get_input_embeddings().weight.dtype
        if not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        return torch.empty(1, heads, 0, head_dim, dtype=dtype, device=self.device)

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        """Room for an attention-sink cache's whole window at once. A growing cache is left to
        grow with what it holds (the bucket of its length, as a prefill or a step needs it):
        room for an answer taken up front would change its capacity, and so compile a step,
        before the cache needs it."""
        self.adopt(cache)
        layers = [layer for layer in cache.layers if isinstance(layer, StaticLayer)]
        if len(layers) != len(cache.layers):
            return  # a cache the static layers could not take over: eager steps
        if not isinstance(cache, SinkCache):
            return
        # the whole window, in a bucket: a pinned system prompt that widens it a little later
        # (`SinkCache.pin`) still fits, with no new buffers and no new compile
        target = bucket(max(needed, cache.capacity))
        if all(layer.capacity >= target for layer in layers):
            return
        like = next((layer.key_buffer for layer in layers if layer.key_buffer is not None), None)
        for layer in layers:
            layer.reserve(target, like=like if like is not None else self._like(), exact=True)

    # -- steps ----------------------------------------------------------------------------

    def step(self, cache: KVCache, token: int) -> torch.Tensor:
        with self._lock:
            self.ids.fill_(int(token))
            return self._run(cache, self.ids)

    def launch(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        """`step` on the token already in `ids` (``[1, 1]`` on the device, written there by
        `choose`): nothing is read back."""
        with self._lock:
            return self._run(cache, ids)

    def _run(self, cache: KVCache, ids: torch.Tensor) -> torch.Tensor:
        self.adopt(cache)
        layers: Sequence[Any] = cache.layers
        if self.failure is not None or not all(isinstance(layer, StaticLayer) for layer in layers):
            return super().step(cache, int(ids))
        length = layers[0].length
        for layer in layers:
            layer.reserve(length + 1)  # full: the next bucket (a new capacity, compiled once)
        self.slot.fill_(length)
        capacity = layers[0].capacity
        first = capacity not in self._compiled_at
        most = cap_threads(torch.get_num_threads()) if self.device.type == "cpu" else 1
        tuner = self.tuners.get(most) or self.tuners.setdefault(most, ThreadTuner(most))
        threads = 1 if first else tuner.pick()
        t0 = time.perf_counter()
        try:
            # the step calls back into Python for each packed product: on a fresh chunk of the
            # frame stack (`chatbot.engine.backends.native.pystack`)
            with packed.graph_threads(threads):
                logits = call_with_room(self._step, ids, self.slot, cache)
        except COMPILE_ERRORS as exc:
            self.failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            self.figures.graph_breaks += 1
            return super().step(cache, int(ids))
        for layer in layers:
            layer.length += 1
        result = logits[0, -1].float().clone()  # a CUDA graph's output is overwritten next replay
        if not first:
            tuner.record(threads, time.perf_counter() - t0)
        else:
            self._compiled_at.add(capacity)
            self.figures.compiles += 1
            self.figures.compile_s += time.perf_counter() - t0
            gc.collect()  # tracing leaves cycles that hold the traced cache's layers (and buffers)
        return result

    # -- the next token on the device (`chatbot.engine.backends.device_sampling`) ----------------------

    @contextlib.contextmanager
    def device_sampling(self) -> Iterator[DeviceSampler | None]:
        """The device sampler for one turn, or None while another turn holds it (a server's
        concurrent requests: that one reads its tokens on the host) or where steps run eagerly."""
        if self.failure is not None or not self._sampling_lock.acquire(blocking=False):
            yield None
            return
        try:
            yield self.sampler
        finally:
            self._sampling_lock.release()

    def choose(self, logits: torch.Tensor, sampler: DeviceSampler) -> torch.Tensor:
        """`choose_token` compiled (one graph per greedy / top-k / top-p kind); ``[token, bad]``."""
        args = (logits, sampler.last, sampler.window, sampler.params, sampler.noise, sampler.next_ids)
        kind = (sampler.greedy, sampler.top_k, sampler.nucleus)
        if self.failure is not None:
            return choose_token(*args, *kind)
        try:
            return call_with_room(self._choose, *args, *kind)
        except COMPILE_ERRORS as exc:
            self.failure = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"
            self.figures.graph_breaks += 1
            return choose_token(*args, *kind)

    def describe(self) -> str:
        if self.failure is not None:
            return f"transformers (compile failed, eager steps: {self.failure})"
        mode = f", mode {self.mode}" if self.mode else ""
        return (
            f"compiled (torch.compile: one step per token on a static cache{mode}; "
            "the next token chosen on the device, read one step late)"
        )
