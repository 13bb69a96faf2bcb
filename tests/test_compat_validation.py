"""The published APIs (chatbot.compat) check their arguments as the CLI checks its flags: a
bad one raises `CompatArgumentError` (a ConfigError and a ValueError) that names it, before
anything is generated or changed, instead of being accepted, truncated or crashing later."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import greedy_by_recompute, make_model

from chatbot.compat import (
    StreamGenerator,
    enable_streaming_llm,
    get_prompt_template,
    persistent_cache,
    reset_persistent_cache,
    stream_generate,
    streaming_chat,
)
from chatbot.config import ConfigError
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.generate import Engine


@pytest.fixture(autouse=True)
def _fresh_persistent_cache(tiny_model):
    reset_persistent_cache(tiny_model)
    yield
    reset_persistent_cache(tiny_model)


@pytest.fixture(scope="module")
def streaming_model(tiny_tokenizer):
    """A model of its own: `enable_streaming_llm` hooks the model it is given."""
    return make_model(len(tiny_tokenizer))


@pytest.fixture
def no_generation(monkeypatch):
    """Fails the test if a refused call reaches the engine."""

    def refuse(*args, **kwargs):
        raise AssertionError("the engine ran for a call that should have been refused")

    monkeypatch.setattr(Engine, "generate", refuse)
    monkeypatch.setattr(Engine, "prefill", refuse)


@contextlib.contextmanager
def refused(match: str) -> Iterator[None]:
    """The error every refusal raises: a ValueError, as code written for the originals
    expects, that is also the project's own ConfigError (CompatArgumentError)."""
    with pytest.raises(ValueError, match=match) as info:
        yield
    assert isinstance(info.value, ConfigError), type(info.value)
    assert type(info.value).__name__ == "CompatArgumentError"


def gen_params(**overrides):
    params = {"temp": 0.0, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.0, "n_predict": 4, "n_vocab": 400}
    params.update(overrides)
    return params


# --- enable_streaming_llm: the CLI's --start-size / --recent-size rules ---------------------------


@pytest.mark.parametrize(
    "start_size,recent_size,match",
    [
        (100, 16, r"start_size \(100\) must not be larger than the recent window"),
        (4, 10**12, r"at most the model's context \(512 tokens\); e\.g\. recent_size=508"),
        (4, 2000, r"start_size \+ recent_size \(4 \+ 2,000\)"),  # the default, on a 512-token model
        (300, 300, r"at most the model's context \(512 tokens\)"),
        (-1, 64, r"start_size must be an integer ≥ 0"),
        (4, 0, r"recent_size must be an integer ≥ 1"),
        (2.5, 64, r"start_size must be an integer.*got 2\.5"),
    ],
)
def test_enable_streaming_llm_refuses_sizes_the_cli_refuses(streaming_model, start_size, recent_size, match):
    before = persistent_cache(streaming_model)
    with refused(match):
        enable_streaming_llm(streaming_model, start_size=start_size, recent_size=recent_size)
    assert persistent_cache(streaming_model) is before  # nothing was changed


def test_enable_streaming_llm_takes_sizes_that_fit(streaming_model):
    assert isinstance(enable_streaming_llm(streaming_model, start_size=4, recent_size=508), SinkCache)
    cache = enable_streaming_llm(streaming_model, start_size=4.0, recent_size=64)  # a whole float is an int
    assert (cache.start_size, cache.recent_size) == (4, 64) and isinstance(cache.start_size, int)
    with refused("evict_block must be an integer ≥ 1"):
        enable_streaming_llm(streaming_model, start_size=4, recent_size=64, evict_block=0)
    reset_persistent_cache(streaming_model)


# --- streaming_chat / stream_generate: the CLI's sampling ranges ----------------------------------


@pytest.mark.parametrize(
    "settings,match",
    [
        ({"top_p": 2.0}, r"streaming_chat: top_p must be a number > 0 and ≤ 1, got 2\.0"),
        ({"top_p": 0.0}, r"top_p must be a number > 0"),
        ({"temperature": -0.5}, r"temperature must be"),
        ({"temperature": 1000.0}, r"temperature must be"),
        ({"temperature": float("nan")}, r"temperature must be"),
        ({"top_k": -1}, r"top_k must be an integer ≥ 0"),
        ({"top_k": 2.5}, r"top_k must be an integer"),
        ({"max_new_tokens": 0}, r"max_new_tokens must be an integer ≥ 1"),
        ({"repetition_penalty": 50.0}, r"repetition_penalty must be"),  # through **kwargs
    ],
)
def test_streaming_chat_refuses_settings_the_cli_refuses(
    tiny_model, tiny_tokenizer, no_generation, settings, match
):
    with refused(match):
        next(streaming_chat(tiny_model, tiny_tokenizer, "Hello", **settings))


def test_streaming_chat_temperature_zero_is_greedy_as_in_the_cli(tiny_model, tiny_tokenizer):
    def answer(**settings):
        reset_persistent_cache(tiny_model)
        return list(streaming_chat(tiny_model, tiny_tokenizer, "Hello", max_new_tokens=5, **settings))[-1][0]

    assert answer(temperature=0.0) == answer(do_sample=False)
    assert answer(top_k=3.0, do_sample=False) == answer(do_sample=False)  # a whole float is an int


@pytest.mark.parametrize(
    "settings", [{"top_p": 1.5}, {"top_k": -2}, {"temperature": -1.0}, {"max_new_tokens": 0}]
)
def test_stream_generate_refuses_settings_the_cli_refuses(tiny_model, no_generation, settings):
    with refused("stream_generate: " + next(iter(settings))):
        next(stream_generate(tiny_model, torch.tensor([[1, 5, 7]]), **settings))


# --- token ids are integers inside the vocabulary -------------------------------------------------


@pytest.mark.parametrize(
    "ids,match",
    [
        (torch.tensor([[1.7, 5.2, 7.9]]), "integer token ids, got a float32 tensor"),
        (torch.tensor([[1.0, 5.0, 7.0]], dtype=torch.float64), "got a float64 tensor"),
        ([[1, 5.5, 7]], "integer token ids"),
        (torch.tensor([[True, False]]), "got a bool tensor"),
        (torch.tensor([[1, 5000]]), r"token id 5000 is outside the model's vocabulary \(0 to 399\)"),
        (torch.tensor([[1, -3]]), "token id -3 is outside"),
    ],
)
def test_stream_generate_refuses_ids_that_are_not_token_ids(tiny_model, no_generation, ids, match):
    with refused(match):
        next(stream_generate(tiny_model, ids, max_new_tokens=2))


def test_integer_ids_of_any_integer_type_still_work(tiny_model):
    for ids in (torch.tensor([[1, 5, 7]], dtype=torch.int32), [[1, 5, 7]], np.array([[1, 5, 7]])):
        out = list(stream_generate(tiny_model, ids, max_new_tokens=2, do_sample=False))
        assert out[-1][0, :3].tolist() == [1, 5, 7]


# --- history entries ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry,match",
    [
        ({"role": "Human"}, r"history\[1\] has no 'message': \{'role': 'Human'\}"),
        (
            {"role": "Human", "message": None},
            r"history\[1\] has a 'message' that is not a string \(NoneType\)",
        ),
        ({"role": "Human", "message": 42}, r"history\[1\] has a 'message' that is not a string \(int\)"),
        ({"message": "hi"}, r"history\[1\] has no 'role' string"),
        ("Human: hi", r"history\[1\] is a str, not a"),
    ],
)
def test_a_history_entry_without_message_text_is_refused(
    tiny_model, tiny_tokenizer, no_generation, entry, match
):
    history = [{"role": "Human", "message": "Q1"}, entry]
    with refused(match):
        get_prompt_template("Q2", history)
    with refused(match):
        next(streaming_chat(tiny_model, tiny_tokenizer, "Q2", history=history))


def test_history_and_roles_of_the_wrong_shape_are_refused():
    with refused("history must be a list"):
        get_prompt_template("Q", {"role": "Human", "message": "hi"})
    with refused("roles must be three names"):
        get_prompt_template("Q", roles=("Human", "Assistant"))
    with refused("input_query must be a string"):
        get_prompt_template(None)
    # An empty message is text: it renders without its closing tag, as in the original.
    assert get_prompt_template("b", [{"role": "Human", "message": ""}]) == (
        "Human: <s>Human: <s>b</s>Assistant: <s>"
    )


# --- no model, no tokenizer -----------------------------------------------------------------------


def test_no_model_is_refused_with_a_clear_message(tiny_model, tiny_tokenizer):
    match = r"model must be a loaded transformers causal LM .*got None"
    with refused("streaming_chat: " + match):
        next(streaming_chat(None, tiny_tokenizer, "Hello"))
    with refused("stream_generate: " + match):
        next(stream_generate(None, torch.tensor([[1, 2]])))
    with refused("StreamGenerator: " + match):
        next(StreamGenerator(None, tiny_tokenizer, "Hello", 0, gen_params()))
    with refused("enable_streaming_llm: " + match):
        enable_streaming_llm(None, start_size=4, recent_size=64)
    with refused(r"model must be .*got a str"):
        enable_streaming_llm("HuggingFaceTB/SmolLM2-135M-Instruct")
    with refused("streaming_chat: tokenizer must be the model's tokenizer"):
        next(streaming_chat(tiny_model, None, "Hello"))
    with refused("StreamGenerator: tokenizer must be"):
        next(StreamGenerator(tiny_model, None, "Hello", 0, gen_params()))


# --- StreamGenerator: gen_params, start_pos, stop ids ---------------------------------------------


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"top_p": 2.0}, r"gen_params top_p must be a number ≥ 0 and ≤ 1, got 2\.0"),
        ({"temp": -1.0}, r"gen_params temp must be"),
        ({"top_k": 2.5}, r"gen_params top_k must be an integer"),
        ({"n_predict": 3.5}, r"gen_params n_predict must be an integer"),
        ({"n_predict": 0}, r"gen_params n_predict must be an integer ≥ 1"),
        ({"repeat_penalty": -1.0}, r"gen_params repeat_penalty must be"),
        ({"temp": "warm"}, r"gen_params temp must be a number"),
    ],
)
def test_stream_generator_refuses_gen_params_out_of_range(
    tiny_model, tiny_tokenizer, no_generation, overrides, match
):
    with refused(match):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(**overrides)))


def test_stream_generator_keeps_tinychats_own_meanings(tiny_model, tiny_tokenizer):
    # temp 0 and top_p 0 are greedy, top_k <= 0 is the whole vocabulary, repeat_penalty < 1 is none
    for overrides in ({"temp": 0.0}, {"top_p": 0.0, "temp": 0.7}, {"top_k": -1}, {"repeat_penalty": 0.5}):
        reset_persistent_cache(tiny_model)
        events = list(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(**overrides)))
        assert events[-1]["finish_reason"] in ("stop", "length")


def test_stream_generator_refuses_float_positions_and_stop_ids(tiny_model, tiny_tokenizer, no_generation):
    with refused(r"start_pos must be an integer \(a token count\), got 2\.0"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 2.0, gen_params()))
    with refused(r"stop_token_ids\[1\] must be an integer token id, got 7\.0"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stop_token_ids=[5, 7.0]))
    with refused("stream_interval must be an integer ≥ 1"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stream_interval=0))
    with refused("input must be a string"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, ["Hello"], 0, gen_params()))


def test_stream_generator_ignores_stop_ids_outside_the_vocabulary(tiny_model, tiny_tokenizer):
    """TinyChat's Qwen prompter passes 151645 whatever the model: an id that cannot occur is
    harmless, and an id beside it still stops the answer (here the first greedy token)."""
    ids = tiny_tokenizer("Hello")["input_ids"]
    first = greedy_by_recompute(tiny_model, ids, 1)[0]
    reset_persistent_cache(tiny_model)
    plain = list(
        StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stop_token_ids=[151645])
    )
    assert plain[-1]["usage"]["completion_tokens"] > 0
    reset_persistent_cache(tiny_model)
    stops = [151645, first]
    stopped = list(
        StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stop_token_ids=stops)
    )
    assert stopped[-1]["finish_reason"] == "stop"
    assert stopped[-1]["usage"]["completion_tokens"] == 0


def test_stream_generator_takes_integer_stop_ids_of_any_integer_type(tiny_model, tiny_tokenizer):
    stops = [np.int64(5), torch.tensor(7), 9]
    events = list(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stop_token_ids=stops))
    assert events[-1]["finish_reason"] in ("stop", "length")
