"""Prefill and decode on a persistent cache: the one generation loop of the project.

The model is called with only the new tokens and the cache; nothing is re-encoded. A cache
that bounds its size (the attention-sink cache) is asked to make room *before* each forward
pass, and the caller learns which physical slice was evicted through `on_evict`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache
from transformers.generation.logits_process import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from chatbot.config import SamplingConfig
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.sampling import TopKTopPLogitsWarper
from chatbot.engine.stats import TurnStats, peak_memory_bytes, synchronize
from chatbot.errors import ContextFullError

EvictCallback = Callable[[int, int], None]
FedCallback = Callable[[Sequence[int]], None]
# transformers' StoppingCriteria(List) or any callable of the same shape:
# (ids [1, n] incl. the new token, scores [1, vocab]) -> bool or BoolTensor [1].
StopCallback = Callable[[torch.Tensor, torch.Tensor], Any]


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

    # -- caches -----------------------------------------------------------------------

    def new_cache(self) -> Cache:
        """A growing cache with one layer per decoder layer (each on its layer's device)."""
        if self.decoder is not None:
            return self.decoder.new_cache()
        return DynamicCache(config=self.model.config)

    @staticmethod
    def cache_length(cache: Cache) -> int:
        return cache.get_seq_length()

    @staticmethod
    def crop(cache: Cache, length: int) -> None:
        """Cut every layer of the cache back to `length` tokens.

        Also repairs a cache left uneven by an interrupted forward pass, where the first
        layers already hold the new tokens and the later ones do not.
        """
        for layer in cache.layers:
            extra = layer.get_seq_length() - length
            if extra > 0:
                layer.crop(-extra)
        if hasattr(cache, "pin"):
            # Let a sink cache pull its pinned region back inside the new length.
            cache.crop(0)

    # -- forward passes -----------------------------------------------------------------

    def _forward(
        self, cache: Cache, ids: torch.Tensor, on_evict: EvictCallback | None, reserve: int = 0
    ) -> torch.Tensor:
        """Run the model on `ids` ([1, n]); return the last position's logits ([vocab])."""
        evict = getattr(cache, "evict_for_space", None)
        if evict is not None:
            removed = evict(ids.shape[1] + reserve)
            if removed is not None and on_evict is not None:
                on_evict(*removed)
        if self.decoder is not None and ids.shape[1] == 1:
            return self.decoder.decode(cache, int(ids[0, 0]))
        out = self.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    def chunk_size(self, cache: Cache, prefill_chunk: int) -> int:
        recent = getattr(cache, "recent_size", None)
        return min(prefill_chunk, recent) if recent else prefill_chunk

    def check_room(self, cache: Cache, n_new: int) -> None:
        """Raise before a prefill that would overflow a growing cache.

        Raises:
            ContextFullError: the conversation plus `n_new` tokens exceeds the context.
        """
        if hasattr(cache, "evict_for_space"):
            return
        used = self.cache_length(cache)
        if used + n_new + 1 > self.max_context:
            raise ContextFullError(
                f"context full ({used} + {n_new} new tokens > {self.max_context}): "
                "/reset, or restart with --enable-streaming"
            )

    @torch.inference_mode()
    def prefill(
        self,
        cache: Cache,
        ids: Sequence[int],
        prefill_chunk: int = 512,
        on_evict: EvictCallback | None = None,
        reserve: int = 0,
        on_fed: FedCallback | None = None,
    ) -> torch.Tensor:
        """Feed `ids` into the cache in chunks; return the logits after the last one.

        `reserve` asks a bounded cache to leave room for that many tokens after the prompt
        (the answer), so that decoding seldom has to evict. `on_fed` is told of each chunk
        once it is in the cache, after any eviction it caused.
        """
        if not ids:
            raise ValueError("prefill needs at least one token")
        if self.decoder is not None:
            self.decoder.prepare(cache)  # the fast path keeps the cache in its own layers
        step = self.chunk_size(cache, prefill_chunk)
        recent = getattr(cache, "recent_size", None)
        tensor = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits = None
        for start in range(0, len(ids), step):
            chunk = tensor[:, start : start + step]
            extra = reserve if start + step >= len(ids) else 0
            if recent:
                extra = max(0, min(extra, recent - chunk.shape[1]))
            logits = self._forward(cache, chunk, on_evict, extra)
            if on_fed is not None:
                on_fed(ids[start : start + step])
        assert logits is not None
        return logits

    @torch.inference_mode()
    def generate(
        self,
        cache: Cache,
        new_ids: Sequence[int],
        sampling: SamplingConfig,
        *,
        history_ids: Sequence[int] = (),
        stop_ids: Sequence[int] = (),
        prefill_chunk: int = 512,
        on_evict: EvictCallback | None = None,
        on_fed: FedCallback | None = None,
        generator: torch.Generator | None = None,
        logits_processor: LogitsProcessorList | None = None,
        stopping_criteria: StopCallback | None = None,
    ) -> Iterator[GenerationChunk]:
        """Prefill `new_ids`, then sample an answer token by token.

        Args:
            cache: the conversation's cache; it already holds `history_ids`.
            new_ids: tokens the conversation gained since the last call.
            sampling: temperature, top-k/p, repetition penalty, limits.
            history_ids: the ids already in the cache (for the repetition penalty).
            stop_ids: ids that end the answer; they are not fed back into the cache.
            on_evict: told of every (start, end) slice a bounded cache drops.
            on_fed: told of the token ids that entered the cache, in order, after any
                eviction that made room for them.
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
        self.check_room(cache, len(new_ids))
        stats = TurnStats(context_tokens=len(new_ids))
        processors = build_logits_processor(sampling) if logits_processor is None else logits_processor
        stop = set(stop_ids)
        detok = IncrementalDetokenizer(self.tokenizer)
        bounded = hasattr(cache, "evict_for_space")

        # Context for the repetition penalty, preallocated for the whole answer.
        seen = torch.empty(
            (1, len(history_ids) + len(new_ids) + sampling.max_new_tokens),
            dtype=torch.long,
            device=self.device,
        )
        n_seen = len(history_ids) + len(new_ids)
        seen[0, :n_seen] = torch.tensor([*history_ids, *new_ids], dtype=torch.long)
        step_input = torch.empty((1, 1), dtype=torch.long, device=self.device)

        t0 = time.perf_counter()
        reserve = min(sampling.max_new_tokens, 256) if bounded else 0
        logits = self.prefill(cache, new_ids, prefill_chunk, on_evict, reserve, on_fed)
        synchronize(self.device)
        stats.context_time_s = time.perf_counter() - t0

        pending: list[int] = []
        pending_text = ""
        last = t0
        finish = "length"
        for i in range(sampling.max_new_tokens):
            scores = processors(seen[:, :n_seen], logits[None]) if processors else logits[None]
            if sampling.greedy:
                token = int(scores.argmax(-1))
            else:
                probs = torch.softmax(scores, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            now = time.perf_counter()
            if i == 0:
                stats.ttft_s = now - t0
            else:
                stats.token_latencies_s.append(now - last)
            last = now
            if token in stop:
                finish = "stop"
                break
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
            if not bounded and self.cache_length(cache) + 1 >= self.max_context:
                finish = "context"
                break
            # Feed the token: only now does it enter the cache.
            step_input[0, 0] = token
            logits = self._forward(cache, step_input, on_evict)
            if on_fed is not None:
                on_fed((token,))
            synchronize(self.device)
        pending_text += detok.flush()
        stats.decode_time_s = sum(stats.token_latencies_s)
        stats.finish_reason = finish
        stats.cache_tokens = self.cache_length(cache)
        stats.cache_capacity = getattr(cache, "capacity", None) or self.max_context
        stats.sinks = getattr(cache, "start_size", 0) if bounded else 0
        stats.evicted_total = getattr(cache, "evicted_total", 0)
        stats.peak_memory_bytes = peak_memory_bytes(self.device)
        yield GenerationChunk(pending_text, tuple(pending), finish, stats)
