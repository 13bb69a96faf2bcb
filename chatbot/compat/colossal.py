"""ColossalAI (Colossal-LLaMA ``stream_chat_patch``): `get_prompt_template`, `streaming_chat`,
`stream_generate`, on our engine."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.logits_process import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from chatbot.compat._common import (
    CompatArgumentError,
    NoText,
    check_model,
    check_sampling,
    check_text,
    check_tokenizer,
    check_vocab,
    single_row,
    sync_cache,
)
from chatbot.compat.records import lookup
from chatbot.config import SamplingConfig
from chatbot.engine.cache.layers import AnyCache, is_cache
from chatbot.engine.detokenize import IncrementalDetokenizer
from chatbot.engine.generate import Engine
from chatbot.engine.stop_criteria import StopOnStrings

DEFAULT_ROLES = ("", "Human", "Assistant")


@dataclass
class _ChatRecord:
    """What `streaming_chat` left in a cache: the prompt text so far and its token ids
    (the last answer token may still be waiting to be fed)."""

    text: str
    ids: list[int] = field(default_factory=list)


CHATS: weakref.WeakKeyDictionary[AnyCache, _ChatRecord] = weakref.WeakKeyDictionary()

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

    Raises:
        CompatArgumentError: a history entry without a string ``role`` and ``message`` (an
            empty message is fine), roles that are not three strings, a query that is not text.
    """
    check_text(input_query, "input_query", "get_prompt_template")
    system_role, user_role, assistant_role = _check_roles(roles)
    messages = [*_check_history(history), {"role": user_role, "message": input_query.strip()}]
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


def _check_roles(roles: Any) -> tuple[str, str, str]:
    """Raises: CompatArgumentError: `roles` is not (system, user, assistant) names."""
    if isinstance(roles, str) or not isinstance(roles, Sequence) or len(roles) != 3:
        raise CompatArgumentError(f"roles must be three names (system, user, assistant), got {roles!r:.80}")
    if not all(isinstance(r, str) for r in roles):
        raise CompatArgumentError(f"roles must be strings, got {roles!r:.80}")
    return roles[0], roles[1], roles[2]


def _check_history(history: Any) -> list[Mapping[str, Any]]:
    """The history's entries, each a mapping with a string ``role`` and ``message``.

    Raises:
        CompatArgumentError: naming the first entry that is not one.
    """
    if history is None:
        return []
    if isinstance(history, (str, bytes, Mapping)) or not isinstance(history, Sequence):
        raise CompatArgumentError(
            f"history must be a list of {{'role': ..., 'message': ...}} entries, got {type(history).__name__}"
        )
    for i, entry in enumerate(history):
        if not isinstance(entry, Mapping):
            problem = f"is a {type(entry).__name__}, not a {{'role': ..., 'message': ...}} dict"
        elif not isinstance(entry.get("role"), str):
            problem = (
                "has no 'role' string" if entry.get("role") is None else "has a 'role' that is not a string"
            )
        elif "message" not in entry:
            problem = "has no 'message'"
        elif not isinstance(entry["message"], str):
            problem = f"has a 'message' that is not a string ({type(entry['message']).__name__})"
        else:
            continue
        raise CompatArgumentError(f"history[{i}] {problem}: {entry!r:.100}")
    return list(history)


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
        CompatArgumentError: no model, ids that are not integers or not in the vocabulary, or
            a sampling setting (temperature, top_p, top_k, repetition_penalty,
            max_new_tokens) outside the range the CLI allows.
        ContextFullError: the prompt does not fit a growing cache.
    """
    check_model(model, "stream_generate")
    kwargs.update(check_sampling("stream_generate", kwargs))
    cache = kwargs.pop("past_key_values", None)
    alt_cache = kwargs.pop("cache", None)
    cache = cache if cache is not None else alt_cache
    attention_mask = kwargs.pop("attention_mask", None)
    tokenizer = kwargs.pop("tokenizer", None)
    generator = kwargs.pop("generator", None)
    ids = single_row(input_ids, attention_mask)
    check_vocab(ids, model, "stream_generate")

    config, max_new = _generation_config(model, generation_config, kwargs, len(ids))
    engine = Engine(model, tokenizer if tokenizer is not None else NoText())
    if cache is None:
        cache = engine.new_cache().cache
    elif not is_cache(cache):
        raise TypeError(
            "past_key_values must be a KV cache (transformers' DynamicCache, or the SinkCache of "
            f"enable_streaming_llm); got {type(cache).__name__} (tuples are gone in transformers v5)"
        )
    out_device = input_ids.device if isinstance(input_ids, torch.Tensor) else engine.device
    processors, criteria = _processors_and_criteria(
        model, engine, config, ids, tokenizer, prefix_allowed_tokens_fn, logits_processor, stopping_criteria
    )
    sampling = SamplingConfig(
        temperature=1.0 if config.do_sample else 0.0,  # the processors do the rest
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        max_new_tokens=max_new,
        stream_interval=1,
    )

    kv, start = sync_cache(engine, cache, ids)
    sequence = list(ids)
    chunks = engine.generate(
        kv,
        ids[start:],
        sampling,
        history_ids=ids[:start],
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
        kv.settle()


def generation_methods(model: Any) -> Any:
    """`model`, where it has transformers' `GenerationMixin` builders; else (our own model of
    a llama GGUF file, `chatbot.engine.backends.native.skeleton`) an object that has them, over
    its config, generation config and device."""
    if hasattr(model, "_prepare_generation_config"):
        return model
    from transformers.generation import GenerationMixin

    class Generation(GenerationMixin):
        def __init__(self) -> None:
            self.config = model.config
            self.generation_config = model.generation_config.to_transformers(model.config)
            self.device = model.device

    return Generation()


def _generation_config(
    model: Any, generation_config: Any, kwargs: dict[str, Any], prompt_len: int
) -> tuple[Any, int]:
    """The `GenerationConfig` `generate` would use for a prompt of `prompt_len` tokens (the
    model's defaults filled in, then `kwargs`), its max_length set from max_new_tokens, and
    the most new tokens (at least 1).

    Raises:
        TypeError: a keyword that is no generation setting.
    """
    # transformers' private builders (pinned to 5.24) give the exact config, processors and
    # criteria that `generate` would use.
    config, unused = generation_methods(model)._prepare_generation_config(generation_config, **kwargs)
    unused = {k: v for k, v in unused.items() if k not in ("output_attentions", "output_hidden_states")}
    if unused:
        raise TypeError(f"stream_generate() got unexpected keyword arguments: {', '.join(sorted(unused))}")
    if config.max_new_tokens is not None:
        config.max_length = prompt_len + config.max_new_tokens
    return config, max(1, config.max_length - prompt_len)


def _processors_and_criteria(
    model: Any,
    engine: Engine,
    config: Any,
    ids: list[int],
    tokenizer: Any,
    prefix_allowed_tokens_fn: Callable[[int, torch.Tensor], list[int]] | None,
    logits_processor: LogitsProcessorList | None,
    stopping_criteria: StoppingCriteriaList | None,
) -> tuple[LogitsProcessorList, StoppingCriteriaList]:
    """The logits processors and stopping criteria `generate` would build from `config`
    (the caller's merged in), with the config's stop strings matched by our `StopOnStrings`
    instead of transformers' StopStringCriteria (`config.stop_strings` is cleared).

    Raises:
        ValueError: stop strings without a tokenizer.
    """
    model = generation_methods(model)
    model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=engine.device, batch_size=1)
    processors = model._get_logits_processor(
        generation_config=config,
        input_ids_seq_length=len(ids),
        encoder_input_ids=torch.tensor([ids], device=engine.device),
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=logits_processor if logits_processor is not None else LogitsProcessorList(),
        device=engine.device,
    )
    stop_strings = config.stop_strings
    config.stop_strings = None
    criteria = model._get_stopping_criteria(
        generation_config=config,
        stopping_criteria=stopping_criteria if stopping_criteria is not None else StoppingCriteriaList(),
        tokenizer=tokenizer,
    )
    if stop_strings:
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer: pass tokenizer= to stream_generate")
        criteria.append(
            StopOnStrings(tokenizer, [stop_strings] if isinstance(stop_strings, str) else stop_strings)
        )
    return processors, criteria


def streaming_chat(
    model: Any,
    tokenizer: Any,
    input_query: str,
    history: Sequence[Mapping[str, Any]] | None = None,
    roles: Sequence[str] = DEFAULT_ROLES,
    past_key_values: AnyCache | None = None,
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

    Raises:
        CompatArgumentError: no model or tokenizer, a history entry without a ``message``
            string, or a setting outside the range the CLI allows (temperature 0 to 100,
            top_p above 0 and at most 1, top_k >= 0, max_new_tokens >= 1). As in the CLI,
            temperature 0 means greedy.
    """
    del length_penalty  # beam search only
    check_model(model, "streaming_chat")
    check_tokenizer(tokenizer, "streaming_chat")
    given = _chat_sampling(temperature, top_p, top_k, max_new_tokens)
    engine = Engine(model, tokenizer)
    cache = past_key_values if past_key_values is not None else engine.new_cache().cache
    prompt = get_prompt_template(input_query, history, roles)
    new_history = [dict(item) for item in history or []]
    new_history.append({"role": roles[1], "message": input_query.strip()})
    assistant = {"role": roles[2], "message": None}
    new_history.append(assistant)
    ids = _chat_ids(tokenizer, cache, prompt)
    settings, stop = _chat_settings(tokenizer.eos_token_id, do_sample, given, kwargs)

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
            CHATS[cache] = _ChatRecord(prompt + detok.text.strip(), ids + answer)


def _chat_sampling(temperature: float, top_p: float, top_k: int, max_new_tokens: int) -> dict[str, Any]:
    """`streaming_chat`'s sampling values by name, each checked.

    Raises:
        CompatArgumentError: a value outside the range the CLI allows.
    """
    given: dict[str, Any] = {
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "max_new_tokens": max_new_tokens,
    }
    given.update(check_sampling("streaming_chat", given))
    return given


def _chat_ids(tokenizer: Any, cache: AnyCache, prompt: str) -> list[int]:
    """`prompt`'s token ids: those `streaming_chat` left in `cache` and the rest of the text
    encoded after them when the cache still holds that chat and `prompt` goes on from its
    text; else the whole prompt encoded."""
    record = CHATS.get(cache)
    kv = lookup(cache)
    continues = record is not None and kv is not None and record.ids[: len(kv.seen)] == kv.seen
    if record is not None and continues and prompt.startswith(record.text):
        rest = prompt[len(record.text) :]
        return record.ids + list(tokenizer(rest, add_special_tokens=False)["input_ids"])
    return list(tokenizer(prompt)["input_ids"])


def _chat_settings(
    eos: int | None, do_sample: bool, given: dict[str, Any], kwargs: dict[str, Any]
) -> tuple[dict[str, Any], set[int]]:
    """`stream_generate`'s generation settings for `streaming_chat` and the ids that end the
    answer (its eos_token_id): greedy for a zero temperature (the CLI's greedy; transformers
    would refuse it), the sampling values of `given` only when sampling, the tokenizer's
    `eos` as the stop token, then `kwargs`."""
    if do_sample and given["temperature"] == 0:
        do_sample = False
    settings: dict[str, Any] = {"do_sample": do_sample, "max_new_tokens": given["max_new_tokens"]}
    if do_sample:
        settings.update(temperature=given["temperature"], top_p=given["top_p"], top_k=given["top_k"])
    if eos is not None:
        settings["eos_token_id"] = [eos]
    settings.update(kwargs)
    stop_ids = settings.get("eos_token_id")
    return settings, {stop_ids} if isinstance(stop_ids, int) else set(stop_ids or ())
