"""TinyChat (mit-han-lab/llm-awq ``stream_gen``): `StreamGenerator` on a persistent cache per
model, on our engine."""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from chatbot.compat._common import (
    CompatArgumentError,
    NoText,
    check_model,
    check_range,
    check_text,
    check_tokenizer,
    token_id,
)
from chatbot.compat.records import track
from chatbot.config import MAX_TOKENS, Range, SamplingConfig
from chatbot.engine.cache.layers import AnyCache
from chatbot.engine.cache.tracked import TrackedCache
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.generate import Engine
from chatbot.engine.stops import StopStrings
from chatbot.errors import ConfigError

_RANGES = {k: v for k, v in SamplingConfig.RANGES.items() if isinstance(v, Range)}  # the numeric ones

# TinyChat models own their KV cache; ours live here, one per model.
PERSISTENT: weakref.WeakKeyDictionary[Any, AnyCache] = weakref.WeakKeyDictionary()


# --- TinyChat: StreamGenerator -------------------------------------------------------------


@dataclass(frozen=True)
class _GenParams:
    temp: float
    top_k: int
    top_p: float
    repeat_penalty: float
    n_predict: int
    n_vocab: int

    @classmethod
    def read(cls, params: Any, vocab: int) -> _GenParams:
        """From TinyChat's AttributeDict, a plain dict or any object with the fields (None:
        TinyChat's defaults), each checked. TinyChat's meanings are kept: a temp or top_p
        of 0 is greedy, a top_k <= 0 the whole vocabulary, a repeat_penalty up to 1 none.

        Raises:
            CompatArgumentError: a value of the wrong kind or outside its range, named.
        """

        def get(key: str, default: Any, allowed: Range) -> Any:
            value = params.get(key, default) if isinstance(params, Mapping) else getattr(params, key, default)
            return check_range("StreamGenerator", f"gen_params {key}", value, allowed)

        return cls(
            temp=get("temp", 0.7, _RANGES["temperature"]),
            top_k=get("top_k", 40, Range(int, -MAX_TOKENS, MAX_TOKENS)),
            top_p=get("top_p", 0.95, Range(float, 0.0, 1.0)),
            repeat_penalty=get("repeat_penalty", 1.1, Range(float, 0.0, _RANGES["repetition_penalty"].high)),
            n_predict=get("n_predict", 512, _RANGES["max_new_tokens"]),
            n_vocab=get("n_vocab", vocab, Range(int, 1, MAX_TOKENS)),
        )

    def sampling(self) -> SamplingConfig:
        """TinyChat's rules: greedy for a tiny temp or top_p, top_k <= 0 means the whole
        vocabulary, the repetition penalty only above 1.

        Raises:
            CompatArgumentError: a value outside the ranges the engine accepts.
        """
        greedy = self.temp < 1e-5 or self.top_p < 1e-8
        try:
            return SamplingConfig(
                temperature=0.0 if greedy else self.temp,
                top_p=1.0 if greedy else min(self.top_p, 1.0),
                top_k=0 if self.top_k <= 0 or self.top_k >= self.n_vocab else self.top_k,
                repetition_penalty=max(1.0, self.repeat_penalty),
                max_new_tokens=self.n_predict,
                stream_interval=1,
            ).validated()
        except ConfigError as exc:
            raise CompatArgumentError(f"StreamGenerator: gen_params {exc}") from None


def persistent_cache(model: Any) -> AnyCache:
    """The cache `StreamGenerator` keeps for `model` (a new `DynamicCache` the first time;
    the `SinkCache` after `enable_streaming_llm`)."""
    cache = PERSISTENT.get(model)
    if cache is None:
        cache = Engine(model, NoText()).new_cache().cache
        PERSISTENT[model] = cache
    return cache


def reset_persistent_cache(model: Any) -> None:
    """Forget `model`'s persistent cache: the next `StreamGenerator` starts a `DynamicCache`."""
    PERSISTENT.pop(model, None)


def _rewind_to(kv: TrackedCache, start_pos: int) -> None:
    """Cut the persistent cache back to its first `start_pos` tokens (counting evicted ones).

    Raises:
        ValueError: `start_pos` is negative, beyond what the cache holds, or inside a part
            the sink cache has already evicted.
    """
    held = len(kv.seen)
    if start_pos < 0 or start_pos > held:
        raise ValueError(
            f"start_pos={start_pos}, but the model's cache holds {held} tokens: pass 0 to start "
            "over, or the sum of the earlier calls' timing['total_tokens']"
        )
    if held - start_pos > kv.rewindable():
        raise ValueError(f"cannot go back to start_pos={start_pos}: those tokens were evicted")
    kv.crop_to(start_pos)


class _StopFlag:
    """A stopping criterion the consumer of the engine's chunks sets: the engine yields each
    token before it asks, so the consumer decides on the token it has just seen."""

    def __init__(self) -> None:
        self.stopped = False

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor | None) -> bool:
        return self.stopped


def StreamGenerator(
    model: Any,
    tokenizer: Any,
    input: str,
    start_pos: int,
    gen_params: Any,
    device: Any = None,
    stream_interval: int = 2,
    echo: bool = False,
    stop_token_ids: Sequence[int] = (),
    chunk_prefilling: bool = False,
    quant_llm: bool = False,
    *,
    stop_strings: Sequence[str] = (),
) -> Iterator[dict[str, Any]]:
    """Stream an answer on the model's persistent cache, like TinyChat's `StreamGenerator`.

    `start_pos` is how many tokens of the conversation the model's cache already holds:
    0 starts over; after each call, ``start_pos += event["timing"]["total_tokens"]``
    continues the same conversation, feeding only `input`. A smaller `start_pos` cuts the
    cache back first. Unlike the original, the token that ends the answer (a stop token, the
    last token of a stop string, or the last token of a long answer) is fed back into the
    cache, so the cache holds the whole answer and the next turn follows it directly.

    Args:
        model: a transformers causal LM.
        tokenizer: its tokenizer.
        input: the text to feed (the whole prompt, or just the new turn).
        start_pos: tokens of the model's cache to keep.
        gen_params: ``temp``, ``top_k`` (<= 0: all), ``top_p``, ``repeat_penalty`` (applied
            above 1 over this call's tokens), ``n_predict`` (most new tokens), ``n_vocab``;
            a dict or TinyChat's AttributeDict.
        device: accepted for compatibility; the model's own device is used.
        stream_interval: yield after the 1st answer token and every `stream_interval`-th
            after it.
        echo: the text includes the input.
        stop_token_ids: ids that end the answer, besides the tokenizer's eos (never changed);
            one outside the vocabulary cannot occur and is ignored (TinyChat's prompters pass
            Qwen's 151645 whatever the model).
        chunk_prefilling: with ``start_pos > 0``, `input` continues the conversation and gets
            no BOS token (the original dropped its first token, BOS or not).
        quant_llm: accepted for compatibility; quantization is chosen when loading.
        stop_strings: texts that end the answer; they are cut from the text, and text that
            might be the start of one is held back until it is resolved.

    Yields:
        Dicts with ``text`` (the answer so far, or input + answer with `echo`, special tokens
        skipped), ``usage`` (``prompt_tokens``, ``completion_tokens``, ``total_tokens``),
        ``finish_reason`` (None, then "stop" or "length") and ``timing`` (None, then
        ``context_tokens``, ``context_time``, ``total_tokens``: the tokens this call added to
        the cache, and ``generation_time_list``: seconds per answer token after the first,
        our own work only, not the caller's time between two dicts).

    Raises:
        ValueError: `start_pos` does not match the cache.
        CompatArgumentError: no model or tokenizer, input that is not text, `start_pos` or a
            stop token id that is not an integer, `stream_interval` < 1, or `gen_params`
            of the wrong kind or out of range (temp 0 to 100, top_p 0 to 1, n_predict >= 1).
        ContextFullError: the input does not fit the model's context.
    """
    del device, quant_llm
    check_model(model, "StreamGenerator")
    check_tokenizer(tokenizer, "StreamGenerator")
    check_text(input, "input", "StreamGenerator")
    start_pos = token_id(start_pos, "start_pos", "StreamGenerator", "an integer (a token count)")
    stream_interval = check_range("StreamGenerator", "stream_interval", stream_interval)
    stop_ids = [token_id(t, f"stop_token_ids[{i}]", "StreamGenerator") for i, t in enumerate(stop_token_ids)]
    engine = Engine(model, tokenizer)
    sampling = _GenParams.read(gen_params, len(tokenizer)).sampling()
    kv = track(persistent_cache(model), engine.max_context)
    _rewind_to(kv, start_pos)
    add_bos = not (chunk_prefilling and start_pos > 0)
    input_ids = list(tokenizer(input, add_special_tokens=add_bos)["input_ids"])
    if not input_ids:
        raise ValueError("input is empty")
    stop = set(stop_ids)
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    stops = StopStrings(stop_strings)
    yield from _generate(engine, kv, input_ids, sampling, stop, stops, stream_interval, echo)


def _generate(
    engine: Engine,
    kv: TrackedCache,
    input_ids: list[int],
    sampling: SamplingConfig,
    stop: set[int],
    stops: StopStrings,
    stream_interval: int,
    echo: bool,
) -> Iterator[dict[str, Any]]:
    """`StreamGenerator`'s dicts for `input_ids` fed on `kv` (already cut back to its start):
    the answer ends at a token of `stop`, a stop string of `stops` or `max_new_tokens`; the
    token that ends it is fed back into the cache, unless the context is full."""
    tokenizer = engine.tokenizer
    flag = _StopFlag()
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    answer: list[int] = []  # answer tokens, the stop token excluded
    generated: list[int] = []  # every sampled token, for feeding the last one back
    cut = False  # a stop string ended the answer
    seen_before = len(kv.seen)

    def text(final: bool) -> str:
        shown = stops.visible(detok.text, final)
        if not echo:
            return shown
        full = tokenizer.decode(input_ids + answer, skip_special_tokens=True)
        return full[: len(full) - (len(detok.text) - len(shown))]

    def usage() -> dict[str, int]:
        return {
            "prompt_tokens": len(input_ids),
            "completion_tokens": len(answer),
            "total_tokens": len(input_ids) + len(answer),
        }

    # Per-token times count only our own work, as TinyChat's do: the time this generator
    # sits suspended at a yield (the caller's time) is taken off the clock.
    paused = 0.0
    last_token_at: float | None = None
    generation_times: list[float] = []

    stats = None
    for chunk in engine.generate(kv, input_ids, sampling, history_ids=(), stopping_criteria=flag):
        for token in chunk.token_ids:
            now = time.perf_counter() - paused
            if last_token_at is not None:
                generation_times.append(now - last_token_at)
            last_token_at = now
            i = len(generated)
            generated.append(token)
            if token in stop:
                flag.stopped = True
                break
            answer.append(token)
            detok.add(token)
            if stops and stops.find(detok.text) >= 0:
                cut = True
                flag.stopped = True
                break
            if i % stream_interval == 0 and i + 1 < sampling.max_new_tokens:
                suspended_at = time.perf_counter()
                yield {"text": text(False), "usage": usage(), "finish_reason": None, "timing": None}
                paused += time.perf_counter() - suspended_at
        if chunk.stats is not None:
            stats = chunk.stats
    assert stats is not None  # the engine's last chunk carries them
    detok.flush()
    if generated and stats.finish_reason != "context":
        engine.prefill(kv, generated[-1:])
    cut = cut or stops.find(detok.text) >= 0
    yield {
        "text": text(True),
        "usage": usage(),
        "finish_reason": "stop" if flag.stopped or cut else "length",
        "timing": {
            "context_tokens": stats.context_tokens,
            "context_time": stats.context_time_s,
            "total_tokens": len(kv.seen) - seen_before,
            "generation_time_list": generation_times,
        },
    }
