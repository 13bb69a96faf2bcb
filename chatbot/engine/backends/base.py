"""What runs the model's forward passes, chosen once when the model loads.

A `Backend` makes the growing cache of a conversation, prefills ids into a cache and steps one
token to logits; the generation loop (`chatbot.engine.generate`) calls it and never asks which
one it has. Three implementations:

- `HFBackend`: transformers' forward pass (any model, any device).
- `NativeBackend`: the native CPU kernels (`chatbot.engine.backends.native.decoder.FastDecoder`)
  for the decode steps and short inputs; long prefills go through transformers' forward pass over the packed
  modules.
- `BatchedBackend`: wraps a backend that can step several caches in one call, so that the
  decode steps of generations running in several threads (a server's requests) run together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from chatbot.engine.backends.native.pystack import call_with_room
from chatbot.engine.batch import DecodeBatcher
from chatbot.engine.cache.layers import KVCache
from chatbot.engine.cache.queries import PassQueries


@runtime_checkable
class Backend(Protocol):
    """The forward passes of one loaded model.

    `prefill` and `step` write the new ids' keys and values at the end of `cache` and return
    the float32 logits after the last id (``[vocab]``); the caller has made room in the cache
    first (a bounded cache evicts) and records the ids after.
    """

    model: Any
    max_batch: int  # the most caches `step_batch` takes at once (1: it cannot batch)

    @property
    def compiled(self) -> bool:
        """Decode steps run compiled (`chatbot.engine.backends.compiled`)."""
        ...

    @property
    def decoder(self) -> Any | None:
        """The native kernels' decoder its steps run on (None: transformers' forward pass)."""
        ...

    @property
    def keeps_queries(self) -> bool:
        """Whether `prefill` keeps and continues a pass's queries (see there)."""
        ...

    def new_cache(self) -> KVCache:
        """An empty growing cache of the layers this backend writes."""
        ...

    def adopt(self, cache: KVCache) -> None:
        """Make `cache` (any of ours, possibly made elsewhere) one this backend can write."""
        ...

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        """Give `cache` room for `needed` positions before a prefill (at most `limit`)."""
        ...

    def prefill(self, cache: KVCache, ids: Sequence[int], queries: PassQueries | None = None) -> torch.Tensor:
        """Feed `ids` (one or more) at the end of `cache`; the logits after the last. With
        `queries` (`chatbot.engine.cache.queries`), a prompt's first pass keeps its first
        queries, or the rest of one continues from them; a backend whose forward pass cannot
        (`keeps_queries` False) leaves them untouched."""
        ...

    def prefill_concurrent(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        """`prefill`, safe to run beside `step_batch` in another thread (on another cache)."""
        ...

    def prefill_every(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        """`prefill`, returning the logits after each id (``[len(ids), vocab]``): one pass
        that verifies a speculative draft (`chatbot.engine.speculative`)."""
        ...

    def step(self, cache: KVCache, token: int) -> torch.Tensor:
        """Feed one answer token at the end of `cache`; the logits after it."""
        ...

    def step_batch(
        self, caches: Sequence[KVCache], tokens: Sequence[int], threads: int | None = None
    ) -> torch.Tensor:
        """One token into each cache in one call; the logits after each (``[B, vocab]``)."""
        ...

    def prefilling(self) -> contextlib.AbstractContextManager[None]:
        """Held around a generation's prefill."""
        ...

    def decoding(self) -> contextlib.AbstractContextManager[None]:
        """Held around a generation's decode loop (its `step` calls)."""
        ...

    def device_sampling(self) -> contextlib.AbstractContextManager[Any]:
        """Held around a turn's decode loop: the sampler that chooses its tokens on the device
        (`chatbot.engine.backends.device_sampling.DeviceSampler`), or None where they are chosen on the
        host (every backend but the compiled one, and that one while another turn holds it)."""
        ...

    def describe(self) -> str:
        """One line for the banner, /model and `chatbot doctor`."""
        ...


def full_cache(config: Any) -> Any:
    """transformers' cache for `config`, with full layers where it would make sliding-window
    ones (gemma, mistral): those drop what falls out of the window, and a chat crops its cache
    back (a stop string, /undo, /retry), which they refuse once past the window. A full layer
    keeps every token; the window is still applied, by the attention masks (as llama.cpp keeps
    a full cache by default too). transformers' own cache, since this backend runs its model
    classes, whose configs may ask for layer kinds (linear attention, shared layers) that
    `chatbot.engine.cache.layers` does not have."""
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=config)
    cache.layers = [
        DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers
    ]
    return cache


class HFBackend:
    """transformers' forward pass, on the model's own device.

    Args:
        model: a transformers causal LM (any device map).
    """

    max_batch = 1

    compiled = False
    decoder: Any | None = None

    def __init__(self, model: Any) -> None:
        self.model = model
        self.forward_model = model  # what runs a prefill through transformers
        self.device = model.get_input_embeddings().weight.device

    @property
    def keeps_queries(self) -> bool:
        """Whether the forward pass keeps and continues a pass's queries (our own model's,
        `chatbot.engine.backends.native.skeleton`; not transformers' classes)."""
        return bool(getattr(type(self.forward_model), "keeps_pass_queries", False))

    def new_cache(self) -> KVCache:
        return full_cache(self.model.config)

    def adopt(self, cache: KVCache) -> None:
        return None

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        return None

    def prefill(self, cache: KVCache, ids: Sequence[int], queries: PassQueries | None = None) -> torch.Tensor:
        tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        extra = {"pass_queries": queries} if queries is not None and self.keeps_queries else {}
        # the forward pass's hundreds of Python frames on a fresh chunk of CPython's frame stack
        # (`chatbot.engine.backends.native.pystack`), whatever the caller's depth
        out = call_with_room(
            self.forward_model, input_ids=tensor, cache=cache, use_cache=True, logits_to_keep=1, **extra
        )
        return out.logits[0, -1].float()

    def prefill_concurrent(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        return self.prefill(cache, ids)

    def prefill_every(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        out = call_with_room(
            self.forward_model, input_ids=tensor, cache=cache, use_cache=True, logits_to_keep=0
        )
        return out.logits[0].float()

    def step(self, cache: KVCache, token: int) -> torch.Tensor:
        return self.prefill(cache, (token,))

    def step_batch(
        self, caches: Sequence[KVCache], tokens: Sequence[int], threads: int | None = None
    ) -> torch.Tensor:
        if len(caches) != 1 or len(tokens) != 1:
            raise ValueError("transformers' backend steps one cache at a time")
        return self.step(caches[0], int(tokens[0]))[None]

    def prefilling(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def decoding(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def device_sampling(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # tokens are chosen on the host

    def describe(self) -> str:
        return "transformers (model forward pass)"


class NativeBackend(HFBackend):
    """The native CPU kernels: each decode step is one call of `decoder.decode`; an input of up
    to `decoder.max_batch` ids one batched call of the decode kernels (cheaper than transformers'
    forward pass for a chat turn's message); a longer one transformers' forward pass over the
    packed modules (`decoder.prefill_model`).

    Args:
        model: the model the decoder was made from.
        decoder: a `chatbot.engine.backends.native.decoder.FastDecoder`.
    """

    decoder: Any  # a FastDecoder, never None here

    def __init__(self, model: Any, decoder: Any) -> None:
        super().__init__(model)
        self.decoder = decoder
        # the model as the decoder's prefill runs it (a GGUF model's packed linears taking the
        # decode kernels' int16 inputs)
        self.forward_model = decoder.prefill_model
        self.max_batch = int(decoder.max_batch)

    def new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def adopt(self, cache: KVCache) -> None:
        self.decoder.prepare(cache)

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        self.decoder.reserve(cache, needed, limit=limit)

    def prefill(self, cache: KVCache, ids: Sequence[int], queries: PassQueries | None = None) -> torch.Tensor:
        if queries is not None and (queries.continuing or len(ids) > self.max_batch):
            # the forward pass, as the whole prompt takes it (never the rows of a short one)
            return super().prefill(cache, ids, queries)
        if len(ids) == 1:
            return self.decoder.decode(cache, int(ids[0]))
        return self.prefill_concurrent(cache, ids)

    def prefill_concurrent(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        # `decode` keeps one set of scratch buffers: even one id takes the batched form here
        if len(ids) <= self.max_batch:
            return self.decoder.prefill_rows(cache, [int(i) for i in ids])
        return super().prefill(cache, ids)

    def prefill_every(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) <= self.max_batch:  # the decode kernels' rows: bit for bit their steps
            return self.decoder.prefill_rows(cache, [int(i) for i in ids], every=True)
        return super().prefill_every(cache, ids)

    def step(self, cache: KVCache, token: int) -> torch.Tensor:
        return self.decoder.decode(cache, int(token))

    def step_batch(
        self, caches: Sequence[KVCache], tokens: Sequence[int], threads: int | None = None
    ) -> torch.Tensor:
        return self.decoder.decode_batch(caches, tokens, threads=threads)

    def describe(self) -> str:
        return str(self.decoder.info().label())


class BatchedBackend:
    """Runs the decode steps of generations in several threads as batched steps of `inner`
    (a server's continuous batching: see `chatbot.engine.batch`). The threads take turns on
    `cond`; a prefill lets go of it and runs beside the others' steps.

    Args:
        inner: a backend whose `max_batch` is over 1.

    Raises:
        ValueError: `inner` cannot batch.
    """

    @property
    def compiled(self) -> bool:
        return self.inner.compiled

    @property
    def decoder(self) -> Any | None:
        return self.inner.decoder

    def __init__(self, inner: Backend) -> None:
        if inner.max_batch <= 1:
            raise ValueError(f"{inner.describe()} cannot step several caches at once")
        self.inner = inner
        self.model = inner.model
        self.batcher = DecodeBatcher(inner)
        self.cond = self.batcher.cond
        self.max_batch = self.batcher.max_batch

    def new_cache(self) -> KVCache:
        return self.inner.new_cache()

    def adopt(self, cache: KVCache) -> None:
        self.inner.adopt(cache)

    def reserve(self, cache: KVCache, needed: int, limit: int | None = None) -> None:
        self.inner.reserve(cache, needed, limit)

    @property
    def keeps_queries(self) -> bool:
        return self.inner.keeps_queries

    def prefill(self, cache: KVCache, ids: Sequence[int], queries: PassQueries | None = None) -> torch.Tensor:
        if queries is not None:
            return self.inner.prefill(cache, ids, queries)
        # runs beside the other threads' steps (see `prefilling`)
        return self.inner.prefill_concurrent(cache, ids)

    def prefill_concurrent(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        return self.inner.prefill_concurrent(cache, ids)

    def prefill_every(self, cache: KVCache, ids: Sequence[int]) -> torch.Tensor:
        # (held with `cond`, between two batched steps: the others wait for it)
        return self.inner.prefill_every(cache, ids)

    def step(self, cache: KVCache, token: int) -> torch.Tensor:
        return self.batcher.step(cache, int(token))

    def step_batch(
        self, caches: Sequence[KVCache], tokens: Sequence[int], threads: int | None = None
    ) -> torch.Tensor:
        return self.inner.step_batch(caches, tokens, threads)

    def prefilling(self) -> contextlib.AbstractContextManager[None]:
        return self.batcher.prefilling()

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        self.batcher.join()
        try:
            yield
        finally:
            self.batcher.leave()

    def device_sampling(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # tokens are chosen on the host

    def describe(self) -> str:
        return f"{self.inner.describe()} · batched steps (up to {self.max_batch})"
