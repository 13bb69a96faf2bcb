"""Prefill and decode on a persistent cache: the one generation loop of the project, in two
layers as mlx-lm has it.

- `token_steps` samples answer tokens from a backend, a cache and a sampler, and yields each
  (token, logits); it feeds a token into the cache only when asked for the next one.
- `stream_chunks` turns those into `GenerationChunk`s: incremental text, stop ids and stop
  criteria, the finish reason and the turn's stats.

`Engine.generate` prefills the new ids and joins the two. The model is called with only the
new tokens and the cache; nothing is re-encoded. The cache is a `TrackedCache`: it makes room
*before* each forward pass (a bounded one evicts) and records the ids that entered it after,
so the caller never keeps a list of its own. The backend is chosen once, when the engine is
made; nothing here asks which one it is.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any, cast

import torch

from chatbot.config import SamplingConfig
from chatbot.engine.backends.base import Backend, full_cache
from chatbot.engine.backends.choose import choose_backend
from chatbot.engine.backends.device_sampling import DeviceBackend, DeviceSampler, device_token_steps
from chatbot.engine.cache.buffers import BufferLayer
from chatbot.engine.cache.layers import KVCache, KVLayer, is_plain_layer
from chatbot.engine.cache.queries import PassQueries
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.chunk import GenerationChunk
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.draft_model import DraftModel, ModelDrafter
from chatbot.engine.sampling import LogitsProcessor, Sampler, build_logits_processor
from chatbot.engine.speculative import Drafter, NgramDrafter, draft_token_steps
from chatbot.engine.stats import TurnStats, peak_memory_bytes, synchronize
from chatbot.engine.stop_criteria import StopOnStrings

__all__ = [
    "Engine",
    "GenerationChunk",
    "build_logits_processor",
    "full_cache",
    "stream_chunks",
    "token_steps",
]

# transformers' StoppingCriteria(List) or any callable of the same shape:
# (ids [1, n] incl. the new token, scores [1, vocab]) -> bool or BoolTensor [1]; scores are
# None for tokens chosen on the device (only `StopOnStrings`, which reads none, is asked then).
StopCallback = Callable[[torch.Tensor, torch.Tensor | None], Any]
# Told of each answer token as it is chosen: (the model's raw logits [vocab], the token id).
TokenObserver = Callable[[torch.Tensor, int], None]
ANSWER_ROOM = 1024
"""The most answer tokens a prefill makes room for in the fast path's cache buffers up front
(a longer answer grows them once more)."""
TokenInserter = Callable[[int | None], Sequence[int]]
"""Told of each answer token (None before the first); returns ids to put in the answer next."""


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's special ids (its template's markers: end of turn and the like, and the
    added tokens flagged special), which the repetition penalty never touches."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    return frozenset(int(i) for i in ids)


class Engine:
    """Runs one causal LM: prefill new tokens into a cache, then decode token by token.

    Args:
        model: a transformers causal LM (any device map).
        tokenizer: its tokenizer.
        max_context: the most tokens the cache may hold (the model's trained context).
        decoder: the native CPU kernels' one-token step
            (`chatbot.engine.backends.native.decoder.FastDecoder`): shorthand for
            ``backend=NativeBackend(model, decoder)``.
        backend: what runs the forward passes (`chatbot.engine.backends.base`); default: the
            native kernels with `decoder`, else transformers.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_context: int | None = None,
        decoder: Any | None = None,
        backend: Backend | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.backend: Backend = backend if backend is not None else choose_backend(model, decoder)
        self.device = model.get_input_embeddings().weight.device
        trained = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_context = max_context or trained
        self.special_ids = special_ids(tokenizer)
        self.draft_model: DraftModel | None = None  # `--draft MODEL`: guesses checked in a pass

    def with_backend(self, backend: Backend) -> Engine:
        """This engine's model, tokenizer and context on another backend (e.g. a server's
        batched one); this engine is unchanged."""
        engine = Engine(self.model, self.tokenizer, self.max_context, backend=backend)
        engine.draft_model = self.draft_model
        return engine

    @property
    def compiled(self) -> bool:
        """True when decode steps run compiled (`chatbot.engine.backends.compiled`)."""
        return self.backend.compiled

    @property
    def decoder(self) -> Any | None:
        """The native kernels' decoder the backend runs on (None: transformers runs)."""
        return self.backend.decoder

    # -- caches -----------------------------------------------------------------------

    def new_cache(self, start_size: int | None = None, recent_size: int | None = None) -> TrackedCache:
        """An empty cache for a conversation: a growing one of the backend's layers, or with
        `recent_size` an attention-sink cache keeping `start_size` sinks (default 4) and that
        many recent tokens.

        Raises:
            StreamingUnsupportedError: the model cannot take an attention-sink cache.
        """
        if recent_size is not None:
            cache: KVCache = SinkCache.for_model(
                self.model, 4 if start_size is None else start_size, recent_size
            )
        else:
            cache = self.backend.new_cache()
        return TrackedCache(cache, self.max_context)

    def copy_prefix(self, src: TrackedCache, dst: TrackedCache, n: int) -> bool:
        """Give the empty growing cache `dst` the first `n` ids of `src` (a growing cache
        that evicted nothing): their keys and values copied, not encoded again. They are what
        a prefill of those ids would write (each position's keys depend only on the ids up to
        it). Returns False, changing nothing, where that does not hold: a bounded or
        sliding-window cache, a `dst` that holds ids, `src` holding fewer than `n`.
        """
        if dst.length or dst.is_bounded or src.is_bounded or src.evicted_total or not 0 < n <= src.length:
            return False
        self.backend.adopt(dst.cache)
        layers = (*src.cache.layers, *dst.cache.layers)
        # a buffer layer of any kind (the compiled step's too), or a plain growing one
        if any(not (is_plain_layer(layer) or isinstance(layer, BufferLayer)) for layer in layers):
            return False  # a sliding-window layer keeps only its window: not a prefix
        for have, take in zip(cast(list[KVLayer], src.cache.layers), cast(list[KVLayer], dst.cache.layers)):
            assert have.keys is not None and have.values is not None
            take.update(have.keys[:, :, :n].clone(), have.values[:, :, :n].clone())
        dst.feed(src.ids[:n])
        return True

    def warm_up(self, kv: TrackedCache, sampling: SamplingConfig | None = None) -> None:
        """Compile the decode step where the backend compiles one (`--opt compile`): a token
        prefilled into the empty cache `kv` and one step, then `kv` emptied again (its
        buffers and pin kept), so that the first answer does not wait for the compiler; with
        `sampling`, also the choice of the next token under it. A no-op for other backends,
        or a `kv` that holds tokens."""
        if not self.compiled or kv.length:
            return
        token = next(
            (t for t in (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id) if t is not None), 0
        )
        pinned = kv.pinned
        with torch.inference_mode():
            logits = self.prefill(kv, [int(token)])
            self.step(kv, int(token))
            if sampling is not None:
                with self.backend.device_sampling() as sampler:
                    if sampler is not None:
                        sampler.begin(sampling, [], logits.shape[-1], None, self.model)
                        sampler.draw()
                        cast(DeviceBackend, self.backend).choose(logits, sampler)
        kv.reset()
        kv.pin(pinned)  # (a reset drops the pin of a system prompt to the sinks)

    # -- forward passes -----------------------------------------------------------------

    def _feed(self, kv: TrackedCache, ids: Sequence[int], queries: PassQueries | None = None) -> torch.Tensor:
        """Prefill `ids` after making room for them in the cache; the last position's logits
        (``[vocab]``)."""
        kv.evict_for(len(ids))
        logits = (
            self.backend.prefill(kv.cache, ids, queries) if queries else self.backend.prefill(kv.cache, ids)
        )
        kv.feed(ids)
        return logits

    def step(self, kv: TrackedCache, token: int) -> torch.Tensor:
        """Feed one answer token after making room for it; the logits after it."""
        kv.evict_for(1)
        logits = self.backend.step(kv.cache, token)
        kv.feed((token,))
        return logits  # (the sampler's read of the next token waits for the device)

    @torch.inference_mode()
    def prefill(
        self,
        kv: TrackedCache,
        ids: Sequence[int],
        prefill_chunk: int = 512,
        on_progress: Callable[[int, int], None] | None = None,
        answer: int = 0,
        queries: PassQueries | None = None,
    ) -> torch.Tensor:
        """Feed `ids` into the cache in chunks; return the logits after the last one.

        A bounded cache evicts before each chunk only what that chunk needs, rounded up to
        its eviction block (a slice of at most a quarter of the window, 64 tokens at most);
        nothing is set aside for the answer, whose steps evict a block in turn when they run
        out of room, so the window keeps as much history as fits and re-rotates its keys
        once per block, not once per token. `on_progress` is told (tokens
        done, tokens in all) before the first chunk and after each one. Interrupted, the
        cache holds the chunks that were fed (`TrackedCache.settle` evens out a torn one).
        The backend first gives the cache room for the ids and `answer` tokens after them (at
        most its capacity), so that its buffers are not regrown between the pass's activations.
        `queries` go with the first chunk (`chatbot.engine.cache.queries`): the rest of a prompt
        after a stored start continues its pass in one chunk, whatever its length.
        """
        if not ids:
            raise ValueError("prefill needs at least one token")
        if queries is not None and queries.continuing and len(ids) > kv.chunk_size(prefill_chunk):
            raise ValueError("the rest of a pass after a stored start is one chunk")
        self.backend.reserve(kv.cache, min(kv.capacity, kv.length + len(ids) + answer), limit=kv.capacity)
        step = kv.chunk_size(prefill_chunk)
        logits = None
        if on_progress is not None:
            on_progress(0, len(ids))
        for start in range(0, len(ids), step):
            logits = self._feed(kv, ids[start : start + step], queries if start == 0 else None)
            if on_progress is not None:
                on_progress(min(start + step, len(ids)), len(ids))
        assert logits is not None
        return logits

    def refill_window(self, kv: TrackedCache, ids: Sequence[int], prefill_chunk: int = 512) -> None:
        """Give an emptied bounded cache what it would hold had it taken in all of `ids`:
        the pinned start (sinks, system prompt) is encoded, and the ids up to the last
        `recent_size` are counted as evicted instead of being encoded only to be evicted
        (after /undo or /retry past an eviction, a /load, a new system prompt), so the cost
        is the window, not the whole conversation. The caller feeds the rest as usual.
        """
        recent = kv.recent_size
        if recent is None or kv.seen or len(ids) <= kv.pinned + recent:
            return
        if kv.pinned:
            self.prefill(kv, ids[: kv.pinned], prefill_chunk)
        kv.skip(ids[kv.pinned : len(ids) - recent])

    @torch.inference_mode()
    def generate(
        self,
        kv: TrackedCache,
        new_ids: Sequence[int],
        sampling: SamplingConfig,
        *,
        history_ids: Sequence[int] | None = None,
        stop_ids: Sequence[int] = (),
        prefill_chunk: int = 512,
        generator: torch.Generator | None = None,
        logits_processor: LogitsProcessor | None = None,
        stopping_criteria: StopCallback | None = None,
        observer: TokenObserver | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        insert: TokenInserter | None = None,
        queries: PassQueries | None = None,
    ) -> Generator[GenerationChunk, None, None]:
        """Prefill `new_ids`, then sample an answer token by token.

        Args:
            kv: the conversation's cache; every id fed enters its record.
            new_ids: tokens the conversation gained since the last call.
            sampling: temperature, top-k/p, repetition penalty, limits.
            history_ids: the context of the repetition penalty before `new_ids` (default:
                the ids the cache holds).
            stop_ids: ids that end the answer; they are not fed back into the cache.
            generator: the random generator for sampling (seeded by the caller).
            logits_processor: used instead of the processors built from `sampling`
                (`sampling.greedy` still chooses argmax over sampling).
            stopping_criteria: asked after each answer token, with all ids so far
                (history, new ids and answer, ``[1, n]``) and the scores; a true answer
                ends the turn with "stop". That token stays in the answer (as in
                transformers) and, like the last token of any answer, is not fed.
            observer: told of each answer token (not of a stop id) with the logits it was
                chosen from, before any sampling transform (the server's logprobs).
            on_progress: told (tokens done, tokens in all) as `new_ids` are prefilled.
            insert: told None before the first token, then each answer token; the ids it
                returns are the answer's next tokens, taken as if sampled (a thinking budget
                closes the thinking so).
            queries: the queries the prefill's first pass keeps, or continues from (a stored
                start: `chatbot.engine.cache.queries`).

        Yields:
            GenerationChunk, every `sampling.stream_interval` tokens; the last one carries
            the finish reason and the turn's stats.

        Raises:
            ContextFullError: before any work, when a growing cache cannot take the prompt.
            GrammarError: before any work, when `sampling.output_format` cannot be enforced.
        """
        kv.check_room(len(new_ids))
        if history_ids is None:
            history_ids = list(kv.ids)
        processors: LogitsProcessor = (
            build_logits_processor(sampling, self.special_ids)
            if logits_processor is None
            else logits_processor
        )
        constraint = None
        if sampling.output_format is not None:  # the grammar engine is imported only here
            from chatbot.engine.grammar import JsonConstraint

            constraint = JsonConstraint(self.tokenizer, sampling.output_format)
        context = [*history_ids, *new_ids]
        # a plain turn on a backend that chooses tokens on the device: read one step late
        plain = constraint is None and logits_processor is None and observer is None and insert is None
        plain = plain and (stopping_criteria is None or isinstance(stopping_criteria, StopOnStrings))
        stats = TurnStats(context_tokens=len(new_ids))
        t0 = time.perf_counter()
        with self.backend.prefilling():
            logits = self.prefill(
                kv,
                new_ids,
                prefill_chunk,
                on_progress=on_progress,
                answer=min(sampling.max_new_tokens, ANSWER_ROOM),
                queries=queries,
            )
        synchronize(self.device)
        stats.context_time_s = time.perf_counter() - t0
        on_device = self.backend.device_sampling() if plain else contextlib.nullcontext()
        with self.backend.decoding(), on_device as ahead:
            sampler: Sampler | DeviceSampler
            if ahead is not None:
                ahead.begin(sampling, context, logits.shape[-1], generator, self.model, self.special_ids)
                tokens = device_token_steps(cast(DeviceBackend, self.backend), kv, logits, ahead)
                sampler = ahead
            else:
                sampler = Sampler(
                    sampling, context, processors, generator, self.device, self.model, constraint
                )
                tokens = self._host_token_steps(kv, logits, sampler, sampling, context, insert, stats)
            detok = IncrementalDetokenizer(self.tokenizer)
            finish = lambda: self._cache_stats(kv, stats)
            yield from stream_chunks(tokens, sampler, sampling, detok, stats, t0, set(stop_ids),
                                     stopping_criteria, observer, finish)  # fmt: skip

    def _host_token_steps(
        self,
        kv: TrackedCache,
        logits: torch.Tensor,
        sampler: Sampler,
        sampling: SamplingConfig,
        context: Sequence[int],
        insert: TokenInserter | None,
        stats: TurnStats,
    ) -> Generator[tuple[int, torch.Tensor], None, str]:
        """The answer's tokens chosen on the host: n-gram or draft-model guesses verified a
        pass at a time with `sampling.draft` (not under a grammar, whose state a rejected
        draft would have to undo, nor with an inserter), else one step per token."""
        step = lambda token: self.step(kv, token)
        drafter: Drafter | None = None
        if sampler.constraint is None and insert is None:
            if sampling.draft == "ngram":
                drafter = NgramDrafter(context, sampling.draft_tokens)
            elif sampling.draft == "model" and self.draft_model is not None:
                width = logits.shape[-1]
                drafter = ModelDrafter(self.draft_model, kv, context, sampling.draft_tokens, width)
        if drafter is None:
            return token_steps(step, kv, logits, sampler, insert)
        verify = lambda ids: self._feed_every(kv, ids)
        return draft_token_steps(verify, step, kv, logits, sampler, drafter, stats,
                                 sampling.max_new_tokens)  # fmt: skip

    def _feed_every(self, kv: TrackedCache, ids: Sequence[int]) -> torch.Tensor:
        """Feed `ids` in one pass (the cache has room: nothing is evicted); the logits after
        each (``[len(ids), vocab]``)."""
        assert not kv.would_evict(len(ids)), "a draft's pass must not evict"
        logits = self.backend.prefill_every(kv.cache, ids)
        kv.feed(ids)
        return logits

    def _cache_stats(self, kv: TrackedCache, stats: TurnStats) -> None:
        """The cache's figures at the end of a turn, into its stats."""
        stats.cache_tokens = kv.length
        stats.cache_capacity = kv.capacity
        stats.sinks = kv.start_size
        stats.evicted_total = kv.evicted_total
        stats.peak_memory_bytes = peak_memory_bytes(self.device)


def token_steps(
    step: Callable[[int], torch.Tensor],
    kv: TrackedCache,
    logits: torch.Tensor,
    sampler: Sampler,
    insert: TokenInserter | None = None,
) -> Generator[tuple[int, torch.Tensor], None, str]:
    """The answer's tokens, sampled one by one from the logits after the prompt on.

    Each token is yielded with the logits it was chosen from (``[vocab]``); it is fed into the
    cache (`step`) only when the caller asks for the next one, so the last token of an answer,
    or a stop token, never enters it. Ends (returning "context") when the cache can take no
    more; the caller ends it otherwise (a stop, the length limit). The ids `insert` returns
    are taken next instead of sampled ones.
    """
    queue = list(insert(None)) if insert is not None else []
    while True:
        token = queue.pop(0) if queue else sampler(logits)
        if insert is not None:
            queue.extend(insert(token))
        yield token, logits
        if kv.is_full():
            return "context"
        logits = step(token)


def stream_chunks(
    tokens: Generator[tuple[int, torch.Tensor], None, str],
    sampler: Sampler | DeviceSampler,
    sampling: SamplingConfig,
    detok: IncrementalDetokenizer,
    stats: TurnStats,
    t0: float,
    stop: set[int],
    stopping_criteria: StopCallback | None = None,
    observer: TokenObserver | None = None,
    on_finish: Callable[[], None] | None = None,
) -> Iterator[GenerationChunk]:
    """`token_steps`' tokens as chunks of text every `sampling.stream_interval` tokens, ended
    by a stop id ("stop", the id left out), `stopping_criteria` ("stop", the token kept),
    a complete answer under the sampler's constraint ("stop": the grammar allows nothing
    more), `sampling.max_new_tokens` ("length") or a full cache ("context"). The last chunk carries
    the finish reason and `stats` (filled in here: first-token time, per-token latencies,
    the answer's length; `on_finish` is called to add the caller's figures before the last
    chunk goes out); `stats.context_time_s` is the caller's.
    """
    pending: list[int] = []
    pending_text = ""
    last = t0
    finish = "length"
    try:
        for i, (token, logits) in enumerate(tokens):
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - t0
            else:
                stats.token_latencies_s.append(now - last)
            last = now
            if token in stop:
                finish = "stop"
                break
            if observer is not None:
                observer(logits, token)
            stats.generated_tokens += 1
            sampler.accept(token)
            pending.append(token)
            pending_text += detok.add(token)
            if len(pending) >= sampling.stream_interval:
                yield GenerationChunk(pending_text, tuple(pending))
                pending, pending_text = [], ""
            if sampler.complete:
                finish = "stop"
                break
            if stopping_criteria is not None:  # (scores: None when chosen on the device)
                hit = stopping_criteria(sampler.context, sampler.scores)
                if bool(hit.all()) if isinstance(hit, torch.Tensor) else bool(hit):
                    finish = "stop"
                    break
            if i + 1 == sampling.max_new_tokens:
                break
        else:
            finish = "context"
    finally:
        tokens.close()
    pending_text += detok.flush()
    stats.decode_time_s = sum(stats.token_latencies_s)
    stats.finish_reason = finish
    if on_finish is not None:
        on_finish()
    yield GenerationChunk(pending_text, tuple(pending), finish, stats)
