"""Engine on a tiny random Llama, compared with full recomputation."""

from __future__ import annotations

import pytest
import torch
from helpers import full_logits, greedy_by_recompute
from transformers import DynamicCache

from chatbot.config import ChatConfig, SamplingConfig
from chatbot.conversation.session import ChatSession
from chatbot.engine.generate import Engine
from chatbot.errors import ContextFullError

GREEDY = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=12)


def test_prefill_in_pieces_matches_one_forward(tiny_engine, tiny_model):
    torch.manual_seed(1)
    ids = torch.randint(3, 300, (90,)).tolist()
    cache = tiny_engine.new_cache()
    # Three "turns" of different sizes, the middle one chunked.
    tiny_engine.prefill(cache, ids[:30])
    tiny_engine.prefill(cache, ids[30:70], prefill_chunk=7)
    last = tiny_engine.prefill(cache, ids[70:])
    ref = full_logits(tiny_model, ids)[-1]
    assert torch.allclose(last, ref, atol=1e-4)
    assert cache.length == 90


def test_greedy_decode_with_cache_equals_recompute(tiny_engine, tiny_model):
    prompt = list(range(5, 25))
    chunks = list(tiny_engine.generate(tiny_engine.new_cache(), prompt, GREEDY))
    got = [t for c in chunks for t in c.token_ids]
    assert got == greedy_by_recompute(tiny_model, prompt, GREEDY.max_new_tokens)
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].stats.generated_tokens == GREEDY.max_new_tokens


def test_stop_token_ends_answer_and_is_not_fed(tiny_engine, tiny_model):
    prompt = list(range(5, 25))
    free = greedy_by_recompute(tiny_model, prompt, 8)
    stop = free[3]
    cache = tiny_engine.new_cache()
    chunks = list(tiny_engine.generate(cache, prompt, GREEDY, stop_ids=[stop]))
    got = [t for c in chunks for t in c.token_ids]
    assert got == free[: free.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    # The prompt and the answer tokens before the stop are in the cache; the stop is not.
    assert cache.length == len(prompt) + len(got)


def test_max_new_tokens_and_stream_interval(tiny_engine):
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=7, stream_interval=3)
    chunks = list(tiny_engine.generate(tiny_engine.new_cache(), list(range(5, 15)), sampling))
    sizes = [len(c.token_ids) for c in chunks]
    assert sum(sizes) == 7
    assert sizes[:2] == [3, 3]
    assert chunks[-1].finish_reason == "length"


def test_seeded_sampling_is_reproducible(tiny_engine):
    sampling = SamplingConfig(temperature=50.0, top_k=200, top_p=0.99, max_new_tokens=10)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(7)
        chunks = tiny_engine.generate(tiny_engine.new_cache(), list(range(5, 15)), sampling, generator=g)
        runs.append([t for c in chunks for t in c.token_ids])
    assert runs[0] == runs[1]
    g = torch.Generator().manual_seed(8)
    other = [
        t
        for c in tiny_engine.generate(tiny_engine.new_cache(), list(range(5, 15)), sampling, generator=g)
        for t in c.token_ids
    ]
    assert other != runs[0]


def test_repetition_penalty_changes_greedy_choice(tiny_engine, tiny_model):
    prompt = list(range(5, 25))
    plain = [t for c in tiny_engine.generate(tiny_engine.new_cache(), prompt, GREEDY) for t in c.token_ids]
    strong = SamplingConfig(temperature=0.0, repetition_penalty=50.0, max_new_tokens=12)
    penal = [t for c in tiny_engine.generate(tiny_engine.new_cache(), prompt, strong) for t in c.token_ids]
    # With a huge penalty no token of the prompt or the answer so far is ever picked again.
    seen = set(prompt)
    for t in penal:
        assert t not in seen
        seen.add(t)
    assert penal != plain


def test_context_full_is_raised_before_any_work(tiny_model, tiny_tokenizer):
    engine = Engine(tiny_model, tiny_tokenizer, max_context=40)
    cache = engine.new_cache()
    engine.prefill(cache, list(range(5, 35)))
    with pytest.raises(ContextFullError, match="context full"):
        next(engine.generate(cache, list(range(5, 20)), GREEDY))
    assert cache.length == 30


def test_session_prefills_only_new_tokens(tiny_engine, tiny_model, tiny_tokenizer):
    session = ChatSession(tiny_engine, ChatConfig(system="Be brief.", sampling=GREEDY))
    for text in ["Hello there!", "How are you today?", "Café 🙂 日本語"]:
        # Not yet in the cache: the last answer token (not fed when max_new_tokens ends
        # the answer) and the template's "<|im_end|>\n" after it.
        pending = session.pending_ids
        assert len(pending) <= 3
        stats = next(c.stats for c in session.send(text) if c.stats)
        prompt_seg = session.segments[session.turns[-1].first_segment]
        assert prompt_seg.kind == "prompt" and "<|im_start|>user" in prompt_seg.text
        assert stats.context_tokens == len(pending) + len(prompt_seg.ids)
        assert stats.context_tokens < len(session.all_ids)
    # The cache holds exactly the ids the session says it holds.
    assert session.cache.get_seq_length() == len(session.cache_ids) == session.n_fed
    # And its logits equal a fresh forward pass over those ids.
    # The template's end-of-turn text is always queued after an answer.
    pending = session.pending_ids
    assert pending
    logits = tiny_engine.prefill(session.kv, pending)
    ref = full_logits(tiny_model, session.all_ids)[-1]
    assert torch.allclose(logits, ref, atol=1e-4)


def test_cache_crop_repairs_uneven_layers(tiny_engine):
    kv = tiny_engine.new_cache()
    tiny_engine.prefill(kv, list(range(5, 25)))
    cache = kv.cache
    # Simulate a forward pass interrupted after layer 0.
    k = cache.layers[0].keys[:, :, -1:, :].clone()
    cache.layers[0].update(k, k)
    assert cache.layers[0].get_seq_length() == 21
    assert kv.settle()
    assert [layer.get_seq_length() for layer in cache.layers] == [20, 20] and kv.length == 20


def test_dynamic_cache_is_the_default(tiny_engine):
    assert isinstance(tiny_engine.new_cache().cache, DynamicCache)


def test_bounded_window_evicts_only_what_a_turn_needs(tiny_engine, tiny_model):
    """Issue 59, 17: with a 64-token window and up to 60 answer tokens, a 15-token message
    answered in 5 tokens left `cache 24/68` (62 evicted that turn): the prefill made room for
    a whole 60-token answer up front. Each pass now evicts what it needs, rounded up to the
    cache's block; the window keeps the rest, and its keys are still exact."""
    kv = tiny_engine.new_cache(start_size=4, recent_size=64)
    sampling = SamplingConfig(temperature=0.0, repetition_penalty=1.0, max_new_tokens=60)
    torch.manual_seed(3)
    list(tiny_engine.generate(kv, torch.randint(3, 300, (40,)).tolist(), sampling))  # a full window
    assert kv.length > 60 and kv.evicted_total > 0
    message = torch.randint(3, 300, (15,)).tolist()
    held, evicted = kv.length, kv.evicted_total
    answered: list[int] = []

    def five_tokens(ids: torch.Tensor, scores: torch.Tensor | None) -> bool:
        answered.append(int(ids[0, -1]))
        return len(answered) == 5  # a stop string that ends the answer at its 5th token

    chunks = list(tiny_engine.generate(kv, message, sampling, stopping_criteria=five_tokens))
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stats.generated_tokens == 5
    fed = len(message) + 4  # (the answer's last token is not fed)
    needed = held + fed - kv.capacity
    block = kv.cache.evict_block
    assert block <= kv.recent_size // 4
    assert needed <= kv.evicted_total - evicted < needed + block
    assert kv.length == held + fed - (kv.evicted_total - evicted) > kv.capacity - block
    assert chunks[-1].stats.cache_tokens == kv.length  # what the stats line shows
    # the kept keys are re-rotated to where a fresh pass over the kept ids puts them
    fresh = DynamicCache()
    with torch.no_grad():
        tiny_model(input_ids=torch.tensor([kv.ids]), cache=fresh, use_cache=True)
    assert torch.allclose(kv.cache.layers[0].keys, fresh.layers[0].keys, atol=1e-4)
