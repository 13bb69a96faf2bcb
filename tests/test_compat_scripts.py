"""The four upstream driver scripts of docs/api.md, re-stated on the tiny random Llama in the
form they call our API (issue 14), and the call forms they need.

- ColossalAI `applications/Colossal-LLaMA/inference/stream_chat_example.py`
- llm-awq `tinychat/demo.py`
- streaming-llm `examples/run_streaming_llama.py` and `examples/eval_long_ppl.py`

References are independent of the adapters: greedy decoding by full recomputation, one
forward pass over the whole text with an attention mask that hides what a cache evicted,
and the slicing StreamingLLM does on plain tensors.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import greedy_by_recompute, make_model
from torch.nn import CrossEntropyLoss
from transformers import DynamicCache

from chatbot import compat
from chatbot.compat import (
    StartRecentKVCache,
    StreamGenerator,
    enable_streaming_llm,
    get_prompt_template,
    load_jsonl,
    parse_args,
    reset_persistent_cache,
    streaming_chat,
)
from chatbot.engine.cache.sinks import rotate_keys, rotation_for_shift
from chatbot.engine.generate import Engine

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
TEXT = " ".join(["the quick brown fox jumps over the lazy dog, and then it sleeps."] * 6)


@pytest.fixture
def model(tiny_tokenizer):
    """A fresh tiny Llama per test: `enable_streaming_llm` leaves a hook on its model."""
    m = make_model(len(tiny_tokenizer))
    yield m
    reset_persistent_cache(m)


def our_warnings(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "enable_streaming_llm gave this model" in str(w.message)]


def filled_dynamic_cache(model, ids: torch.Tensor) -> DynamicCache:
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).past_key_values


def banded_reference(model, ids: torch.Tensor, start: int, recent: int) -> torch.Tensor:
    """Logits [S, V] of one pass where token q sees the first `start` tokens and q-recent..q,
    at their true positions: what a start + recent cache trimmed after every step gives."""
    n = ids.shape[1]
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    allowed = (k <= q) & ((k < start) | (k >= q - recent))
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=allowed[None, None]).logits[0].float()


# --- SinkCache: StreamingLLM's call forms -------------------------------------------------------


def test_evict_for_space_takes_past_key_values_and_returns_the_cache(model, tiny_tokenizer):
    """Defect 1: ``evict_for_space(past_key_values, n)`` was a TypeError."""
    kv_cache = enable_streaming_llm(model, start_size=4, recent_size=32)
    assert kv_cache.evict_for_space(None, 10) is kv_cache  # None in: the empty sink cache out
    ids = tiny_tokenizer(TEXT, return_tensors="pt").input_ids[:, :30]
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=kv_cache, use_cache=True)
    assert out.past_key_values is kv_cache and kv_cache.get_seq_length() == 30
    assert kv_cache.evict_for_space(out.past_key_values, 10) is kv_cache
    assert kv_cache.get_seq_length() == 4 + 32 - 10
    # None again means a new conversation, as a fresh `past_key_values = None` upstream.
    assert kv_cache.evict_for_space(None, 1) is kv_cache and kv_cache.get_seq_length() == 0
    with pytest.raises(TypeError, match="num_coming"):
        kv_cache.evict_for_space(None, 1, 2)
    # StreamingLLM's parameter names work as keywords too.
    assert kv_cache.evict_for_space(past_key_values=None, num_coming=1) is kv_cache
    assert kv_cache.evict_for_space(num_coming=1) is None
    with pytest.raises(TypeError):
        kv_cache.evict_for_space(None, past_key_values=None)


def test_upstream_forms_match_streamingllm_slicing_on_tensors(model, tiny_tokenizer):
    """The kept values are StreamingLLM's slices of the same tensors; the kept keys are its
    slices moved back by the evicted count (the positions it would shift them to)."""
    ids = tiny_tokenizer(TEXT, return_tensors="pt").input_ids[:, :40]
    start, recent = 4, 20
    for num_coming in (0, 5, 20, 25):
        dynamic = filled_dynamic_cache(model, ids)
        keys = [layer.keys.clone() for layer in dynamic.layers]
        values = [layer.values.clone() for layer in dynamic.layers]
        kv_cache = enable_streaming_llm(model, start_size=start, recent_size=recent)
        out = kv_cache.evict_for_space(dynamic, num_coming)  # a foreign cache is taken in
        assert out is kv_cache
        tail = 40 - recent + num_coming  # StreamingLLM: k[:, :, seq_len - recent + num_coming:]
        kept = list(range(start)) + list(range(min(tail, 40), 40))
        assert kv_cache.get_seq_length() == len(kept)
        for layer, k, v in zip(kv_cache.layers, keys, values):
            assert torch.equal(layer.values, v[..., kept, :])
            assert torch.equal(layer.keys[..., :start, :], k[..., :start, :])
            if tail < 40:
                cos, sin = rotation_for_shift(tail - start, kv_cache.inv_freq)
                assert torch.allclose(
                    layer.keys[..., start:, :], rotate_keys(k[..., tail:, :], cos, sin), atol=1e-6
                )


def test_more_coming_than_the_window_keeps_the_sinks_and_never_raises(model, tiny_tokenizer):
    """Defect 3: ``num_coming > recent_size`` raised ValueError, even on an empty cache."""
    kv_cache = enable_streaming_llm(model, start_size=4, recent_size=16)
    assert kv_cache.evict_for_space(None, 100) is kv_cache and kv_cache.get_seq_length() == 0
    assert kv_cache.evict_for_space(100) is None
    ids = tiny_tokenizer(TEXT, return_tensors="pt").input_ids[:, :20]
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kv_cache, use_cache=True)
    sinks = [layer.keys[..., :4, :].clone() for layer in kv_cache.layers]
    assert kv_cache.evict_for_space(kv_cache, 17) is kv_cache
    assert kv_cache.get_seq_length() == 4 and kv_cache.evicted_total == 16
    assert all(torch.equal(layer.keys, s) for layer, s in zip(kv_cache.layers, sinks))


def test_evict_range_and_call_keep_positions_contiguous(model, tiny_tokenizer):
    ids = tiny_tokenizer(TEXT, return_tensors="pt").input_ids[:, :40]
    kv_cache = enable_streaming_llm(model, start_size=4, recent_size=16)
    assert kv_cache(None) is None
    cache = kv_cache.evict_range(filled_dynamic_cache(model, ids), 10, 25)
    assert cache is kv_cache and cache.get_seq_length() == 25 and cache.evicted_total == 15
    with pytest.raises(ValueError, match="start <= end"):
        kv_cache.evict_range(kv_cache, 20, 10)
    assert kv_cache(kv_cache) is kv_cache and kv_cache.get_seq_length() == 20
    # What is left reads as a contiguous text: the next token's logits equal a pass over the
    # kept ids at positions 0..19 (re-rotated keys), up to the cached states' history.
    with torch.no_grad():
        out = model(input_ids=ids[:, 39:40], past_key_values=kv_cache, use_cache=True)
    assert out.logits.isfinite().all() and kv_cache.get_seq_length() == 21


def test_running_the_model_without_the_sink_cache_warns_once(model, tiny_tokenizer):
    """Defect 2: a model that `enable_streaming_llm` set up ran on its own `DynamicCache`
    (from ``past_key_values=None``) and nothing was ever evicted, silently."""
    ids = tiny_tokenizer("USER: Hello there!\n\nASSISTANT: ", return_tensors="pt").input_ids
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with torch.no_grad():
            model(input_ids=ids, past_key_values=None, use_cache=True)  # before: no warning
        assert our_warnings(record) == []
        kv_cache = enable_streaming_llm(model, start_size=4, recent_size=16)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=kv_cache, use_cache=True)
            model(input_ids=ids, use_cache=False)
        assert our_warnings(record) == []
        with torch.no_grad():
            out = model(input_ids=ids, past_key_values=None, use_cache=True)
            model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
            model(input_ids=ids, cache=DynamicCache(), use_cache=True)
    messages = our_warnings(record)
    assert len(messages) == 1 and "DynamicCache" in messages[0] and "evict_for_space" in messages[0]
    # It points at the caller's line, not at torch.
    hit = next(w for w in record if "enable_streaming_llm gave" in str(w.message))
    assert hit.filename == __file__


# --- streaming-llm examples/run_streaming_llama.py ----------------------------------------------


def test_run_streaming_llama_logic(model, tiny_tokenizer):
    """greedy_generate + streaming_inference, in the script's own form: ``past_key_values``
    starts as None, ``kv_cache.evict_for_space(past_key_values, space_needed)`` before
    each prompt, ``outputs.past_key_values`` after each step."""
    tokenizer = tiny_tokenizer
    start_size, recent_size, max_gen_len = 4, 24, 20  # the answer alone passes the window

    @torch.no_grad()
    def greedy_generate(model, tokenizer, input_ids, past_key_values, max_gen_len):
        outputs = model(input_ids=input_ids, past_key_values=past_key_values, use_cache=True)
        past_key_values = outputs.past_key_values
        pred_token_idx = outputs.logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
        generated_ids = [pred_token_idx.item()]
        for _ in range(max_gen_len - 1):
            outputs = model(input_ids=pred_token_idx, past_key_values=past_key_values, use_cache=True)
            past_key_values = outputs.past_key_values
            pred_token_idx = outputs.logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
            generated_ids.append(pred_token_idx.item())
            if pred_token_idx == tokenizer.eos_token_id:
                break
        return past_key_values, generated_ids

    kv_cache = enable_streaming_llm(model, start_size=start_size, recent_size=recent_size)
    lengths, answers, contexts = [], [], []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        past_key_values = None
        for prompt in ["Hello there!", "How are you today?", "The quick brown fox?", "Café?"]:
            prompt = "USER: " + prompt + "\n\nASSISTANT: "
            input_ids = tokenizer(prompt, return_tensors="pt").input_ids
            seq_len = input_ids.shape[1]
            if kv_cache is not None:
                space_needed = seq_len + max_gen_len
                past_key_values = kv_cache.evict_for_space(past_key_values, space_needed)
            assert past_key_values is kv_cache
            # What the cache holds is the sinks only (space_needed > recent_size).
            contexts.append(past_key_values.get_seq_length())
            past_key_values, answer = greedy_generate(
                model, tokenizer, input_ids, past_key_values, max_gen_len
            )
            lengths.append(past_key_values.get_seq_length())
            answers.append((input_ids[0].tolist(), answer))
    assert our_warnings(record) == []  # the model never ran on a cache of its own
    assert past_key_values is kv_cache and kv_cache.evicted_total > 0
    assert contexts[0] == 0 and all(c == start_size for c in contexts[1:])
    assert max(lengths) > start_size + recent_size  # generated past the window, as upstream
    # The first answer is plain greedy decoding of its prompt (nothing evicted yet).
    prompt_ids, answer = answers[0]
    assert answer == greedy_by_recompute(model, prompt_ids, max_gen_len)[: len(answer)]


# --- streaming-llm examples/eval_long_ppl.py -----------------------------------------------------


@pytest.mark.parametrize("start_size,recent_size", [(4, 12), (0, 16)])
def test_eval_long_ppl_logic(model, tiny_tokenizer, start_size, recent_size):
    """Defect 4: ``StartRecentKVCache`` did not exist. The script's loop: one token per
    step, ``past_key_values = kv_cache(past_key_values)`` on the model's own cache."""
    model_type = model.config.model_type
    assert "llama" in model_type
    k_seq_dim = v_seq_dim = 2
    kv_cache = StartRecentKVCache(
        start_size=start_size, recent_size=recent_size, k_seq_dim=k_seq_dim, v_seq_dim=v_seq_dim
    )
    encodings = tiny_tokenizer(TEXT, return_tensors="pt")
    seq_len = min(encodings.input_ids.size(1), 60)
    nlls = []
    loss_fn = CrossEntropyLoss(reduction="none")
    past_key_values = None
    for idx in range(seq_len - 1):
        input_ids = encodings.input_ids[:, idx : idx + 1]
        with torch.no_grad():
            outputs = model(input_ids, past_key_values=past_key_values, use_cache=True)
            logits = outputs.logits.view(-1, model.config.vocab_size)
            past_key_values = outputs.past_key_values
            label = encodings.input_ids[:, idx + 1 : idx + 2].to(logits.device).view(-1)
            neg_log_likelihood = loss_fn(logits, label)
            if kv_cache is not None:
                past_key_values = kv_cache(past_key_values)
        nlls.append(neg_log_likelihood)
        assert past_key_values.layers[0].keys.shape[-2] <= start_size + recent_size
    ids = encodings.input_ids[:, :seq_len]
    ref = banded_reference(model, ids, start_size, recent_size)
    ref_nll = loss_fn(ref[:-1], ids[0, 1:])
    assert torch.allclose(torch.stack(nlls).view(-1), ref_nll, atol=1e-4)
    # The window really bit: the dense model scores this text differently.
    dense = loss_fn(banded_reference(model, ids, 0, seq_len)[:-1], ids[0, 1:])
    assert not torch.allclose(dense, ref_nll, atol=1e-3)


def test_start_recent_kv_cache_forms(model, tiny_tokenizer):
    ids = tiny_tokenizer(TEXT, return_tensors="pt").input_ids[:, :30]
    kv_cache = StartRecentKVCache(start_size=2, recent_size=8)
    assert kv_cache(None) is None and kv_cache.evict_for_space(None, 3) is None
    dynamic = filled_dynamic_cache(model, ids)
    values = dynamic.layers[0].values.clone()
    cache = kv_cache.evict_for_space(dynamic, 3)  # keeps 2 sinks + the newest 5
    assert cache.layers[0].keys.shape[-2] == 7 and cache.get_seq_length() == 30  # true positions
    assert torch.equal(cache.layers[0].values, values[..., [0, 1, 25, 26, 27, 28, 29], :])
    cache = kv_cache.evict_for_space(filled_dynamic_cache(model, ids), 50)  # only the sinks
    assert torch.equal(cache.layers[0].values, values[..., :2, :])
    cache = kv_cache.evict_range(filled_dynamic_cache(model, ids), 5, 10)
    assert cache.layers[0].keys.shape[-2] == 25
    with pytest.raises(ValueError):
        kv_cache.evict_range(cache, 3, 40)
    with pytest.raises(ValueError):
        StartRecentKVCache(4, 8, k_seq_dim=4)
    with pytest.raises(TypeError, match="old positions"):  # its keys are not at 0..n-1
        enable_streaming_llm(model, start_size=2, recent_size=8).evict_for_space(cache, 1)
    # A prefill chunk after eviction is causal within itself: equal to the banded reference.
    kv_cache = StartRecentKVCache(start_size=2, recent_size=8)
    cache = kv_cache.evict_for_space(filled_dynamic_cache(model, ids[:, :20]), 4)  # 2 + newest 4
    with torch.no_grad():
        out = model(input_ids=ids[:, 20:24], past_key_values=cache, use_cache=True)
    n = 24
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (k <= q) & ((k < 2) | (k >= 16) | (q < 20))
    with torch.no_grad():
        ref = model(input_ids=ids[:, :n], attention_mask=allowed[None, None]).logits[0, 20:]
    assert torch.allclose(out.logits[0], ref, atol=1e-4)


def test_streamingllm_script_helpers(tmp_path):
    path = tmp_path / "mt_bench.jsonl"
    path.write_text('{"turns": ["a", "b"]}\n\n{"turns": ["c"]}\n', encoding="utf-8")
    assert [t for s in load_jsonl(path) for t in s["turns"]] == ["a", "b", "c"]
    args = parse_args(["--enable_start_recent_kv_cache", "--start_size", "4", "--recent_size", "124"])
    assert (args.enable_start_recent_kv_cache, args.start_size, args.recent_size) == (True, 4, 124)
    assert (parse_args([]).start_size, parse_args([]).recent_size, parse_args([]).num_eval_tokens) == (
        1,
        255,
        None,
    )
    (tmp_path / "x.json").write_text("{}", encoding="utf-8")  # there already: no download
    assert compat.download_url("https://example.invalid/x.json?raw=1", tmp_path) == str(tmp_path / "x.json")


# --- ColossalAI applications/Colossal-LLaMA/inference/stream_chat_example.py -------------------


def test_colossal_stream_chat_example_logic(model, tiny_tokenizer, monkeypatch):
    tokenizer = tiny_tokenizer
    prefilled: list[int] = []
    real_prefill = Engine.prefill

    def prefill(self, cache, ids, *args, **kwargs):
        prefilled.append(len(ids))
        return real_prefill(self, cache, ids, *args, **kwargs)

    monkeypatch.setattr(Engine, "prefill", prefill)
    system = "A chat between a curious human and an assistant."
    past_key_values, history = None, []
    roles = ["", "Human", "Assistant"]
    history = []
    history.append({"role": roles[0], "message": system})
    printed = []
    for input_query in ["Hello there!", "How are you today?"]:
        first_prompt = get_prompt_template(input_query, history, roles)
        gen_len = 0
        for response, history, past_key_values in streaming_chat(  # noqa: B020 - the script's own form
            model,
            tokenizer,
            input_query,
            history=history,
            roles=roles,
            temperature=0.8,
            top_p=0.95,
            top_k=50,
            do_sample=False,
            length_penalty=1.2,
            max_new_tokens=8,
            past_key_values=past_key_values,
            return_past_key_values=True,
        ):
            output = response[gen_len:]
            printed.append(output)
            gen_len = len(response)
        if input_query == "Hello there!":
            ids = tokenizer(first_prompt)["input_ids"]
            expected = greedy_by_recompute(model, ids, 8, stop={tokenizer.eos_token_id})
            assert response == tokenizer.decode(expected)
            full_first = len(ids)
    assert [m["role"] for m in history] == ["", "Human", "Assistant", "Human", "Assistant"]
    assert "".join(printed).endswith(response)
    # The cache was reused: the second turn fed only its new text.
    assert prefilled[0] == full_first and 0 < prefilled[-1] < full_first
    # "clear" in the script: a new conversation with a None cache.
    past_key_values, history = None, []
    for response, history, past_key_values in streaming_chat(  # noqa: B020 - the script's own form
        model,
        tokenizer,
        "Hi",
        history=history,
        roles=roles,
        do_sample=False,
        max_new_tokens=4,
        past_key_values=past_key_values,
        return_past_key_values=True,
    ):
        pass
    assert len(history) == 2 and past_key_values.get_seq_length() > 0


# --- llm-awq tinychat/demo.py ---------------------------------------------------------------------


class AttributeDict(dict):
    """What `attributedict.collections.AttributeDict` is to the script: a dict read by attribute."""

    def __getattr__(self, name):
        return self[name]

    def __setattr__(self, name, value):
        self[name] = value


class Prompter:
    """A two-role prompter with TinyChat's `insert_prompt` / `update_template` protocol."""

    def __init__(self):
        self.template = "### Human: {prompt}\n### Assistant:"
        self.model_input = None

    def insert_prompt(self, input_prompt):
        self.model_input = self.template.format(prompt=input_prompt)

    def update_template(self, outputs, chunk_prefilling=0):
        if chunk_prefilling:
            self.template = "### Human: {prompt}\n### Assistant:"
        else:
            self.template = self.model_input + " " + outputs.strip() + "\n### Human: {prompt}\n### Assistant:"
        self.model_input = None


@pytest.mark.parametrize("chunk_prefilling", [True, False])
def test_tinychat_demo_logic(model, tiny_tokenizer, chunk_prefilling):
    tokenizer = tiny_tokenizer
    gen_params = AttributeDict(
        seed=-1, n_predict=10, n_vocab=len(tokenizer), top_k=40, top_p=0.95, temp=0.0, repeat_penalty=1.0
    )

    def stream_output(output_stream):
        pre = 0
        for outputs in output_stream:
            output_text = outputs["text"]
            output_text = output_text.strip().split(" ")
            now = len(output_text) - 1
            pre = max(pre, now)
        timing = outputs["timing"]
        generation_time_list = timing["generation_time_list"]
        assert all(isinstance(t, float) and t >= 0 for t in generation_time_list)
        assert len(generation_time_list) in (
            outputs["usage"]["completion_tokens"] - 1,
            outputs["usage"]["completion_tokens"],
        )
        return " ".join(output_text), timing["total_tokens"], timing["context_tokens"]

    model_prompter = Prompter()
    start_pos, contexts, conversation = 0, [], ""
    for input_prompt in ["Hello there!", "How are you today?", "Why?"]:
        model_prompter.insert_prompt(input_prompt)
        conversation_before = conversation
        output_stream = StreamGenerator(
            model,
            tokenizer,
            model_prompter.model_input,
            start_pos,
            gen_params,
            device="cuda:0",
            stop_token_ids=[151645],  # what TinyChat's Qwen prompter passes, whatever the model
            chunk_prefilling=chunk_prefilling,
            quant_llm=False,
        )
        outputs, total_tokens, context_tokens = stream_output(output_stream)
        contexts.append(context_tokens)
        if not contexts[:-1]:  # the first answer is greedy decoding of its prompt
            ids = tokenizer(model_prompter.model_input)["input_ids"]
            expected = greedy_by_recompute(model, ids, 10, stop={tokenizer.eos_token_id})
            assert outputs == " ".join(
                tokenizer.decode(expected, skip_special_tokens=True).strip().split(" ")
            )
        if chunk_prefilling:
            start_pos += total_tokens
        else:
            start_pos = 0
        model_prompter.update_template(outputs, chunk_prefilling)
        conversation = conversation_before + model_prompter.template
    if chunk_prefilling:
        # The cache was reused: each later turn prefilled only its own text.
        assert (
            contexts[1]
            < len(tokenizer(model_prompter.template.format(prompt="How are you today?"))["input_ids"]) + 1
        )
        assert compat.persistent_cache(model).get_seq_length() == start_pos
    else:
        # Every turn re-feeds the whole conversation, as the script does without the flag.
        assert contexts[0] < contexts[1] < contexts[2]


def test_tinychat_generation_times_leave_out_the_callers_time(model, tiny_tokenizer):
    """Defect 5: 0.25 s of caller sleep showed up in every entry of generation_time_list."""
    gen_params = {
        "temp": 0.0,
        "top_k": 40,
        "top_p": 0.95,
        "repeat_penalty": 1.0,
        "n_predict": 8,
        "n_vocab": len(tiny_tokenizer),
    }
    sleep = 0.25
    t0 = time.perf_counter()
    events = []
    for event in StreamGenerator(
        model, tiny_tokenizer, "Hello there, how are you?", 0, gen_params, stream_interval=1
    ):
        events.append(event)
        if event["finish_reason"] is None:
            time.sleep(sleep)
    wall = time.perf_counter() - t0
    times = events[-1]["timing"]["generation_time_list"]
    assert len(times) >= 3
    assert max(times) < sleep  # a tiny-model step is milliseconds
    own = wall - sleep * (len(events) - 1)  # the time that was not the caller's
    assert sum(times) + events[-1]["timing"]["context_time"] <= own + 1e-3


# --- docs/api.md ------------------------------------------------------------------------------------


def test_docs_state_what_evict_for_space_keeps_and_the_lines_to_change():
    """Defect 6, and the "exact lines" of each upstream script."""
    doc = DOC.read_text(encoding="utf-8")
    flat = " ".join(doc.split())
    assert "start_size + recent_size - num_coming" not in flat
    assert "keeps the sinks and the newest `recent_size - num_coming` tokens" in flat
    for script in (
        "stream_chat_example.py",
        "tinychat/demo.py",
        "run_streaming_llama.py",
        "eval_long_ppl.py",
    ):
        assert re.search(rf"### .*{re.escape(script)}", doc), script
    assert doc.count("```diff") >= 4
