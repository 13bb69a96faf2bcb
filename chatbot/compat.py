"""The three published streaming APIs, as thin adapters over our engine.

- ColossalAI (Colossal-LLaMA ``stream_chat_patch``): `get_prompt_template`, `streaming_chat`,
  `stream_generate`.
- TinyChat (mit-han-lab/llm-awq ``stream_gen``): `StreamGenerator`.
- StreamingLLM (mit-han-lab/streaming-llm): `enable_streaming_llm`, `StartRecentKVCache`, and
  the helpers its example scripts import (`load_jsonl`, `download_url`, `parse_args`).

None of them has a decoding loop of its own: each drives `Engine.generate` (and
`Engine.prefill` to top up a cache) on the engine's cache classes, a `DynamicCache` or our
`SinkCache`, exactly as the CLI does. The originals' known faults are fixed and listed in
docs/api.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import urllib.request
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, DynamicLayer
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from chatbot.config import SamplingConfig
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.generate import Engine
from chatbot.engine.seq import common_prefix
from chatbot.engine.sink_cache import SinkCache
from chatbot.models.templates import held_back

__all__ = [
    "StartRecentKVCache",
    "StreamGenerator",
    "download_url",
    "enable_streaming_llm",
    "get_prompt_template",
    "load_jsonl",
    "parse_args",
    "persistent_cache",
    "reset_persistent_cache",
    "stream_generate",
    "streaming_chat",
]

DEFAULT_ROLES = ("", "Human", "Assistant")

# Every id each cache has taken in through these adapters, in order (evicted ones too): a
# caller who passes the cache back with the whole sequence, as transformers' API has it,
# gets only the part the cache has not seen fed, even after an edit in the middle.
_FED: weakref.WeakKeyDictionary[Cache, list[int]] = weakref.WeakKeyDictionary()


@dataclass
class _ChatRecord:
    """What `streaming_chat` left in a cache: the prompt text so far and its token ids
    (the last answer token may still be waiting to be fed)."""

    text: str
    ids: list[int] = field(default_factory=list)


_CHATS: weakref.WeakKeyDictionary[Cache, _ChatRecord] = weakref.WeakKeyDictionary()

# TinyChat models own their KV cache; ours live here, one per model.
_PERSISTENT: weakref.WeakKeyDictionary[Any, Cache] = weakref.WeakKeyDictionary()


class _NoText:
    """Stands in for a tokenizer where only ids are wanted (`stream_generate` without one)."""

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return ""


# --- shared helpers -----------------------------------------------------------------------


def _rewindable(cache: Cache, length: int) -> int:
    """How many tokens can be cut from the tail of `cache` and give a prefix of what it saw.

    After an eviction the pinned head and the recent tail are all that is left: only the
    unpinned tail can go.
    """
    if getattr(cache, "evicted_total", 0):
        return max(0, length - int(getattr(cache, "pinned", 0)))
    return length


def _sync_cache(engine: Engine, cache: Cache, ids: Sequence[int]) -> int:
    """Make `cache` hold a prefix of `ids`, reusing as much as it can.

    A cache these adapters have filled is compared with `ids` token by token and cut back
    to the common prefix; a cache they do not know is taken to hold ``ids[:length]``, as
    transformers assumes. At least one id is always left to feed.

    Returns:
        How many leading ids the cache already holds (feed ``ids[start:]``).

    Raises:
        ValueError: an unknown cache holds more tokens than `ids`.
    """
    length = engine.cache_length(cache)
    held = length + int(getattr(cache, "evicted_total", 0))
    fed = _FED.get(cache)
    if fed is not None and len(fed) != held:
        fed = None  # the cache was used elsewhere since: our record is stale
    if fed is None:
        if held > len(ids):
            raise ValueError(
                f"the cache holds {held} tokens but input_ids has only {len(ids)}; pass the "
                "whole conversation, or a new cache"
            )
        fed = list(ids[:held])
    keep = min(common_prefix(fed, ids), len(ids) - 1)
    drop = len(fed) - keep
    if drop > _rewindable(cache, length):
        # The tokens to cut were evicted long ago: start over (a sink cache re-streams).
        cache.reset()
        keep, fed = 0, []
    elif drop:
        engine.crop(cache, length - drop)
        del fed[keep:]
    _FED[cache] = fed
    return keep


def _settle(engine: Engine, cache: Cache) -> None:
    """After a run was abandoned, cut a cache left uneven back to what it really holds."""
    fed = _FED.get(cache)
    if fed is not None and not getattr(cache, "evicted_total", 0):
        engine.crop(cache, len(fed))


def _single_row(input_ids: Any, attention_mask: Any = None) -> list[int]:
    """The token ids of a one-row batch, with padding (mask 0) removed wherever it sits."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"one sequence at a time: input_ids has shape {tuple(ids.shape)}, expected [1, n]")
    row = ids[0].tolist()
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).reshape(-1).tolist()
        row = [t for t, m in zip(row, mask) if m]
    if not row:
        raise ValueError("input_ids is empty")
    return [int(t) for t in row]


# --- ColossalAI: stream_chat_patch ----------------------------------------------------------


def get_prompt_template(
    input_query: str,
    history: Sequence[Mapping[str, Any]] | None = None,
    roles: Sequence[str] = DEFAULT_ROLES,
) -> str:
    """The Colossal-LLaMA chat prompt for a new query after `history`.

    Args:
        input_query: the user's message (stripped).
        history: past messages, ``{"role": ..., "message": ...}``; a message whose role is
            ``roles[0]`` is the system text.
        roles: (system, user, assistant) names.

    Returns:
        ``"<s>{system}\\n\\n"`` for the system message, ``"{role}: <s>{message}</s>"`` for each
        other message, then ``"{user}: <s>{query}</s>{assistant}: <s>"``.
    """
    system_role, user_role, assistant_role = roles[0], roles[1], roles[2]
    messages = [*(history or []), {"role": user_role, "message": input_query.strip()}]
    parts: list[str] = []
    for item in messages:
        role, message = item.get("role"), item.get("message")
        if role == system_role:
            parts.append(f"<s>{message}\n\n")
        elif message:
            parts.append(f"{role}: <s>{message}</s>")
        else:
            parts.append(f"{role}: <s>")
    parts.append(f"{assistant_role}: <s>")
    return "".join(parts)


def stream_generate(
    model: Any,
    input_ids: Any,
    generation_config: Any = None,
    logits_processor: LogitsProcessorList | None = None,
    stopping_criteria: StoppingCriteriaList | None = None,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None = None,
    return_past_key_values: bool = False,
    **kwargs: Any,
) -> Iterator[Any]:
    """Yield the growing sequence, one token at a time, like Colossal-LLaMA's `stream_generate`.

    The generation config (the model's by default, updated with `kwargs`) is honoured with
    transformers' own processors and stopping criteria: temperature, top-k/p, repetition
    penalty, bad words, min/max new tokens, eos ids, stop strings (pass ``tokenizer=``) and
    the rest. Beam settings are ignored, as in the original: this samples or takes argmax.

    Args:
        model: a transformers causal LM.
        input_ids: ``[1, n]`` ids, the whole sequence so far (one row; padding is dropped
            using ``attention_mask``, so no padding side is required).
        generation_config: a `GenerationConfig` (copied, never changed).
        logits_processor: extra processors, merged as `generate` does.
        stopping_criteria: extra criteria, merged as `generate` does.
        prefix_allowed_tokens_fn: constrains each step, as in `generate`.
        return_past_key_values: also yield the cache.
        **kwargs: generation-config fields (``max_new_tokens``, ``do_sample``, ...), and
            ``past_key_values`` (or ``cache``): a cache to continue; it is updated in place and
            only the ids it does not hold yet are fed. Also ``attention_mask``,
            ``tokenizer``, ``generator`` (a seeded `torch.Generator`).

    Yields:
        ``[1, n + k]`` ids after each new token (the eos included, as in transformers), or
        ``(ids, cache)``. The last token is not in the cache yet; the next call feeds it.

    Raises:
        TypeError: for a keyword that is neither a generation setting nor one of the above.
        ValueError: for a batch of more than one sequence.
        ContextFullError: the prompt does not fit a growing cache.
    """
    cache = kwargs.pop("past_key_values", None)
    alt_cache = kwargs.pop("cache", None)
    cache = cache if cache is not None else alt_cache
    attention_mask = kwargs.pop("attention_mask", None)
    tokenizer = kwargs.pop("tokenizer", None)
    generator = kwargs.pop("generator", None)
    ids = _single_row(input_ids, attention_mask)

    # transformers' private builders (pinned to 5.24) give the exact config, processors and
    # criteria that `generate` would use: the model's defaults filled in, then `kwargs`.
    config, unused = model._prepare_generation_config(generation_config, **kwargs)
    unused = {k: v for k, v in unused.items() if k not in ("output_attentions", "output_hidden_states")}
    if unused:
        raise TypeError(f"stream_generate() got unexpected keyword arguments: {', '.join(sorted(unused))}")
    if config.max_new_tokens is not None:
        config.max_length = len(ids) + config.max_new_tokens
    max_new = max(1, config.max_length - len(ids))

    engine = Engine(model, tokenizer if tokenizer is not None else _NoText())
    if cache is None:
        cache = engine.new_cache()
    elif not isinstance(cache, Cache):
        raise TypeError(
            "past_key_values must be a transformers Cache (DynamicCache, or the SinkCache of "
            f"enable_streaming_llm); got {type(cache).__name__} (tuples are gone in transformers v5)"
        )
    out_device = input_ids.device if isinstance(input_ids, torch.Tensor) else engine.device

    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=engine.device, batch_size=1)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=len(ids),
        encoder_input_ids=torch.tensor([ids], device=engine.device),
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=engine.device,
    )
    criteria = model._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    sampling = SamplingConfig(
        temperature=1.0 if config.do_sample else 0.0,  # the processors do the rest
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=max_new,
        stream_interval=1,
    )

    start = _sync_cache(engine, cache, ids)
    fed = _FED[cache]
    sequence = list(ids)
    chunks = engine.generate(
        cache,
        ids[start:],
        sampling,
        history_ids=ids[:start],
        on_fed=fed.extend,
        generator=generator,
        logits_processor=processors,
        stopping_criteria=criteria,
    )
    try:
        for chunk in chunks:
            if not chunk.token_ids:
                continue
            sequence.extend(chunk.token_ids)
            out = torch.tensor([sequence], dtype=torch.long, device=out_device)
            yield (out, cache) if return_past_key_values else out
    finally:
        chunks.close()
        _settle(engine, cache)


def streaming_chat(
    model: Any,
    tokenizer: Any,
    input_query: str,
    history: Sequence[Mapping[str, Any]] | None = None,
    roles: Sequence[str] = DEFAULT_ROLES,
    past_key_values: Cache | None = None,
    temperature: float = 0.8,
    top_p: float = 0.95,
    top_k: int = 50,
    do_sample: bool = True,
    length_penalty: float = 1.2,
    max_new_tokens: int = 512,
    logits_processor: LogitsProcessorList | None = None,
    return_past_key_values: bool = False,
    **kwargs: Any,
) -> Iterator[tuple[Any, ...]]:
    """Stream an answer to `input_query`, like Colossal-LLaMA's `streaming_chat`.

    The prompt is `get_prompt_template(input_query, history, roles)`; the answer ends at the
    tokenizer's eos token. With the cache of an earlier call (``past_key_values``) and the
    history it yielded, only the new text is encoded and prefilled: the cache already holds
    the conversation, the earlier answers exactly as the model wrote them.

    Args:
        model: a transformers causal LM.
        tokenizer: its tokenizer. Any padding side works: one conversation is one row, never
            padded, so the original's left-padding requirement does not apply.
        input_query: the user's message.
        history: earlier messages (not changed; a copy with the new exchange is yielded).
        roles: (system, user, assistant) names.
        past_key_values: a cache from an earlier call (or any `Cache` holding a prefix of
            this prompt); None starts a new `DynamicCache`.
        temperature: sampling temperature (with `do_sample`).
        top_p: nucleus sampling threshold (with `do_sample`).
        top_k: top-k filter (with `do_sample`).
        do_sample: sample; False takes the most likely token.
        length_penalty: accepted for compatibility; it only affects beam search, which this
            (like the original) never runs.
        max_new_tokens: the most answer tokens.
        logits_processor: extra transformers logits processors.
        return_past_key_values: also yield the cache, to pass to the next call.
        **kwargs: more generation-config fields (e.g. ``repetition_penalty``,
            ``eos_token_id``) and ``generator``.

    Yields:
        ``(response, history)`` or ``(response, history, cache)`` after each token:
        `response` is the answer so far (cumulative, eos excluded), `history` has the new
        user message and the answer so far (stripped) as its last two entries.
    """
    del length_penalty  # beam search only
    engine = Engine(model, tokenizer)
    cache = past_key_values if past_key_values is not None else engine.new_cache()
    prompt = get_prompt_template(input_query, history, roles)
    new_history = [dict(item) for item in history or []]
    new_history.append({"role": roles[1], "message": input_query.strip()})
    assistant = {"role": roles[2], "message": None}
    new_history.append(assistant)

    record = _CHATS.get(cache)
    fed = _FED.get(cache)
    continues = record is not None and fed is not None and record.ids[: len(fed)] == fed
    if record is not None and continues and prompt.startswith(record.text):
        rest = prompt[len(record.text) :]
        ids = record.ids + list(tokenizer(rest, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(prompt)["input_ids"])

    eos = tokenizer.eos_token_id
    settings: dict[str, Any] = {"do_sample": do_sample, "max_new_tokens": max_new_tokens}
    if do_sample:
        settings.update(temperature=temperature, top_p=top_p, top_k=top_k)
    if eos is not None:
        settings["eos_token_id"] = [eos]
    settings.update(kwargs)
    stop_ids = settings.get("eos_token_id")
    stop = {stop_ids} if isinstance(stop_ids, int) else set(stop_ids or ())

    detok = IncrementalDetokenizer(tokenizer)
    answer: list[int] = []
    started = False

    def event() -> tuple[Any, ...]:
        assistant["message"] = detok.text.strip()
        return (detok.text, new_history, cache) if return_past_key_values else (detok.text, new_history)

    try:
        for out in stream_generate(
            model,
            torch.tensor([ids], dtype=torch.long),
            logits_processor=logits_processor,
            past_key_values=cache,
            tokenizer=tokenizer,
            **settings,
        ):
            started = True
            token = int(out[0, -1])
            if token not in stop:
                answer.append(token)
                detok.add(token)
            yield event()
        if detok.flush():
            yield event()
    finally:
        if started:
            # What the cache now stands for, as the next call's prompt will render it.
            _CHATS[cache] = _ChatRecord(prompt + detok.text.strip(), ids + answer)


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
        """From TinyChat's AttributeDict, a plain dict or any object with the fields."""

        def get(key: str, default: Any) -> Any:
            if isinstance(params, Mapping):
                return params.get(key, default)
            return getattr(params, key, default)

        return cls(
            temp=float(get("temp", 0.7)),
            top_k=int(get("top_k", 40)),
            top_p=float(get("top_p", 0.95)),
            repeat_penalty=float(get("repeat_penalty", 1.1)),
            n_predict=int(get("n_predict", 512)),
            n_vocab=int(get("n_vocab", vocab)),
        )

    def sampling(self) -> SamplingConfig:
        """TinyChat's rules: greedy for a tiny temp or top_p, top_k <= 0 means the whole
        vocabulary, the repetition penalty only above 1.

        Raises:
            ConfigError: a value outside the ranges the engine accepts.
        """
        greedy = self.temp < 1e-5 or self.top_p < 1e-8
        return SamplingConfig(
            temperature=0.0 if greedy else self.temp,
            top_p=1.0 if greedy else min(self.top_p, 1.0),
            top_k=0 if self.top_k <= 0 or self.top_k >= self.n_vocab else self.top_k,
            repetition_penalty=max(1.0, self.repeat_penalty),
            max_new_tokens=self.n_predict,
            stream_interval=1,
        ).validated()


def persistent_cache(model: Any) -> Cache:
    """The cache `StreamGenerator` keeps for `model` (a new `DynamicCache` the first time;
    the `SinkCache` after `enable_streaming_llm`)."""
    cache = _PERSISTENT.get(model)
    if cache is None:
        cache = Engine(model, _NoText()).new_cache()
        _PERSISTENT[model] = cache
    return cache


def reset_persistent_cache(model: Any) -> None:
    """Forget `model`'s persistent cache: the next `StreamGenerator` starts a `DynamicCache`."""
    _PERSISTENT.pop(model, None)


def _rewind_to(engine: Engine, cache: Cache, start_pos: int) -> None:
    """Cut the persistent cache back to its first `start_pos` tokens (counting evicted ones).

    Raises:
        ValueError: `start_pos` is negative, beyond what the cache holds, or inside a part
            the sink cache has already evicted.
    """
    length = engine.cache_length(cache)
    evicted = int(getattr(cache, "evicted_total", 0))
    held = length + evicted
    if start_pos < 0 or start_pos > held:
        raise ValueError(
            f"start_pos={start_pos}, but the model's cache holds {held} tokens: pass 0 to start "
            "over, or the sum of the earlier calls' timing['total_tokens']"
        )
    if start_pos == 0:
        cache.reset()
    elif start_pos < held:
        drop = held - start_pos
        if drop > _rewindable(cache, length):
            raise ValueError(f"cannot go back to start_pos={start_pos}: those tokens were evicted")
        engine.crop(cache, length - drop)


class _StopFlag:
    """A stopping criterion the consumer of the engine's chunks sets: the engine yields each
    token before it asks, so the consumer decides on the token it has just seen."""

    def __init__(self) -> None:
        self.stopped = False

    def __call__(self, ids: torch.Tensor, scores: torch.Tensor) -> bool:
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
        stop_token_ids: ids that end the answer, besides the tokenizer's eos (never changed).
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
        ValueError: `start_pos` does not match the cache, or `stream_interval` < 1.
        ConfigError: `gen_params` out of range.
        ContextFullError: the input does not fit the model's context.
    """
    del device, quant_llm
    if stream_interval < 1:
        raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
    engine = Engine(model, tokenizer)
    sampling = _GenParams.read(gen_params, len(tokenizer)).sampling()
    cache = persistent_cache(model)
    _FED.pop(cache, None)  # stream_generate's record of it goes stale here
    _rewind_to(engine, cache, start_pos)
    add_bos = not (chunk_prefilling and start_pos > 0)
    input_ids = list(tokenizer(input, add_special_tokens=add_bos)["input_ids"])
    if not input_ids:
        raise ValueError("input is empty")
    stop = set(stop_token_ids)
    if tokenizer.eos_token_id is not None:
        stop.add(int(tokenizer.eos_token_id))
    stops = [s for s in stop_strings if s]

    flag = _StopFlag()
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    answer: list[int] = []  # answer tokens, the stop token excluded
    generated: list[int] = []  # every sampled token, for feeding the last one back
    cut: int | None = None  # where a stop string starts in the answer text
    n_fed = 0

    def count_fed(ids: Sequence[int]) -> None:
        nonlocal n_fed
        n_fed += len(ids)

    def text(final: bool) -> str:
        shown = detok.text if cut is None else detok.text[:cut]
        if not final and cut is None:
            shown = shown[: len(shown) - held_back(shown, stops)]
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
    for chunk in engine.generate(
        cache, input_ids, sampling, history_ids=(), on_fed=count_fed, stopping_criteria=flag
    ):
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
            if stops:
                found = [p for p in (detok.text.find(s) for s in stops) if p >= 0]
                if found:
                    cut = min(found)
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
        engine.prefill(cache, generated[-1:], on_fed=count_fed)
    if stops and cut is None:
        found = [p for p in (detok.text.find(s) for s in stops) if p >= 0]
        cut = min(found) if found else None
    yield {
        "text": text(True),
        "usage": usage(),
        "finish_reason": "stop" if flag.stopped or cut is not None else "length",
        "timing": {
            "context_tokens": stats.context_tokens,
            "context_time": stats.context_time_s,
            "total_tokens": n_fed,
            "generation_time_list": generation_times,
        },
    }


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
    skip = (os.path.dirname(torch.__file__), __file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def enable_streaming_llm(
    model: Any, start_size: int = 4, recent_size: int = 2000, *, evict_block: int = 1
) -> SinkCache:
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
        The `SinkCache`.

    Raises:
        StreamingUnsupportedError: the model's positions cannot be re-rotated.
    """
    cache = SinkCache.for_model(
        model, start_size=start_size, recent_size=recent_size, evict_block=evict_block
    )
    _PERSISTENT[model] = cache
    if model not in _WATCHED and hasattr(model, "register_forward_pre_hook"):
        _WATCHED[model] = model.register_forward_pre_hook(_warn_unbounded_cache, with_kwargs=True)
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
        if not self.is_initialized or start_size + recent >= length:
            return
        tail = length - recent
        self.keys = torch.cat([self.keys[..., :start_size, :], self.keys[..., tail:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :start_size, :], self.values[..., tail:, :]], dim=-2)
        self.evicted += tail - start_size

    def cut(self, start: int, end: int) -> None:
        self.keys = torch.cat([self.keys[..., :start, :], self.keys[..., end:, :]], dim=-2)
        self.values = torch.cat([self.values[..., :start, :], self.values[..., end:, :]], dim=-2)
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

    def physical_length(self) -> int:
        return self.layers[0].physical_length()


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
        if isinstance(past_key_values, Cache):
            pairs = [(layer.keys, layer.values) for layer in past_key_values.layers]
        elif isinstance(past_key_values, (tuple, list)):
            pairs = [(kv[0], kv[1]) for kv in past_key_values]
        else:
            raise TypeError(
                f"past_key_values must be None, a transformers Cache or per-layer (key, value) pairs, "
                f"got {type(past_key_values).__name__}"
            )
        cache = _StartRecentCache(len(pairs))
        for layer, (keys, values) in zip(cache.layers, pairs):
            if keys is not None and values is not None and keys.numel():
                layer.update(keys, values)
        return cache

    def __call__(self, past_key_values: Any) -> Cache | None:
        """After a forward pass: keep the sinks and the newest `recent_size` tokens."""
        if past_key_values is None:
            return None
        cache = self._own(past_key_values)
        if cache.physical_length() > self.cache_size:
            for layer in cache.layers:
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
            for layer in cache.layers:
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
            for layer in cache.layers:
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
