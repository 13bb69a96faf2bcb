"""The published streaming APIs (chatbot.compat) on the tiny random Llama.

References are independent of the adapters: greedy decoding by full recomputation, and
prompts written out by hand.
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch
from helpers import full_logits, greedy_by_recompute, make_model
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from chatbot import compat
from chatbot.compat import (
    StreamGenerator,
    enable_streaming_llm,
    get_prompt_template,
    persistent_cache,
    reset_persistent_cache,
    stream_generate,
    streaming_chat,
)
from chatbot.compat.records import track
from chatbot.config import SamplingConfig
from chatbot.engine.cache.sinks import SinkCache
from chatbot.engine.generate import Engine
from chatbot.engine.stops import StopStrings
from chatbot.errors import ConfigError, StreamingUnsupportedError


@pytest.fixture(autouse=True)
def _fresh_persistent_cache(tiny_model):
    reset_persistent_cache(tiny_model)
    yield
    reset_persistent_cache(tiny_model)


@pytest.fixture
def engine_calls(monkeypatch):
    """Counts Engine.generate and Engine.prefill calls and the ids each prefill gets."""
    calls = {"generate": 0, "prefill": []}
    real_generate, real_prefill = Engine.generate, Engine.prefill

    def generate(self, *args, **kwargs):
        calls["generate"] += 1
        return real_generate(self, *args, **kwargs)

    def prefill(self, cache, ids, *args, **kwargs):
        calls["prefill"].append(list(ids))
        return real_prefill(self, cache, ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "generate", generate)
    monkeypatch.setattr(Engine, "prefill", prefill)
    return calls


def gen_params(**overrides):
    params = {"temp": 0.0, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.0, "n_predict": 8, "n_vocab": 400}
    params.update(overrides)
    return params


# --- ColossalAI: get_prompt_template ------------------------------------------------------------


def test_prompt_template_matches_hand_written_strings():
    assert get_prompt_template("  Hi  ") == "Human: <s>Hi</s>Assistant: <s>"
    history = [
        {"role": "", "message": "Be nice."},
        {"role": "Human", "message": "Q1"},
        {"role": "Assistant", "message": "A1"},
    ]
    assert get_prompt_template("Q2", history) == (
        "<s>Be nice.\n\nHuman: <s>Q1</s>Assistant: <s>A1</s>Human: <s>Q2</s>Assistant: <s>"
    )
    # An empty answer renders without its closing tag, as in the original.
    empty = [{"role": "User", "message": "a"}, {"role": "Bot", "message": ""}]
    assert get_prompt_template("b", empty, roles=("Sys", "User", "Bot")) == (
        "User: <s>a</s>Bot: <s>User: <s>b</s>Bot: <s>"
    )
    assert history[-1] == {"role": "Assistant", "message": "A1"}  # not changed


# --- ColossalAI: streaming_chat -----------------------------------------------------------------


def test_streaming_chat_cumulative_response_and_history(tiny_model, tiny_tokenizer, engine_calls):
    history = [{"role": "", "message": "You are terse."}]
    events = list(
        streaming_chat(
            tiny_model, tiny_tokenizer, "Hello there!", history=history, do_sample=False, max_new_tokens=6
        )
    )
    assert engine_calls["generate"] == 1  # the engine's loop, not one of our own
    responses = [r for r, _ in events]
    assert len(events) == 6
    for a, b in itertools.pairwise(responses):
        assert b.startswith(a)
    prompt_ids = tiny_tokenizer(get_prompt_template("Hello there!", history))["input_ids"]
    expected = greedy_by_recompute(tiny_model, prompt_ids, 6, stop={tiny_tokenizer.eos_token_id})
    assert responses[-1] == tiny_tokenizer.decode(expected)
    final_history = events[-1][1]
    assert final_history[:1] == history and len(history) == 1  # the caller's list is untouched
    assert final_history[1:] == [
        {"role": "Human", "message": "Hello there!"},
        {"role": "Assistant", "message": responses[-1].strip()},
    ]


def test_streaming_chat_reuses_the_cache(tiny_model, tiny_tokenizer, engine_calls):
    history, cache = [], None
    for _, history, cache in streaming_chat(  # noqa: B020 - the upstream API's own form
        tiny_model,
        tiny_tokenizer,
        "Hello there!",
        history=history,
        do_sample=False,
        max_new_tokens=5,
        return_past_key_values=True,
    ):
        pass
    assert isinstance(cache, DynamicCache)
    first_prompt = get_prompt_template("Hello there!")
    held = cache.get_seq_length()
    engine_calls["prefill"].clear()

    events = list(
        streaming_chat(
            tiny_model,
            tiny_tokenizer,
            "How are you today?",
            history=history,
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=5,
            return_past_key_values=True,
        )
    )
    response, history2, cache2 = events[-1]
    assert cache2 is cache
    second_prompt = get_prompt_template("How are you today?", history)
    rest = second_prompt[len(first_prompt + history[-1]["message"]) :]
    assert rest.startswith("</s>Human: <s>How are you today?")
    new_ids = tiny_tokenizer(rest, add_special_tokens=False)["input_ids"]
    # Prefilled: the first answer's last token (never fed after a max_new_tokens stop) and
    # the new text; nothing of the first exchange is encoded again.
    fed = engine_calls["prefill"][0]
    assert len(fed) == 1 + len(new_ids)
    assert fed[1:] == new_ids
    assert len(fed) < len(tiny_tokenizer(second_prompt)["input_ids"])
    assert cache.get_seq_length() == held + len(fed) + 5 - 1

    # The answer equals greedy decoding over the same ids recomputed from scratch.
    turn1 = compat.CHATS[cache].ids[: held + 1]
    expected = greedy_by_recompute(tiny_model, turn1 + new_ids, 5, stop={tiny_tokenizer.eos_token_id})
    assert response == tiny_tokenizer.decode(expected)
    assert len(history2) == 4 and history2[-1]["message"] == response.strip()


def test_streaming_chat_edited_history_is_re_encoded_from_the_divergence(
    tiny_model, tiny_tokenizer, engine_calls
):
    history, cache = [], None
    for _, history, cache in streaming_chat(
        tiny_model,
        tiny_tokenizer,
        "Hello there!",
        do_sample=False,
        max_new_tokens=4,
        return_past_key_values=True,
    ):
        pass
    edited = [history[0], {"role": "Assistant", "message": "Something else entirely."}]
    engine_calls["prefill"].clear()
    response, _, cache = list(
        streaming_chat(
            tiny_model,
            tiny_tokenizer,
            "Next?",
            history=edited,
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=4,
            return_past_key_values=True,
        )
    )[-1]
    full = tiny_tokenizer(get_prompt_template("Next?", edited))["input_ids"]
    shared = len(tiny_tokenizer(get_prompt_template("Hello there!"))["input_ids"])
    assert len(engine_calls["prefill"][0]) <= len(full) - shared + 2
    expected = greedy_by_recompute(tiny_model, full, 4, stop={tiny_tokenizer.eos_token_id})
    assert response == tiny_tokenizer.decode(expected)


def test_streaming_chat_stops_at_eos_and_takes_extra_settings(tiny_model, tiny_tokenizer):
    prompt_ids = tiny_tokenizer(get_prompt_template("Hello there!"))["input_ids"]
    first = greedy_by_recompute(tiny_model, prompt_ids, 1)[0]
    # Any keyword of the generation config passes through, eos_token_id included.
    events = list(
        streaming_chat(
            tiny_model,
            tiny_tokenizer,
            "Hello there!",
            do_sample=False,
            max_new_tokens=6,
            eos_token_id=[first],
            length_penalty=3.0,
        )
    )
    assert [r for r, _ in events] == [""]  # one event: the answer ended at once
    assert events[-1][1][-1] == {"role": "Assistant", "message": ""}


def test_streaming_chat_sampling_is_seeded_and_signature_has_no_mutable_defaults(tiny_model, tiny_tokenizer):
    def run(seed):
        g = torch.Generator().manual_seed(seed)
        return list(
            streaming_chat(
                tiny_model,
                tiny_tokenizer,
                "Hi",
                temperature=50.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=8,
                generator=g,
            )
        )[-1][0]

    assert run(3) == run(3)
    assert run(3) != run(4)
    for fn in (streaming_chat, get_prompt_template, StreamGenerator):
        for p in inspect.signature(fn).parameters.values():
            assert not isinstance(p.default, (list, dict, set)), (fn.__name__, p.name)


# --- ColossalAI: stream_generate ----------------------------------------------------------------


def test_stream_generate_yields_growing_ids(tiny_model, tiny_tokenizer, engine_calls):
    ids = tiny_tokenizer("The quick brown fox", return_tensors="pt")
    outs = list(
        stream_generate(
            tiny_model, ids.input_ids, attention_mask=ids.attention_mask, max_new_tokens=5, do_sample=False
        )
    )
    assert engine_calls["generate"] == 1
    n = ids.input_ids.shape[1]
    assert [o.shape[1] for o in outs] == [n + 1, n + 2, n + 3, n + 4, n + 5]
    prompt = ids.input_ids[0].tolist()
    assert outs[-1][0].tolist() == prompt + greedy_by_recompute(tiny_model, prompt, 5)
    for a, b in itertools.pairwise(outs):
        assert torch.equal(b[:, :-1], a)


def test_stream_generate_honours_config_processors_and_criteria(tiny_model):
    prompt = list(range(5, 20))
    free = greedy_by_recompute(tiny_model, prompt, 6)

    outs = list(
        stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            generation_config=GenerationConfig(max_new_tokens=3, do_sample=False),
        )
    )
    assert outs[-1][0].tolist() == prompt + free[:3]

    class Forbid(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            scores[:, free[0]] = -float("inf")
            return scores

    outs = list(
        stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            max_new_tokens=4,
            do_sample=False,
            logits_processor=LogitsProcessorList([Forbid()]),
        )
    )
    assert free[0] not in outs[-1][0, len(prompt) :].tolist()

    outs = list(
        stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            max_new_tokens=4,
            do_sample=False,
            prefix_allowed_tokens_fn=lambda batch, ids: [7, 8],
        )
    )
    assert set(outs[-1][0, len(prompt) :].tolist()) <= {7, 8}

    class AfterTwo(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.tensor([input_ids.shape[1] >= len(prompt) + 2])

    outs = list(
        stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            max_new_tokens=9,
            do_sample=False,
            stopping_criteria=StoppingCriteriaList([AfterTwo()]),
        )
    )
    assert outs[-1].shape[1] == len(prompt) + 2


def test_stream_generate_eos_is_yielded_but_not_fed(tiny_model):
    prompt = list(range(5, 20))
    g = torch.Generator().manual_seed(11)
    free = [
        o[0, -1].item()
        for o in stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=True,
            temperature=50.0,
            top_k=0,
            generator=g,
        )
    ]
    stop = free[5]
    cut = free.index(stop)
    g = torch.Generator().manual_seed(11)
    outs = list(
        stream_generate(
            tiny_model,
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=True,
            temperature=50.0,
            top_k=0,
            generator=g,
            eos_token_id=stop,
            return_past_key_values=True,
        )
    )
    ids, cache = outs[-1]
    assert ids[0, len(prompt) :].tolist() == free[: cut + 1]  # ends with the eos, as transformers
    assert cache.get_seq_length() == ids.shape[1] - 1  # which is not in the cache


def test_stream_generate_continues_a_returned_cache(tiny_model, engine_calls):
    prompt = list(range(5, 20))
    ids, cache = list(
        stream_generate(
            tiny_model, torch.tensor([prompt]), max_new_tokens=4, do_sample=False, return_past_key_values=True
        )
    )[-1]
    assert isinstance(cache, DynamicCache)
    engine_calls["prefill"].clear()
    more = ids[0].tolist() + [30, 31, 32]
    outs = list(
        stream_generate(
            tiny_model, torch.tensor([more]), past_key_values=cache, max_new_tokens=3, do_sample=False
        )
    )
    assert engine_calls["prefill"][0] == [ids[0, -1].item(), 30, 31, 32]
    assert outs[-1][0].tolist() == more + greedy_by_recompute(tiny_model, more, 3)
    # Going back (an edited sequence) cuts the cache to the common prefix.
    engine_calls["prefill"].clear()
    edited = prompt[:10] + [40, 41]
    outs = list(
        stream_generate(
            tiny_model, torch.tensor([edited]), past_key_values=cache, max_new_tokens=2, do_sample=False
        )
    )
    assert engine_calls["prefill"][0] == [40, 41]
    assert outs[-1][0].tolist() == edited + greedy_by_recompute(tiny_model, edited, 2)


def test_stream_generate_refuses_batches_and_unknown_arguments(tiny_model):
    with pytest.raises(ValueError, match="one sequence"):
        next(stream_generate(tiny_model, torch.ones((2, 4), dtype=torch.long)))
    with pytest.raises(TypeError, match="no_such_setting"):
        next(stream_generate(tiny_model, torch.ones((1, 4), dtype=torch.long), no_such_setting=1))
    with pytest.raises(TypeError, match="Cache"):
        next(stream_generate(tiny_model, torch.ones((1, 4), dtype=torch.long), past_key_values=((1, 2),)))


# --- TinyChat: StreamGenerator ------------------------------------------------------------------


def test_stream_generator_events_usage_and_timing(tiny_model, tiny_tokenizer, engine_calls):
    events = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, "The quick brown fox", 0, gen_params(n_predict=7), stream_interval=3
        )
    )
    assert engine_calls["generate"] == 1
    *middle, last = events
    # Yields after answer tokens 1 and 4 (every 3rd from the 1st), then the final event.
    assert [e["usage"]["completion_tokens"] for e in middle] == [1, 4]
    for e in middle:
        assert set(e) == {"text", "usage", "finish_reason", "timing"}
        assert e["finish_reason"] is None and e["timing"] is None
    prompt = tiny_tokenizer("The quick brown fox")["input_ids"]
    answer = greedy_by_recompute(tiny_model, prompt, 7)
    assert last["text"] == tiny_tokenizer.decode(answer, skip_special_tokens=True)
    for e in middle:
        assert last["text"].startswith(e["text"])
    assert last["finish_reason"] == "length"
    assert last["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 7,
        "total_tokens": len(prompt) + 7,
    }
    timing = last["timing"]
    assert set(timing) == {"context_tokens", "context_time", "total_tokens", "generation_time_list"}
    assert timing["context_tokens"] == len(prompt)
    assert timing["context_time"] > 0
    assert len(timing["generation_time_list"]) == 6 and all(t > 0 for t in timing["generation_time_list"])
    # Every answer token, the last one too, is in the cache: start_pos arithmetic holds.
    assert timing["total_tokens"] == len(prompt) + 7 == persistent_cache(tiny_model).get_seq_length()
    assert isinstance(persistent_cache(tiny_model), DynamicCache)


def test_stream_interval_one_yields_every_token(tiny_model, tiny_tokenizer):
    events = list(
        StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(n_predict=5), stream_interval=1)
    )
    assert [e["usage"]["completion_tokens"] for e in events] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="stream_interval"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(), stream_interval=0))
    with pytest.raises(ConfigError):
        next(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, gen_params(n_predict=0)))


def test_stream_generator_start_pos_continues_one_conversation(tiny_model, tiny_tokenizer, engine_calls):
    turn1 = "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n"
    turn2 = "\n<|im_start|>user\nHow are you today?<|im_end|>\n<|im_start|>assistant\n"
    last1 = list(StreamGenerator(tiny_model, tiny_tokenizer, turn1, 0, gen_params(n_predict=5)))[-1]
    start_pos = last1["timing"]["total_tokens"]
    engine_calls["prefill"].clear()
    last2 = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, turn2, start_pos, gen_params(n_predict=5), chunk_prefilling=True
        )
    )[-1]
    ids1 = tiny_tokenizer(turn1)["input_ids"]
    ids2 = tiny_tokenizer(turn2, add_special_tokens=False)["input_ids"]
    assert engine_calls["prefill"][0] == ids2  # only the new turn is fed
    answer1 = greedy_by_recompute(tiny_model, ids1, 5)
    answer2 = greedy_by_recompute(tiny_model, ids1 + answer1 + ids2, 5)
    assert last2["text"] == tiny_tokenizer.decode(answer2, skip_special_tokens=True)
    start_pos += last2["timing"]["total_tokens"]
    assert persistent_cache(tiny_model).get_seq_length() == start_pos

    # Going back to the end of turn 1 and asking again gives the same answer.
    again = list(
        StreamGenerator(
            tiny_model,
            tiny_tokenizer,
            turn2,
            last1["timing"]["total_tokens"],
            gen_params(n_predict=5),
            chunk_prefilling=True,
        )
    )[-1]
    assert again["text"] == last2["text"]
    # start_pos 0 starts over.
    fresh = list(StreamGenerator(tiny_model, tiny_tokenizer, turn1, 0, gen_params(n_predict=5)))[-1]
    assert fresh["text"] == last1["text"]
    with pytest.raises(ValueError, match="start_pos"):
        next(StreamGenerator(tiny_model, tiny_tokenizer, turn2, 10_000, gen_params()))


def test_stream_generator_stop_token_is_fed_back(tiny_model, tiny_tokenizer, tiny_engine):
    params = gen_params(temp=50.0, top_k=0, top_p=1.0, n_predict=12)
    prompt = tiny_tokenizer("Hello")["input_ids"]
    # The same engine run with the same seed: the tokens StreamGenerator will sample.
    torch.manual_seed(5)
    sampling = SamplingConfig(temperature=50.0, top_p=1.0, top_k=0, repetition_penalty=1.0, max_new_tokens=12)
    free = [t for c in tiny_engine.generate(tiny_engine.new_cache(), prompt, sampling) for t in c.token_ids]
    stop_list = [free[4]]
    n = free.index(free[4])
    torch.manual_seed(5)
    events = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, "Hello", 0, params, stream_interval=1, stop_token_ids=stop_list
        )
    )
    last = events[-1]
    assert stop_list == [free[4]]  # the caller's list is not changed
    assert last["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == n
    assert last["text"] == tiny_tokenizer.decode(free[:n], skip_special_tokens=True)
    # The stop token is in the cache after the answer, and counted in total_tokens.
    assert last["timing"]["total_tokens"] == len(prompt) + n + 1
    cache = persistent_cache(tiny_model)
    assert cache.get_seq_length() == len(prompt) + n + 1
    logits = tiny_engine.prefill(track(cache, tiny_engine.max_context), [7])
    assert torch.allclose(logits, full_logits(tiny_model, prompt + free[: n + 1] + [7])[-1], atol=1e-4)


def test_stream_generator_eos_and_echo(tiny_model, tiny_tokenizer):
    prompt = tiny_tokenizer("The quick brown fox")["input_ids"]
    first = greedy_by_recompute(tiny_model, prompt, 1)[0]
    events = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, "The quick brown fox", 0, gen_params(), stop_token_ids=[first]
        )
    )
    assert len(events) == 1 and events[0]["finish_reason"] == "stop" and events[0]["text"] == ""
    events = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, "The quick brown fox", 0, gen_params(n_predict=4), echo=True
        )
    )
    answer = greedy_by_recompute(tiny_model, prompt, 4)
    assert events[-1]["text"] == tiny_tokenizer.decode(prompt + answer, skip_special_tokens=True)
    assert all(e["text"].startswith("The quick brown fox") for e in events)


def test_partial_stop_string_is_held_back():
    def held(text, stops):
        return StopStrings(stops).held_back(text)

    assert held("Hello ##", ["###"]) == 2
    assert held("Hello #", ["###"]) == 1
    assert held("Hello", ["###"]) == 0
    assert held("a</", ["</s>", "<|im_end|>"]) == 2
    assert held("ab", ["b", "x"]) == 0  # a whole stop string is a stop, not a prefix


def test_stream_generator_stop_strings(tiny_model, tiny_tokenizer):
    params = gen_params(temp=50.0, top_k=0, top_p=1.0, n_predict=16)
    torch.manual_seed(9)
    free = list(StreamGenerator(tiny_model, tiny_tokenizer, "Hello", 0, params))[-1]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3
    torch.manual_seed(9)
    events = list(
        StreamGenerator(
            tiny_model, tiny_tokenizer, "Hello", 0, params, stream_interval=1, stop_strings=[stop]
        )
    )
    expected = free[: free.find(stop)]
    assert events[-1]["text"] == expected
    assert events[-1]["finish_reason"] == "stop"
    for e in events[:-1]:
        assert expected.startswith(e["text"])
        assert StopStrings([stop]).held_back(e["text"]) == 0  # never ends in a possible stop start


# --- StreamingLLM: enable_streaming_llm ---------------------------------------------------------


@pytest.fixture
def streaming_model(tiny_tokenizer):
    return make_model(len(tiny_tokenizer))


def test_enable_streaming_llm_returns_a_sink_cache(streaming_model):
    kv_cache = enable_streaming_llm(streaming_model, start_size=4, recent_size=64)
    assert isinstance(kv_cache, SinkCache)
    assert (kv_cache.start_size, kv_cache.recent_size, kv_cache.capacity) == (4, 64, 68)
    assert persistent_cache(streaming_model) is kv_cache


def test_enable_streaming_llm_refuses_learned_positions(tiny_tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(StreamingUnsupportedError, match="gpt2"):
        enable_streaming_llm(gpt2)


def test_run_streaming_llama_style_loop_stays_bounded(streaming_model, tiny_tokenizer):
    """StreamingLLM's examples/run_streaming_llama.py, written for transformers v5."""
    model, tokenizer = streaming_model, tiny_tokenizer
    start_size, recent_size, max_gen_len = 4, 96, 8
    kv_cache = enable_streaming_llm(model, start_size=start_size, recent_size=recent_size)

    @torch.no_grad()
    def greedy_generate(input_ids, max_gen_len):
        out = model(input_ids=input_ids, cache=kv_cache, use_cache=True)
        token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
        generated = [token.item()]
        for _ in range(max_gen_len - 1):
            out = model(input_ids=token, cache=kv_cache, use_cache=True)
            token = out.logits[:, -1, :].argmax(dim=-1, keepdim=True)
            generated.append(token.item())
            if token.item() == tokenizer.eos_token_id:
                break
        return generated

    fed: list[int] = []  # what the cache has seen, while nothing is evicted
    checked = 0
    for turn in range(12):
        prompt = f"USER: Hello there, turn {turn}!\n\nASSISTANT: "
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        kv_cache.evict_for_space(input_ids.shape[1] + max_gen_len)
        answer = greedy_generate(input_ids, max_gen_len)
        if kv_cache.evicted_total == 0:
            # Before any eviction it is plain greedy decoding over the whole conversation.
            context = fed + input_ids[0].tolist()
            assert answer == greedy_by_recompute(model, context, max_gen_len)[: len(answer)]
            fed = context + answer[:-1]  # the last token is never fed
            assert kv_cache.get_seq_length() == len(fed)
            checked += 1
        assert kv_cache.get_seq_length() <= start_size + recent_size
    assert checked >= 2
    assert kv_cache.evicted_total > 0


def test_sink_cache_drives_every_adapter(streaming_model, tiny_tokenizer):
    kv_cache = enable_streaming_llm(streaming_model, start_size=4, recent_size=40, evict_block=8)
    start_pos = 0
    for turn in range(6):
        text = f"<|im_start|>user\nHello there, turn {turn}!<|im_end|>\n<|im_start|>assistant\n"
        last = list(
            StreamGenerator(
                streaming_model,
                tiny_tokenizer,
                text,
                start_pos,
                gen_params(n_predict=6),
                chunk_prefilling=True,
            )
        )[-1]
        start_pos += last["timing"]["total_tokens"]
        assert kv_cache.get_seq_length() <= kv_cache.capacity
        assert kv_cache.get_seq_length() + kv_cache.evicted_total == start_pos
    assert kv_cache.evicted_total > 0

    history, cache = [], enable_streaming_llm(streaming_model, start_size=4, recent_size=40, evict_block=8)
    for query in ["Hello there!", "How are you today?", "The quick brown fox?", "Café?"]:
        for _, history, cache in streaming_chat(  # noqa: B020 - the upstream API's own form
            streaming_model,
            tiny_tokenizer,
            query,
            history=history,
            past_key_values=cache,
            do_sample=False,
            max_new_tokens=6,
            return_past_key_values=True,
        ):
            pass
        assert isinstance(cache, SinkCache) and cache.get_seq_length() <= cache.capacity
    assert cache.evicted_total > 0 and len(history) == 8
