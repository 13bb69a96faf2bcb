"""Prefill and decode on a persistent cache: the one generation loop of the project.

The model is called with only the new tokens and the cache; nothing is re-encoded. The cache
is a `TrackedCache`: it makes room *before* each forward pass (a bounded one evicts) and
records the ids that entered it after, so the caller never keeps a list of its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chatbot.config import SamplingConfig
from chatbot.engine.batch import DecodeBatcher
from chatbot.engine.buffer_cache import BufferLayer
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.finite import checked_token, sampled_token
from chatbot.engine.sampling import TopKTopPLogitsWarper
from chatbot.engine.sink_cache import SinkCache
from chatbot.engine.stats import TurnStats, peak_memory_bytes, synchronize
from chatbot.engine.tracked_cache import TrackedCache, track

# transformers' StoppingCriteria(List) or any callable of the same shape:
# (ids [1, n] incl. the new token, scores [1, vocab]) -> bool or BoolTensor [1].
StopCallback = Callable[[torch.Tensor, torch.Tensor], Any]
# Told of each answer token as it is chosen: (the model's raw logits [vocab], the token id).
TokenObserver = Callable[[torch.Tensor, int], None]
ANSWER_ROOM = 1024
"""The most answer tokens a prefill makes room for in the fast path's cache buffers up front
(a longer answer grows them once more)."""


@dataclass(frozen=True)
class GenerationChunk:
    """One piece of a streamed answer.

    `text` is the new text since the previous chunk; `token_ids` the answer tokens it covers
    (a stop token is never among them). The last chunk has `finish_reason` ("stop",
    "length" or "context") and `stats`.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    stats: TurnStats | None = None


def build_logits_processor(sampling: SamplingConfig) -> LogitsProcessorList:
    """transformers' processors for the settings (top-k with top-p fused into one that sorts
    only the k candidates): built once per turn."""
    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0 and sampling.top_p < 1.0:
            # The same filter as TopK then TopP, sorting k candidates instead of the vocabulary.
            processors.append(TopKTopPLogitsWarper(sampling.top_k, sampling.top_p))
        elif sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        elif sampling.top_p < 1.0:
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


def full_cache(config: Any) -> DynamicCache:
    """transformers' cache for `config`, with full layers where it would make sliding-window
    ones (gemma, mistral): those drop what falls out of the window, and a chat crops its cache
    back (a stop string, /undo, /retry), which they refuse once past the window. A full layer
    keeps every token; the window is still applied, by the attention masks (as llama.cpp keeps
    a full cache by default too)."""
    cache = DynamicCache(config=config)
    cache.layers = [
        DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers
    ]
    return cache


class Engine:
    """Runs one causal LM: prefill new tokens into a cache, then decode token by token.

    Args:
        model: a transformers causal LM (any device map).
        tokenizer: its tokenizer.
        max_context: the most tokens the cache may hold (the model's trained context).
        decoder: a one-token step that replaces the model's forward pass while decoding
            (`chatbot.engine.fast.FastDecoder`); prefill stays with the model.
    """

    def __init__(
        self, model: Any, tokenizer: Any, max_context: int | None = None, decoder: Any | None = None
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # A fast one-token step (chatbot.engine.fast.FastDecoder); None: transformers decodes.
        self.decoder = decoder
        self.device = model.get_input_embeddings().weight.device
        trained = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_context = max_context or trained
        # Runs the decode steps of generations in several threads as batched steps (the
        # server's continuous batching); None: each step alone.
        self.batcher: DecodeBatcher | None = None
        self._local = threading.local()

    @property
    def token_observer(self) -> TokenObserver | None:
        """Told of each answer token of `generate` (not of a stop id) with the logits it was
        chosen from, before any sampling transform (the server's logprobs); the caller sets it
        for one answer and clears it after. One per thread: each generation its own."""
        return getattr(self._local, "observer", None)

    @token_observer.setter
    def token_observer(self, observer: TokenObserver | None) -> None:
        self._local.observer = observer

    # -- caches -----------------------------------------------------------------------

    def new_cache(self, start_size: int | None = None, recent_size: int | None = None) -> TrackedCache:
        """An empty cache for a conversation: a growing one, or with `recent_size` an
        attention-sink cache keeping `start_size` sinks (default 4) and that many recent
        tokens. The fast decoder's buffer layers are used when it is on.

        Raises:
            StreamingUnsupportedError: the model cannot take an attention-sink cache.
        """
        if recent_size is not None:
            cache: Cache = SinkCache.for_model(
                self.model, 4 if start_size is None else start_size, recent_size
            )
        elif self.decoder is not None:
            cache = self.decoder.new_cache()
        else:
            cache = full_cache(self.model.config)
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
        if self.decoder is not None:
            self.decoder.prepare(dst.cache)
        plain = (DynamicLayer, BufferLayer)
        if any(type(layer) not in plain for layer in (*src.cache.layers, *dst.cache.layers)):
            return False  # a sliding-window layer keeps only its window: not a prefix
        for have, take in zip(
            cast(list[DynamicLayer], src.cache.layers), cast(list[DynamicLayer], dst.cache.layers)
        ):
            assert have.keys is not None and have.values is not None
            take.update(have.keys[:, :, :n].clone(), have.values[:, :, :n].clone())
        dst.feed(src.ids[:n])
        return True

    def track(self, cache: Cache, assume: Sequence[int] | None = None) -> TrackedCache:
        """The record of a cache a caller passes around (see `tracked_cache.track`)."""
        return track(cache, self.max_context, assume)

    # -- forward passes -----------------------------------------------------------------

    def _forward(self, kv: TrackedCache, ids: Sequence[int], reserve: int = 0) -> torch.Tensor:
        """Run the model on `ids` after making room for them (and `reserve` more) in the
        cache; return the last position's logits (``[vocab]``)."""
        kv.evict_for(len(ids) + reserve)
        if self.batcher is not None and len(ids) == 1 and self._local.__dict__.get("batched"):
            logits = self.batcher.step(kv.cache, int(ids[0]))
        elif self.decoder is not None and len(ids) == 1 and self.batcher is None:
            logits = self.decoder.decode(kv.cache, int(ids[0]))
        elif self.decoder is not None and len(ids) <= self.decoder.max_batch:
            # (with a batcher, a prompt's one token too: this may run beside a batched step,
            # and `decode` is not for two threads at once)
            # a short prompt or a chat turn's message: one batched pass of the decode kernels
            # (the cache as decoding them one by one leaves it) costs less than transformers'
            logits = self.decoder.prefill_rows(kv.cache, [int(i) for i in ids])
        else:
            tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
            out = self.model(input_ids=tensor, cache=kv.cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1].float()
        kv.feed(ids)
        return logits

    @torch.inference_mode()
    def prefill(
        self,
        kv: TrackedCache,
        ids: Sequence[int],
        prefill_chunk: int = 512,
        reserve: int = 0,
        on_progress: Callable[[int, int], None] | None = None,
        answer: int = 0,
    ) -> torch.Tensor:
        """Feed `ids` into the cache in chunks; return the logits after the last one.

        `reserve` asks a bounded cache to leave room for that many tokens after the prompt
        (the answer), so that decoding seldom has to evict. `on_progress` is told (tokens
        done, tokens in all) after each chunk. Interrupted, the cache holds the chunks that
        were fed (`TrackedCache.settle` evens out a torn one). On the fast path the cache's
        buffers are first sized for the ids and `answer` tokens after them (at most the
        cache's capacity), so that they are not regrown between the pass's activations.
        """
        if not ids:
            raise ValueError("prefill needs at least one token")
        if self.decoder is not None:
            # The fast path keeps the cache in its own layers, preallocated.
            needed = min(kv.capacity, kv.length + len(ids) + answer)
            self.decoder.reserve(kv.cache, needed, limit=kv.capacity)
        step = kv.chunk_size(prefill_chunk)
        recent = kv.recent_size
        logits = None
        for start in range(0, len(ids), step):
            chunk = ids[start : start + step]
            extra = reserve if start + step >= len(ids) else 0
            if recent:
                extra = max(0, min(extra, recent - len(chunk)))
            logits = self._forward(kv, chunk, extra)
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
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StopCallback | None = None,
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

        Yields:
            GenerationChunk, every `sampling.stream_interval` tokens; the last one carries
            the finish reason and the turn's stats.

        Raises:
            ContextFullError: before any work, when a growing cache cannot take the prompt.
        """
        kv.check_room(len(new_ids))
        if history_ids is None:
            history_ids = list(kv.ids)
        stats = TurnStats(context_tokens=len(new_ids))
        processors = build_logits_processor(sampling) if logits_processor is None else logits_processor
        stop = set(stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer)

        # Context for the repetition penalty, preallocated for the whole answer.
        seen = torch.empty(
            (1, len(history_ids) + len(new_ids) + sampling.max_new_tokens),
            dtype=torch.long,
            device=self.device,
        )
        n_seen = len(history_ids) + len(new_ids)
        seen[0, :n_seen] = torch.tensor([*history_ids, *new_ids], dtype=torch.long)

        t0 = time.perf_counter()
        reserve = min(sampling.max_new_tokens, 256) if kv.is_bounded else 0
        answer = min(sampling.max_new_tokens, ANSWER_ROOM)
        batcher = self.batcher
        # with a batcher (a server), beside the steps of the generations decoding
        with batcher.prefilling() if batcher is not None else contextlib.nullcontext():
            logits = self.prefill(kv, new_ids, prefill_chunk, reserve, answer=answer)
        synchronize(self.device)
        stats.context_time_s = time.perf_counter() - t0

        if batcher is not None:
            batcher.join()
            self._local.batched = True
        try:
            yield from self._decode_loop(kv, sampling, logits, seen, n_seen, processors, generator,
                                         stop, detok, stats, t0, stopping_criteria)  # fmt: skip
        finally:
            if batcher is not None:
                self._local.batched = False
                batcher.leave()

    def _decode_loop(
        self,
        kv: TrackedCache,
        sampling: SamplingConfig,
        logits: torch.Tensor,
        seen: torch.Tensor,
        n_seen: int,
        processors: LogitsProcessorList,
        generator: torch.Generator | None,
        stop: set[int],
        detok: IncrementalDetokenizer,
        stats: TurnStats,
        t0: float,
        stopping_criteria: StopCallback | None,
    ) -> Generator[GenerationChunk, None, None]:
        """Sample the answer from the prefill's `logits` on (see `generate`)."""
        pending: list[int] = []
        pending_text = ""
        last = t0
        finish = "length"
        for i in range(sampling.max_new_tokens):
            context = cast(torch.LongTensor, seen[:, :n_seen])
            scores = processors(context, logits[None]) if processors else logits[None]
            if sampling.greedy:  # (the chosen token's logit is tested as it is read: free)
                token = checked_token(logits, scores.argmax(-1), self.model)
            else:
                token = sampled_token(logits, scores, generator, self.model)
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - t0
            else:
                stats.token_latencies_s.append(now - last)
            last = now
            if token in stop:
                finish = "stop"
                break
            if self.token_observer is not None:
                self.token_observer(logits, token)
            stats.generated_tokens += 1
            seen[0, n_seen] = token
            n_seen += 1
            pending.append(token)
            pending_text += detok.add(token)
            if len(pending) >= sampling.stream_interval:
                yield GenerationChunk(pending_text, tuple(pending))
                pending, pending_text = [], ""
            if stopping_criteria is not None:
                hit = stopping_criteria(seen[:, :n_seen], scores)
                if bool(hit.all()) if isinstance(hit, torch.Tensor) else bool(hit):
                    finish = "stop"
                    break
            if i + 1 == sampling.max_new_tokens:
                break
            if kv.is_full():
                finish = "context"
                break
            # Feed the token: only now does it enter the cache.
            logits = self._forward(kv, (token,))
            synchronize(self.device)
        pending_text += detok.flush()
        stats.decode_time_s = sum(stats.token_latencies_s)
        stats.finish_reason = finish
        stats.cache_tokens = kv.length
        stats.cache_capacity = kv.capacity
        stats.sinks = kv.start_size
        stats.evicted_total = kv.evicted_total
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        yield GenerationChunk(pending_text, tuple(pending), finish, stats)
